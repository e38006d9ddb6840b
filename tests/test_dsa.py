"""The DSA lightning indexer (DeepSeek-V3.2) against transformers' ``DeepseekV32Indexer``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import random_tokens, tiny_model  # noqa: E402
from support.indexer_ties import watch_indexers  # noqa: E402

from moeaudit.replay.dsa import index_scores, sparse_causal_mask  # noqa: E402


def _indexer_inputs(model, layer: int, tokens: torch.Tensor):
    attn = model.model.layers[layer].self_attn
    x = model.model.embed_tokens(tokens)
    pos = torch.arange(tokens.shape[1])[None]
    cos, sin = model.model.rotary_emb(x, pos)
    q_lat = attn.q_a_layernorm(attn.q_a_proj(x))
    ix = attn.indexer
    p = {
        "idx_wq_b": ix.wq_b.weight,
        "idx_wk": ix.wk.weight,
        "idx_k_norm": ix.k_norm.weight,
        "idx_k_norm_bias": ix.k_norm.bias,
        "idx_weights": ix.weights_proj.weight,
    }
    return ix, p, x, q_lat, (cos, sin)


@torch.no_grad()
def test_indexer_selects_the_keys_transformers_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers as it is: the probe's cuts do not tie (asserted), so its top-k's keys are the
    replay's whatever order the kernel gives tied keys (docs/decisions.md, "DSA key selection")."""
    ties = watch_indexers(monkeypatch, by_position=False)
    model = tiny_model("deepseek_v32")
    tokens = random_tokens(3, 12)
    ix, p, x, q_lat, (cos, sin) = _indexer_inputs(model, 1, tokens)
    T = tokens.shape[1]
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1).expand(3, T, T)
    want = ix(x, q_lat, (cos, sin), causal, None)  # [B, T, topk] indices
    assert (ties.calls, ties.tied_cuts) == (1, 0)
    want_keep = torch.zeros(3, T, T, dtype=torch.bool).scatter_(-1, want.long(), True)
    want_keep &= torch.ones(T, T, dtype=torch.bool).tril()
    keep = sparse_causal_mask(p, x, q_lat, (cos[0], sin[0]), ix.n_heads, ix.head_dim, ix.index_topk)
    assert keep is not None and keep.shape == (3, 1, T, T)
    assert torch.equal(keep[:, 0], want_keep)
    # the first index_topk queries see every causal key, the later ones exactly index_topk
    counts = keep[:, 0].sum(-1)
    assert counts[:, : ix.index_topk].tolist() == [list(range(1, ix.index_topk + 1))] * 3
    assert (counts[:, ix.index_topk :] == ix.index_topk).all()
    # and the selection is not just the most recent keys (it depends on the scores)
    recent = torch.ones(T, T, dtype=torch.bool).tril().triu(-(ix.index_topk - 1))
    assert not torch.equal(keep[0, 0], recent)


@torch.no_grad()
def test_indexer_scores_match_the_reference_formula() -> None:
    """I[s,t] = Σ_h w_h ReLU(q_h·k_t/√D), recomputed from transformers' own submodules."""
    model = tiny_model("deepseek_v32", seed=3)
    tokens = random_tokens(2, 9)
    ix, p, x, q_lat, (cos, sin) = _indexer_inputs(model, 0, tokens)
    ours = index_scores(p, x, q_lat, cos[0], sin[0], ix.n_heads, ix.head_dim)
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    q = ix.wq_b(q_lat).view(2, 9, ix.n_heads, ix.head_dim)
    k = ix.k_norm(ix.wk(x))[:, :, None]
    r = ix.qk_rope_head_dim
    q_r, k_r = apply_rotary_pos_emb(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_r, q[..., r:]], -1), torch.cat([k_r, k[..., r:]], -1)[:, :, 0]
    w = ix.weights_proj(x) * ix.n_heads**-0.5
    want = torch.einsum("bsh,bsht->bst", w, torch.relu(torch.einsum("bshd,btd->bsht", q, k) * ix.head_dim**-0.5))
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)
    assert (ours != 0).float().mean() > 0.9  # ReLU did not zero whole rows of heads


def test_query_blocks_do_not_change_the_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    import moeaudit.replay.dsa as dsa

    model = tiny_model("deepseek_v32", seed=2)
    ix, p, x, q_lat, (cos, sin) = _indexer_inputs(model, 1, random_tokens(2, 11))
    whole = index_scores(p, x, q_lat, cos[0], sin[0], ix.n_heads, ix.head_dim)
    monkeypatch.setattr(dsa, "QUERY_BLOCK", 4)  # 11 queries: blocks of 4, 4, 3
    assert torch.equal(index_scores(p, x, q_lat, cos[0], sin[0], ix.n_heads, ix.head_dim), whole)


def test_no_mask_when_every_causal_key_fits() -> None:
    model = tiny_model("deepseek_v32")
    ix, p, x, q_lat, (cos, sin) = _indexer_inputs(model, 0, random_tokens(2, ix_top := 5))
    assert sparse_causal_mask(p, x, q_lat, (cos[0], sin[0]), 8, 8, ix_top) is None
