"""Memory per rank falls as the experts are spread — under an enforced per-process
cap, one process cannot audit a checkpoint that four ranks can (docs/decisions.md, "Memory demonstration under
`RLIMIT_DATA`").

The cap is ``RLIMIT_DATA`` (Linux counts the heap and every private writable mapping: what torch's
allocator and Python's take; thread stacks and untouched reservations do not count, which is why
``RLIMIT_AS`` is no measure of use). It is set on the ``moeaudit receipts`` process, and the ranks
``--nproc 4`` starts inherit it, so each process has the same cap. The checkpoint is
benchmarks/sharded.py's (a Mixtral layout, 8 layers × 16 experts, H = 256, I = 512, float32,
199 MiB). The cap is not a constant tuned to one machine (torch's own baseline differs between
builds and CPUs): the test finds, by bisection to 16 MiB, the largest cap under which one process
runs out, and asserts that four ranks audit the same checkpoint under a cap 32 MiB lower still.
Measured on the development machine (torch 2.13 CPU, one OMP thread): one process needs
450–475 MiB, four ranks 350–375 MiB each (docs/benchmarks.md §8). The difference is the private
copy each process keeps of what it replays: the whole checkpoint for one process, a quarter of
the experts and the replicated tensors for a rank (``replay.rank_bytes``).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not sys.platform.startswith("linux") or not torch.distributed.is_available():
    pytest.skip("RLIMIT_DATA bounds private mappings on Linux only; torch.distributed needed", allow_module_level=True)

from moeaudit import canary as canary_mod  # noqa: E402

MiB = 1 << 20
LOW, HIGH = 192 * MiB, 1024 * MiB  # one process fails at the first and runs at the second


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("memory")
    config = transformers.MixtralConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=16,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(root / "ckpt", max_shard_size="8MB")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (8, 128), generator=g, dtype=torch.int32)
    canary_mod.save(
        canary_mod.Canary(tokens, torch.zeros(8, dtype=torch.int32), ("text",)), root / "canary.safetensors"
    )
    return root / "ckpt", root / "canary.safetensors"


def _receipts(ckpt: Path, canary: Path, out: Path, cap: int, *more: str) -> subprocess.CompletedProcess[str]:
    # The one process at its leanest: no expert products kept for the backward (``replay.stash``
    # would spend a quarter of the cap's headroom on them, raising the cap it needs).
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "MOEAUDIT_DIST_TIMEOUT": "120",
        "MOEAUDIT_ACTIVATION_BUDGET": "0",
    }

    def capped() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    return subprocess.run(
        [
            sys.executable,
            "-m",
            "moeaudit",
            "receipts",
            str(ckpt),
            "--canary",
            str(canary),
            "--json",
            str(out),
            "--force",
            *more,
        ],
        env=env,
        preexec_fn=capped,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _out_of_memory(run: subprocess.CompletedProcess[str], out: Path) -> bool:
    """The run failed as the cap should make it fail: exit 4, one error line saying out of
    memory and pointing at --nproc, nothing written. Any other failure fails the test."""
    if run.returncode == 0:
        return False
    assert run.returncode == 4, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("moeaudit: error: out of memory"), run.stderr
    assert "--nproc N" in errors[0]
    assert not out.exists()
    return True


def test_one_process_runs_out_under_the_cap_four_ranks_do_not(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, canary = checkpoint
    assert sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) > 190 << 20
    one = tmp_path / "one.json"
    assert _out_of_memory(_receipts(ckpt, canary, one, LOW), one)
    assert not _out_of_memory(_receipts(ckpt, canary, one, HIGH), one)
    one.unlink()
    lo, hi = LOW, HIGH  # one process: out of memory at lo, runs at hi
    while hi - lo > 16 * MiB:
        mid = (lo + hi) // 2 // MiB * MiB
        if _out_of_memory(_receipts(ckpt, canary, one, mid), one):
            lo = mid
        else:
            hi = mid
            one.unlink()
    cap = lo - 32 * MiB  # below what one process needs by at least 32 MiB
    four = _receipts(ckpt, canary, tmp_path / "four.json", cap, "--nproc", "4")
    assert four.returncode == 0, f"cap {cap // MiB} MiB: {four.stderr[-2000:]}"
    doc = json.loads((tmp_path / "four.json").read_text())
    assert doc["environment"]["world_size"] == 4 and len(doc["layers"]) == 8
