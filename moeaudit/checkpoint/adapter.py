"""A directory moeaudit cannot replay, said as what it is: a PEFT adapter, or no config.json
(docs/decisions.md, "PEFT / LoRA fine-tunes").

A Trainer fine-tuning a ``peft.PeftModel`` saves only the adapter in ``checkpoint-<step>/``
(``adapter_config.json`` + ``adapter_model.safetensors``): the low-rank deltas, not the weights a
replay runs. Merging them onto a base is the user's step (``merge_and_unload()`` then
``save_pretrained``); moeaudit does not merge, so no certificate binds a base it fetched or
guessed. An adapter directory is refused for the whole run (never skipped as if it were still
being written): a run of adapters has no checkpoint to audit, and a mix would be certified on
the full-weight ones only.
"""

from __future__ import annotations

import json
from pathlib import Path

from moeaudit.checkpoint.dcp import is_dcp
from moeaudit.checkpoint.names import weight_files
from moeaudit.errors import CheckpointError, InputError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
MAX_ADAPTER_CONFIG_BYTES = 1 << 20


class AdapterCheckpointError(InputError):
    """A PEFT adapter where a checkpoint was expected (exit 4; not a ``CheckpointError``, so a
    run directory refuses it rather than skipping it as incomplete)."""


def is_adapter(path: Path) -> bool:
    """``path`` holds a PEFT adapter and no model weights besides it."""
    if not (path / ADAPTER_CONFIG).is_file():
        return False
    try:
        weights = weight_files(path)
    except OSError:
        return False
    return not [w for w in weights if w not in ADAPTER_WEIGHTS]


def _base_named(path: Path) -> str | None:
    """The base model ``adapter_config.json`` names (``base_model_name_or_path``), if readable."""
    try:
        with open(path / ADAPTER_CONFIG, "rb") as f:
            value = json.loads(f.read(MAX_ADAPTER_CONFIG_BYTES)).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def refuse_unreadable(path: Path) -> None:
    """Raise the one-line error for a checkpoint directory without a config.json, or holding a
    PEFT adapter instead of model weights; return when ``path`` can be read as a checkpoint."""
    if is_adapter(path):
        base = _base_named(path)
        raise AdapterCheckpointError(
            f"holds a PEFT adapter ({ADAPTER_CONFIG}), not the model weights a replay runs",
            path=path,
            hint=f"merge it onto its base{f' ({base})' if base else ''}: PeftModel.from_pretrained(base, DIR)"
            '.merge_and_unload().save_pretrained(OUT), then audit OUT (README.md, "PEFT / LoRA fine-tunes")',
        )
    if (path / "config.json").is_file():
        return
    hint = (
        "copy the model's Hugging Face config.json next to .metadata (a DCP directory does not say its architecture)"
        if is_dcp(path)
        else "a checkpoint is a save_pretrained directory"
    )
    raise CheckpointError("no config.json", path=path, hint=hint)
