"""Mamba hybrids (docs/decisions.md, "Mamba hybrids (jamba, granitemoehybrid)") replayed against
transformers' pure-torch Mamba paths (mamba_ssm and causal_conv1d are absent, so ``JambaMambaMixer`` runs
``mamba_selective_scan``'s recurrence and ``GraniteMoeHybridMambaLayer`` ``mamba2_chunk_scan``): same checks and
tolerances as ``test_oracle`` (loss, per-window NLL, hidden states, MoE inputs, router logits, top-k sets off
near-ties, combine weights, gradient norms per expert, router, shared MLP and token mixer), in
float32 and from bfloat16 checkpoints (both sides upcast the same stored values), on
configurations that move top-k, the expert count, the shared MLP and where the attention, Mamba,
routed and dense layers sit. The last tests check the scans themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from support.oracle import FORWARD, GRADIENT, Observed, _cross_entropy, _norm, assert_agree, moeaudit_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import mamba  # noqa: E402
from moeaudit.replay.determinism import recording  # noqa: E402

# decoder-layer module names: (MoE block, its router, the norm before it)
MODULES = {
    "jamba": ("feed_forward", "router", "pre_ff_layernorm"),
    "granitemoehybrid": ("block_sparse_moe", "router", "post_attention_layernorm"),
}
SHARED = {"granitemoehybrid": "shared_mlp."}


def hf_observed(family: str, model: Any, tokens_WT: torch.Tensor) -> Observed:
    """``test_oracle.transformers_observed`` for these module names; a layer's token-mixer
    gradient is its attention's or its Mamba mixer's, with the input norm."""
    moe, gate, pre_norm = MODULES[family]
    layers = model.model.layers
    routed = [i for i, layer in enumerate(layers) if hasattr(getattr(layer, moe), "experts")]
    seen: dict[tuple[str, int], Any] = {}

    def keep(kind: str, i: int):
        def hook(_module, args, out):
            seen[kind, i] = args[0].detach().flatten(0, -2) if kind == "h" else out

        return hook

    hooks = [getattr(layers[i], pre_norm).register_forward_hook(keep("h", i)) for i in routed]
    hooks += [getattr(getattr(layers[i], moe), gate).register_forward_hook(keep("gate", i)) for i in routed]
    try:
        out = model(tokens_WT, output_hidden_states=True, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    nll_WT1, loss, entropy = _cross_entropy(out.logits, tokens_WT)
    loss.backward()
    grads = dict(model.named_parameters())

    def norm(i: int, *prefixes: str) -> float:
        return _norm([p.grad for n, p in grads.items() if any(n.startswith(f"model.layers.{i}.{x}") for x in prefixes)])

    experts = {}
    for i in routed:
        fused = getattr(layers[i], moe).experts
        experts[i] = sum(p.grad.double().pow(2).flatten(1).sum(1) for p in (fused.gate_up_proj, fused.down_proj)).sqrt()
    return Observed(
        loss=loss.detach(),
        nll_windows_W=nll_WT1.detach().mean(1),
        entropy=entropy,
        layer_inputs=[h.detach() for h in out.hidden_states],
        moe_inputs={i: seen["h", i] for i in routed},
        scores={i: logits.detach() for i, logits in zip(routed, out.router_logits, strict=True)},
        topk={i: seen["gate", i][2] for i in routed},
        combine={i: seen["gate", i][1].detach() for i in routed},
        expert_grads=experts,
        router_grads={i: norm(i, f"{moe}.{gate}.") for i in routed},
        shared_grads={i: norm(i, SHARED[family]) if family in SHARED else 0.0 for i in routed},
        attention_grads={i: norm(i, "self_attn.", "mamba.", "input_layernorm.") for i in routed},
    )


def worst(ref: Observed, ours: Observed) -> tuple[float, float]:
    """(|NLL difference|, largest relative gradient-norm difference) of one comparison."""
    rel = [
        float(((o.double() - r.double()).abs() / r.double()).max())
        for o, r in ((ours.expert_grads[i], ref.expert_grads[i]) for i in ref.scores)
    ]
    for name in ("router_grads", "shared_grads", "attention_grads"):
        rel += [abs(getattr(ours, name)[i] - w) / w for i, w in getattr(ref, name).items() if w > 1e-6]
    return abs(float(ours.loss) - float(ref.loss)), max(rel)


def check(family: str, path: Path, tokens: torch.Tensor) -> tuple[Checkpoint, tuple[float, float]]:
    ckpt = Checkpoint(path)
    model = load(path)
    ref, ours = hf_observed(family, model, tokens), moeaudit_observed(ckpt, tokens)
    assert_agree(ref, ours, ckpt.spec.top_k, FORWARD, GRADIENT)
    nll_abs, grad_rel = worst(ref, ours)
    assert nll_abs <= 1e-4 and grad_rel <= 2e-3
    types = model.config.layer_types  # transformers' own reading of where the Mamba layers sit
    assert ckpt.spec.mamba_layers == tuple(i for i, t in enumerate(types) if t == "linear_attention")
    moe = MODULES[family][0]
    assert ckpt.spec.routed_layers == tuple(
        i for i, layer in enumerate(model.model.layers) if hasattr(getattr(layer, moe), "experts")
    )
    assert ckpt.warnings == [] and ckpt.notes == []
    return ckpt, (nll_abs, grad_rel)


DTYPES = {"fp32": None, "bf16": torch.bfloat16}

JAMBA: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    # layer 1 attention, 0/2/3 Mamba; 0, 2 routed (top-2 of 4), 1, 3 dense
    "jamba": ({}, (3, 12)),
    # attention last, every layer routed, top-1 of 6; biased in/out projections, unbiased conv,
    # dt rank "auto" (ceil(32 / 16) = 2); a 70-token window crosses the scan's 64-token chunk
    "jamba-top1-of-6-all-routed-biases": (
        dict(
            num_hidden_layers=3,
            attn_layer_period=3,
            attn_layer_offset=2,
            expert_layer_period=1,
            expert_layer_offset=0,
            num_experts=6,
            num_experts_per_tok=1,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
            mamba_dt_rank="auto",
        ),
        (1, 70),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", JAMBA)
def test_jamba_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    overrides, (windows, length) = JAMBA[case]
    save_tiny(tmp_path, "jamba", dtype=DTYPES[dtype], **overrides)
    ckpt, _ = check("jamba", tmp_path, random_tokens(windows, length))
    attending = tuple(i for i in range(ckpt.spec.num_layers) if i not in ckpt.spec.mamba_layers)
    assert ckpt.spec.nope_layers == attending and not ckpt.spec.settings.norm_topk_prob  # the attention layers: NoPE
    if dtype == "bf16":
        assert set(ckpt.summary(with_digest=False)["dtypes"]) == {"BF16"}


def test_jamba_config_defaults_match_transformers() -> None:
    """Jamba-v0.1's layout from transformers' defaults: attention on every 8th layer from 4,
    experts on every 2nd from 1, dt rank ceil(4096 / 16)."""
    import transformers

    cfg = transformers.AutoConfig.for_model("jamba").to_dict()
    spec = spec_from_config(cfg)
    assert spec.routed_layers == tuple(range(1, 32, 2))
    assert spec.mamba_layers == tuple(i for i in range(32) if i % 8 != 4)
    m = spec.settings.mamba
    assert m is not None and (m.version, m.inner, m.state, m.conv_kernel, m.dt_rank) == (1, 8192, 16, 4, 256)
    assert (spec.num_experts, spec.top_k, spec.expert_dim, spec.dense_dim) == (16, 2, 14336, 14336)
    one_expert = spec_from_config  # a Jamba with one expert per layer has only dense MLPs
    with pytest.raises(CheckpointError, match="none of the 32 decoder layers is a routed MoE layer"):
        one_expert({**cfg, "num_experts": 1, "num_experts_per_tok": 1})


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"attn_layer_offset": 8}, "attn_layer_offset=8 must be below attn_layer_period=8"),
        ({"mamba_d_state": 0}, "must be ≥ 1"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_bad_jamba_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model("jamba").to_dict()
    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**cfg, **bad})


# ----- the scans themselves -------------------------------------------------------------------


def test_prefix_sums_are_a_cumsum_and_dispatch_none() -> None:
    x = torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(0))
    with recording() as rec:
        got = mamba.prefix_sum(x).float()
        seg = mamba.segment_sum(x)
    assert rec.raising == {}
    torch.testing.assert_close(got, torch.cumsum(x.double(), -1).float(), rtol=0, atol=0)
    i, j = 20, 7
    assert seg[1, 2, i, j] == x[1, 2, j + 1 : i + 1].double().sum().float()
    assert seg[1, 2, j, i] == float("-inf") and seg[1, 2, i, i] == 0


def _naive_mamba2(x, dt, A, B, C, D):
    """h_t = exp(Δ_t A) h_{t−1} + Δ_t B_t x_tᵀ per head, y_t = h_t C_t + D x_t, in float64."""
    Bsz, T, h, P = x.shape
    r = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(r, 2).double(), C.repeat_interleave(r, 2).double()
    state = torch.zeros(Bsz, h, P, B.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        dA = torch.exp(dt[:, t].double() * A.double())[..., None, None]
        state = dA * state + (dt[:, t].double()[..., None, None] * x[:, t].double()[..., None] * Bh[:, t, :, None, :])
        out.append((state @ Ch[:, t, :, :, None]).squeeze(-1) + D.double()[:, None] * x[:, t].double())
    return torch.stack(out, 1)


@pytest.mark.parametrize("T, chunk", [(12, 5), (16, 16), (7, 32), (33, 8)])
def test_ssd_chunks_equal_the_recurrence(T: int, chunk: int) -> None:
    g = torch.Generator().manual_seed(T)
    x, dt = torch.randn(2, T, 4, 3, generator=g), F.softplus(torch.randn(2, T, 4, generator=g))
    A, D = -torch.rand(4, generator=g) * 2, torch.randn(4, generator=g)
    B, C = torch.randn(2, T, 2, 5, generator=g), torch.randn(2, T, 2, 5, generator=g)
    got = mamba.ssd_scan(x, dt, A, B, C, D, chunk)
    torch.testing.assert_close(got.double(), _naive_mamba2(x, dt, A, B, C, D), rtol=1e-5, atol=1e-5)


def test_mamba1_chunking_changes_no_bit() -> None:
    g = torch.Generator().manual_seed(3)
    x, dt = torch.randn(2, 70, 6, generator=g), F.softplus(torch.randn(2, 70, 6, generator=g))
    A = -torch.rand(6, 4, generator=g) * 3
    B, C = torch.randn(2, 70, 4, generator=g), torch.randn(2, 70, 4, generator=g)
    whole = mamba.selective_scan(x, dt, A, B, C, chunk=70)
    assert torch.equal(mamba.selective_scan(x, dt, A, B, C, chunk=8), whole)
    h = torch.zeros(2, 6, 4)
    for t in range(70):
        h = torch.exp(A * dt[:, t, :, None]) * h + dt[:, t, :, None] * B[:, t, None] * x[:, t, :, None]
        torch.testing.assert_close(whole[:, t], (h @ C[:, t, :, None]).squeeze(-1), rtol=1e-5, atol=1e-6)


def test_the_mixer_is_what_the_oracle_checks(tmp_path: Path) -> None:
    """The same Jamba with its Mamba layers' D skip zeroed scores another NLL: the agreement
    above could not pass with the scan skipped or its skip dropped."""
    from safetensors.torch import load_file, save_file

    from moeaudit.replay import replay

    save_tiny(tmp_path / "a", "jamba")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    save_file(
        {k: torch.zeros_like(t) if k.endswith("mamba.D") else t for k, t in tensors.items()},
        tmp_path / "b" / "model.safetensors",
    )
    tokens = random_tokens()
    assert abs(replay(Checkpoint(tmp_path / "a"), tokens).nll - replay(Checkpoint(tmp_path / "b"), tokens).nll) > 1e-3
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == "jamba"


# ----- Granite 4.0 (granitemoehybrid): Mamba-2 / SSD ------------------------------------------

GRANITEMOEHYBRID: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    # Mamba-2, attention without RoPE, Mamba-2; top-2 of 4 plus a shared MLP of 40; Granite
    # 3.0's multipliers; 2 groups; chunks of 5 (a 12-token window: 3 chunks, the last padded)
    "granite": ({}, (3, 12)),
    # attention first, with RoPE; top-1 of 6, a narrow shared MLP, unit multipliers; one group,
    # biased projections, unbiased conv, dt clamped to [0.3, 1.0] (both bounds bite), chunks of 8
    "granite-rope-top1-of-6-dt-clamped": (
        dict(
            num_hidden_layers=4,
            layer_types=["attention", "mamba", "mamba", "mamba"],
            position_embedding_type="rope",
            num_local_experts=6,
            num_experts_per_tok=1,
            shared_intermediate_size=16,
            embedding_multiplier=1.0,
            attention_multiplier=8**-0.5,
            residual_multiplier=1.0,
            logits_scaling=1.0,
            mamba_n_groups=1,
            mamba_proj_bias=True,
            mamba_conv_bias=False,
            time_step_limit=[0.3, 1.0],
            mamba_chunk_size=8,
        ),
        (2, 20),
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GRANITEMOEHYBRID)
def test_granitemoehybrid_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    overrides, (windows, length) = GRANITEMOEHYBRID[case]
    save_tiny(tmp_path, "granitemoehybrid", dtype=DTYPES[dtype], **overrides)
    ckpt, _ = check("granitemoehybrid", tmp_path, random_tokens(windows, length))
    s = ckpt.spec
    assert s.routed_layers == tuple(range(s.num_layers)) and s.shared_dim and not s.settings.shared_gated
    attending = tuple(i for i in range(s.num_layers) if i not in s.mamba_layers)
    assert s.nope_layers == (() if overrides.get("position_embedding_type") == "rope" else attending)
    assert ckpt.fused
    if dtype == "bf16":
        assert set(ckpt.summary(with_digest=False)["dtypes"]) == {"BF16"}


def test_granite_4_hub_config_reads_as_transformers_does() -> None:
    """granite-4.0-h-tiny's config.json (legacy layer names, RoPE off, 64 experts, top-6)."""
    import transformers

    types = (
        ["mamba"] * 5
        + ["attention"]
        + ["mamba"] * 9
        + ["attention"]
        + ["mamba"] * 9
        + ["attention"]
        + ["mamba"] * 9
        + ["attention"]
        + ["mamba"] * 4
    )
    cfg = {
        "model_type": "granitemoehybrid",
        "hidden_size": 1536,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "num_hidden_layers": 40,
        "layer_types": types,
        "vocab_size": 100352,
        "intermediate_size": 512,
        "num_local_experts": 64,
        "num_experts_per_tok": 6,
        "shared_intermediate_size": 1024,
        "embedding_multiplier": 12.0,
        "attention_multiplier": 0.0078125,
        "residual_multiplier": 0.22,
        "logits_scaling": 6.0,
        "mamba_n_heads": 48,
        "mamba_n_groups": 1,
        "mamba_d_state": 128,
        "mamba_d_head": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "position_embedding_type": "nope",
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
    }
    s = spec_from_config(cfg)
    hf = transformers.GraniteMoeHybridConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert s.mamba_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "linear_attention")
    assert (
        len(s.mamba_layers) == 36
        and s.nope_layers == tuple(i for i in range(40) if i not in s.mamba_layers)
        and s.routed_layers == tuple(range(40))
    )
    m = s.settings.mamba
    assert m is not None and (m.inner, m.heads, m.head_dim, m.groups, m.state, m.chunk) == (3072, 48, 64, 1, 128, 256)
    assert (m.dt_min, m.dt_max) == (0.0, None) and s.routing == "softmax top-6 of 64, renormalised"


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"mamba_d_head": 10}, "do not make the"),
        ({"mamba_n_groups": 3}, "do not split into 3 groups"),
        ({"layer_types": ["mamba", "moe", "mamba"]}, "layer_types must list 3 layers"),
        ({"time_step_limit": [1.0, 0.5]}, "time_step_limit must be"),
        ({"num_local_experts": 0, "num_experts_per_tok": 0}, "num_experts_per_tok=0 not in 1..0"),
    ],
)
def test_bad_granitemoehybrid_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    from hfmodels import tiny_config

    cfg = {**tiny_config("granitemoehybrid").to_dict(), **bad}
    with pytest.raises(CheckpointError, match=message):
        spec_from_config(cfg)


def test_time_step_limit_as_transformers_writes_it(tmp_path: Path) -> None:
    save_tiny(tmp_path, "granitemoehybrid")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["time_step_limit"] == [0.0, {"__float__": "Infinity"}]
    m = Checkpoint(tmp_path).spec.settings.mamba
    assert m is not None and (m.dt_min, m.dt_max) == (0.0, None)
    assert "Infinity" not in json.dumps(Checkpoint(tmp_path).spec.to_json())
