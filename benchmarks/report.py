"""Markdown tables from ``run.py --json`` results, for docs/benchmarks.md:
``python benchmarks/report.py RESULTS.json [MORE.json ...]`` prints them to stdout."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

# the receipts against transformers, and against the floor that includes the overlap receipts'
# extra experts (the arithmetic the receipts are defined on: docs/benchmarks.md §1)
TARGETS = {"moeaudit/hf_fp32": 0.7, "moeaudit/floor_overlap": 1.05}
RATIOS = (
    "moeaudit/hf_fp32",
    "moeaudit/floor",
    "moeaudit/floor_overlap",
    "floor_overlap/floor",
    "floor/hf_fp32",
    "moeaudit/moeaudit_kept",
)


def speed(env_name: str, s: dict[str, Any]) -> list[str]:
    names = list(s["runs"])
    rounds = len(s["runs"][names[0]])
    lines = [
        f"#### {env_name} environment {s['env'] or '(nothing set)'}",
        "",
        *([f"Shape: {s['arch']}; canary {s['canary'][0]} × {s['canary'][1]} tokens.", ""] if "arch" in s else []),
        f"Every contender reported computing in: `{s.get('env_reported', 'not recorded')}`, "
        f"{s.get('dtype', 'float32')}."
        + (
            f" W1/W3 products kept for every layer by default: {s['kept_by_default']}; receipts identical "
            f"with every layer's kept (`moeaudit_kept`): {s.get('receipts_identical_kept')}."
            if "kept_by_default" in s
            else ""
        ),
        "",
        "| contender | "
        + " | ".join(f"round {r + 1} wall (cpu) s" for r in range(rounds))
        + " | median wall s | median cpu s | max RSS MB |",
        "|---|" + "---|" * (rounds + 3),
    ]
    for n in names:
        runs = s["runs"][n]
        cells = [f"{r['wall']:.2f} ({r['cpu']:.2f})" for r in runs]
        lines.append(
            f"| {n} | "
            + " | ".join(cells)
            + f" | {statistics.median(r['wall'] for r in runs):.2f}"
            + f" | {statistics.median(r['cpu'] for r in runs):.2f}"
            + f" | {max(r['rss_mb'] for r in runs):.0f} |"
        )
    lines += [
        "",
        "| ratio | per round (wall) | median wall | median cpu | target | met? |",
        "|---|---|---|---|---|---|",
    ]
    for key in RATIOS:
        if key not in s:
            continue
        r = s[key]
        target = TARGETS.get(key)
        met = "—" if target is None else ("met" if r["median_wall"] <= target else "**not met**")
        lines.append(
            f"| {key} | {', '.join(f'{x:.3f}' for x in r['per_round'])} | "
            f"{r['median_wall']:.3f} | {r['median_cpu']:.3f} | "
            f"{'—' if target is None else f'≤ {target}'} | {met} |"
        )
    if "gflop" in s:
        lines += [
            "",
            "| contender | GFLOP per replay (products) | GFLOP per CPU-second | "
            "single-thread GEMM ceiling | share of the ceiling |",
            "|---|---|---|---|---|",
        ]
        ceiling = s["gemm_ceiling_gflops_1thread"]
        for n, g in s["gflop"].items():
            rate = s["gflop_per_cpu_s"][n]
            lines.append(f"| {n} | {g:.1f} | {rate:.1f} | {ceiling:.1f} | {rate / ceiling:.0%} |")
    return lines + [""]


def rss(r: dict[str, Any]) -> list[str]:
    size = r["checkpoint_bytes"]
    lines = [
        f"Checkpoint: {size / 1e9:.3f} GB ({size} bytes), bf16, {r['arch']}; canary {r['canary'][0]}×{r['canary'][1]}.",
        "",
        "| run | expert products kept | max RSS (GB) | fraction of checkpoint | target | met? | wall s | cpu s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, x in enumerate(r["runs"], 1):
        met = "met" if x["fraction"] <= 0.35 else "**not met**"
        lines.append(
            f"| {i} | {x.get('budget', 'none kept')} | {x['max_rss_bytes'] / 1e9:.3f} | {x['fraction']:.1%} | ≤ 35% "
            f"| {met} | {x['wall']:.1f} | {x['cpu']:.1f} |"
        )
    return lines + [""]


def scaling(sc: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each axis with its least-squares line t = a + b·n: linear cost means the points sit on
    it (a is what a run costs whatever n: reading the canary, embeddings, LM head, setup)."""
    lines = []
    for axis, points in sc.items():
        xs, ys = [float(p[axis]) for p in points], [p["replay_s"] for p in points]
        fit = statistics.linear_regression(xs, ys)
        r2 = statistics.correlation(xs, ys) ** 2
        base = points[0]
        fixed = {k: base[k] for k in ("layers", "experts", "tokens") if k != axis}
        lines += [
            f"**vs {axis}** ({', '.join(f'{k} {v}' for k, v in fixed.items())}): fit "
            f"{fit.intercept:.2f} s + {fit.slope * 1000:.3g} ms × {axis}, R² = {r2:.3f}",
            "",
            f"| {axis} | replay s (min of repeats) | fit s | residual | whole process s |",
            "|---|---|---|---|---|",
        ]
        for p, x, y in zip(points, xs, ys, strict=True):
            pred = fit.intercept + fit.slope * x
            lines.append(f"| {p[axis]} | {y:.2f} | {pred:.2f} | {(y - pred) / pred:+.0%} | {p['process_s']:.2f} |")
        lines.append("")
    return lines


def cache(name: str, c: dict[str, Any]) -> list[str]:
    lines = [
        f"**{name}** run: {c['checkpoints']} checkpoints, {c['arch']}, canary {c['canary'][0]}×{c['canary'][1]}",
        "",
        "| round | first certify s | second s | speed-up | replayed (second) "
        "| one checkpoint added s | replayed then |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, row in enumerate(c["rounds"], 1):
        lines.append(
            f"| {i} | {row['cold_s']:.2f} | {row['warm_s']:.2f} | "
            f"{row['speedup']:.1f}× | {', '.join(row['replays_warm']) or 'none'} | "
            f"{row['added_s']:.2f} | {', '.join(row['replays_added']) or 'none'} |"
        )
    return lines + [""]


def main(paths: list[str]) -> None:
    out: list[str] = []
    for path in paths:
        res = json.loads(Path(path).read_text())
        out += [f"### {Path(path).name}", "", "```", json.dumps(res["machine"]), "```", ""]
        for env_name, s in res.get("speed", {}).items():
            out += speed(env_name, s)
        if "rss" in res:
            out += rss(res["rss"])
        if "scaling" in res:
            out += scaling(res["scaling"])
        for name, c in res.get("cache", {}).items():
            out += cache(name, c)
    print("\n".join(out))


if __name__ == "__main__":
    main(sys.argv[1:])
