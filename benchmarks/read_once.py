"""Bytes read, wall time and peak memory of `certify` and `receipts`, before and after the
checkpoint reader reads each file once into private memory (docs/security.md, "One read per input"; docs/benchmarks.md
§6).

    git archive BASE moeaudit | tar -x -C /tmp/before      # the code to compare against
    python benchmarks/read_once.py --before /tmp/before [--after /tmp/after] --workdir W \
        [--only certify,streamed,big] [--rounds 2] [--json OUT]

Every measurement is a fresh process (``python read_once.py child ...``) running the real CLI;
the child counts the bytes its own ``os.read``/``pread``/``readv``/``preadv`` calls returned from
files under the audited directory (the reader uses nothing else), and reports ``/proc/self/io``
(``rchar``: every byte any read returned; ``read_bytes``: what came from the block device, ~0
once the page cache holds the checkpoint). The parent takes wall time and ``ru_maxrss`` of the
child from ``wait4``. "before" runs with ``PYTHONPATH`` set to the ``--before`` tree, "after"
with this checkout; contenders alternate within each round, in the same environment.

Scenarios: ``certify`` of a run of three ``CACHE_SMALL`` checkpoints (``--no-cache``; with the
private-copy budget at its default, and forced to 0 so that every file takes the streamed,
verified path a checkpoint larger than the budget takes), and (``big``) ``receipts`` of the
4.3 GB bf16 checkpoint of docs/benchmarks.md §2 (built once, ~2 min; larger than the budget).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve()
MARK = "READ_ONCE "


# ----- the child: count reads, run the CLI ------------------------------------------------------


def _proc_io() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = int(v)
    return out


def child(under: str, budget: int | None, args: list[str]) -> None:
    counted = {"bytes": 0, "calls": 0}
    root = os.path.realpath(under) + os.sep

    def mine(fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(root)
        except OSError:
            return False

    def wrap(name: str) -> None:
        real = getattr(os, name)

        def counting(fd: int, *a: object) -> object:
            got = real(fd, *a)
            if mine(fd):
                counted["bytes"] += got if isinstance(got, int) else len(got)  # type: ignore[arg-type]
                counted["calls"] += 1
            return got

        setattr(os, name, counting)

    for name in ("read", "pread", "readv", "preadv"):
        wrap(name)
    if budget is not None:
        import moeaudit.limits as limits

        limits.PRIVATE_COPY_BYTES = budget  # type: ignore[attr-defined]
    io0, t0 = _proc_io(), time.perf_counter()
    from moeaudit.cli import main

    code = 0
    try:
        sys.argv = ["moeaudit", *args]
        main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    io1 = _proc_io()
    print(
        MARK
        + json.dumps(
            {
                "exit": code,
                "in_process_s": time.perf_counter() - t0,
                "ckpt_bytes": counted["bytes"],
                "ckpt_calls": counted["calls"],
                "rchar": io1["rchar"] - io0["rchar"],
                "read_bytes": io1["read_bytes"] - io0["read_bytes"],
            }
        ),
        flush=True,
    )
    sys.exit(code)


# ----- the parent ---------------------------------------------------------------------------------


def measure(
    code_dir: Path | None, under: Path, args: list[str], budget: int | None = None, env: dict[str, str] | None = None
) -> dict[str, object]:
    cmd = [sys.executable, str(HERE), "child", "--under", str(under)]
    cmd += ["--budget", str(budget)] if budget is not None else []
    environ = {**os.environ, **(env or {})}
    if code_dir is not None:
        environ["PYTHONPATH"] = str(code_dir)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [*cmd, "--", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ
    )
    out = proc.stdout.read() if proc.stdout else ""
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    m = re.search(MARK + r"(\{.*\})", out)
    if m is None or os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed ({status}): {' '.join(cmd)}\n{out[-3000:]}")
    return {
        **json.loads(m.group(1)),
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_bytes": usage.ru_maxrss * 1024,
    }


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def load() -> str:
    return "load {:.1f}/{:.1f}/{:.1f}".format(*os.getloadavg())


def compare(
    name: str, rounds: int, contenders: dict[str, dict[str, object]], under: Path, args: list[str], size: int
) -> dict[str, object]:
    rows: dict[str, list[dict[str, object]]] = {c: [] for c in contenders}
    for r in range(rounds):
        order = list(contenders)[r % 2 :] + list(contenders)[: r % 2]
        for c in order:
            row = measure(under=under, args=args, **contenders[c])  # type: ignore[arg-type]
            rows[c].append(row)
            print(
                f"{name} round {r + 1} {c}: {row['ckpt_bytes'] / size:.2f}× the checkpoint bytes "
                f"({row['ckpt_bytes'] / 1e9:.3f} GB in {row['ckpt_calls']} reads), "
                f"wall {row['wall_s']:.1f} s, cpu {row['cpu_s']:.1f} s, "
                f"max RSS {row['max_rss_bytes'] / 1e9:.3f} GB ({load()})",
                flush=True,
            )
    return {"bytes_on_disk": size, "args": args, "rounds": rows}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":  # child --under DIR [--budget N] -- ARGS
        split = sys.argv.index("--")
        cp = argparse.ArgumentParser()
        cp.add_argument("--under", required=True)
        cp.add_argument("--budget", type=int)
        c = cp.parse_args(sys.argv[2:split])
        child(c.under, c.budget, sys.argv[split + 1 :])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="a source tree of the old code")
    ap.add_argument("--after", type=Path, help="a source tree of the new code (default: the installed moeaudit)")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--only",
        default="certify,streamed",
        help="scenarios, comma-separated: certify, streamed, big (4.3 GB receipts)",
    )
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    from build import Arch, write_canary, write_checkpoint  # torch: the parent only builds inputs
    from run import BIG, CACHE_SMALL

    work = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    env = {"MOEAUDIT_CACHE_DIR": str(work / "cache"), "XDG_CONFIG_HOME": str(work / "config")}
    key = work / "key"
    if not key.exists():
        subprocess.run(
            [sys.executable, "-m", "moeaudit", "keygen", "--out", str(key)], check=True, env={**os.environ, **env}
        )
    before: dict[str, object] = {"code_dir": a.before, "env": env}
    after: dict[str, object] = {"code_dir": a.after, "env": env}
    results: dict[str, object] = {"load_before": load()}
    only = set(a.only.split(","))
    if only & {"certify", "streamed"}:
        run_dir, canary = work / "run", work / "run-canary.safetensors"
        if not run_dir.exists():
            for i in range(3):
                write_checkpoint(run_dir / f"checkpoint-{100 * (i + 1)}", CACHE_SMALL, seed=i)
        if not canary.exists():
            write_canary(canary, CACHE_SMALL.vocab, 16, 256)
        args = [
            "certify",
            str(run_dir),
            "--canary",
            str(canary),
            "--out",
            str(work / "out"),
            "--key",
            str(key),
            "--force",
            "--no-cache",
        ]
        size = sum(tree_bytes(p) for p in run_dir.glob("checkpoint-*"))
    if "certify" in only:
        results["certify"] = compare("certify", a.rounds, {"before": before, "after": after}, run_dir, args, size)
    if "streamed" in only:
        results["certify_streamed"] = compare(
            "certify, budget 0", a.rounds, {"before": before, "after": {**after, "budget": 0}}, run_dir, args, size
        )
    if "big" in only:
        big, canary = work / "big", work / "big-canary.safetensors"
        arch: Arch = BIG
        if not (big / "model.safetensors").exists():
            write_checkpoint(big, arch)
            write_canary(canary, arch.vocab, 8, 256)
        args = ["receipts", str(big), "--canary", str(canary), "--json", str(work / "big.json"), "--force"]
        results["big_receipts"] = compare(
            "big receipts", a.rounds, {"before": before, "after": after}, big, args, tree_bytes(big)
        )
    results["load_after"] = load()
    if a.json:
        a.json.write_text(json.dumps(results, indent=2, default=str))
    shutil.rmtree(work / "out", ignore_errors=True)


if __name__ == "__main__":
    main()
