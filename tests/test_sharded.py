"""The expert-parallel replay gives one process's receipts at any world size (docs/decisions.md,
"Expert-parallel replay").

Real ranks on 127.0.0.1 over gloo (tests/sharded_worker.py, ``moeaudit ... --nproc``, torchrun),
tiny multi-file checkpoints of mixtral (4 experts, top-2), deepseek_v3 (8 experts in 4 groups, a
shared expert, a selection bias, a dense first layer), and two families whose experts are stored
fused [E, …], which a rank reads by the byte range of its rows: gpt_oss (gate/up interleaved,
biased clamped GLU, sinks) and llama4_text (transposed, expert inputs scaled by the router).
Every process and collective has a bounded timeout.

What must be equal bit for bit (the operands and the order of every sum are those of one
process): the root digest, every layer's top-k sets, the NLL, the per-expert gradient norms and
every receipt computed from the taps; and the bytes read from disk, which are the checkpoint once
in all (measured at 2 ranks: 50 % / 50 %; at 4: 22–28 % each). What may differ in the last bits: the router's, the
shared expert's and attention's gradient norms, whose weight gradients are summed over the ranks'
windows (measured: relative differences up to 4e-8; the bound is 1e-6).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import sharded_worker  # noqa: E402
from hfmodels import save_tiny  # noqa: E402
from support.sharded import DEADLINE_S, _env, _free_port, _launch, _without_environment, same  # noqa: E402

from moeaudit import canary as canary_mod  # noqa: E402

FAMILIES = ("mixtral", "deepseek_v3", "gpt_oss", "llama4_text")  # the last two: fused [E, …] experts


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[str, Any]]:
    """(canary, checkpoints, the single-process reference of each)."""
    root = tmp_path_factory.mktemp("sharded")
    ckpts = []
    for family in FAMILIES:  # several files: each is hashed by one rank, read by every rank
        save_tiny(root / family, family, max_shard_size="40KB")
        ckpts.append(str(root / family))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (4, 16), generator=g, dtype=torch.int32)
    canary_mod.save(
        canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose")),
        root / "canary.safetensors",
    )
    canary = root / "canary.safetensors"
    # the reference in the ranks' thread setting (OMP_NUM_THREADS=1, ``_env``): bit-identity is
    # claimed per thread count, and the pytest process may run with several
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return canary, ckpts, sharded_worker.audit(ckpts, str(canary))
    finally:
        torch.set_num_threads(threads)


def test_over_the_private_copy_budget_ranks_read_verified_and_agree(
    setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path
) -> None:
    """A budget smaller than a rank's share (96 KiB, about two files): nothing is sent at hashing,
    each rank reads its blocks when the replay asks (verified) and the least recently used files
    give theirs up, so the backward and the later checkpoints read again — same answers."""
    canary, ckpts, want = setup
    _launch(2, tmp_path / "out.json", canary, ckpts[:2], MOEAUDIT_TEST_PRIVATE_COPY_BYTES=str(96 << 10))
    got = json.loads((tmp_path / "out.json").read_text())
    for family in FAMILIES[:2]:
        assert got[family]["digest"] == want[family]["digest"]
        assert got[family]["topk"] == want[family]["topk"]
        assert got[family]["expert_norms"] == want[family]["expert_norms"]
        assert same(_without_environment(want[family]["receipts"]), _without_environment(got[family]["receipts"])) == []
    size = sum(f.stat().st_size for c in ckpts[:2] for f in Path(c).glob("*.safetensors"))
    reads = [json.loads((tmp_path / f"out.json.bytes.{r}").read_text()) for r in range(2)]
    assert all(r[1] == 0 for r in reads), reads  # nothing sent
    assert sum(r[0] for r in reads) > 1.5 * size, (size, reads)  # re-read, verified


@pytest.mark.parametrize("world", [2, 4])
def test_world_sizes_give_one_process_receipts(
    setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path, world: int
) -> None:
    canary, ckpts, want = setup
    _launch(world, tmp_path / "out.json", canary, ckpts)
    got = json.loads((tmp_path / "out.json").read_text())
    assert set(got) == set(FAMILIES)
    for family in FAMILIES:
        g, w = got[family], want[family]
        assert g["digest"] == w["digest"]  # assembled from the files the ranks hashed
        assert g["topk"] == w["topk"] and g["routing"] == w["routing"]
        assert g["expert_norms"] == w["expert_norms"]  # on the owning rank, bit for bit
        assert g["receipts"]["nll"] == w["receipts"]["nll"]
        assert same(_without_environment(w["receipts"]), _without_environment(g["receipts"])) == []
        env = g["receipts"]["environment"]
        assert (env["world_size"], env["backend"], env["rank_devices"]) == (world, "gloo", ["cpu"] * world)
        assert "world_size" not in w["receipts"]["environment"]
    # read once in all: the ranks together read each file once from disk (one process reads
    # the same), each rank a share of it; what a rank replays of the others' files was sent to it
    size = sum(f.stat().st_size for c in ckpts for f in Path(c).glob("*.safetensors"))
    reads = [json.loads((tmp_path / f"out.json.bytes.{r}").read_text()) for r in range(world)]
    assert sum(r[0] for r in reads) == size
    assert max(r[0] for r in reads) < (0.6 if world == 2 else 0.35) * size, (size, reads)
    assert all(r[1] > 0 for r in reads), reads
    # the summed norms do move (this test can see a difference where there is one)
    assert same({"router_grad_norm": 1.0}, {"router_grad_norm": 1.0 + 1e-5}) != []


def _cli(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "moeaudit", *args], env=_env(**env), capture_output=True, text=True, timeout=DEADLINE_S
    )


def test_nproc_option_writes_one_process_receipts(
    setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path
) -> None:
    canary, ckpts, want = setup
    out = tmp_path / "r.json"
    run = _cli(["receipts", ckpts[1], "--canary", str(canary), "--json", str(out), "--nproc", "2"])
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert same(_without_environment(want["deepseek_v3"]["receipts"]), _without_environment(doc)) == []
    assert doc["environment"]["world_size"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # rank 1 wrote nothing


@pytest.mark.parametrize("kind", ["error", "exit"])
def test_a_failing_rank_ends_every_rank_with_one_line_and_no_output(
    setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path, kind: str
) -> None:
    canary, ckpts, _ = setup
    out = tmp_path / "r.json"
    run = _cli(
        ["receipts", ckpts[0], "--canary", str(canary), "--json", str(out), "--nproc", "2"],
        MOEAUDIT_TEST_RANK_FAULT=f"1:1:{kind}",
    )
    assert run.returncode == 4, (run.returncode, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, run.stderr
    if kind == "error":  # the failing rank's own message, through every rank
        assert errors[0].startswith("moeaudit: error: rank 1 of 2: ")
        assert "injected read failure in layer 1" in errors[0]
    else:  # the rank died: named by rank 0, which stopped the others
        assert errors[0].startswith(
            "moeaudit: error: expert-parallel replay of 2 ranks failed: rank 1 exited with code 9"
        )
    assert list(tmp_path.iterdir()) == []


def test_torchrun_launch(setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 2 -m moeaudit receipts …``: rank 1 serves, rank 0 writes."""
    canary, ckpts, want = setup
    out = tmp_path / "r.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(_free_port()),
            "-m",
            "moeaudit",
            "receipts",
            ckpts[0],
            "--canary",
            str(canary),
            "--json",
            str(out),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert same(_without_environment(want["mixtral"]["receipts"]), _without_environment(doc)) == []
    assert doc["environment"]["world_size"] == 2


def test_certify_nproc_records_the_ranks(setup: tuple[Path, list[str], dict[str, Any]], tmp_path: Path) -> None:
    """``certify --nproc 2``: the signed environment names the world size, backend and each rank's
    device of the receipts' replays, and that the pair receipts were computed by rank 0 alone."""
    import base64
    import shutil

    canary, ckpts, _ = setup
    run = tmp_path / "run"
    for step in (100, 200):  # the same weights twice: a pair to compare, nothing else new to test
        shutil.copytree(ckpts[0], run / f"checkpoint-{step}")
    key, out = tmp_path / "key", tmp_path / "out"
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    assert _cli(["keygen", "--out", str(key)], **env).returncode == 0
    done = _cli(
        ["certify", str(run), "--key", str(key), "--out", str(out), "--canary", str(canary), "--nproc", "2"], **env
    )
    assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: a verdict other than PASS
    signed = json.loads(base64.b64decode(json.loads((out / "certificate.json").read_text())["payload"]))
    env_doc = signed["predicate"]["environment"]
    assert (env_doc["worldSize"], env_doc["backend"], env_doc["rankDevices"]) == (2, "gloo", ["cpu", "cpu"])
    assert env_doc["worldSizes"] == {"checkpoint-100.json": 2, "checkpoint-200.json": 2, "pair-200-vs-100.json": 1}
    verified = _cli(["verify", str(out / "certificate.json"), "--pubkey", str(key) + ".pub"], **env)
    assert verified.returncode == 0, verified.stdout + verified.stderr
