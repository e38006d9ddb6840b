"""``--device``: the device branch (docs/scaling.md, "The device branch").

The default path (``device=None``) computes on the host with no copies. Any explicit device
takes the device branch — the CPU too — so CI runs that branch for every family on the CPU and
checks it gives the default path's receipts, and that every receipt and the certificate name the
device that computed each part (``cpu:0`` stands in for a GPU: it goes through the device
branch and is recorded as itself). The CUDA tests run only where a GPU exists.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint
from moeaudit.policy import Policy
from moeaudit.receipts.state import state_receipts

pytest.importorskip("transformers")

import hfmodels  # noqa: E402
from support.certify_families import _nudged_copy  # noqa: E402

STANDIN = "cpu:0"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def probe() -> canary_mod.Canary:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=g, dtype=torch.int32)
    return canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``family -> Path`` of a tiny checkpoint, saved once per module."""
    saved: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in saved:
            saved[family] = hfmodels.save_any(tmp_path_factory.mktemp(family) / "ckpt", family)
        return saved[family]

    return get


@pytest.fixture()
def placements(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every device a layer's weights were placed on (replay, generation, pair receipts)."""
    import moeaudit.receipts.drift as drift
    import moeaudit.replay.engine as engine
    from moeaudit.replay import device

    seen: list[str] = []

    def spy(lw: Any, dev: Any) -> Any:
        seen.append(str(dev))
        return device.on_device(lw, dev)

    monkeypatch.setattr(engine, "on_device", spy)
    monkeypatch.setattr(drift, "on_device", spy)
    return seen


def _numbers(doc: Any, path: str = "") -> dict[str, float]:
    """Every float of a receipts document, by its path."""
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() for k, v in _numbers(val, f"{path}/{key}").items()}
    if isinstance(doc, list):
        return {k: v for i, val in enumerate(doc) for k, v in _numbers(val, f"{path}/{i}").items()}
    return {path: float(doc)} if isinstance(doc, float) else {}


def _skeleton(doc: Any) -> Any:
    """``doc`` with every float replaced by a marker: what must match exactly."""
    if isinstance(doc, dict):
        return {k: _skeleton(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_skeleton(v) for v in doc]
    return "<float>" if isinstance(doc, float) else doc


def assert_receipts_agree(a: dict[str, Any], b: dict[str, Any], rel: float = 1e-6, abs_: float = 1e-9) -> None:
    """Same structure, counts and strings; every float within ``rel`` / ``abs_``."""
    a, b = {k: v for k, v in a.items() if k != "environment"}, {k: v for k, v in b.items() if k != "environment"}
    assert _skeleton(a) == _skeleton(b)
    na, nb = _numbers(a), _numbers(b)
    bad = [
        p
        for p in na
        if not (
            na[p] == nb[p]
            or (math.isnan(na[p]) and math.isnan(nb[p]))
            or math.isclose(na[p], nb[p], rel_tol=rel, abs_tol=abs_)
        )
    ]
    assert not bad, f"{len(bad)} numbers differ, first {bad[:5]}"


@pytest.mark.parametrize("family", hfmodels.ALL)
def test_the_device_branch_gives_the_default_receipts(
    family: str, tiny: Any, probe: canary_mod.Canary, placements: list[str]
) -> None:
    """Every registered family through the device branch on the CPU: the default path's
    receipts (within float tolerance; today bit for bit), and the device recorded as itself."""
    ckpt = Checkpoint(tiny(family))
    default = state_receipts(ckpt, probe)
    assert placements == ["None"] * 2 * ckpt.spec.num_layers  # the default path: no device
    placements.clear()
    branch = state_receipts(ckpt, probe, device=STANDIN)
    assert placements == [STANDIN] * 2 * ckpt.spec.num_layers  # every layer, forward and backward
    assert default["environment"]["device"] == "cpu" and branch["environment"]["device"] == STANDIN
    assert_receipts_agree(default, branch)


def test_explicit_cpu_takes_the_device_branch(tiny: Any, probe: canary_mod.Canary, placements: list[str]) -> None:
    """Asking for "cpu" is not a synonym of the default path: it runs the device branch."""
    ckpt = Checkpoint(tiny("mixtral"))
    doc = state_receipts(ckpt, probe, device="cpu")
    assert set(placements) == {"cpu"} and doc["environment"]["device"] == "cpu"
    assert_receipts_agree(doc, state_receipts(ckpt, probe))


def test_conflict_and_generation_run_on_the_device(tiny: Any, probe: canary_mod.Canary, placements: list[str]) -> None:
    """``--conflict`` (one backward per domain) and ``--generate`` (G forwards) run where the
    replay runs, and give the default path's numbers."""
    ckpt = Checkpoint(tiny("qwen2_moe"))
    layers = ckpt.spec.num_layers
    branch = state_receipts(ckpt, probe, conflict=True, generate=2, device=STANDIN)
    # replay (2L) + one backward replay per domain (2 × 2L) + 2 generated tokens (2 × L)
    assert placements == [STANDIN] * (2 * layers + 2 * 2 * layers + 2 * layers)
    default = state_receipts(ckpt, probe, conflict=True, generate=2)
    assert branch["environment"]["device"] == STANDIN
    assert_receipts_agree(default, branch)


def _run(tiny: Any, tmp_path: Path, family: str = "mixtral") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(tiny(family), run / "checkpoint-100")
    _nudged_copy(run / "checkpoint-100", run / "checkpoint-200")
    return run


def test_the_certificate_names_the_device_of_every_part(
    tiny: Any, probe: canary_mod.Canary, tmp_path: Path, placements: list[str]
) -> None:
    """certify on ``cpu:0``: both replays and the pair receipts run through the device branch,
    each receipts file records it, and so does the signed predicate (it said "cpu" whatever
    ran); the default path still says "cpu" (the golden statement's)."""
    from moeaudit.cache import ReceiptsCache
    from moeaudit.certify import audit_run

    run = _run(tiny, tmp_path)
    layers = Checkpoint(run / "checkpoint-100").spec
    audit = audit_run(run, probe, Policy(), cache=ReceiptsCache(tmp_path / "cache"), device=STANDIN)
    routed_pairs = len(layers.routed_layers)
    assert placements == [STANDIN] * (2 * 2 * layers.num_layers + 2 * routed_pairs)
    replayed = ["checkpoint-100.json", "checkpoint-200.json", "pair-200-vs-100.json"]
    assert set(replayed) <= set(audit.receipts)  # and envelope.json: host algebra on the logs
    assert {audit.receipts[name]["environment"]["device"] for name in replayed} == {STANDIN}
    assert audit.statement["predicate"]["environment"]["device"] == STANDIN
    assert "devices" not in audit.statement["predicate"]["environment"]

    placements.clear()  # the same run again: every part from the cache, its device as recorded
    again = audit_run(run, probe, Policy(), cache=ReceiptsCache(tmp_path / "cache"), device=STANDIN)
    assert placements == [] and again.statement["predicate"]["environment"]["device"] == STANDIN

    default = audit_run(run, probe, Policy(), cache=ReceiptsCache(tmp_path / "cache"))
    env = default.statement["predicate"]["environment"]
    assert env["device"] == "cpu" and set(env) == {"torch", "python", "device", "dtype"}
    for name in replayed:  # the device branch's numbers are the default's
        assert_receipts_agree(default.receipts[name], audit.receipts[name])


def test_parts_computed_on_several_devices_are_each_named() -> None:
    from moeaudit.certify import _environment

    env = _environment({"checkpoint-100.json": "cuda:0", "pair-200-vs-100.json": "cuda:0"})
    assert env["device"] == "cuda:0" and "devices" not in env
    env = _environment({"checkpoint-100.json": "cuda:0", "checkpoint-200.json": "cuda:1"})
    assert env["device"] == "mixed"
    assert env["devices"] == {"checkpoint-100.json": "cuda:0", "checkpoint-200.json": "cuda:1"}


def test_cli_receipts_on_the_standin_device(tiny: Any, tmp_path: Path, placements: list[str]) -> None:
    """``receipts --device cpu:0 --conflict --generate``: everything through the device branch,
    recorded as cpu:0; ``--device cpu`` stays the default path."""
    import json

    from click.testing import CliRunner

    from moeaudit.cli import cli

    samples = Path(__file__).resolve().parents[1] / "sample_checkpoints"
    args = ["receipts", str(tiny("olmoe")), "--canary", str(samples / "canary.safetensors")]
    out = tmp_path / "r.json"
    result = CliRunner().invoke(cli, [*args, "--device", STANDIN, "--conflict", "--generate", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["environment"]["device"] == STANDIN and "conflict" in doc and "generation" in doc
    assert placements and set(placements) == {STANDIN}
    placements.clear()
    result = CliRunner().invoke(cli, [*args, "--json", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output
    assert set(placements) == {"None"}
    assert json.loads((tmp_path / "d.json").read_text())["environment"]["device"] == "cpu"


@cuda
def test_cuda_receipts_match_cpu(tiny: Any, probe: canary_mod.Canary) -> None:
    ckpt = Checkpoint(tiny("mixtral"))
    on_cpu, on_gpu = state_receipts(ckpt, probe), state_receipts(ckpt, probe, device="cuda")
    assert on_gpu["environment"]["device"] == f"cuda:{torch.cuda.current_device()}"
    for layer_cpu, layer_gpu in zip(on_cpu["layers"], on_gpu["layers"], strict=True):
        assert layer_cpu["occupancy"]["counts"] == layer_gpu["occupancy"]["counts"]
    cpu_numbers, gpu_numbers = _numbers(on_cpu), _numbers(on_gpu)
    assert math.isclose(cpu_numbers["/nll"], gpu_numbers["/nll"], rel_tol=1e-5)
    for path in ("/predictive_entropy", "/pooled/gradients/grad_mean"):
        assert math.isclose(cpu_numbers[path], gpu_numbers[path], rel_tol=1e-4), path


@cuda
@pytest.mark.parametrize("family", hfmodels.ALL)
def test_cuda_replays_every_family_deterministically(family: str, tiny: Any, probe: canary_mod.Canary) -> None:
    """Strict deterministic mode on CUDA (float cumsum would raise here) and bit-identical reruns."""
    ckpt = Checkpoint(tiny(family))
    first = state_receipts(ckpt, probe, device="cuda")
    assert first == state_receipts(ckpt, probe, device="cuda")
    assert math.isclose(first["nll"], state_receipts(ckpt, probe)["nll"], rel_tol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
@pytest.mark.parametrize("command", ["receipts", "certify"])
def test_cuda_without_a_gpu_is_a_usage_error(command: str, tmp_path: Path) -> None:
    """Exit 2, one line naming the option, nothing written."""
    from click.testing import CliRunner

    from moeaudit.cli import cli

    samples = Path(__file__).resolve().parents[1] / "sample_checkpoints"
    target = samples / "healthy" / ("checkpoint-250" if command == "receipts" else "")
    out = ["--json", str(tmp_path / "r.json")] if command == "receipts" else ["--out", str(tmp_path / "cert")]
    result = CliRunner().invoke(cli, [command, str(target), "--device", "cuda", *out])
    assert result.exit_code == 2
    assert "--device" in result.output and "CUDA is not available" in result.output
    assert list(tmp_path.iterdir()) == []


def test_freed_memory_goes_back_every_eighth_layer_step_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host trims after every ``TRIM_EVERY``-th layer step (a trim after each cost a narrow
    replay 8 % of its wall time in page faults; docs/decisions.md), an accelerator never."""
    from moeaudit.replay import device as device_mod

    calls: list[int] = []
    monkeypatch.setattr(device_mod, "release_freed_memory", lambda: calls.append(1))
    assert device_mod.TRIM_EVERY == 8
    trim = device_mod.trimmer(None)
    for _ in range(20):
        trim()
    assert len(calls) == 2  # after the 8th and the 16th
    calls.clear()
    for _ in range(20):
        device_mod.trimmer("meta")()
    assert calls == []
