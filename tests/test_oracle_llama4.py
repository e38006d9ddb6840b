"""Llama 4 (``llama4_text``, and ``llama4``'s text decoder) replay against transformers'
``Llama4ForCausalLM``.

The tiny models carry what sets Llama 4 apart: dense and MoE layers interleaved, a sigmoid
router whose weight scales each chosen expert's *input* (Σ_k u_k(c_k y)) next to an ungated
shared expert, RoPE on adjacent pairs, chunked attention (chunks of 5 < the 12-token windows) on
the RoPE layers, a NoPE layer whose query temperature changes within the window (floor_scale 4),
and a weightless L2 norm of q and k. Same checks and tolerances as the other families.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, redraw, save_tiny, tiny_config  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_gpt_oss import assert_experts_backward_is_autograd  # noqa: E402
from support.oracle_llama4 import hf_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.model import experts_backward, swiglu  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}

CASES: dict[str, dict[str, Any]] = {
    "scout-like-top1": {},
    "top2-all-routed": {"num_experts_per_tok": 2, "interleave_moe_layer_step": 1},
    "llama3-rope": {"rope_parameters": LLAMA3},
    "no-qk-norm-no-temperature-no-chunks": {
        "use_qk_norm": False,
        "attn_temperature_tuning": False,
        "attention_chunk_size": None,
    },
    "explicit-layers": {"moe_layers": [0, 2], "no_rope_layers": [1, 0, 1, 1]},
}


@pytest.mark.parametrize("case", CASES)
def test_llama4_text_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama4_text", **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(hf_observed(load(tmp_path), ckpt, tokens), observed(ckpt, tokens), ckpt)
    assert ckpt.fused and ckpt.warnings == [] and ckpt.notes == []


def test_bf16_checkpoint_matches_transformers(tmp_path: Path) -> None:
    save_tiny(tmp_path, "llama4_text", dtype=torch.bfloat16)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    assert_agree_deepseek(hf_observed(load(tmp_path), ckpt, tokens), observed(ckpt, tokens), ckpt)


def test_the_released_vision_language_checkpoint_replays_its_text_decoder(tmp_path: Path) -> None:
    """``llama4`` (Llama4ForConditionalGeneration, as Scout and Maverick are released): the text
    decoder under ``language_model.*`` against transformers' own language model; the vision
    encoder and projector are recognised and left out with a note."""
    import transformers

    text = tiny_config("llama4_text").to_dict()
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    torch.manual_seed(0)
    model = transformers.Llama4ForConditionalGeneration(config).float()
    redraw(model, 0)
    model.save_pretrained(tmp_path)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.family == "llama4" and ckpt.spec.routed_layers == (1, 3) and ckpt.warnings == []
    assert any("vision encoder" in n for n in ckpt.notes) and any("projector" in n for n in ckpt.notes)
    lm = transformers.Llama4ForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokens = random_tokens()
    assert_agree_deepseek(hf_observed(lm.language_model, ckpt, tokens), observed(ckpt, tokens), ckpt)


@pytest.mark.parametrize(
    "feature",
    [
        "scaled_expert_inputs",
        "nope_layers",
        "attn_temperature",
        "chunked_layers",
        "qk_norm",
        "rope_interleaved",
        "llama3_rope",
    ],
)
def test_each_llama4_difference_is_what_the_oracle_checks(feature: str, tmp_path: Path) -> None:
    """Turning any one difference off changes the NLL on the same weights, so the agreement
    above pins each of them."""
    save_tiny(tmp_path, "llama4_text", rope_parameters=LLAMA3)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    ref = replay(ckpt, tokens, backward=False)
    variants = ckpt.spec.settings.attention
    off: dict[str, Any] = {
        "scaled_expert_inputs": False,
        "nope_layers": {"attention": tuple(dataclasses.replace(v, rope=True) for v in variants)},
        "attn_temperature": None,
        "chunked_layers": {"attention": tuple(dataclasses.replace(v, chunk=None) for v in variants)},
        "qk_norm": "none",
        "rope_interleaved": False,
        "llama3_rope": None,
    }
    change = off[feature]
    ckpt.spec = ckpt.spec.revised(**(change if isinstance(change, dict) else {feature: change}))
    assert abs(replay(ckpt, tokens, backward=False).nll - ref.nll) > 1e-4


def test_scaled_input_expert_backward_equals_autograd() -> None:
    """out = Σ_k u_k(c_k y): the hand-written backward (dL/dy, dL/dc, weight gradients) against
    autograd on the same experts."""
    gen = torch.Generator().manual_seed(4)
    H, I, N, K, E = 16, 12, 40, 2, 3
    experts = [
        {
            "w1": torch.randn(I, H, generator=gen) / 2,
            "w3": torch.randn(I, H, generator=gen) / 2,
            "w2": torch.randn(H, I, generator=gen) / 3,
        }
        for _ in range(E)
    ]
    y = torch.randn(N, H, generator=gen)
    topk = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    c = torch.rand(N, K, generator=gen)
    g_out = torch.randn(N, H, generator=gen)
    back = experts_backward(experts, y, topk, c, g_out, scaled_inputs=True)
    assert_experts_backward_is_autograd(
        back, experts, y, topk, c, g_out, lambda w, x, c_M1: swiglu(c_M1 * x, w["w1"], w["w3"], w["w2"])
    )


def test_expert_outputs_keep_the_combine_form(tmp_path: Path) -> None:
    """The taps' u_k are u_k(c_k y)/c_k, so Σ_k c_k u_k is the routed part of the block's output
    (what the overlap receipts decompose)."""
    save_tiny(tmp_path, "llama4_text", num_experts_per_tok=2)
    ckpt = Checkpoint(tmp_path)
    taps: dict[int, Any] = {}
    replay(ckpt, random_tokens(), backward=False, observers=[lambda tap, lw: taps.setdefault(tap.layer, (tap, lw))])
    tap, lw = taps[1]
    r = tap.routing
    direct = torch.zeros_like(tap.y_NH)
    for k in range(2):
        for e in range(4):
            rows = r.topk_NK[:, k] == e
            w = lw.experts[e]
            direct[rows] += swiglu(r.combine_NK[rows, k, None] * tap.y_NH[rows], w["w1"], w["w3"], w["w2"])
    torch.testing.assert_close((tap.u_NKH * r.combine_NK[..., None]).sum(1), direct, rtol=1e-5, atol=1e-6)


def scout_config() -> dict[str, Any]:
    """meta-llama/Llama-4-Scout-17B-16E's text_config (the keys the replay reads)."""
    return {
        "model_type": "llama4_text",
        "attention_bias": False,
        "attention_chunk_size": 8192,
        "attn_scale": 0.1,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 5120,
        "interleave_moe_layer_step": 1,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "max_position_embeddings": 10485760,
        "num_attention_heads": 40,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "num_local_experts": 16,
        "no_rope_layers": [],
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 16.0,
            "high_freq_factor": 1.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "use_qk_norm": True,
        "vocab_size": 202048,
        "tie_word_embeddings": False,
    }


def test_scout_config_reads_as_transformers_does() -> None:
    import transformers

    cfg = scout_config()
    s = spec_from_config(cfg)
    hf = transformers.Llama4TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert s.routed_layers == tuple(hf.moe_layers) == tuple(range(48))
    assert s.nope_layers == tuple(i for i, f in enumerate(hf.no_rope_layers) if not f) == tuple(range(3, 48, 4))
    assert s.chunked_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "chunked_attention")
    assert s.rope.llama3 is not None and s.rope.llama3.factor == 16.0 and s.settings.qk_norm == "l2"
    assert s.settings.attn_temperature == (0.1, 8192.0) and s.attention_chunk == 8192 and s.dense_dim == 0
    assert s.routing == "sigmoid top-1 of 16, not renormalised" and s.shared_dim == 8192


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"moe_layers": [0, 9]}, "moe_layers must be layer indices in 0..3"),
        ({"no_rope_layers": [1, 1]}, "no_rope_layers must hold a 0 or 1 for each of the 4"),
        ({"attention_chunk_size": 0}, "attention_chunk_size must be a positive integer or null"),
        ({"layer_types": ["chunked_attention"] * 4, "attention_chunk_size": None}, "attention_chunk_size is null"),
        ({"rope_parameters": {**LLAMA3, "high_freq_factor": 0.5}}, "high_freq_factor ≥ low_freq_factor"),
        ({"rope_parameters": {**LLAMA3, "factor": None}}, "llama3 RoPE needs a positive 'factor'"),
    ],
)
def test_bad_llama4_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("llama4_text").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


def test_the_sigmoid_router_note_says_what_rho_is(tmp_path: Path) -> None:
    """Llama 4's gate note: sigmoid combine weights without renormalisation, chosen on the
    linear logits (so Theorem 1's cones still hold and are not listed as uncertified), scaled
    expert inputs; ρ = σ/Σσ has the active set as its top-k (checked on a replay)."""
    from moeaudit.receipts.gate import gate_note

    save_tiny(tmp_path, "llama4_text", num_experts_per_tok=2)
    ckpt = Checkpoint(tmp_path)
    note = gate_note(ckpt.spec)
    assert note is not None and "scale each chosen expert's input" in note["why"]
    assert not any("cones" in n for n in note["not_certified"])
    assert "their top-k is the active set" in note["changed"][1]
    result = replay(ckpt, random_tokens(), backward=False)
    for r in result.routing.values():
        top = r.probs_NE.topk(2, dim=-1).indices
        assert torch.equal(top.sort(-1).values, r.topk_NK.sort(-1).values)


# --- torchtitan DCP -------------------------------------------------------------------------------

# torchtitan's Llama 4 names (its state_dict_adapter's from_hf_map), written out by hand
LLAMA4_TT = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "feed_forward.router.weight": "moe.router.gate.weight",
    "feed_forward.shared_expert.gate_proj.weight": "moe.shared_experts.w1.weight",
    "feed_forward.shared_expert.up_proj.weight": "moe.shared_experts.w3.weight",
    "feed_forward.shared_expert.down_proj.weight": "moe.shared_experts.w2.weight",
    "feed_forward.gate_proj.weight": "feed_forward.w1.weight",
    "feed_forward.up_proj.weight": "feed_forward.w3.weight",
    "feed_forward.down_proj.weight": "feed_forward.w2.weight",
}


def llama4_torchtitan_state(sd: dict[str, torch.Tensor], layers: int, prefix: str = "model.") -> dict:
    """A Llama 4 state dict as torchtitan holds it: its ``from_hf`` splits ``gate_up_proj``
    [E, H, 2I] into w1, w3 and transposes them to [E, I, H], and transposes ``down_proj``
    [E, I, H] to w2 [E, H, I]; a training state rides along."""
    lm_head = "language_model.lm_head.weight" if prefix != "model." else "lm_head.weight"
    out: dict[str, Any] = {
        "tok_embeddings.weight": sd[prefix + "embed_tokens.weight"],
        "norm.weight": sd[prefix + "norm.weight"],
        "lm_head.weight": sd[lm_head],
    }
    for i in range(layers):
        p = f"{prefix}layers.{i}."
        for hf, tt in LLAMA4_TT.items():
            if p + hf in sd:
                out[f"layers.{i}.{tt}"] = sd[p + hf]
        if p + "feed_forward.experts.gate_up_proj" in sd:
            w1, w3 = sd[p + "feed_forward.experts.gate_up_proj"].chunk(2, dim=-1)
            out[f"layers.{i}.moe.experts.w1"] = w1.transpose(-1, -2).contiguous()
            out[f"layers.{i}.moe.experts.w3"] = w3.transpose(-1, -2).contiguous()
            out[f"layers.{i}.moe.experts.w2"] = sd[p + "feed_forward.experts.down_proj"].transpose(-1, -2).contiguous()
    return {**out, "train_state": {"step": 10}}


@pytest.mark.parametrize("vl", [False, True])
def test_torchtitan_dcp_reads_bit_exact_and_replays_the_same(vl: bool, tmp_path: Path) -> None:
    """A torchtitan Llama 4 DCP directory, with the text config (``llama4_text``) or with the
    released vision-language config.json beside it (``llama4``, as torchtitan's adapter pairs
    them): every tensor the replay reads equals the safetensors original bit for bit, and the
    replay gives the same NLL."""
    import json

    from safetensors.torch import load_file
    from support.dcp import assert_same_weights, save

    src = tmp_path / "hf"
    save_tiny(src, "llama4_text")
    sd = load_file(str(src / "model.safetensors"))
    dst = tmp_path / "dcp"
    save(llama4_torchtitan_state(sd, 4), dst)
    cfg = json.loads((src / "config.json").read_text())
    if vl:
        cfg = {"model_type": "llama4", "text_config": cfg, "tie_word_embeddings": False}
    (dst / "config.json").write_text(json.dumps(cfg))
    ours, ref = Checkpoint(dst), Checkpoint(src)
    assert ours.is_dcp and ours.warnings == [] and ours.fused and ours.fused_format == "stacked"
    assert ours.spec.family == ("llama4" if vl else "llama4_text")
    # 3 globals + 4 layers × (4 attention + 2 norms) + 2 dense × 3 + 2 routed × (router + 3 shared + 4 experts × 3)
    assert assert_same_weights(ours, ref) == 3 + 4 * 6 + 2 * 3 + 2 * (1 + 3 + 4 * 3)
    tokens = random_tokens()
    assert replay(ours, tokens).nll == replay(ref, tokens).nll


def test_a_torchtitan_load_balancing_bias_is_refused_not_dropped(tmp_path: Path) -> None:
    """torchtitan adds ``moe.expert_bias`` to the scores when it chooses experts; transformers'
    Llama 4 has no such term, so the replay cannot honour it: the checkpoint is refused, naming
    the tensor (docs/decisions.md, "Extra tensors": replaying without it would audit another model than was trained)."""
    from safetensors.torch import load_file
    from support.dcp import save

    src = tmp_path / "hf"
    save_tiny(src, "llama4_text")
    state = llama4_torchtitan_state(load_file(str(src / "model.safetensors")), 4)
    state["layers.1.moe.expert_bias"] = torch.tensor([0.1, -0.1, 0.0, 0.0])
    save(state, tmp_path / "dcp")
    (tmp_path / "dcp" / "config.json").write_bytes((src / "config.json").read_bytes())
    with pytest.raises(
        CheckpointError,
        match=r"1 tensor\(s\) that moeaudit's llama4_text replay does not use: "
        r"model\.layers\.1\.feed_forward\.router\.expert_bias —",
    ):
        Checkpoint(tmp_path / "dcp")
