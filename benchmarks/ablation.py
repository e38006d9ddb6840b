"""What ``certify --ablate`` costs on the shipped samples (docs/benchmarks.md §12).

    python benchmarks/ablation.py [--samples collapse,healthy,...] [--rounds 1] [--json OUT]

Per sample run, ``certify RUN --no-cache`` without and with ``--ablate low-occupancy`` and
``--ablate all``, each a fresh process, the three back to back and their order rotating every
round, same environment. Reported per row: wall seconds and CPU seconds (user + sys of the
child, from ``wait4``), the ratio of each to the plain certify's in the same round, and from
the signed receipt the experts removed and the decoder-layer forwards it ran (one forward of
the canary is ``num_layers`` of them).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ("collapse", "deepseek", "frozen-drift", "healthy", "resume", "sft-refine", "sft-repurpose")
KEY = ROOT / "tests" / "golden" / "test-signing-key.pem"
MODES = ("none", "low-occupancy", "all")


def one(run: Path, mode: str, work: Path) -> dict[str, object]:
    out = work / f"{run.name}-{mode}"
    args = [sys.executable, "-m", "moeaudit", "certify", str(run), "--no-cache", "--force", "--out", str(out)]
    args += ["--key", str(KEY)] + ([] if mode == "none" else ["--ablate", mode])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEAUDIT_HOME": str(work / "home")}
    start = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{run.name} {mode}: exit {status}: {proc.stderr.read().decode() if proc.stderr else ''}")
    row: dict[str, object] = {
        "sample": run.name,
        "mode": mode,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
    }
    if mode != "none":
        env_doc = json.loads((out / "certificate.json").read_text(encoding="utf-8"))
        a = json.loads(base64.b64decode(env_doc["payload"]))["predicate"]["ablation"]
        row.update(
            removed=len(a["experts"]),
            layer_forwards=a["cost"]["layerForwards"],
            replay_layer_forwards=a["cost"]["replayLayerForwards"],
            needed=sum(1 for e in a["experts"] if e["reading"].endswith("needed") and "not" not in e["reading"]),
        )
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", default=",".join(SAMPLES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--inprocess", action="store_true", help="only the in-process comparison with one replay")
    a = ap.parse_args()
    if a.inprocess:
        for name in a.samples.split(","):
            print(json.dumps({"sample": name, **inprocess(name)}), flush=True)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name in a.samples.split(","):
                order = MODES[r % 3 :] + MODES[: r % 3]
                got = {m: one(ROOT / "sample_checkpoints" / name, m, Path(tmp)) for m in order}
                for m in MODES:
                    row = {**got[m], "round": r}
                    row["wall_ratio"] = got[m]["wall_s"] / got["none"]["wall_s"]  # type: ignore[operator]
                    row["cpu_ratio"] = got[m]["cpu_s"] / got["none"]["cpu_s"]  # type: ignore[operator]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


def inprocess(name: str, rounds: int = 3) -> dict[str, float]:
    """The receipt's own compute next to one state replay (forward + backward) of the same
    checkpoint, in one process, alternating: the seconds of ``ablation_nll`` for every expert
    and for none (the baseline forward alone), and of ``replay``."""

    from moeaudit.canary import load
    from moeaudit.checkpoint import Checkpoint
    from moeaudit.replay import replay
    from moeaudit.replay.ablation import ablation_nll

    run = ROOT / "sample_checkpoints" / name
    ckpt = Checkpoint(sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1])
    tokens = load(ROOT / "sample_checkpoints" / "canary.safetensors").tokens
    every = {i: list(range(ckpt.spec.num_experts)) for i in ckpt.spec.routed_layers}
    best = {"replay": float("inf"), "ablate_all": float("inf"), "baseline_forward": float("inf")}
    for _ in range(rounds):
        for what, fn in (
            ("replay", lambda: replay(ckpt, tokens)),
            ("ablate_all", lambda: ablation_nll(ckpt, tokens, every)),
            ("baseline_forward", lambda: ablation_nll(ckpt, tokens, {})),
        ):
            t = time.process_time()
            fn()
            best[what] = min(best[what], time.process_time() - t)
    return {**best, "ratio_all_to_replay": best["ablate_all"] / best["replay"]}


if __name__ == "__main__":
    raise SystemExit(main())
