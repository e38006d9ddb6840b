"""The weight groups of a layer whose gradients the receipts measure (SPEC §4 "Gradients"): the
router, the attention sub-block and the shared expert, by the canonical names the checkpoint
reader gives a layer's tensors (``checkpoint.expected_layer_names``). A group is read off the
names a layer has, so every kind of token mixer — softmax attention, MLA, Lightning and linear
attention, Gated DeltaNet, KDA, Mamba, the short convolution, a mixture of attention heads — is
covered by what it holds. Both the attention gradient norm (``replay.result.layer_grads``) and
the domain conflict vector (``receipts.conflict``) take their names from here."""

from __future__ import annotations

from collections.abc import Container, Sequence

from moeaudit.checkpoint.checkpoint import KDA_NAMES, LIGHTNING_NAMES, LINEAR_ATTENTION_NAMES
from moeaudit.spec.config import HC_NAMES, MAMBA_NAMES, MOA_NAMES, SECOND_BLOCK, SHORT_CONV_NAMES

ROUTER = ("router", "router_logit_bias")
# the attention sub-block, in the order its squared norms are summed (the order is part of the
# receipts' bits): the mixer's own weights and what forms its input (``ATTENTION_INPUT``)
ATTENTION = (
    "q",
    "k",
    "v",
    "o",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "q_norm",
    "k_norm",
    "input_norm",
    "input_norm_bias",
    "attn_out_norm",
    "q_a",
    "q_a_bias",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_bias",
    "kv_a_norm",
    "kv_b",
    "sinks",
    "qkv",
    "qkv_bias",
    "g_proj",
    *(SECOND_BLOCK + n for n in ("input_norm", "q_a", "q_a_bias", "q_a_norm", "q_b", "kv_a", "kv_a_bias")),
    *(SECOND_BLOCK + n for n in ("kv_a_norm", "kv_b", "o", "o_bias")),  # LongCat's second attention
    *LIGHTNING_NAMES,
    *LINEAR_ATTENTION_NAMES,
    *KDA_NAMES,
    *MAMBA_NAMES,
    *SHORT_CONV_NAMES,
    *MOA_NAMES,
    *HC_NAMES[:3],  # HY-V4: the attention sub-block's hyper-connection (it forms the attention's input)
)
# what forms the mixer's input rather than mixing tokens: the pre-norm gains and HY-V4's
# hyper-connection (in the attention gradient norm, not in the conflict vector)
ATTENTION_INPUT = frozenset(("input_norm", "input_norm_bias", SECOND_BLOCK + "input_norm", *HC_NAMES[:3]))
MIXER = tuple(n for n in ATTENTION if n not in ATTENTION_INPUT)
# JetMoE's bias on the MoE output: an always-on term of the block, with the shared expert
SHARED_EXPERT = ("shared_w1", "shared_w3", "shared_w2", "shared_gate", "moe_bias")
# the domain conflict vector (`001` Eq. 14–15): the layer's parameters every token passes through
CONFLICT = (*ROUTER, *MIXER, *SHARED_EXPERT)


def present(group: Sequence[str], params: Container[str]) -> list[str]:
    """The names of ``group`` that a layer has, in the group's order."""
    return [n for n in group if n in params]
