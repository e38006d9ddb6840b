"""The signed training loss and the canary probe under distributed training equal one process.

* HF Trainer under DDP (2 gloo ranks, its default ``average_tokens_across_devices``): the
  callback's ``metrics.jsonl`` loss is the loss the Trainer logs (not rank 0's share of it, half
  of it on two ranks), which is the one-process loss of the same global batch.
* FSDP2 (``fully_shard``): the loop hook's canary probe equals one process's within 1e-5 (not 0
  for every expert), leaves the training gradient as it was, and a canary loss computed outside
  ``probe_scope`` is refused.

Each run is ``torchrun`` with two CPU ranks on 127.0.0.1 (tests/dist_train_worker.py); the
processes and every collective have bounded timeouts."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from dist_train_worker import STEPS, canary  # noqa: E402
from hfmodels import tiny_model  # noqa: E402

from moeaudit.errors import InputError  # noqa: E402
from moeaudit.integrations.core import canary_loss  # noqa: E402
from moeaudit.integrations.hooks import ExpertGradLogger  # noqa: E402

WORKER = Path(__file__).with_name("dist_train_worker.py")
DEADLINE_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(mode: str, out: Path, *, single: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if single:
        cmd = [sys.executable, str(WORKER), mode, str(out), "single"]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-addr=127.0.0.1",
            f"--master-port={_free_port()}",
            str(WORKER),
            mode,
            str(out),
        ]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as exc:  # run() kills the launcher; torchrun ends its ranks
        raise AssertionError(f"{mode} ran past {DEADLINE_S} s") from exc
    assert done.returncode == 0, f"{mode} failed:\n{(done.stdout + done.stderr)[-3000:]}"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["trainer", "trainer_ga"])
def test_trainer_ddp_logs_the_loss_the_trainer_logs(tmp_path: Path, mode: str) -> None:
    """``trainer_ga``: two micro-batches per optimizer step (each rank's loss is a share of the
    step's, normalised by the token count of every micro-batch on every rank)."""
    _run(mode, tmp_path / "ddp")
    _run(mode, tmp_path / "one", single=True)
    ddp, one = _lines(tmp_path / "ddp" / "metrics.jsonl"), _lines(tmp_path / "one" / "metrics.jsonl")
    logged = json.loads((tmp_path / "ddp" / "log_history.json").read_text())
    assert [x["step"] for x in ddp] == [h["step"] for h in logged] == list(range(1, STEPS + 1))
    for mine, theirs, single in zip(ddp, logged, one, strict=True):
        # the Trainer's own log (float32 on each rank) and the one-process run of the same rows
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-6)
        assert mine["loss"] == pytest.approx(single["loss"], rel=1e-5)
        for layer, norms in single["expert_grad_norms"].items():
            assert mine["expert_grad_norms"][layer] == pytest.approx(norms, rel=1e-4)


def test_fsdp2_canary_probe_equals_one_process(tmp_path: Path) -> None:
    _run("fsdp_probe", tmp_path / "fsdp")
    _run("fsdp_probe", tmp_path / "one", single=True)
    (sharded,) = _lines(tmp_path / "fsdp" / "canary_probe.jsonl")  # rank 1 wrote nothing
    (single,) = _lines(tmp_path / "one" / "canary_probe.jsonl")
    assert sharded["canary"] == single["canary"] == canary().digest
    assert sharded["loss"] == pytest.approx(single["loss"], rel=1e-6)
    for table in ("expert_grad_norms", "router_grad_norms"):
        assert sharded[table].keys() == single[table].keys()
        for layer, want in single[table].items():
            assert sharded[table][layer] == pytest.approx(want, rel=1e-5, abs=1e-9)
    assert min(min(v) for v in sharded["expert_grad_norms"].values()) > 0  # not zeros
    for r in range(2):  # the training gradient is as the probe found it, on every rank
        assert json.loads((tmp_path / "fsdp" / f"grads_kept{r}.json").read_text()) is True
        refused = (tmp_path / "fsdp" / f"refused{r}.txt").read_text()
        assert refused.startswith("canary probe under FSDP2: compute the canary loss inside") and "\n" not in refused


def test_a_probe_loss_without_a_path_to_the_routers_is_refused(tmp_path: Path) -> None:
    """The loss of another copy of the model reaches none of the logged parameters: refused,
    not logged as zeros (the failure FSDP2's sharded parameters had)."""
    model = tiny_model("mixtral")
    other = copy.deepcopy(model)
    with ExpertGradLogger(tmp_path / "metrics.jsonl", model) as logger:
        with pytest.raises(InputError, match="no gradient path to the model's router parameters"):
            logger.probe(1, canary_loss(other, canary()), canary=canary().digest)
        assert logger.probe(1, canary_loss(model, canary())) is not None
    (line,) = _lines(tmp_path / "canary_probe.jsonl")
    assert all(v > 0 for v in line["router_grad_norms"].values())
