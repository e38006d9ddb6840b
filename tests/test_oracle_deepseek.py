"""DeepSeek-V3 / V2 replay against transformers' ``DeepseekV3ForCausalLM`` /
``DeepseekV2ForCausalLM`` (docs/decisions.md, "DeepSeek-V3 / V2: sigmoid and group-limited routing, YaRN, MTP layers").

The tiny models have MLA attention (low-rank q, a shared kv latent, rope/nope split), a dense
first layer, shared experts, 8 routed experts in 4 groups of which the best 2 compete, a
non-trivial selection bias (drawn at std 0.2, comparable to the sigmoid scores' spread) and
scaled combine weights. Same tolerances as the other families (``test_oracle``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import (  # noqa: E402
    _by_expert,
    assert_identical,
    fuse_experts,
    rewrite,
    transformers_observed,
)
from support.oracle_deepseek import YARN, _fp8_checkpoint, assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "v3": ("deepseek_v3", {}),
    "v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None}),
    "v3-rope-not-interleaved": ("deepseek_v3", {"rope_interleave": False}),
    "v3-one-group-no-renorm": ("deepseek_v3", {"n_group": 1, "topk_group": 1, "norm_topk_prob": False}),
    "v3-attention-bias-two-shared-top3": (
        "deepseek_v3",
        {"attention_bias": True, "n_shared_experts": 2, "num_experts_per_tok": 3},
    ),
    "v3-all-routed-top1-group": ("deepseek_v3", {"first_k_dense_replace": 0, "topk_group": 1}),
    # the released configs' RoPE: YaRN with mscale_all_dim (softmax scale × mscale²)
    "v3-yarn": ("deepseek_v3", {"rope_parameters": YARN}),
    "v2-yarn-no-mscale": (
        "deepseek_v2",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 8,
            }
        },
    ),
    "v2-greedy": ("deepseek_v2", {}),
    "v2-group-limited": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}),
}


@pytest.mark.parametrize("case", CASES)
def test_deepseek_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    model = save_tiny(tmp_path, family, **overrides)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    assert ckpt.warnings == [] and ckpt.notes == []
    if family == "deepseek_v3":
        bias = model.model.layers[routed[0]].mlp.gate.e_score_correction_bias
        assert bias.abs().min() > 0  # the oracle ran with a real selection bias


def test_the_bias_changes_the_active_sets_but_not_the_combine_weights(tmp_path: Path) -> None:
    """Zeroing the bias moves tokens to other experts (it is used for selection), while the
    weights of the experts chosen in both cases are the unbiased sigmoid scores. Compared at
    the first routed layer, whose input the bias cannot have changed yet."""
    save_tiny(tmp_path / "a", "deepseek_v3", n_group=1, topk_group=1)
    unbiased = rewrite(tmp_path / "a", tmp_path / "b", _scale_bias(0.0))
    tokens = random_tokens()
    r_bias, r_zero = replay(Checkpoint(tmp_path / "a"), tokens), replay(Checkpoint(unbiased), tokens)
    for i in r_bias.routing:
        a, b = r_bias.routing[i], r_zero.routing[i]
        if i != min(r_bias.routing):
            assert not torch.equal(a.logits_NE, b.logits_NE)  # downstream inputs did change
            continue
        torch.testing.assert_close(a.logits_NE, b.logits_NE)
        torch.testing.assert_close(a.probs_NE, b.probs_NE)  # ρ ignores the bias
        moved = (a.topk_NK.sort(-1).values != b.topk_NK.sort(-1).values).any(-1)
        assert moved.float().mean() > 0.2
        same = ~moved
        ka, ca = _by_expert(a.topk_NK[same], a.combine_NK[same])
        kb, cb = _by_expert(b.topk_NK[same], b.combine_NK[same])
        assert torch.equal(ka, kb)
        torch.testing.assert_close(ca, cb)


def _scale_bias(factor: float, expert: int | None = None, value: float | None = None):
    def edit(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for i in ckpt.spec.routed_layers:
            key = ckpt.layer_keys(i)["router_bias"]
            out[key] = tensors[key] * factor
            if expert is not None:
                out[key][expert] = value
        return out

    return edit


def test_an_expert_excluded_by_a_very_negative_bias_is_reported_dead(tmp_path: Path) -> None:
    from moeaudit.canary import Canary
    from moeaudit.receipts.state import state_receipts

    save_tiny(tmp_path / "a", "deepseek_v3")
    excluded = rewrite(tmp_path / "a", tmp_path / "b", _scale_bias(1.0, expert=5, value=-100.0))
    tokens = random_tokens(windows=4, length=16).int()
    canary = Canary(tokens, torch.zeros(4, dtype=torch.int32), ("d",))
    before = state_receipts(Checkpoint(tmp_path / "a"), canary)
    after = state_receipts(Checkpoint(excluded), canary)
    for j, (was, layer) in enumerate(zip(before["layers"], after["layers"], strict=True)):
        assert was["occupancy"]["counts"][5] > 0  # a live expert …
        occ = layer["occupancy"]
        assert occ["counts"][5] == 0  # … is dead wherever the bias excludes it
        assert layer["gradients"]["grad_norms"][5] == 0.0
        if j == 0:  # the first routed layer sees the same inputs: exactly one more dead expert
            assert occ["dead"] == was["occupancy"]["dead"] + 1


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_layers_are_recognised_and_left_out(tmp_path: Path, family: str) -> None:
    """Released V3 checkpoints store the multi-token-prediction module as layer 61 (here: 3),
    GLM-4.5 as layer 46; it is named in a note, never a warning, and changes no number."""
    save_tiny(tmp_path / "a", family)
    base = Checkpoint(tmp_path / "a")
    n = base.spec.num_layers

    def add_mtp(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for key, t in tensors.items():
            if key.startswith(f"model.layers.{n - 1}."):
                out[key.replace(f"layers.{n - 1}.", f"layers.{n}.")] = t.clone()
        H = ckpt.spec.hidden_size
        out[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(H, 2 * H)
        out[f"model.layers.{n}.enorm.weight"] = torch.ones(H)
        return out

    with_mtp = rewrite(tmp_path / "a", tmp_path / "b", add_mtp)
    cfg_path = with_mtp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg))
    ckpt = Checkpoint(with_mtp)
    assert ckpt.warnings == []
    assert len(ckpt.notes) == 1 and f"multi-token-prediction layer(s) {n}" in ckpt.notes[0]
    assert ckpt.summary(with_digest=False)["notes"] == ckpt.notes
    tokens = random_tokens()
    assert_identical(replay(base, tokens), replay(ckpt, tokens))


def test_fused_and_bf16_deepseek_checkpoints(tmp_path: Path) -> None:
    """v5's fused expert tensors replay bit-identically; bf16 on disk (the bias stays float32,
    as transformers keeps it) agrees with transformers' upcast."""
    src = tmp_path / "src"
    save_tiny(src, "deepseek_v3")
    fused = rewrite(src, tmp_path / "fused", fuse_experts)
    tokens = random_tokens()
    assert Checkpoint(fused).fused
    assert_identical(replay(Checkpoint(src), tokens), replay(Checkpoint(fused), tokens))

    bf16 = tmp_path / "bf16"
    model = tiny_model("deepseek_v3")
    biases = {
        i: layer.mlp.gate.e_score_correction_bias.clone()
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    }
    model = model.to(torch.bfloat16)
    for i, bias in biases.items():  # the released checkpoints keep the bias in float32
        model.model.layers[i].mlp.gate.e_score_correction_bias.data = bias
    model.save_pretrained(bf16)
    stored = load_file(bf16 / "model.safetensors")
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    ckpt = Checkpoint(bf16)
    assert_agree_deepseek(
        transformers_observed(load(bf16), tokens),
        observed(ckpt, tokens),
        ckpt,
        {"rtol": 1e-3, "atol": 1e-4},
        {"rtol": 5e-3, "atol": 1e-5},
    )


@pytest.mark.parametrize(
    "bad,message",
    [
        ({"n_group": 3}, "do not split into n_group=3"),
        ({"topk_group": 5}, "topk_group=5 not in 1..4"),
        ({"n_group": 8, "topk_group": 4}, "≥ 2 experts per group"),
        ({"kv_lora_rank": 0}, "MLA needs"),
    ],
)
def test_inconsistent_deepseek_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    from moeaudit.errors import CheckpointError

    cfg = {**tiny_model_config(), **bad}
    with pytest.raises(CheckpointError, match=message):
        spec_from_config(cfg)


def tiny_model_config() -> dict[str, Any]:
    from hfmodels import tiny_config

    return tiny_config("deepseek_v3").to_dict()


def test_deepseek_config_defaults_match_transformers() -> None:
    """Omitted keys read as transformers' DeepseekV3Config / V2 defaults."""
    import transformers

    v3 = spec_from_config(transformers.AutoConfig.for_model("deepseek_v3").to_dict())
    assert (v3.num_experts, v3.top_k, v3.gate.n_group, v3.gate.topk_group) == (256, 8, 8, 4)
    assert v3.gate.scaling == 2.5 and v3.settings.norm_topk_prob and v3.gate.selection_bias
    assert v3.routed_layers[0] == 3 and v3.shared_dim == 2048 and v3.dense_dim == 18432
    assert v3.mla is not None and v3.mla.qk_head_dim == 192 and v3.head_dim == 64
    assert v3.mtp_layers == 1
    cfg = transformers.AutoConfig.for_model("deepseek_v2", num_experts_per_tok=6).to_dict()
    v2 = spec_from_config(cfg)
    assert (v2.num_experts, v2.gate.scoring, v2.gate.grouped, v2.settings.norm_topk_prob) == (
        64,
        "softmax",
        False,
        False,
    )
    assert v2.shared_dim == 2 * 1407 and v2.routed_layers[0] == 0


def test_a_v3_checkpoint_without_its_bias_is_incomplete(tmp_path: Path) -> None:
    from moeaudit.errors import CheckpointError

    save_tiny(tmp_path / "a", "deepseek_v3")
    dst = tmp_path / "b"
    dst.mkdir()
    (dst / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    tensors = {
        k: v for k, v in load_file(tmp_path / "a" / "model.safetensors").items() if "e_score_correction_bias" not in k
    }
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="e_score_correction_bias"):
        Checkpoint(dst)


def test_fp8_block_scaled_weights_match_transformers_dequantised(tmp_path: Path) -> None:
    """DeepSeek-V3 as released stores FP8 weights with 128×128 block scales; transformers
    dequantises them on a CPU-only machine. Both read the same float32 products w·s, so the
    replay agrees at float32 tolerance — and differs from the unquantised model."""
    pytest.importorskip("accelerate")  # transformers' FP8 loader needs it
    save_tiny(tmp_path / "src", "deepseek_v3")
    # Every dimension divides by 4: where one does not, transformers derives the block from the
    # scale grid instead of using weight_block_size (DeepSeek's partial last block; next test).
    fp8 = _fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", (4, 4))
    ckpt = Checkpoint(fp8)
    assert ckpt.warnings == [] and ckpt.fp8_block == (4, 4)
    assert "F8_E4M3" in ckpt.summary(with_digest=False)["dtypes"]
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(fp8), tokens), observed(ckpt, tokens), ckpt)
    assert replay(ckpt, tokens).nll != replay(Checkpoint(tmp_path / "src"), tokens).nll


def test_fp8_partial_blocks_dequantise_blockwise(tmp_path: Path) -> None:
    """Dimensions that are not multiples of the block (V3's kv_a_proj_with_mqa is 576 rows of
    128-blocks) use partial last blocks, as DeepSeek's ``weight_dequant`` does; checked against
    a block-by-block loop, exactly."""
    from moeaudit.checkpoint.checkpoint import dequantize_fp8

    save_tiny(tmp_path / "src", "deepseek_v3")
    block = (5, 7)
    ckpt = Checkpoint(_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", block))
    stored = load_file(tmp_path / "fp8" / "model.safetensors")
    key = "model.layers.1.self_attn.kv_b_proj.weight"  # 56 × 12: partial blocks both ways
    w, s = stored[key], stored[key + "_scale_inv"]
    want = torch.empty(w.shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * 5, (i + 1) * 5), slice(j * 7, (j + 1) * 7)
            want[rows, cols] = w[rows, cols].float() * s[i, j]
    assert torch.equal(ckpt.read(key), want)
    assert torch.equal(dequantize_fp8(w, s, block), want)
    original = load_file(tmp_path / "src" / "model.safetensors")[key]
    torch.testing.assert_close(want, original, rtol=0.07, atol=1e-6)  # e4m3: 3 mantissa bits


def test_fp8_without_or_with_wrong_scales_is_refused(tmp_path: Path) -> None:
    from moeaudit.errors import CheckpointError

    save_tiny(tmp_path / "src", "deepseek_v3")
    fp8 = _fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", (8, 8))
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"

    def drop(_c: Checkpoint, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in t.items() if k != key + "_scale_inv"}

    def reshape(_c: Checkpoint, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**t, key + "_scale_inv": torch.ones(1, 1)}

    with pytest.raises(CheckpointError, match="without .*_scale_inv.*needs its block scales"):
        Checkpoint(rewrite(fp8, tmp_path / "a", drop))
    with pytest.raises(CheckpointError, match=r"8×8 blocks .* need float \[3, 4\]"):
        Checkpoint(rewrite(fp8, tmp_path / "b", reshape))


@pytest.mark.parametrize("family", ["qwen3_moe"])  # transformers 5.23 mixtral: YaRN crashes
def test_yarn_rope_matches_transformers_in_other_families(family: str, tmp_path: Path) -> None:
    """YaRN without MLA: cos/sin scaled by the attention factor, the softmax scale unchanged."""
    from support.oracle import check_against_transformers

    save_tiny(tmp_path, family, rope_parameters={**YARN, "mscale_all_dim": None, "mscale": None})
    ckpt = check_against_transformers(tmp_path, random_tokens())
    assert ckpt.spec.rope.yarn is not None and ckpt.spec.attention_scale is None


def test_group_limited_margin_by_hand() -> None:
    """docs/decisions.md: m = min(in-group margin, group gap / 2) for V3's top-2-sum groups."""
    from moeaudit.replay.model import _group_limit
    from moeaudit.spec.config import Gate

    g = Gate(scoring="sigmoid", selection_bias=True, n_group=2, topk_group=1, group_score="top2sum")
    s = torch.tensor(
        [
            [0.9, 0.8, 0.85, 0.1],  # group 0 (1.7) beats group 1 (0.95)
            [0.9, 0.2, 0.85, 0.8],  # group 1 (1.65) wins: expert 0 cannot compete
            [0.6, 0.5, 0.9, 0.19],
        ],
        dtype=torch.float64,
    )  # 1.1 vs 1.09: gap decides
    allowed, m = _group_limit(g, s, s, k=1)
    assert allowed.tolist() == [[True, True, False, False], [False, False, True, True], [True, True, False, False]]
    torch.testing.assert_close(m, torch.tensor([0.1, 0.05, 0.005], dtype=torch.float64))
    v2 = Gate(n_group=2, topk_group=1, group_score="max")
    _, m2 = _group_limit(v2, s, s, k=1)  # max: group 1 wins row 3 (0.9 > 0.6), gap counts once
    torch.testing.assert_close(m2, torch.tensor([0.05, 0.05, 0.3], dtype=torch.float64))
