"""Nemotron-H (docs/decisions.md, "Single-block layers and ReLU² experts (nemotron_h)")
replayed against transformers' pure-torch path (mamba_ssm and
causal_conv1d are absent, so ``NemotronHMamba2Mixer`` runs ``mamba2_chunk_scan``): loss,
per-window NLL, hidden states, MoE inputs, raw router logits, top-k sets off near-ties, combine
weights, gradient norms per expert (non-gated ReLU², up/down only), router, shared expert and the
MoE layer's norm, in float32 and from bfloat16 checkpoints, on two configurations that move
top-k, the expert count, the routing groups, the shared expert's width and where the Mamba,
attention, dense-MLP and MoE blocks sit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny, tiny_config  # noqa: E402
from support.oracle import FORWARD, GRADIENT  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_nemotron import CASES, hf_observed, worst  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.model import _relu2_grads, _swiglu_grads, relu2_mlp  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

WORST: dict[tuple[str, str], tuple[float, float]] = {}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_nemotron_h_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    overrides, (windows, length) = CASES[case]
    model = save_tiny(tmp_path, "nemotron_h", dtype=DTYPES[dtype], **overrides)
    tokens = random_tokens(windows, length)
    ckpt = Checkpoint(tmp_path)
    ref, ours = hf_observed(load(tmp_path), tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt, FORWARD, GRADIENT)
    nll_abs, grad_rel = worst(ref, ours)
    assert nll_abs <= 1e-4 and grad_rel <= 2e-3
    WORST[case, dtype] = (nll_abs, grad_rel)
    s, types = ckpt.spec, model.config.layers_block_type
    assert s.routed_layers == tuple(i for i, t in enumerate(types) if t == "moe")
    assert s.mamba_layers == tuple(i for i, t in enumerate(types) if t == "linear_attention")
    assert s.block_kinds == tuple({"linear_attention": "mamba", "full_attention": "attention"}.get(t, t) for t in types)
    assert s.mlp_act == "relu2" and s.shared_dim == model.config.moe_shared_expert_intermediate_size
    assert ckpt.warnings == [] and ckpt.notes == [] and not ckpt.fused  # save_pretrained writes per-expert keys
    if dtype == "bf16":
        assert set(ckpt.summary(with_digest=False)["dtypes"]) == {"BF16"}


def test_fused_expert_keys_read_as_the_per_expert_ones(tmp_path: Path) -> None:
    """transformers' in-memory layout (``model.`` keys, experts fused up [E, I, H] and down
    [E, H, I]) replays to the same numbers as the released per-expert ``backbone.`` files."""
    from safetensors.torch import load_file, save_file

    save_tiny(tmp_path / "a", "nemotron_h")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        k = k.replace("backbone.", "model.")
        if ".experts." in k:
            head, rest = k.split(".experts.")
            e, name = rest.split(".", 1)
            fused.setdefault(f"{head}.experts.{name.split('.')[0]}", {})[int(e)] = t  # type: ignore[index]
        else:
            fused[k] = t
    out = {k: (torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v) for k, v in fused.items()}
    save_file(out, tmp_path / "b" / "model.safetensors")
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert b.fused and not a.fused and b.warnings == []
    tokens = random_tokens()
    ra, rb = replay(a, tokens), replay(b, tokens)
    assert ra.nll == rb.nll
    for i in ra.grads:
        assert torch.equal(ra.grads[i].experts_E, rb.grads[i].experts_E)


def test_relu2_expert_backward_is_autograds() -> None:
    """The manual ReLU² expert backward: dL/dx, dL/dc and [dW1, dW2] as autograd forms them
    (and not the SwiGLU ones: no w3 is read)."""
    g = torch.Generator().manual_seed(0)
    x, g_out = torch.randn(7, 6, generator=g, dtype=torch.float64), torch.randn(7, 6, generator=g, dtype=torch.float64)
    w1 = torch.randn(5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    c = torch.rand(7, 1, generator=g, dtype=torch.float64, requires_grad=True)
    xl = x.clone().requires_grad_(True)
    (c * relu2_mlp(xl, w1, w2)).mul(g_out).sum().backward()
    dx, dc, (dw1, dw2) = _relu2_grads(x, {"w1": w1.detach(), "w2": w2.detach()}, g_out, c.detach())
    assert xl.grad is not None and c.grad is not None and w1.grad is not None and w2.grad is not None
    torch.testing.assert_close(dx, xl.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dc, c.grad[:, 0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw1, w1.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw2, w2.grad, rtol=1e-12, atol=1e-12)
    a = x @ w1.detach().T
    assert a.min() < 0 < a.max()  # both sides of the ReLU's kink are exercised
    with pytest.raises(KeyError):
        _swiglu_grads(x, {"w1": w1.detach(), "w2": w2.detach()}, g_out, c.detach())


def test_nemotron_3_nano_config_reads_as_transformers_does() -> None:
    """NVIDIA-Nemotron-3-Nano-30B-A3B's config.json shape (legacy hybrid_override_pattern)."""
    import transformers

    pattern = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
    cfg = {
        "model_type": "nemotron_h",
        "hidden_size": 2688,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": pattern,
        "vocab_size": 131072,
        "intermediate_size": 1856,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "chunk_size": 128,
        "layer_norm_epsilon": 1e-5,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    s = spec_from_config(cfg)
    hf = transformers.NemotronHConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    types = hf.layers_block_type
    assert s.num_layers == len(types) == 52
    assert s.routed_layers == tuple(i for i, t in enumerate(types) if t == "moe")
    assert s.mamba_layers == tuple(i for i, t in enumerate(types) if t == "linear_attention")
    m = s.settings.mamba
    assert m is not None and (m.inner, m.heads, m.groups, m.state, m.chunk) == (4096, 64, 8, 128, 128)
    assert (m.dt_min, m.dt_max) == (hf.time_step_min, None)
    assert s.routing == "sigmoid top-6 of 128, selection bias, renormalised, ×2.5"
    assert (s.shared_dim, s.expert_dim, s.num_kv_heads, s.head_dim) == (3712, 1856, 2, 128)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"moe_latent_size": 16}, "does not replay moe_latent_size=16 for nemotron_h"),
        ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act='gelu'"),
        ({"layers_block_type": ["linear_attention", "moe", "cross"]}, "layers_block_type must be"),
        ({"mamba_num_heads": 3}, "do not split into 2 groups"),
        ({"n_group": 3}, "do not split into n_group=3"),
    ],
)
def test_bad_nemotron_h_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    cfg = {**tiny_config("nemotron_h").to_dict(), **bad}
    with pytest.raises(CheckpointError, match=message):
        spec_from_config(cfg)


def test_save_pretrained_config_has_no_layer_count(tmp_path: Path) -> None:
    """transformers writes no num_hidden_layers (a property of layers_block_type): the reader
    takes the list's length, as transformers does."""
    save_tiny(tmp_path, "nemotron_h")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "num_hidden_layers" not in cfg
    assert Checkpoint(tmp_path).spec.num_layers == len(cfg["layers_block_type"]) == 5
