"""What the receipts of a layer mean when its gate is not a bias-free linear softmax gate
(docs/decisions.md, "DeepSeek-V3 / V2: sigmoid and group-limited routing, YaRN, MTP layers"), and the bias-balancing
telemetry of DeepSeek-V3-style routers.

The atlas theorem (`003` §4.1, Theorem 1) assumes router logits that are bias-free linear in
the post-gain coordinate, so that the active-set cells are cut by linear strict inequalities.
A selection bias (``σ(W_r y) + b``, DeepSeek-V3) or a group limit (only the best groups
compete) breaks that assumption: the cells are still open and still partition the routed
region (the selection scores are continuous), but their walls are no longer hyperplanes in y.
Every layer whose gate is like this carries a ``gate`` entry saying so, and which receipts
keep, change or lose their meaning.

Shape suffixes: E experts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moeaudit.spec.config import ModelSpec

if TYPE_CHECKING:  # the gate statements are read torch-free (a fully cached certify)
    import torch

HOLDS = [
    "occupancy, dead experts, active sets and per-domain routing: counted on the active sets "
    "the router really selected (bias and groups included)",
    "exact C2, transition incompatibility and adjacency specificity: taken over those active "
    "sets with the combine weights the model uses",
    "expert, router and shared-expert gradient norms, the envelope series, NLL and entropy",
    "the expert cover of `003` Theorem 1 (charts from the down-projections): it does not involve the gate",
]


def bias_free_linear(spec: ModelSpec) -> bool:
    """True when the gate is what the atlas theorem assumes: softmax of bias-free linear logits,
    top-k, no groups (Mixtral, OLMoE, Qwen, DeepSeek-V2 greedy)."""
    g = spec.gate
    return g.scoring == "softmax" and not g.selection_bias and not g.grouped and not spec.moe.logit_bias


def _score(spec: ModelSpec) -> tuple[str, str]:
    """(the selection scores, the units their margins are in; "" for logit units)."""
    g = spec.gate
    if g.selection_bias:  # ERNIE 4.5: softmax + b; DeepSeek-V3 and others: σ + b; DeepSeek-V4: √softplus + b
        if g.scoring == "sqrtsoftplus":
            return "√softplus(W_r y) + b", "√softplus"
        return ("σ(W_r y) + b" if g.scoring == "sigmoid" else "softmax(W_r y) + b"), (
            "sigmoid" if g.scoring == "sigmoid" else "probability"
        )
    if g.scoring == "sigmoid":
        return "σ(W_r y)", "sigmoid"
    if g.scoring == "sqrtsoftplus":
        return "√softplus(W_r y)", "√softplus"
    return ("W_r y + b" if spec.moe.logit_bias else "W_r y"), ""


def _positive(scoring: str) -> str:
    """The positive score map of a sigmoid-style gate, as a formula: σ or √softplus (DeepSeek-V4)."""
    return "√softplus" if scoring == "sqrtsoftplus" else "σ"


def gate_note(spec: ModelSpec) -> dict[str, Any] | None:
    """The per-layer statement for a gate the atlas theorem does not cover as it is stated;
    None otherwise. It says what differs, which receipts keep their meaning (``holds``), which
    change it (``changed``) and which statements are not certified for this gate."""
    if bias_free_linear(spec):
        return None
    g = spec.gate
    score, units = _score(spec)
    why = []
    if g.selection_bias:
        why.append(f"a per-expert selection bias b ({score} is not linear in y)")
    elif g.scoring in ("sigmoid", "sqrtsoftplus"):
        f = _positive(g.scoring)
        why.append(
            f"{'sigmoid' if g.scoring == 'sigmoid' else '√softplus'} combine weights {f}(W_r y), not "
            "renormalised (the choice is the top-k of the bias-free linear logits W_r y)"
        )
    if spec.moe.logit_bias:
        why.append("a router bias b in the logits W_r y + b (affine, not linear, in y)")
    if g.scoring == "sparsemixer":
        why.append(
            "sparsemixer combine weights (each chosen expert's softmax over the experts within a "
            "relative jitter band of it; the choice is the top-2 of the bias-free linear logits W_r y)"
        )
    if g.grouped:
        why.append(f"a group limit (only the best {g.topk_group} of {g.n_group} expert groups compete)")
    if spec.moe.scaled_inputs:
        why.append(
            "combine weights that scale each chosen expert's input, u_e(c_e y) (the receipts use "
            "u_e(c_e y)/c_e as the expert output, docs/families.md)"
        )
    rho = (
        f"ρ = {_positive(g.scoring)}(s)/Σ{_positive(g.scoring)}(s) on the unbiased scores"
        if g.scoring in ("sigmoid", "sqrtsoftplus")
        else "ρ = softmax(W_r y + b)"
        if spec.moe.logit_bias
        else "ρ = softmax(W_r y)"
    )
    smooth = "ρ, π_smooth, smooth C2, the JS transition and the smooth margins describe "
    if g.selection_bias or g.grouped:
        without = [w for w, on in (("the bias", g.selection_bias), ("the group limit", g.grouped)) if on]
        smooth += f"the gate without {' and without '.join(without)} ({rho}): their top-k need not be the active set"
    elif g.scoring in ("sigmoid", "sqrtsoftplus"):
        f = _positive(g.scoring)
        smooth += (
            f"{f}(W_r y) normalised over all experts ({rho}), not the combine weights {f}(W_r y) the model "
            "uses; their top-k is the active set"
        )
    elif g.scoring == "sparsemixer":
        smooth += (
            f"the softmax over all experts ({rho}), not the sparsemixer's combine weights; their top-2 is "
            "the active set"
        )
    else:
        smooth += f"the gate's own softmax ({rho}), bias included"
    changed = [
        f"margins, boundary mass and flip rate are measured on the selection scores {score}"
        + (f" in {units} units, not comparable with softmax-logit margins of other families" if units else "")
        + (
            ", as the distance to the nearer of an in-group swap and a group swap (docs/decisions.md)"
            if g.grouped
            else ""
        ),
        smooth,
    ]
    not_certified = []
    if g.selection_bias:
        not_certified.append(
            "`003` Theorem 1's cells as linear cones (the routing assumption fails): cell walls are curved"
        )
    elif g.grouped:
        not_certified.append("`003` Theorem 1's cells as linear cones: the group limit adds a second partition")
    if spec.moe.logit_bias:
        not_certified.append(
            "`003` Theorem 1's cells as linear cones: the logit bias makes the cell walls "
            "affine hyperplanes, so the cells are convex polyhedra, not cones through the origin"
        )
    if g.selection_bias or g.grouped or spec.moe.logit_bias or units:
        not_certified.append("the Gaussian boundary-mass closed form of `002`, which assumes a linear gate")
    return {
        "gate": spec.routing,
        "bias_free_linear": False,
        "why": "the atlas theorem (`003` §4.1) assumes a bias-free linear gate; this layer has " + " and ".join(why),
        "holds": HOLDS,
        "changed": changed,
        "not_certified": not_certified,
    }


def bias_telemetry(bias_E: torch.Tensor | None) -> dict[str, Any] | None:
    """The operator's control input as the checkpoint holds it: per-expert bias and its spread."""
    from moeaudit.receipts.deferred import resolve

    return resolve(bias_telemetry_pending(bias_E))  # type: ignore[no-any-return]


def bias_telemetry_pending(bias_E: torch.Tensor | None) -> dict[str, Any] | None:
    """:func:`bias_telemetry` left where the bias is (``deferred.resolve`` reads it)."""
    from moeaudit.receipts.deferred import floats, number

    if bias_E is None:
        return None
    b = bias_E.double()
    return {
        "values": floats(b),
        "mean": number(b.mean()),
        "std": number(b.std(unbiased=False)),
        "min": number(b.min()),
        "max": number(b.max()),
    }


def bias_drift(b0_E: torch.Tensor, b1_E: torch.Tensor, pi0_E: torch.Tensor, pi1_E: torch.Tensor) -> dict[str, Any]:
    """Δb per expert between two checkpoints next to Δπ, the result of that control (both π on
    the base checkpoint's states, so only the router moved). An aux-loss-free balancer
    (``b_i ← b_i + γ·sign(load deficit)``, `000` Eq. 2) lowers the bias of over-loaded
    experts: a working one shows Δb anti-correlated with the base load's excess over k/E."""
    d_b = b1_E.double() - b0_E.double()
    p0 = pi0_E.double()
    return {
        "delta": d_b.tolist(),
        "delta_pi": (pi1_E.double() - p0).tolist(),
        "l2": float(d_b.norm()),
        "max_abs": float(d_b.abs().max()),
        "corr_delta_bias_vs_load_excess": _corr(d_b, p0 - p0.mean()),
    }


def _corr(a: torch.Tensor, b: torch.Tensor) -> float | None:
    a, b = a - a.mean(), b - b.mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else None
