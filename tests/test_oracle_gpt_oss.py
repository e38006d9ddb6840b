"""gpt-oss (``gpt_oss``) replay against transformers' ``GptOssForCausalLM``.

The tiny models carry what sets gpt-oss apart: a sink logit per head in every attention softmax,
sliding-window attention on even layers (window 5 < the 12-token windows) and full attention on
odd ones, q/k/v/o biases, YaRN RoPE, a biased router, biased experts whose clamped GLU is set to
``swiglu_limit`` 1.0 so that the O(1) activations cross both clamps, and the fused
``gate_up_proj`` [E, H, 2I] with gate and up columns interleaved. MXFP4 checkpoints (the
released format) are written by ``mxfp4.quantize`` and read back against transformers' own
dequantisation. Same checks and tolerances as the other families.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_gpt_oss import _mxfp4_checkpoint, assert_experts_backward_is_autograd  # noqa: E402

from moeaudit.checkpoint import (
    Checkpoint,  # noqa: E402
    mxfp4,  # noqa: E402
)
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.model import clamped_glu, experts_backward, route_layer  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "sinks-sliding-clamped": {},
    "released-limit-mha-top1": {"swiglu_limit": 7.0, "num_key_value_heads": 4, "num_experts_per_tok": 1},
    "window-beyond-the-canary-top3": {"sliding_window": 64, "num_experts_per_tok": 3},
    "full-layers-only": {"layer_types": ["full_attention"] * 3},
}


@pytest.mark.parametrize("case", CASES)
def test_gpt_oss_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "gpt_oss", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    want = transformers_observed(load(tmp_path), tokens, moe="mlp", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)
    assert ckpt.fused and ckpt.spec.routed_layers == (0, 1, 2) and ckpt.warnings == [] and ckpt.notes == []


def test_bf16_checkpoint_matches_transformers(tmp_path: Path) -> None:
    save_tiny(tmp_path, "gpt_oss", dtype=torch.bfloat16)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    want = transformers_observed(load(tmp_path), tokens, moe="mlp", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)


def test_both_clamps_act_in_the_oracle_cases(tmp_path: Path) -> None:
    """With swiglu_limit 1 a real share of the gate and up pre-activations the replay computes
    for the canary (each token's chosen experts, every routed layer) lie beyond the limit, so the
    agreement above covers the clamped branches (forward and the masked backward)."""
    save_tiny(tmp_path, "gpt_oss")
    ckpt = Checkpoint(tmp_path)
    gate, up = [], []

    def observe(tap: Any, lw: Any) -> None:
        for k in range(tap.routing.topk_NK.shape[1]):
            for e in range(len(lw.experts)):
                rows = tap.routing.topk_NK[:, k] == e
                w = lw.experts[e]
                gate.append(tap.y_NH[rows] @ w["w1"].T + w["b1"])
                up.append(tap.y_NH[rows] @ w["w3"].T + w["b3"])

    replay(ckpt, random_tokens(), backward=False, observers=[observe])
    a1, a3 = torch.cat(gate), torch.cat(up)
    assert 0.05 < float((a1 > 1.0).double().mean()) < 0.95
    assert 0.05 < float((a3.abs() > 1.0).double().mean()) < 0.95


@pytest.mark.parametrize(
    "feature", ["attention_sinks", "router_logit_bias", "expert_bias", "limit", "alpha", "sliding_layers"]
)
def test_each_gpt_oss_difference_is_what_the_oracle_checks(feature: str, tmp_path: Path) -> None:
    """Turning any one difference off changes the NLL on the same weights, so the agreement
    above pins each of them."""
    save_tiny(tmp_path, "gpt_oss")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    ref = replay(ckpt, tokens, backward=False)
    spec = ckpt.spec
    glu = spec.clamped_glu
    assert glu is not None
    change: dict[str, Any] = {
        "attention_sinks": {"attention_sinks": False},
        "router_logit_bias": {"router_logit_bias": False},  # the reader then leaves the bias out
        "limit": {"clamped_glu": dataclasses.replace(glu, limit=7.0)},
        "alpha": {"clamped_glu": dataclasses.replace(glu, alpha=1.0)},
        "sliding_layers": {"attention": ()},  # every layer attends fully
        "expert_bias": {},
    }[feature]
    ckpt.spec = spec.revised(**change)
    if feature == "expert_bias":
        real_read = ckpt._read_experts
        ckpt._read_experts = lambda i: [
            {**w, "b1": 0 * w["b1"], "b3": 0 * w["b3"], "b2": 0 * w["b2"]}  # type: ignore[method-assign]
            for w in real_read(i)
        ]
    assert abs(replay(ckpt, tokens, backward=False).nll - ref.nll) > 1e-4


def test_clamped_glu_backward_equals_autograd() -> None:
    """The hand-written expert backward (the clamps' masks, the biases' gradients, dL/dc)
    against autograd on the same expert, with both clamps active."""
    gen = torch.Generator().manual_seed(3)
    H, I, N, K = 16, 12, 40, 2
    spec = spec_from_config({**tiny_config("gpt_oss").to_dict(), "hidden_size": H, "intermediate_size": I})
    glu = spec.clamped_glu
    assert glu is not None
    experts = [
        {
            "w1": torch.randn(I, H, generator=gen) / 2,
            "w3": torch.randn(I, H, generator=gen) / 2,
            "w2": torch.randn(H, I, generator=gen) / 3,
            "b1": torch.randn(I, generator=gen) / 5,
            "b3": torch.randn(I, generator=gen) / 5,
            "b2": torch.randn(H, generator=gen) / 5,
        }
        for _ in range(3)
    ]
    y = torch.randn(N, H, generator=gen)
    topk = torch.stack([torch.randperm(3, generator=gen)[:K] for _ in range(N)])
    c = torch.rand(N, K, generator=gen)
    g_out = torch.randn(N, H, generator=gen)

    def contribution(w: dict[str, torch.Tensor], x: torch.Tensor, c_M1: torch.Tensor) -> torch.Tensor:
        h = clamped_glu(glu, x @ w["w1"].T + w["b1"], x @ w["w3"].T + w["b3"])
        return c_M1 * (h @ w["w2"].T + w["b2"])

    assert_experts_backward_is_autograd(
        experts_backward(experts, y, topk, c, g_out, glu), experts, y, topk, c, g_out, contribution
    )


def test_router_bias_is_part_of_the_logits(tmp_path: Path) -> None:
    """The scores are W_r y + b (what transformers returns as router logits): the margins and the
    flip test see the bias."""
    save_tiny(tmp_path, "gpt_oss")
    lw = Checkpoint(tmp_path).layer_weights(1)
    y = torch.randn(10, 32, generator=torch.Generator().manual_seed(0))
    r = route_layer(Checkpoint(tmp_path).spec, lw.params, y)
    torch.testing.assert_close(r.scores_NE, y @ lw.params["router"].T + lw.params["router_logit_bias"])


# --- MXFP4 ----------------------------------------------------------------------------------------


def _transformers_dequantised(src: Path, dst: Path) -> Any:
    """The HF model with the MXFP4 checkpoint's weights, dequantised by transformers'
    ``convert_moe_packed_tensors`` (what ``Mxfp4Config(dequantize=True)`` loads)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = load(src)
    packed = load_file(str(dst / "model.safetensors"))
    state = {}
    for key, t in packed.items():
        if key.endswith("_blocks"):
            stem = key.removesuffix("_blocks")
            state[stem] = convert_moe_packed_tensors(t, packed[stem + "_scales"], dtype=torch.float32)
        elif not key.endswith("_scales"):
            state[key] = t.float()
    model.load_state_dict(state, strict=True)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_is_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """Every code and every finite exponent (0..254, subnormal results included) against
    transformers' ``convert_moe_packed_tensors``."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 255, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.arange(255, dtype=torch.uint8)[None, :, None].expand(3, 255, 4).contiguous()
    assert torch.equal(mxfp4.dequantize(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype))


def test_mxfp4_checkpoint_matches_transformers_dequantised(tmp_path: Path) -> None:
    src, dst = tmp_path / "dense", tmp_path / "mxfp4"
    save_tiny(src, "gpt_oss", intermediate_size=32)  # MXFP4 blocks: in-dims multiples of 32
    _mxfp4_checkpoint(src, dst)
    ckpt = Checkpoint(dst)
    assert len(ckpt.packed) == 6 and ckpt.warnings == []
    summary = ckpt.summary(with_digest=False)
    assert summary["mxfp4"] == "6 expert tensors in MXFP4 (blocks of 32)"
    assert summary["parameters"] == Checkpoint(src).summary(with_digest=False)["parameters"]  # values, not bytes
    tokens = random_tokens()
    want = transformers_observed(_transformers_dequantised(src, dst), tokens, moe="mlp", gate="router")
    assert_agree_deepseek(want, observed(ckpt, tokens), ckpt)
    dense = replay(Checkpoint(src), tokens, backward=False).nll
    assert abs(float(want.loss) - dense) > 1e-4  # the quantisation is in the numbers compared


def test_bad_mxfp4_tensors_are_refused(tmp_path: Path) -> None:
    src, dst = tmp_path / "dense", tmp_path / "mxfp4"
    save_tiny(src, "gpt_oss", intermediate_size=32)
    _mxfp4_checkpoint(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    key = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key].float()
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match="MXFP4 tensor .*down_proj_scales.* is F32"):
        Checkpoint(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral", "num_local_experts": 4}))
    with pytest.raises(CheckpointError, match="MXFP4 weights are read for gpt_oss only"):
        Checkpoint(dst)


# --- config ---------------------------------------------------------------------------------------


def released_20b_config() -> dict[str, Any]:
    """openai/gpt-oss-20b's config.json (transformers 4.55 era: ``rope_scaling``, MXFP4)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": False,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": 201088,
    }


def test_released_config_reads_as_transformers_does() -> None:
    import transformers

    cfg = released_20b_config()
    s = spec_from_config(cfg)
    hf = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("quantization_config",)})
    assert s.sliding_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert (s.sliding_window, s.rms_eps, s.rope.theta, s.top_k, s.num_experts) == (128, 1e-5, 150000.0, 4, 32)
    assert s.rope.yarn is not None and (s.rope.yarn.factor, s.rope.yarn.truncate) == (32.0, False)
    assert s.clamped_glu is not None and (s.clamped_glu.alpha, s.clamped_glu.limit) == (1.702, 7.0)
    assert s.routing == "softmax top-4 of 32, biased logits, renormalised"
    # no layer_types and no rope scaling: GptOssConfig's defaults (even layers slide, YaRN ×32)
    bare = {k: v for k, v in cfg.items() if k not in ("layer_types", "rope_scaling")}
    s2 = spec_from_config(bare)
    assert s2.sliding_layers == tuple(range(0, 24, 2)) and s2.rope.yarn is not None and s2.rope.yarn.factor == 32.0


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 3"),
        ({"layer_types": ["local", "full_attention", "sliding_attention"]}, "layer_types must list 3"),
        ({"swiglu_limit": 0.0}, "swiglu_limit must be positive"),
        ({"sliding_window": -4}, "sliding_window must be a positive integer or null"),
        ({"sliding_window": None}, "layer_types name sliding layers but sliding_window is null"),
    ],
)
def test_bad_gpt_oss_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("gpt_oss").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


# --- end to end -----------------------------------------------------------------------------------


def test_certify_a_gpt_oss_run_with_an_mxfp4_checkpoint(tmp_path: Path) -> None:
    """A run of a dense checkpoint and its MXFP4 quantisation: certify writes a certificate that
    verifies, and the receipts name the MXFP4 storage; inspect reads the packed checkpoint."""
    from support.certify_families import certify_and_verify

    from moeaudit.cli import cli

    run = tmp_path / "run"
    save_tiny(run / "checkpoint-100", "gpt_oss", intermediate_size=32)
    _mxfp4_checkpoint(run / "checkpoint-100", run / "checkpoint-200")
    runner, out = certify_and_verify(run, tmp_path)
    receipt = json.loads((out / "receipts" / "checkpoint-200.json").read_text())
    quantization = receipt["checkpoint"]["quantization"]
    assert quantization == "MXFP4 experts (6 tensors) dequantised exactly, one expert at a time"
    assert "quantization" not in json.loads((out / "receipts" / "checkpoint-100.json").read_text())["checkpoint"]
    assert receipt["checkpoint"]["family"] == "gpt_oss"
    shown = runner.invoke(cli, ["inspect", str(run / "checkpoint-200"), "--json"])
    assert shown.exit_code == 0 and json.loads(shown.output)["mxfp4"].startswith("6 expert tensors")


def test_the_biased_router_carries_a_gate_note(tmp_path: Path) -> None:
    """The atlas theorem assumes bias-free linear logits: a gpt-oss layer says its cells are
    polyhedra cut by affine walls, and that the Gaussian closed form is not certified; its ρ is
    the gate's own softmax, whose top-k is the active set (checked on a replay)."""
    from moeaudit.receipts.gate import gate_note

    save_tiny(tmp_path, "gpt_oss")
    ckpt = Checkpoint(tmp_path)
    note = gate_note(ckpt.spec)
    assert note is not None and "a router bias b in the logits W_r y + b" in note["why"]
    assert any("affine hyperplanes" in n for n in note["not_certified"])
    assert any("Gaussian boundary-mass closed form" in n for n in note["not_certified"])
    assert "the gate's own softmax (ρ = softmax(W_r y + b)), bias included" in note["changed"][1]
    result = replay(ckpt, random_tokens(), backward=False)
    for r in result.routing.values():
        top = r.probs_NE.topk(ckpt.spec.top_k, dim=-1).indices
        assert torch.equal(top.sort(-1).values, r.topk_NK.sort(-1).values)


# --- torchtitan DCP -------------------------------------------------------------------------------

GPT_OSS_TT = {  # torchtitan's gpt-oss names (its state_dict_adapter's from_hf_map), by hand
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.router": "moe.router.gate",
}


def gpt_oss_torchtitan_state(sd: dict[str, torch.Tensor], layers: int) -> dict[str, Any]:
    """The model as torchtitan's GroupedExperts hold it: mlp1 [E, 2I, H] (out × in, gate and up
    rows interleaved) and mlp2 [E, H, I], the transposes of transformers' tensors; the newer
    parameter names with their shape suffixes; the embedding, norm and head under torchtitan's names."""
    out: dict[str, Any] = {
        "tok_embeddings.weight": sd["model.embed_tokens.weight"],
        "norm.weight": sd["model.norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    for i in range(layers):
        p, t = f"model.layers.{i}.", f"layers.{i}."
        for hf, tt in GPT_OSS_TT.items():
            for part in ("weight", "bias"):
                out[f"{t}{tt}.{part}"] = sd[f"{p}{hf}.{part}"]
        out[t + "attention.sinks"] = sd[p + "self_attn.sinks"]
        out[t + "attention_norm.weight"] = sd[p + "input_layernorm.weight"]
        out[t + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        out[t + "moe.experts.mlp1_weight_EGD"] = sd[p + "mlp.experts.gate_up_proj"].transpose(1, 2).contiguous()
        out[t + "moe.experts.mlp1_bias_EG"] = sd[p + "mlp.experts.gate_up_proj_bias"]
        out[t + "moe.experts.mlp2_weight_EDF"] = sd[p + "mlp.experts.down_proj"].transpose(1, 2).contiguous()
        out[t + "moe.experts.mlp2_bias_ED"] = sd[p + "mlp.experts.down_proj_bias"]
    return {**out, "train_state": {"step": 10}}


def test_torchtitan_dcp_reads_bit_exact_and_replays_the_same(tmp_path: Path) -> None:
    from support.dcp import assert_same_weights, save

    src, dst = tmp_path / "hf", tmp_path / "dcp"
    save_tiny(src, "gpt_oss")
    save(gpt_oss_torchtitan_state(load_file(str(src / "model.safetensors")), 3), dst)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    ours, ref = Checkpoint(dst), Checkpoint(src)
    assert ours.is_dcp and ours.warnings == [] and ours.fused_format == "interleaved_rows"
    # 3 globals + 3 layers × (2 norms + 4 attention + 4 biases + sinks + router + its bias) + 3 × 4 experts × 6
    assert assert_same_weights(ours, ref) == 3 + 3 * 13 + 3 * 4 * 6
    tokens = random_tokens()
    assert replay(ours, tokens).nll == replay(ref, tokens).nll


def test_mxfp4_experts_stay_packed_until_used(tmp_path: Path) -> None:
    """A routed layer holds its experts as MXFP4 codes and exponents (uint8), dequantised one
    expert at a time on access, bit for bit what dequantising the whole tensor gives; the
    device path (``DeviceExperts``) converts the same way after moving the packed bytes."""
    from moeaudit.checkpoint.checkpoint import MXFP4Experts
    from moeaudit.replay.engine import DeviceExperts

    src, dst = tmp_path / "dense", tmp_path / "mxfp4"
    save_tiny(src, "gpt_oss", intermediate_size=32)
    _mxfp4_checkpoint(src, dst)
    ckpt = Checkpoint(dst)
    lazy = ckpt.layer_weights(1, lazy_experts=True).experts
    assert isinstance(lazy, MXFP4Experts)
    assert {t.dtype for w in lazy.stored for n, t in w.items() if not n.endswith("bias")} == {torch.uint8}
    keys = ckpt.expert_keys(1)
    assert isinstance(keys, dict)
    gate_up, down = ckpt.read(keys["gate_up"]).float(), ckpt.read(keys["down"]).float()  # whole tensors
    eager = ckpt.layer_weights(1).experts
    on_cpu = DeviceExperts(lazy, torch.device("cpu"))
    for e in range(4):
        want = {"w1": gate_up[e, :, 0::2].T, "w3": gate_up[e, :, 1::2].T, "w2": down[e].T}
        for got in (lazy[e], eager[e], on_cpu[e]):
            for n, t in want.items():
                assert torch.equal(got[n], t), (e, n)


def test_a_nan_exponent_is_reported_as_a_non_finite_weight(tmp_path: Path) -> None:
    """E8M0's code 255 is NaN: the forward pass names the tensor among the non-finite weights,
    as it names a NaN in a dense tensor."""
    src, dst = tmp_path / "dense", tmp_path / "mxfp4"
    save_tiny(src, "gpt_oss", intermediate_size=32)
    _mxfp4_checkpoint(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.down_proj_scales"][2, 0, 0] = 255
    save_file(tensors, str(dst / "model.safetensors"))
    result = replay(Checkpoint(dst), random_tokens(), backward=False)
    assert result.nonfinite_weights == ["layer 1 expert 2 down_scales"]
