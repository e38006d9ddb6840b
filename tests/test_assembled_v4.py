"""DeepSeek-V4 as a whole model, composed from the replay's pieces in this test (not yet through
the engine, the checkpoint reader or a family: ``deepseek_v4`` stays refused until they are
wired), against transformers' ``DeepseekV4ForCausalLM``: the next-token NLL and the gradient of
its mean with respect to every weight.

The pieces: ``hc_mix`` / ``hc_add`` with Sinkhorn hyper-connections and the hyper head,
``v4_attention`` (sliding, CSA and HCA layers; the compressed base with YaRN in one
configuration), the √softplus router with its selection bias (``route``), the hash router
(``hash_route`` on tid2eid[token]), clamped SwiGLU experts and the clamped shared expert. The two
dtypes are the oracle suite's: a float32 checkpoint, and a bfloat16 one (every weight rounded to
bfloat16, transformers and the replay both computing in float32 from the stored values). Two
configurations vary the expert count, top-k, hash and learned layers, the attention types, hc
streams, Sinkhorn iterations and the RoPE. Their CSA indexers' cuts tie (few heads: ReLU's exact
zeros), so transformers' top-k breaks the ties by position, as the replay does
(``support.indexer_ties``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from support.indexer_ties import watch_indexers  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4  # noqa: E402
from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config  # noqa: E402

from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.compress import V4Branch, v4_attention  # noqa: E402
from moeaudit.replay.model import (  # noqa: E402
    experts_forward_sets,
    hash_route,
    hc_add,
    hc_mix,
    rms_norm,
    route,
    shared_expert,
    yarn_inv_freq,
)
from moeaudit.spec.config import ClampedGLU, Gate, ModelSpec  # noqa: E402
from moeaudit.spec.rope_config import _yarn  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    # 4 layers: hash, hash, learned, learned; sliding / CSA / HCA / CSA; top-2 of 6; 2 streams
    "top2-of-6-hash2-hc2": {
        "hidden_size": 24,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "o_groups": 2,
        "o_lora_rank": 8,
        "q_lora_rank": 10,
        "n_routed_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "sliding_window": 6,
        "index_n_heads": 3,
        "index_head_dim": 12,
        "index_topk": 2,
        "hc_mult": 2,
        "hc_sinkhorn_iters": 3,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 0.8,
        "rope_theta": 100.0,
        "compress_rope_theta": 500.0,
    },
    # 3 layers: hash, learned, learned; HCA / CSA / sliding; top-3 of 8; 3 streams; YaRN on the
    # compressed base
    "top3-of-8-hash1-hc3-yarn": {
        "hidden_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 3,
        "head_dim": 12,
        "partial_rotary_factor": 1 / 3,
        "o_groups": 3,
        "o_lora_rank": 5,
        "q_lora_rank": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 6,
        "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 5},
        "sliding_window": 9,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 3,
        "hc_mult": 3,
        "hc_sinkhorn_iters": 5,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 0.5,
        "rms_norm_eps": 1e-3,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
        "max_position_embeddings": 32,
    },
}
V, B, T = 40, 2, 23  # a partial last window for every ratio above
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def _config(case: dict[str, Any]) -> DeepseekV4Config:
    cfg = DeepseekV4Config(vocab_size=V, **case)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"  # the reference loop (grouped_mm wants 16-byte strides)
    return cfg


def _model(cfg: DeepseekV4Config, stored: torch.dtype | None, seed: int) -> dsv4.DeepseekV4ForCausalLM:
    torch.manual_seed(seed)
    model = dsv4.DeepseekV4ForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "position_bias" in name or name.endswith(("hc_base", ".base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("hc_scale", ".scale")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 / max(p.shape[-1], 1) ** 0.5)
        for m in model.modules():
            if isinstance(m, dsv4.DeepseekV4TopKRouter):
                m.e_score_correction_bias.copy_(0.3 * torch.randn(m.e_score_correction_bias.shape, generator=gen))
            if isinstance(m, dsv4.DeepseekV4HashRouter):
                E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
                m.tid2eid.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(V)]))
        if stored is not None:  # a bfloat16 checkpoint: the stored values, computed in float32
            for p in model.parameters():
                p.copy_(p.to(stored).float())
            for m in model.modules():
                if isinstance(m, dsv4.DeepseekV4TopKRouter):
                    m.e_score_correction_bias.copy_(m.e_score_correction_bias.to(stored).float())
    return model


def _spec(cfg: DeepseekV4Config) -> ModelSpec:
    base = spec_from_config(
        {
            "model_type": "hy_v4",
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "vocab_size": V,
            "n_routed_experts": cfg.n_routed_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "q_lora_rank": 8,
            "kv_lora_rank": 8,
            "qk_nope_head_dim": 4,
            "qk_rope_head_dim": 4,
            "v_head_dim": 4,
            "index_head_dim": 8,
        }
    )
    return base.revised(
        gate=Gate(scoring="sqrtsoftplus", selection_bias=True, scaling=cfg.routed_scaling_factor),
        norm_topk_prob=True,
        clamped_glu=ClampedGLU(alpha=1.0, limit=cfg.swiglu_limit, offset=0.0),
        shared_clamped=True,
        shared_gated=False,
        hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters,
        hc_eps=cfg.hc_eps,
        hc_magnitude=2.0,
        rms_eps=cfg.rms_norm_eps,
    )


_ATTN = {
    "q_a": "q_a_proj.weight",
    "q_a_norm": "q_a_norm.weight",
    "q_b": "q_b_proj.weight",
    "kv": "kv_proj.weight",
    "kv_norm": "kv_norm.weight",
    "sinks": "sinks",
    "o_a": "o_a_proj.weight",
    "o_b": "o_b_proj.weight",
    "c_kv": "compressor.kv_proj.weight",
    "c_gate": "compressor.gate_proj.weight",
    "c_bias": "compressor.position_bias",
    "c_norm": "compressor.kv_norm.weight",
    "i_kv": "compressor.indexer.kv_proj.weight",
    "i_gate": "compressor.indexer.gate_proj.weight",
    "i_bias": "compressor.indexer.position_bias",
    "i_norm": "compressor.indexer.kv_norm.weight",
    "i_q": "compressor.indexer.q_b_proj.weight",
    "i_w": "compressor.indexer.scorer.weights_proj.weight",
}


def _inv_freqs(cfg: DeepseekV4Config) -> dict[str, torch.Tensor]:
    rd = cfg.qk_rope_head_dim
    out = {}
    for kind, params in cfg.rope_parameters.items():
        y = _yarn({"rope_parameters": params}, "config.json")
        theta = params["rope_theta"]
        out[kind] = (
            yarn_inv_freq(y, theta, rd) if y is not None else 1.0 / (theta ** (torch.arange(0, rd, 2).float() / rd))
        )
        assert y is None or y.attention_factor == 1.0
    return out


def _replay(
    cfg: DeepseekV4Config,
    model: dsv4.DeepseekV4ForCausalLM,
    ids: torch.Tensor,
    sets: list[torch.Tensor] | None = None,
    hashed: bool = True,
) -> torch.Tensor:
    """Mean next-token NLL from the replay's pieces, reading transformers' parameters; each
    layer's active sets appended to ``sets``; ``hashed`` False routes hash layers by their
    learned scores instead (to show the table matters)."""
    spec = _spec(cfg)
    inv_freq = _inv_freqs(cfg)
    m = model.model
    x = F.embedding(ids, m.embed_tokens.weight)
    x = x.unsqueeze(-2).expand(B, T, cfg.hc_mult, cfg.hidden_size)
    for i, layer in enumerate(m.layers):
        kind = cfg.layer_types[i]
        write, a = hc_mix(spec, layer.attn_hc.fn, layer.attn_hc.base, layer.attn_hc.scale, x)
        assert write is not None
        attn = layer.self_attn
        parts = {"sliding_attention": ("",), "heavily_compressed_attention": ("", "c_")}.get(kind, ("", "c_", "i_"))
        p = {k: attn.get_parameter(v) for k, v in _ATTN.items() if (k[:2] if k[:2] in ("c_", "i_") else "") in parts}
        branch = None
        if kind != "sliding_attention":
            csa = kind == "compressed_sparse_attention"
            branch = V4Branch(
                cfg.compress_rates[kind], csa, cfg.index_n_heads if csa else 0, cfg.index_topk if csa else 0
            )
        out = v4_attention(
            p, rms_norm(a, layer.input_layernorm.weight, cfg.rms_norm_eps),
            n_heads=cfg.num_attention_heads, head_dim=cfg.head_dim, window=cfg.sliding_window,
            eps=cfg.rms_norm_eps, o_groups=cfg.o_groups,
            inv_freq=inv_freq["main" if branch is None else "compress"], branch=branch,
        )  # fmt: skip
        x = hc_add(write, out, x)
        write, h = hc_mix(spec, layer.ffn_hc.fn, layer.ffn_hc.base, layer.ffn_hc.scale, x)
        assert write is not None
        y = rms_norm(h, layer.post_attention_layernorm.weight, cfg.rms_norm_eps).reshape(B * T, -1)
        gate, ex = layer.mlp.gate, layer.mlp.experts
        if cfg.mlp_layer_types[i] == "hash_moe" and hashed:
            r = hash_route(spec, gate.weight, y, gate.tid2eid[ids.reshape(-1)].long())
        else:
            r = route(spec, gate.weight, y, getattr(gate, "e_score_correction_bias", None))
        if sets is not None:
            sets.append(r.topk_NK)
        experts = []
        for e in range(cfg.n_routed_experts):
            w1, w3 = ex.gate_up_proj[e].chunk(2, dim=0)
            experts.append({"w1": w1, "w3": w3, "w2": ex.down_proj[e]})
        (u,) = experts_forward_sets(experts, y, [r.topk_NK], spec.clamped_glu)
        moe = (u * r.combine_NK[..., None]).sum(1)
        sh = layer.mlp.shared_experts
        moe = moe + shared_expert(
            spec,
            {"shared_w1": sh.gate_proj.weight, "shared_w3": sh.up_proj.weight, "shared_w2": sh.down_proj.weight},
            y,
        )
        x = hc_add(write, moe.view(B, T, -1), x)
    head = m.hc_head
    _, z = hc_mix(spec, head.hc_fn, head.hc_base, head.hc_scale, x, head=True)
    logits = F.linear(rms_norm(z, m.norm.weight, cfg.rms_norm_eps), model.lm_head.weight).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_assembled_deepseek_v4(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    watch_indexers(monkeypatch, by_position=True)
    cfg = _config(CASES[name])
    model = _model(cfg, DTYPES[dtype], seed=7)
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(8))
    sets_t: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: sets_t.append(out[2]))
        for m in model.modules()
        if isinstance(m, (dsv4.DeepseekV4TopKRouter, dsv4.DeepseekV4HashRouter))
    ]
    out = model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    loss_t = float(out.loss.detach())
    g_t = _grads(model, out.loss)
    sets_r: list[torch.Tensor] = []
    loss_r = _replay(cfg, model, ids, sets_r)
    g_r = _grads(model, loss_r)
    diff = abs(float(loss_r.detach()) - loss_t)
    assert diff < 1e-4 * max(1.0, loss_t)
    assert len(sets_r) == len(sets_t) == cfg.num_hidden_layers
    for a, b in zip(sets_r, sets_t):  # the active sets (hash layers: in the table's order)
        assert torch.equal(a.sort(-1).values, b.sort(-1).values)
    missing = {n for n in g_t if n not in g_r}
    assert not missing, missing
    worst = 0.0
    for n, g in g_t.items():
        rel = float((g_r[n] - g).norm() / g.norm().clamp_min(1e-30))
        worst = max(worst, rel)
        assert rel < 2e-3, (n, rel)
    print(f"{name} {dtype}: loss {loss_t:.6f} |Δ| {diff:.2e}, grad ≤ {worst:.2e}")
    # the hash table decides the hash layers' sets: routing them by score moves the loss
    with torch.no_grad():
        assert abs(float(_replay(cfg, model, ids, hashed=False)) - loss_t) > 1e-4
