"""Per-expert gradient norms under DDP, FSDP2 and expert parallelism equal the
single-process norms, and only rank 0 writes. Two real gloo ranks on 127.0.0.1
(tests/dist_worker.py); every collective and the processes themselves have bounded timeouts."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_worker import batch  # noqa: E402
from hfmodels import tiny_model  # noqa: E402

WORKER = Path(__file__).with_name("dist_worker.py")
WORLD = 2
DEADLINE_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(mode: str, out: Path) -> None:
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(WORLD),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), mode, str(out)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
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
    for r, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} of {mode} failed:\n{text[-3000:]}"


def _reference() -> tuple[dict[str, list[float]], float]:
    """Single process, the whole batch: per-layer per-expert norms and the global norm."""
    model = tiny_model("mixtral").train()
    tokens = batch()
    model(input_ids=tokens, labels=tokens).loss.backward()
    norms = {}
    for i, layer in enumerate(model.model.layers):
        up, down = layer.mlp.experts.gate_up_proj.grad.double(), layer.mlp.experts.down_proj.grad.double()
        norms[str(i)] = [math.sqrt(float(up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(up.shape[0])]
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return norms, total


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "ep"])
def test_sharded_norms_equal_single_process(tmp_path: Path, mode: str) -> None:
    if mode == "fsdp":
        pytest.importorskip("torch.distributed.fsdp")
    _launch(mode, tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # rank 1 wrote nothing
    assert not (tmp_path / "unused.jsonl").exists()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [r["wrote"] for r in ranks] == [True, False]
    assert all(r["collective"] == (mode != "ddp") for r in ranks)  # DDP: no collective needed
    record = json.loads(lines[0])
    want, total = _reference()
    assert math.sqrt(ranks[0]["total"]) == pytest.approx(total, rel=1e-5)
    for layer, norms in want.items():
        assert record["expert_grad_norms"][layer] == pytest.approx(norms, rel=1e-5, abs=1e-9)
