"""Helpers of tests/test_sharded.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")


WORKER = Path(__file__).resolve().parents[1] / "sharded_worker.py"


DEADLINE_S = 240


SUMMED = {"router_grad_norm", "shared_grad_norm", "attention_grad_norm"}  # summed over the ranks


REL = 1e-6


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MOEAUDIT_DIST_TIMEOUT": "90", **extra}


def _launch(world: int, out: Path, canary: Path, ckpts: list[str], **extra: str) -> None:
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world), **extra)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(canary), *ckpts],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=DEADLINE_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{text[-3000:]}"


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Where ``b`` differs from ``a``: exactly, except the summed norms (within REL)."""
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in same(x, y, f"{path}[{i}]")]
    if path.rsplit("/", 1)[-1] in SUMMED and isinstance(a, float):
        return [] if abs(a - b) <= REL * max(abs(a), abs(b)) else [f"{path}: {a!r} vs {b!r}"]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]


def _without_environment(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k != "environment"}
