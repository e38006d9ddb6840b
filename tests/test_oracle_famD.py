"""Routed designs against transformers: K-EXAONE (``exaone_moe``), …

Each family: at least two configurations varying top-k, the expert count, shared experts and
the dense/sparse layer placement, each in float32 and from a bfloat16 checkpoint (both sides
compute in float32 from the same upcast weights, so the float32 tolerances of ``test_oracle``
hold: NLL within 1e-4, gradient norms within 2e-3 relative, top-k sets identical on every token
whose k-th and (k+1)-th scores are more than 1e-5 apart). A test per new mechanism shows that
turning it off changes the NLL, so the agreement pins it.

With ``MOEAUDIT_FAMD_LOG=FILE`` each comparison appends its NLL absolute and worst gradient-norm
relative difference to FILE (the figures of docs/families.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import Observed, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config
from moeaudit.replay import replay  # noqa: E402
from moeaudit.spec.config import Gate  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def _log(family: str, case: str, dtype: str, ref: Observed, ours: Observed) -> None:
    path = os.environ.get("MOEAUDIT_FAMD_LOG")
    if not path:
        return
    rel = [0.0]
    for i in ref.scores:
        r, o = ref.expert_grads[i].double(), ours.expert_grads[i].double()
        keep = r > 1e-6
        rel.append(float(((o[keep] - r[keep]).abs() / r[keep]).max()) if keep.any() else 0.0)
        for name in ("router_grads", "shared_grads", "attention_grads"):
            want, got = getattr(ref, name)[i], getattr(ours, name)[i]
            if want > 1e-6:
                rel.append(abs(got - want) / want)
    row = {
        "family": family,
        "case": case,
        "dtype": dtype,
        "nll_abs": abs(float(ours.loss) - float(ref.loss)),
        "grad_rel": max(rel),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def check(
    tmp_path: Path,
    family: str,
    case: str,
    dtype: str,
    overrides: dict[str, Any],
    reference: Callable[[Any, torch.Tensor], Observed] | None = None,
) -> tuple[Any, Checkpoint]:
    """Save a tiny model (in ``dtype``), replay it and compare with transformers on the same file."""
    model = save_tiny(tmp_path, family, dtype=DTYPES[dtype], **overrides)
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    hf = load(tmp_path)
    ref = reference(hf, tokens) if reference else transformers_observed(hf, tokens)
    ours = observed(ckpt, tokens)
    _log(family, case, dtype, ref, ours)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == []
    return model, ckpt


def _routed(model: Any, moe: str = "mlp") -> tuple[int, ...]:
    return tuple(i for i, layer in enumerate(model.model.layers) if hasattr(getattr(layer, moe), "experts"))


# ----- exaone_moe (K-EXAONE) ------------------------------------------------------------------

EXAONE: dict[str, dict[str, Any]] = {
    # sliding 0, 2 (RoPE, window 5), global 1 (no RoPE); dense layer 0; top-2 of 8 in 4 groups
    "grouped-window-nope": {},
    # every layer sliding (RoPE everywhere) with a window beyond T, all routed, top-3 of 16 in
    # 4 groups, two shared experts
    "top3-16-experts-two-shared-all-routed": {
        "num_experts": 16,
        "num_experts_per_tok": 3,
        "num_shared_experts": 2,
        "first_k_dense_replace": 0,
        "sliding_window": 16,
        "layer_types": ["sliding_attention"] * 3,
        "routed_scaling_factor": 1.0,
    },
    # explicit mlp_layer_types with a dense middle layer, one group, no renormalisation, top-1
    "top1-dense-middle-ungrouped": {
        "mlp_layer_types": ["sparse", "dense", "sparse"],
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 1,
        "norm_topk_prob": False,
    },
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", EXAONE)
def test_exaone_moe_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    model, ckpt = check(tmp_path, "exaone_moe", case, dtype, EXAONE[case])
    assert ckpt.spec.routed_layers == _routed(model)
    types = model.config.layer_types
    assert ckpt.spec.sliding_layers == tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    assert ckpt.spec.nope_layers == tuple(i for i, t in enumerate(types) if t == "full_attention")
    bias = model.model.layers[ckpt.spec.routed_layers[0]].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0  # the oracle ran with a real selection bias


def test_exaone_moe_nope_layers_change_the_loss(tmp_path: Path) -> None:
    """Rotating the global layer too (what a Llama-style reader would do) changes the NLL: the
    agreement above pins EXAONE's NoPE global layers."""
    save_tiny(tmp_path, "exaone_moe")
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.nope_layers == (1,)
    tokens = random_tokens()
    base = replay(ckpt, tokens, backward=False).nll
    rotated = tuple(dataclasses.replace(v, rope=True) for v in ckpt.spec.settings.attention)
    ckpt.spec = ckpt.spec.revised(attention=rotated)  # its layers derived anew, the global one rotated too
    assert abs(replay(ckpt, tokens, backward=False).nll - base) > 1e-3


def test_exaone_moe_mtp_tensors_are_left_out(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path, "exaone_moe")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ckpt = Checkpoint(tmp_path)
    assert [lo.what for lo in ckpt.left_out] == ["the multi-token-prediction module (mtp.*)"]


def test_exaone_moe_release_config_reads_as_transformers_does() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("exaone_moe")
    s = spec_from_config(hf.to_dict())
    assert s.routed_layers == tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "sparse")
    assert s.sliding_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert s.nope_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "full_attention")
    assert (s.sliding_window, s.rms_eps, s.shared_dim) == (4096, 1e-5, 1024)
    assert s.routing == "sigmoid top-8 of 64, selection bias, renormalised, ×2.5"
    no_types = {k: v for k, v in hf.to_dict().items() if k != "layer_types"}
    assert spec_from_config(no_types).sliding_layers == s.sliding_layers


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"layer_types": None, "sliding_window_pattern": "LLLG"}, "sliding_window_pattern must be a positive integer"),
        ({"mlp_layer_types": ["dense", "moe", "sparse"]}, "mlp_layer_types must list 3 layers"),
        ({"num_shared_experts": 0}, "num_shared_experts must be ≥ 1"),
    ],
)
def test_bad_exaone_moe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("exaone_moe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


# ----- cohere2_moe (Command A MoE) ----------------------------------------------------------

COHERE: dict[str, dict[str, Any]] = {
    # LayerNorm, softmax top-2 of 8, one shared expert averaged, sliding 0 and 2, NoPE global 1
    "layernorm-average-shared-window-nope": {},
    # RMSNorm, sigmoid top-3 of 16 renormalised, two shared experts summed, a dense first layer
    # (its own width, RoPE: prefix pattern 1), q/k/v/o biases, untied LM head
    "rms-sigmoid-top3-16-sum-dense-prefix": {
        "rms_norm_eps": 1e-6,
        "expert_selection_fn": "sigmoid",
        "num_experts": 16,
        "num_experts_per_tok": 3,
        "num_shared_experts": 2,
        "shared_expert_combination_strategy": "sum",
        "first_k_dense_replace": 1,
        "prefix_dense_intermediate_size": 40,
        "attention_bias": True,
        "tie_word_embeddings": False,
    },
    # no shared expert, sigmoid top-1 not renormalised, a dense middle layer that is global
    # without RoPE (prefix pattern 2), every layer global except the first
    "top1-sigmoid-no-shared-dense-middle": {
        "num_shared_experts": 0,
        "expert_selection_fn": "sigmoid",
        "norm_topk_prob": False,
        "num_experts_per_tok": 1,
        "mlp_layer_types": ["sparse", "dense", "sparse"],
        "prefix_dense_sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    },
}


def cohere_observed(model: Any, tokens: torch.Tensor) -> Observed:
    """transformers' numbers for the parallel block: the MoE block reads the layer input through
    ``input_layernorm`` (aliased as the generic hooks' ``post_attention_layernorm``, the same
    module: its parameter is counted once, under ``input_layernorm``). With the "average"
    combination the block halves the router's weights: that halved weight is the combine weight
    c_e of the routed output Σ c_e u_e, as the replay reports it."""
    for layer in model.model.layers:
        layer.post_attention_layernorm = layer.input_layernorm
    cfg = model.config
    half = 0.5 if cfg.num_shared_experts and cfg.shared_expert_combination_strategy == "average" else 1.0
    return transformers_observed(model, tokens, chosen=lambda out: (out[2], out[1] * half))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", COHERE)
def test_cohere2_moe_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    model, ckpt = check(tmp_path, "cohere2_moe", case, dtype, COHERE[case], cohere_observed)
    s, cfg = ckpt.spec, model.config
    assert s.routed_layers == _routed(model) and s.settings.parallel_block
    assert s.sliding_layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
    rotated = [layer.self_attn.sliding_window is not None or layer.self_attn.force_rope for layer in model.model.layers]
    assert s.nope_layers == tuple(i for i, r in enumerate(rotated) if not r)
    assert s.layer_norm == (cfg.rms_norm_eps is None)
    assert ckpt.summary(with_digest=False)["tied_embeddings"] == cfg.tie_word_embeddings


@pytest.mark.parametrize("change", ["serial", "rope-halves", "rope-everywhere", "sum", "logit-scale"])
def test_cohere2_moe_each_difference_changes_the_loss(change: str, tmp_path: Path) -> None:
    """Replaying with any one of Cohere's differences undone moves the NLL well beyond the
    oracle's tolerance, so the agreement above pins each of them."""

    save_tiny(tmp_path, "cohere2_moe")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    base = replay(ckpt, tokens, backward=False).nll
    undo: dict[str, dict[str, Any]] = {
        "serial": {"parallel_block": False},
        "rope-halves": {"rope_interleaved": False},
        "rope-everywhere": {
            "attention": tuple(dataclasses.replace(v, rope=True) for v in ckpt.spec.settings.attention)
        },
        "sum": {"shared_scale": 1.0, "gate": Gate()},
        "logit-scale": {"logits_scaling": 1.0},
    }
    ckpt.spec = ckpt.spec.revised(**undo[change])
    assert abs(replay(ckpt, tokens, backward=False).nll - base) > 1e-3


def test_cohere2_moe_default_config_reads_as_transformers_does() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("cohere2_moe")
    s = spec_from_config(hf.to_dict())
    assert (s.head_dim, s.layer_norm, s.norm_bias, s.rms_eps, s.logits_scaling) == (128, True, False, 1e-5, 16.0)
    assert s.tie_embeddings and s.routed_layers == tuple(range(40)) and s.shared_dim == 0
    assert s.sliding_layers == tuple(i for i in range(40) if (i + 1) % 4)
    assert s.nope_layers == tuple(i for i in range(40) if (i + 1) % 4 == 0)
    assert s.routing == "softmax top-2 of 8, renormalised"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"expert_selection_fn": "relu"}, "expert_selection_fn must be"),
        ({"shared_expert_combination_strategy": "max"}, "shared_expert_combination_strategy must be"),
        ({"logit_scale": 0.0}, "logit_scale must be a positive number"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list 3 layers"),
    ],
)
def test_bad_cohere2_moe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("cohere2_moe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


# ----- dbrx ---------------------------------------------------------------------------------

DBRX: dict[str, dict[str, Any]] = {
    # clip 0.5 (the fused q/k/v cross it), top-2 of 4 renormalised, 2 kv heads
    "clip-top2-of-4": {},
    # top-3 of 8, the released clip (8: never reached here; transformers 5.24 cannot run a null
    # clip_qkv, which the replay reads as no clamp), not normalised (moe_normalize_expert_weights
    # null), MHA, θ 5e5 (in both places transformers writes it: it reads rope_parameters, DBRX's
    # code attn_config)
    "top3-of-8-unnormalised-mha": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "attn_config": {"kv_n_heads": 4, "clip_qkv": 8, "rope_theta": 500000.0},
        "ffn_config": {
            "ffn_hidden_size": 24,
            "moe_num_experts": 8,
            "moe_top_k": 3,
            "moe_normalize_expert_weights": None,
        },
    },
    # top-1 of 6, one kv head (DBRX's default), a tight clip
    "top1-of-6-one-kv-head": {
        "attn_config": {"kv_n_heads": 1, "clip_qkv": 0.25, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 16, "moe_num_experts": 6, "moe_top_k": 1},
    },
}


def dbrx_observed(model: Any, tokens: torch.Tensor) -> Observed:
    """transformers' numbers from DbrxForCausalLM's own modules: h enters ``norm_2``, the router
    returns the logits and ``route_tokens_to_experts`` the (weights, experts), the flat expert
    tensors [E·I, H] give each expert's gradient rows."""
    from support.oracle import _cross_entropy, _norm

    blocks = model.transformer.blocks
    seen: dict[tuple[str, int], Any] = {}
    hooks = []
    for i, block in enumerate(blocks):
        hooks.append(
            block.norm_attn_norm.norm_2.register_forward_hook(
                lambda _m, args, _o, i=i: seen.__setitem__(("h", i), args[0].detach().flatten(0, -2))
            )
        )
        hooks.append(
            block.ffn.router.register_forward_hook(
                lambda _m, _a, out, i=i: seen.__setitem__(("logits", i), out.detach())
            )
        )
        route = block.ffn.route_tokens_to_experts
        block.ffn.route_tokens_to_experts = lambda logits, route=route, i=i: seen.setdefault(
            ("route", i), route(logits)
        )
    try:
        out = model(tokens, output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
        for block in blocks:
            del block.ffn.route_tokens_to_experts
    nll, loss, entropy = _cross_entropy(out.logits, tokens)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    n = len(blocks)

    def under(i: int, prefix: str) -> list[torch.Tensor | None]:
        return [g for name, g in grads.items() if name.startswith(f"transformer.blocks.{i}.{prefix}")]

    experts = {}
    for i, block in enumerate(blocks):
        E = block.ffn.experts.num_experts
        mlp = block.ffn.experts.mlp
        experts[i] = sum(p.grad.double().view(E, -1).pow(2).sum(1) for p in (mlp.w1, mlp.v1, mlp.w2)).sqrt()
    return Observed(
        loss=loss.detach(),
        nll_windows_W=nll.detach().mean(1),
        entropy=entropy,
        layer_inputs=[h.detach() for h in out.hidden_states],
        moe_inputs={i: seen["h", i] for i in range(n)},
        scores={i: seen["logits", i] for i in range(n)},
        topk={i: seen["route", i][1] for i in range(n)},
        combine={i: seen["route", i][0].detach() for i in range(n)},
        expert_grads=experts,
        router_grads={i: _norm(under(i, "ffn.router.")) for i in range(n)},
        shared_grads=dict.fromkeys(range(n), 0.0),
        attention_grads={
            i: _norm(under(i, "norm_attn_norm.attn.") + under(i, "norm_attn_norm.norm_1.")) for i in range(n)
        },
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", DBRX)
def test_dbrx_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    model, ckpt = check(tmp_path, "dbrx", case, dtype, DBRX[case], dbrx_observed)
    s, attn, ffn = ckpt.spec, model.config.attn_config, model.config.ffn_config
    assert (s.num_experts, s.top_k, s.expert_dim) == (ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size)
    assert (s.num_kv_heads, s.settings.clip_qkv, s.rope.theta) == (
        attn.kv_n_heads,
        attn.clip_qkv,
        model.config.rope_parameters["rope_theta"],
    )
    assert s.settings.norm_topk_prob == (ffn.moe_normalize_expert_weights is not None)


def test_dbrx_clip_changes_the_loss(tmp_path: Path) -> None:
    """Without the clamp the NLL moves: the agreement above pins clip_qkv (the flat experts'
    layout is pinned by their shapes, I = 24 ≠ H = 32, and by the per-expert gradient norms)."""

    save_tiny(tmp_path, "dbrx")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    base = replay(ckpt, tokens, backward=False).nll
    ckpt.spec = ckpt.spec.revised(clip_qkv=None)
    assert abs(replay(ckpt, tokens, backward=False).nll - base) > 1e-3


def test_dbrx_hub_config_reads_with_its_own_rope_theta() -> None:
    """dbrx-instruct's config.json: no top-level rope parameters, θ in attn_config (5e5)."""
    cfg = {
        "model_type": "dbrx",
        "d_model": 6144,
        "n_heads": 48,
        "n_layers": 40,
        "max_seq_len": 32768,
        "vocab_size": 100352,
        "attn_config": {"clip_qkv": 8, "kv_n_heads": 8, "rope_theta": 500000},
        "ffn_config": {
            "ffn_hidden_size": 10752,
            "moe_jitter_eps": 0.01,
            "moe_loss_weight": 0.05,
            "moe_num_experts": 16,
            "moe_top_k": 4,
        },
        "tie_word_embeddings": False,
    }
    s = spec_from_config(cfg)
    assert (s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.num_layers) == (6144, 48, 8, 128, 40)
    assert (s.rope.theta, s.settings.clip_qkv, s.expert_dim, s.rms_eps) == (5e5, 8.0, 10752, 1e-5)
    assert s.routing == "softmax top-4 of 16, renormalised" and not s.norm_bias


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}}, "differ: which one"),
        ({"ffn_config": {"moe_normalize_expert_weights": 2.0}}, "moe_normalize_expert_weights=2.0"),
        ({"attn_config": {"clip_qkv": -1}}, "clip_qkv must be positive"),
        ({"ffn_config": {"ffn_act_fn": {"name": "gelu"}}}, "hidden_act 'gelu'"),
    ],
)
def test_bad_dbrx_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("dbrx").to_dict()
    for key, value in bad.items():
        cfg[key] = {**cfg[key], **value} if key in ("attn_config", "ffn_config") else value
    with pytest.raises(CheckpointError, match=message):
        spec_from_config(cfg)


# ----- lfm2_moe (LFM2-MoE) ------------------------------------------------------------------

LFM2: dict[str, dict[str, Any]] = {
    # conv 0, 2 / attention 1; dense layer 0; sigmoid + expert_bias top-2 of 8, renormalised, ×2
    "conv-attn-conv-bias-top2": {},
    # attention first, convs after (kernel 4, with biases), every layer routed, top-3 of 16 chosen
    # on σ alone (no expert bias), not renormalised
    "attn-conv-conv-top3-16-no-bias": {
        "layer_types": ["full_attention", "conv", "conv"],
        "conv_L_cache": 4,
        "conv_bias": True,
        "num_dense_layers": 0,
        "num_experts": 16,
        "num_experts_per_tok": 3,
        "use_expert_bias": False,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    },
    # two dense layers, one routed attention layer, top-1
    "two-dense-top1": {
        "num_dense_layers": 2,
        "num_experts_per_tok": 1,
        "layer_types": ["conv", "conv", "full_attention"],
    },
}


def lfm2_observed(model: Any, tokens: torch.Tensor) -> Observed:
    """transformers' numbers for LFM2-MoE: the MoE block is ``feed_forward`` behind ``ffn_norm``
    (aliased for the generic hooks); a layer's token mixer is ``self_attn`` or ``conv``, behind
    ``operator_norm``."""

    from support.oracle import _norm

    for layer in model.model.layers:
        layer.post_attention_layernorm = layer.ffn_norm
    ref = transformers_observed(model, tokens, moe="feed_forward")
    params = dict(model.named_parameters())
    mixer = {
        i: _norm(
            [
                p.grad
                for n, p in params.items()
                if n.startswith(f"model.layers.{i}.") and n.split(".")[3] in ("self_attn", "conv", "operator_norm")
            ]
        )
        for i in ref.attention_grads
    }
    return dataclasses.replace(ref, attention_grads=mixer)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LFM2)
def test_lfm2_moe_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    model, ckpt = check(tmp_path, "lfm2_moe", case, dtype, LFM2[case], lfm2_observed)
    s = ckpt.spec
    assert s.routed_layers == _routed(model, "feed_forward")
    assert s.conv_layers == tuple(i for i, t in enumerate(model.config.layer_types) if t == "conv")
    if s.gate.selection_bias:
        assert model.model.layers[s.routed_layers[0]].feed_forward.expert_bias.abs().min() > 0


def test_lfm2_moe_short_conv_matches_transformers_module() -> None:
    """The mixer alone against ``Lfm2MoeShortConv`` (kernel 4 with biases): same output, and the
    convolution is causal (a change at position t moves nothing before t)."""
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeShortConv

    from moeaudit.replay.shortconv import short_conv

    cfg = tiny_config("lfm2_moe", conv_L_cache=4, conv_bias=True)
    torch.manual_seed(0)
    mod = Lfm2MoeShortConv(cfg, layer_idx=0).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        for prm in mod.parameters():
            prm.copy_(torch.randn(prm.shape) / max(prm.shape[-1], 1) ** 0.5)
    stored: dict[str, Any] = {
        "conv_in": mod.in_proj.weight,
        "conv_in_bias": mod.in_proj.bias,
        "conv_w": mod.conv.weight,
        "conv_bias": mod.conv.bias,
        "conv_out": mod.out_proj.weight,
        "conv_out_bias": mod.out_proj.bias,
    }
    p: dict[str, torch.Tensor] = {n: t for n, t in stored.items() if t is not None}
    assert len(p) == 6
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        torch.testing.assert_close(short_conv(p, x), mod(x), rtol=1e-5, atol=1e-6)
        moved = x.clone()
        moved[:, 5] += 1.0
        assert torch.equal(short_conv(p, moved)[:, :5], short_conv(p, x)[:, :5])
        assert not torch.equal(short_conv(p, moved)[:, 5:8], short_conv(p, x)[:, 5:8])


def test_lfm2_moe_hub_style_config() -> None:
    """LFM2-8B-A1B's config form: ``tie_embedding`` (legacy name), no rope parameters."""
    cfg = {
        "model_type": "lfm2_moe",
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "vocab_size": 65536,
        "intermediate_size": 7168,
        "moe_intermediate_size": 1792,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "num_dense_layers": 2,
        "tie_embedding": True,
        "layer_types": ["conv", "conv", "full_attention", "conv"],
        "norm_eps": 1e-5,
        "conv_L_cache": 3,
    }
    s = spec_from_config(cfg)
    assert (s.rope.theta, s.tie_embeddings, s.conv_layers, s.routed_layers) == (1e6, True, (0, 1, 3), (2, 3))
    assert s.routing == "sigmoid top-4 of 32, selection bias, renormalised"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"layer_types": ["conv", "mamba", "conv"]}, "layer_types must list 3 layers"),
        ({"conv_L_cache": 0}, "conv_L_cache must be ≥ 1"),
    ],
)
def test_bad_lfm2_moe_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = tiny_config("lfm2_moe").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})
