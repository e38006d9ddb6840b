"""Issue 28 §5: memory per rank falls as the experts are spread — under an enforced per-process
cap, one process cannot audit a checkpoint that four ranks can.

The cap is ``RLIMIT_DATA`` (Linux counts the heap and every private writable mapping: what torch's
allocator and Python's take; thread stacks and untouched reservations do not count, which is why
``RLIMIT_AS`` is no measure of use). It is set on the ``moeaudit receipts`` process, and the ranks
``--nproc 4`` starts inherit it, so each process has the same cap. The checkpoint is
benchmarks/sharded.py's (a Mixtral layout, 8 layers × 16 experts, H = 256, I = 512, float32,
199 MiB). Measured on the development machine (torch 2.13 CPU, one OMP thread, bisected in
25 MiB steps): one process needs 450–475 MiB, four ranks 350–375 MiB each (rank 0 the most); the
cap of 415 MiB sits ≥ 35 MiB from either (docs/benchmarks.md §8). The difference is the
private copy each process keeps of what it replays: the whole checkpoint for one process, a
quarter of the experts and the replicated tensors for a rank (``replay.rank_bytes``).
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
    pytest.skip("RLIMIT_DATA bounds private mappings on Linux only; torch.distributed needed",
                allow_module_level=True)

from moeaudit import canary as canary_mod  # noqa: E402

CAP = 415 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("memory")
    config = transformers.MixtralConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                        num_attention_heads=8, num_key_value_heads=4, num_local_experts=16,
                                        num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(root / "ckpt", max_shard_size="8MB")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 512, (8, 128), generator=g, dtype=torch.int32)
    canary_mod.save(canary_mod.Canary(tokens, torch.zeros(8, dtype=torch.int32), ("text",)),
                    root / "canary.safetensors")
    return root / "ckpt", root / "canary.safetensors"


def _capped() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (CAP, CAP))


def _receipts(ckpt: Path, canary: Path, out: Path, *more: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MOEAUDIT_DIST_TIMEOUT": "120"}
    return subprocess.run([sys.executable, "-m", "moeaudit", "receipts", str(ckpt), "--canary", str(canary),
                           "--json", str(out), *more], env=env, preexec_fn=_capped, capture_output=True,
                          text=True, timeout=300)


def test_one_process_runs_out_under_the_cap_four_ranks_do_not(checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    ckpt, canary = checkpoint
    assert sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) > 190 << 20
    one = _receipts(ckpt, canary, tmp_path / "one.json")
    assert one.returncode == 4, one.stderr[-2000:]
    errors = [line for line in one.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("moeaudit: error: out of memory"), one.stderr
    assert "--nproc N" in errors[0]
    assert not (tmp_path / "one.json").exists()
    four = _receipts(ckpt, canary, tmp_path / "four.json", "--nproc", "4")
    assert four.returncode == 0, four.stderr[-2000:]
    doc = json.loads((tmp_path / "four.json").read_text())
    assert doc["environment"]["world_size"] == 4 and len(doc["layers"]) == 8
