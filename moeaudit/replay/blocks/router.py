"""The MoE router (``spec.blocks.MoE``: its ``gate`` and router settings): softmax or sigmoid scores,
selection biases, group-limited top-k, sparsemixer, hash routing."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeaudit.replay.excluded import exclude
from moeaudit.spec.config import Gate, ModelSpec


@dataclass
class Routing:
    """Router outputs for N tokens of one layer (taps s, ρ, R_k, c_e: docs/glossary.md, "Taps")."""

    scores_NE: torch.Tensor  # s: the selection scores (W_r y; DeepSeek-V3: σ(W_r y) + b)
    probs_NE: torch.Tensor  # ρ, the full gate distribution (sigmoid routers: σ(W_r y)/Σσ)
    topk_NK: torch.Tensor  # R_k, ordered by decreasing score
    combine_NK: torch.Tensor  # c_e for e in R_k
    logits_NE: torch.Tensor | None = None  # W_r y when s is not it (what transformers returns)
    margin_N: torch.Tensor | None = None  # distance to a routing change when groups limit R_k


def route(
    spec: ModelSpec,
    router_EH: torch.Tensor,
    y_NH: torch.Tensor,
    bias_E: torch.Tensor | None = None,
    logit_bias_E: torch.Tensor | None = None,
) -> Routing:
    """The family's routing rule (transformers' routers): softmax then top-k (Mixtral, OLMoE,
    Qwen, DeepSeek-V2 greedy) or sigmoid scores, a selection-only bias ``bias_E`` and
    group-limited top-k (DeepSeek-V3); optional renormalisation, then ``routed_scaling_factor``.
    ``logit_bias_E`` is part of the logits (gpt-oss's router is a biased linear layer)."""
    g, m = spec.gate, spec.moe
    logits = F.linear(y_NH, router_EH, logit_bias_E)
    if m.softcap:  # Laguna: c·tanh(logit / c), in float32
        logits = torch.tanh(logits.float() / m.softcap) * m.softcap
    logits, bias_E = exclude(logits, bias_E)  # experts removed by the ablation receipt (replay.excluded)
    margin = None
    if g.scoring == "sparsemixer":
        return _sparsemixer(spec, logits)
    if g.scoring == "softmax":
        probs = torch.softmax(logits.float(), dim=-1)
        select = probs
        if bias_E is not None:  # ERNIE 4.5: softmax probabilities + a selection-only bias
            scores = probs + bias_E.float()
            top_idx = torch.topk(scores, spec.top_k, dim=-1).indices
            top_vals, raw_logits = probs.gather(1, top_idx), logits
        else:
            if g.grouped:  # DeepSeek-V2 group_limited_greedy: a group's score is its max
                # (Mistral 4: the sum of its best two probabilities, so margins in probabilities:
                # a sum of two logits does not order the groups as the sum of two probabilities)
                ranked = probs if g.group_score == "top2sum" else logits
                allowed, margin = _group_limit(g, probs, ranked.double(), spec.top_k)
                select = probs.masked_fill(~allowed, 0.0)
            top_vals, top_idx = torch.topk(select, spec.top_k, dim=-1)
            scores, raw_logits = logits, None
    else:
        sig = positive_scores(g.scoring, logits)
        probs = sig / sig.sum(dim=-1, keepdim=True)
        scores = sig if bias_E is None else sig + bias_E.float()
        # without a bias or groups, choose on the logits (Llama 4's router does): σ is monotone,
        # but saturates to 1.0 in float32 above ~17, where choosing on σ would meet ties
        # (Flint's router chooses on σ itself: ``sigmoid_select``)
        select = scores if bias_E is not None or g.grouped or m.sigmoid_select else logits.float()
        if g.grouped:
            allowed, margin = _group_limit(g, scores, scores.double(), spec.top_k)
            select = scores.masked_fill(~allowed, float("-inf"))
        top_idx = torch.topk(select, spec.top_k, dim=-1).indices
        top_vals, raw_logits = sig.gather(1, top_idx), logits
    if m.renormalise:
        eps = m.renorm_eps or (1e-20 if g.scoring in POSITIVE_SCORES else 0.0)  # transformers' V3 denominator
        denom = top_vals.sum(dim=-1, keepdim=True) + eps
        top_vals = top_vals / (denom.clamp_min(m.renorm_min) if m.renorm_min else denom)
    if g.scaling != 1.0:
        top_vals = top_vals * g.scaling
    return Routing(scores, probs, top_idx, top_vals, raw_logits, margin)


POSITIVE_SCORES = ("sigmoid", "sqrtsoftplus")


def positive_scores(scoring: str, logits_NE: torch.Tensor) -> torch.Tensor:
    """A sigmoid-style router's scores, in float32: σ(logits), or DeepSeek-V4's √softplus(logits)."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits_NE.float()).sqrt()
    return torch.sigmoid(logits_NE.float())


def hash_route(spec: ModelSpec, router_EH: torch.Tensor, y_NH: torch.Tensor, topk_NK: torch.Tensor) -> Routing:
    """DeepSeek-V4's hash-routed layers (``DeepseekV4HashRouter``): the active set is fixed by
    the token id (R_k = ``tid2eid[token]``, in the table's order, not ordered by score); the
    learned router only weights it — its scores s gathered on R_k, renormalised (+1e-20),
    × ``routed_scaling_factor``. No selection happens, so there is no boundary."""
    logits = F.linear(y_NH, router_EH)
    scores = positive_scores(spec.gate.scoring, logits)
    top_vals = scores.gather(1, topk_NK)
    if spec.moe.renormalise:
        top_vals = top_vals / (top_vals.sum(dim=-1, keepdim=True) + (spec.moe.renorm_eps or 1e-20))
    if spec.gate.scaling != 1.0:
        top_vals = top_vals * spec.gate.scaling
    return Routing(scores, scores / scores.sum(dim=-1, keepdim=True), topk_NK, top_vals, logits)


def _sparsemixer(spec: ModelSpec, logits_NE: torch.Tensor) -> Routing:
    """Phi-3.5-MoE's sparsemixer in evaluation mode (transformers' ``sparsemixer`` with
    ``training=False``): the top-2 of the logits; each chosen expert's combine weight is its
    softmax over the experts whose logit lies within a relative band 2ε of its own (the first
    expert's rivals include every expert; the second's exclude the first). ρ is the plain
    softmax of the logits; the selection scores are the logits."""
    eps = spec.moe.sparsemixer_eps or 0.0
    s = logits_NE.float()
    first_val, first = s.max(dim=-1, keepdim=True)
    masked = s.scatter(-1, first, float("-inf"))
    second_val, second = masked.max(dim=-1, keepdim=True)
    combine = []
    for rivals, top_val, idx in ((s, first_val, first), (masked, second_val, second)):
        with torch.no_grad():  # transformers computes the band without gradient
            far = ((top_val - s) / s.abs().clamp(min=top_val)) > 2 * eps
        combine.append(torch.softmax(rivals.masked_fill(far, float("-inf")), dim=-1).gather(-1, idx))
    return Routing(s, torch.softmax(s, dim=-1), torch.cat([first, second], dim=-1), torch.cat(combine, dim=-1))


def _group_limit(g: Gate, select_NE: torch.Tensor, s_NE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts allowed to compete [N, E], margin to a routing change [N]).

    The groups are chosen on ``select_NE`` exactly as transformers chooses them (float32; V2:
    softmax probabilities, V3: biased sigmoid scores). The margin, in float64 on the selection
    scores ``s_NE`` (V2: the logits, in which softmax margins are measured), is the smaller of
    the in-group margin s_(k) − s_(k+1) among the allowed experts and the gap between the
    weakest chosen and the strongest other group score, divided by how much moving every score
    by ±m/2 moves that gap (2 for a sum of two scores, 1 for a max), so both are in the units
    of the ungrouped margin (docs/decisions.md)."""
    N, E = select_NE.shape
    per = E // g.n_group

    def group_scores(x_NE: torch.Tensor) -> torch.Tensor:
        x = x_NE.view(N, g.n_group, per)
        return x.topk(2, dim=-1).values.sum(-1) if g.group_score == "top2sum" else x.amax(-1)

    chosen_idx = group_scores(select_NE).topk(g.topk_group, dim=-1).indices
    chosen = torch.zeros(N, g.n_group, dtype=torch.bool, device=select_NE.device)
    chosen.scatter_(1, chosen_idx, True)
    allowed = chosen[:, :, None].expand(N, g.n_group, per).reshape(N, E)
    g_NG = group_scores(s_NE)
    unit = 2.0 if g.group_score == "top2sum" else 1.0
    group_gap = (
        g_NG.masked_fill(~chosen, float("inf")).amin(-1) - g_NG.masked_fill(chosen, float("-inf")).amax(-1)
    ) / unit
    inner = torch.full_like(group_gap, float("inf"))
    if per * g.topk_group > k:
        ranked = s_NE.masked_fill(~allowed, float("-inf")).topk(k + 1, dim=-1).values
        inner = ranked[:, k - 1] - ranked[:, k]
    return allowed, torch.minimum(inner, group_gap)
