"""The weight groups of a layer whose gradients the receipts measure (docs/glossary.md, "Gradient norms
/ var_grad"): the router, the attention sub-block (the token mixer and what forms its input) and the
shared expert, by the canonical names the checkpoint reader gives a layer's tensors. Each block kind
declares its part (``spec.blocks``: ``MoE.GRADS``, ``SharedExpert.GRADS``, a mixer's ``grads`` with
the residual's pre-norm gains in place, ``Residual.grads``); here they are merged into one order per
group, so that a layer's group is read off the names it has (:func:`present`) and every kind of
token mixer — softmax attention, MLA, Lightning and linear attention, Gated DeltaNet, KDA, Mamba,
the short convolution, a mixture of attention heads — is covered by what it holds. Both the
attention gradient norm (``replay.result.layer_grads``) and the domain conflict vector
(``receipts.conflict``) take their names from here. The order of a group is the order in which its
squared norms are summed: it is part of the receipts' bits."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import get_args

from moeaudit.spec import blocks

ROUTER = blocks.MoE.GRADS[blocks.ROUTER]


def merge(*orders: Sequence[str]) -> tuple[str, ...]:
    """One order of every name in ``orders`` that keeps each order's own: a name is placed once
    everything any order puts before it is placed (taken left to right, first order first)."""
    before: dict[str, set[str]] = {}
    for order in orders:
        for i, name in enumerate(order):
            before.setdefault(name, set()).update(order[:i])
    out: list[str] = []
    pending = list(before)
    while pending:
        name = next(n for n in pending if before[n] <= set(out))  # no cycle: every order is one
        out.append(name)
        pending.remove(name)
    return tuple(out)


_INPUTS, _AFTER = blocks.Residual().grads()
_MIXERS: tuple[type[blocks.Mixer], ...] = get_args(blocks.Mixer)  # every token mixer kind, in its order
# the attention sub-block: each mixer kind's weights around the pre-norm gains (MLA: then LongCat's
# second attention), then HY-V4's hyper-connection of the attention sub-block
ATTENTION = merge(*((*kind.grads(_INPUTS), *_AFTER) for kind in _MIXERS))
# what forms the mixer's input rather than mixing tokens: the pre-norm gains and HY-V4's
# hyper-connection (in the attention gradient norm, not in the conflict vector)
ATTENTION_INPUT = frozenset((*_INPUTS, blocks.SECOND_BLOCK + "input_norm", *_AFTER))
MIXER = tuple(n for n in ATTENTION if n not in ATTENTION_INPUT)
# JetMoE's bias on the MoE output: an always-on term of the block, with the shared expert
SHARED_EXPERT = (*blocks.SharedExpert.GRADS[blocks.SHARED], *blocks.MoE.GRADS[blocks.SHARED])
# the domain conflict vector (`001` Eq. 14–15): the layer's parameters every token passes through
CONFLICT = (*ROUTER, *MIXER, *SHARED_EXPERT)


def present(group: Sequence[str], params: Container[str]) -> list[str]:
    """The names of ``group`` that a layer has, in the group's order."""
    return [n for n in group if n in params]
