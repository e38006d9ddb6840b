"""Phi-3.5-MoE (``phimoe``) replay against transformers' ``PhimoeForCausalLM``.

The tiny models carry what sets Phi-3.5-MoE apart: LayerNorms with biases (block and final),
q/k/v/o and LM-head biases, the sparsemixer router (top-2 of the logits, each expert's combine
weight its softmax over the experts inside a relative band 2ε of its logit; ε = 0.3 here so the
bands hold rivals), longrope RoPE in both length regimes, a sliding window. Same checks and
tolerances as the other families.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.receipts.overlap import visible_field  # noqa: E402
from moeaudit.replay import replay  # noqa: E402


def longrope(original: int) -> dict[str, Any]:
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.3, 1.9, 2.6],
        "long_factor": [1.0, 2.0, 4.0, 8.0],
        "short_mscale": 1.1,
        "long_mscale": 1.3,
        "original_max_position_embeddings": original,
    }


CASES: dict[str, dict[str, Any]] = {
    "biases-wide-jitter": {},
    "released-jitter-no-biases": {"router_jitter_noise": 0.01, "attention_bias": False, "lm_head_bias": False},
    "longrope-within-original": {"rope_parameters": longrope(64)},
    "longrope-beyond-original": {"rope_parameters": longrope(8)},  # 12-token windows: the long mscale
    "sliding-window-zero-jitter": {"sliding_window": 5, "router_jitter_noise": 0.0},
}


@pytest.mark.parametrize("case", CASES)
def test_phimoe_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "phimoe", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    want = transformers_observed(load(tmp_path), tokens, moe="mlp", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)
    assert not ckpt.fused and ckpt.warnings == [] and ckpt.notes == []


def test_bf16_checkpoint_matches_transformers(tmp_path: Path) -> None:
    save_tiny(tmp_path, "phimoe", dtype=torch.bfloat16)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    want = transformers_observed(load(tmp_path), tokens, moe="mlp", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)


def test_the_sparsemixer_band_is_in_the_compared_numbers(tmp_path: Path) -> None:
    """With ε = 0.3 a good share of first-choice weights are below 1 (rivals in the band) and of
    second-choice weights too, so the agreement above covers both masked softmaxes."""
    save_tiny(tmp_path, "phimoe")
    result = replay(Checkpoint(tmp_path), random_tokens(), backward=False)
    c = torch.cat([r.combine_NK for r in result.routing.values()])
    assert 0.1 < float((c[:, 0] < 0.999).double().mean()) < 0.95
    assert 0.1 < float((c[:, 1] < 0.999).double().mean()) < 0.95


@pytest.mark.parametrize("feature", ["layer_norm", "lm_head_bias", "sparsemixer_eps", "longrope"])
def test_each_phimoe_difference_is_what_the_oracle_checks(feature: str, tmp_path: Path) -> None:
    """Turning any one difference off changes the NLL on the same weights, so the agreement
    above pins each of them."""
    save_tiny(tmp_path, "phimoe", rope_parameters=longrope(64))
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    ref = replay(ckpt, tokens, backward=False)
    off: dict[str, Any] = {"layer_norm": False, "lm_head_bias": False, "sparsemixer_eps": 0.0, "longrope": None}
    ckpt.spec = ckpt.spec.revised(**{feature: off[feature]})
    assert abs(replay(ckpt, tokens, backward=False).nll - ref.nll) > 1e-4


def test_layernorm_taps_and_visible_field(tmp_path: Path) -> None:
    """Under LayerNorm the tap's z is the centred, normalised state (mean 0, ‖z‖² ≈ H) and
    y = γ ⊙ z + β; the visible field removes the mean and the z direction, the two directions a
    LayerNorm's Jacobian annihilates (checked against autograd's Jacobian-vector products)."""
    save_tiny(tmp_path, "phimoe")
    ckpt = Checkpoint(tmp_path)
    taps: dict[int, Any] = {}
    replay(ckpt, random_tokens(), backward=False, observers=[lambda tap, lw: taps.setdefault(tap.layer, (tap, lw))])
    tap, lw = taps[1]
    H = ckpt.spec.hidden_size
    z = tap.z_NH
    torch.testing.assert_close(z.mean(-1), torch.zeros(z.shape[0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(z.pow(2).sum(-1), torch.full((z.shape[0],), float(H)), rtol=1e-3, atol=0)
    torch.testing.assert_close(lw.params["post_norm"] * z + lw.params["post_norm_bias"], tap.y_NH, rtol=1e-5, atol=1e-5)
    u = tap.u_NKH
    v = visible_field(u, z, centred=True)
    h = tap.h_NH[:4]
    for n in range(4):

        def ln(x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.layer_norm(x, (H,), None, None, ckpt.spec.rms_eps)

        _, jvp_u = torch.func.jvp(ln, (h[n],), (u[n, 0],))
        _, jvp_v = torch.func.jvp(ln, (h[n],), (v[n, 0],))
        torch.testing.assert_close(jvp_v, jvp_u, rtol=1e-4, atol=1e-6)  # the removed part is invisible
        assert abs(float(v[n, 0].sum())) < 1e-4 and abs(float(v[n, 0] @ z[n])) < 1e-3


def test_the_sparsemixer_gate_note(tmp_path: Path) -> None:
    from moeaudit.receipts.gate import gate_note

    note = gate_note(spec_from_config(tiny_config("phimoe").to_dict()))
    assert note is not None and "sparsemixer combine weights" in note["why"]
    assert "their top-2 is the active set" in note["changed"][1] and note["not_certified"] == []


def phi35_config() -> dict[str, Any]:
    """microsoft/Phi-3.5-MoE-instruct's config.json (the keys the replay reads; 64 factors)."""
    short = [1.0, 1.0399, 1.0399, 1.0399, 1.0399, 1.0873, 1.0873, 1.1254, 1.1254, 1.1254] + [1.2] * 54
    return {
        "model_type": "phimoe",
        "attention_bias": True,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "input_jitter_noise": 0.01,
        "intermediate_size": 6400,
        "lm_head_bias": True,
        "max_position_embeddings": 131072,
        "num_attention_heads": 32,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "long_factor": [1.1] * 64,
            "long_mscale": 1.243163121016122,
            "original_max_position_embeddings": 4096,
            "short_factor": short,
            "short_mscale": 1.243163121016122,
            "type": "longrope",
        },
        "rope_theta": 10000.0,
        "router_jitter_noise": 0.01,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "vocab_size": 32064,
    }


def test_released_config_reads() -> None:
    s = spec_from_config(phi35_config())
    assert s.layer_norm and s.lm_head_bias and s.settings.attention_bias and s.settings.sparsemixer_eps == 0.01
    assert (
        s.rope.longrope is not None
        and len(s.rope.longrope.short_factor) == 64
        and s.rope.longrope.original_max_positions == 4096
    )
    assert s.sliding_window == 131072 and s.routing == "sparsemixer top-2 of 16, jitter ε 0.01"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"num_experts_per_tok": 3}, "routes exactly 2 experts per token"),
        ({"router_jitter_noise": -0.1}, "router_jitter_noise must be ≥ 0"),
        ({"rope_parameters": {**longrope(8), "short_factor": [1.0, 2.0]}}, "short_factor must be 4 positive numbers"),
        ({"rope_parameters": {**longrope(8), "short_mscale": None}}, "longrope needs a positive 'short_mscale'"),
    ],
)
def test_bad_phimoe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("phimoe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


def test_longrope_is_refused_for_other_families() -> None:
    cfg = tiny_config("mixtral").to_dict()
    with pytest.raises(CheckpointError, match="rope type 'longrope' is read for phimoe only"):
        spec_from_config({**cfg, "rope_parameters": longrope(8)})
