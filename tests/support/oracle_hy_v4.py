"""Helpers of tests/test_oracle_hy_v4.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.replay.engine import hc_collapse, hc_head_weights  # noqa: E402
from moeaudit.replay.model import block_norm, decoder_layer, embed, rope_tables  # noqa: E402
from support.oracle import Observed, _norm, transformers_observed  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    # two streams; dense first layer; top-2 of 8, one shared expert; the clamp at 0.5 bites;
    # every layer's indexer keeps 5 of the 12 keys
    "two-streams-dense-first-top2-8-experts-clamped": {},
    # four streams; every layer routed; top-3 of 12, two shared experts, not renormalised, × 1;
    # four layers, layer 2 dense; the indexer keeps 7 keys; eps large enough to be seen (the
    # norms', the indexer key norm's among them, and the hyper-connections')
    "four-streams-top3-12-experts-two-shared": {
        "rms_norm_eps": 0.05,
        "hc_eps": 0.05,
        "hc_mult": 4,
        "num_hidden_layers": 4,
        "mlp_layer_types": ["sparse", "sparse", "dense", "sparse"],
        "indexer_types": ["full"] * 4,
        "num_experts_per_tok": 3,
        "n_routed_experts": 12,
        "n_shared_experts": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "index_topk": 7,
        "swiglu_limit": 10.0,
        "hc_magnitude": 1.5,
    },
    # sixteen indexer heads: a score is exactly zero only where all sixteen ReLUs are, so the
    # probe's cuts do not tie and transformers is compared as it is (the other cases tie)
    "sixteen-indexer-heads": {"index_n_heads": 16, "index_topk": 6},
}
# cases whose probe meets no tied cut in any indexer (asserted): compared with transformers as it
# is; the others with its indexers' top-k breaking ties by position, as the replay does
# (support.indexer_ties)
UNTIED = ("sixteen-indexer-heads",)


def hy_v4_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """transformers' side: the MoE input h is what ``post_attention_layernorm`` reads (the ffn
    hyper-connection's mix, which ``transformers_observed`` hooks), and the attention gradient
    norm takes in the attention sub-block's hyper-connection and its gate and sinks."""
    ref = transformers_observed(model, tokens_WT)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for i in ref.scores:
        parts = tuple(f"model.layers.{i}.{p}" for p in ("self_attn.", "input_layernorm.", "attn_hc."))
        ref.attention_grads[i] = _norm([g for n, g in grads.items() if n.startswith(parts)])
    return ref


@torch.no_grad()
def layer_inputs(ckpt: Checkpoint, tokens_WT: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's streams, then the final hidden state after the hyper head and the final norm."""
    spec = ckpt.spec
    rope = rope_tables(spec, tokens_WT.shape[1])
    x = embed(spec, ckpt.read_global("embed"), tokens_WT)
    inputs = []
    for i in range(spec.num_layers):
        inputs.append(x)
        x, _ = decoder_layer(spec, ckpt.layer_weights(i), x, rope)
    x = hc_collapse(spec, hc_head_weights(ckpt, torch.float32), x)
    return inputs + [block_norm(spec, x, ckpt.read_global("final_norm"))]
