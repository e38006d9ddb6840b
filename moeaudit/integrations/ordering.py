"""Put a Trainer callback ahead of the ``report_to`` integrations, from inside the callback.

The Trainer builds its callback list as ``DEFAULT_CALLBACKS + report_to integrations + the
user's callbacks`` and calls them in that order, each with the same ``logs`` dict. A callback
passed as ``Trainer(callbacks=[cb])`` therefore sees a training log only after TensorBoard,
W&B, MLflow … have written it: scalars it adds there reach ``log_history`` and no tracker.

No Trainer event hands the callback its Trainer or its ``CallbackHandler``, but every event
is called by the handler's ``call_event``, whose frame is on the stack. :func:`lead` finds
the handler that holds the callback there and moves the callback to the front of its list,
so it runs first on every later event (docs/decisions.md, "Tracker delivery"). Moving an
element to the front while ``call_event`` iterates the list visits every later callback once:
those after it keep their indices.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

# call_event is the callback's caller; a few more frames allow a wrapper in between
MAX_DEPTH = 8


def handler_of(callback: Any, depth: int = MAX_DEPTH) -> Any | None:
    """The object on the call stack (within ``depth`` frames above the caller) whose
    ``callbacks`` list holds ``callback`` itself — the Trainer's ``CallbackHandler`` — or None."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        callbacks = getattr(owner, "callbacks", None)
        if owner is not callback and isinstance(callbacks, list) and any(c is callback for c in callbacks):
            return owner
        frame = frame.f_back
    return None


def move_first(callbacks: list[Any], callback: Any) -> None:
    """Make ``callback`` the first element of ``callbacks`` (once, by identity)."""
    for i, c in enumerate(callbacks):
        if c is callback:
            if i:
                del callbacks[i]
                callbacks.insert(0, callback)
            return


def lead(callback: Any) -> bool:
    """Move ``callback`` to the front of the handler that is calling it. True when it is
    first there now; False when no handler holding it is on the stack."""
    handler = handler_of(callback)
    if handler is None:
        return False
    move_first(handler.callbacks, callback)
    return True
