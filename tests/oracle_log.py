"""What the oracle tests measured, written down when ``MOEAUDIT_ORACLE_LOG=FILE`` is set: one
JSON line per comparison with the worst differences between our replay and transformers.

The tests assert tolerances; this keeps the figures behind them (docs/families.md, "Measured
agreement"): ``python -m pytest tests/test_oracle*.py`` with the variable set, then
``python tests/oracle_log.py FILE`` prints the table per test file."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from typing import Any

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(((a - b).abs() / b.abs().clamp_min(1e-12)).max()) if b.numel() else 0.0


def _abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if b.numel() else 0.0


def worst(ref: Any, ours: Any) -> dict[str, float]:
    """NLL abs and the worst relative gradient-norm difference over experts, router, shared
    expert and attention (norms where transformers' is above 1e-6), for a family test's own log."""
    rel = [0.0]
    for i in ref.scores:
        r, o = ref.expert_grads[i].double(), ours.expert_grads[i].double()
        keep = r > 1e-6
        rel.append(float(((o[keep] - r[keep]).abs() / r[keep]).max()) if keep.any() else 0.0)
        for name in ("router_grads", "shared_grads", "attention_grads"):
            want, got = getattr(ref, name)[i], getattr(ours, name)[i]
            if want > 1e-6:
                rel.append(abs(got - want) / want)
    return {"nll_abs": abs(float(ours.loss) - float(ref.loss)), "grad_rel": max(rel)}


def record(ref: Any, ours: Any, decisive: dict[int, torch.Tensor], same_topk: dict[int, bool]) -> None:
    """Append the comparison's worst differences to $MOEAUDIT_ORACLE_LOG (nothing when unset).
    Gradient norms are compared where transformers' norm is above 1e-6 (the tests' atol)."""
    path = os.environ.get("MOEAUDIT_ORACLE_LOG")
    if not path:
        return
    grads = [(ours.expert_grads[i].double(), ref.expert_grads[i].double()) for i in ref.scores]
    grad_rel = max((_rel(o[r > 1e-6], r[r > 1e-6]) for o, r in grads), default=0.0)
    row = {
        "test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
        "loss_rel": abs(float(ours.loss) - float(ref.loss)) / abs(float(ref.loss)),
        "hidden_abs": max(_abs(x, y) for x, y in zip(ours.layer_inputs, ref.layer_inputs, strict=True)),
        "router_abs": max(_abs(ours.scores[i], ref.scores[i]) for i in ref.scores),
        "grad_rel": grad_rel,
        "decisive": min(float(decisive[i].float().mean()) for i in ref.scores),
        "topk_equal": all(same_topk.values()),
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def table(path: str) -> str:
    """Worst figures per test file, as a Markdown table."""
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in open(path, encoding="utf-8"):
        row = json.loads(line)
        rows[row["test"].split("::")[0].removeprefix("tests/")].append(row)
    out = [
        "| test file | comparisons | loss rel | hidden abs | router logits abs | grad norms rel "
        "| top-k sets equal (decisive tokens, min share) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rs in sorted(rows.items()):
        worst = {k: max(r[k] for r in rs) for k in ("loss_rel", "hidden_abs", "router_abs", "grad_rel")}
        equal = "yes" if all(r["topk_equal"] for r in rs) else "NO"
        out.append(
            f"| {name} | {len(rs)} | {worst['loss_rel']:.1e} | {worst['hidden_abs']:.1e} | "
            f"{worst['router_abs']:.1e} | {worst['grad_rel']:.1e} | {equal} "
            f"({min(r['decisive'] for r in rs):.2f}) |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    print(table(sys.argv[1]))
