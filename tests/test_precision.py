"""``--precision fp32|tf32|bf16`` (docs/policy.md, "Reduced precision"): fp32 untouched, the bf16 experts'
kernels, the measured agreement with fp32 and how the verdict reads it (docs/policy.md
"Reduced precision")."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from moeaudit import canary as canary_mod
from moeaudit.attest.naming import from_wire
from moeaudit.checkpoint import Checkpoint
from moeaudit.cli import cli
from moeaudit.judge.decide import Evidence, decide, precision_check
from moeaudit.precision import current, precision_mode, ran
from moeaudit.receipts.agreement import RESOLUTION_RULE, agreement_windows
from moeaudit.receipts.state import state_receipts
from moeaudit.replay import model, replay
from moeaudit.replay import precision as rp

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_checkpoints"
HEALTHY = SAMPLES / "healthy" / "checkpoint-1500"
GOLDEN = ROOT / "tests" / "golden" / "healthy.statement.json"


@pytest.fixture(scope="module")
def probe() -> canary_mod.Canary:
    return canary_mod.load(SAMPLES / "canary.safetensors")


@pytest.fixture(scope="module")
def fp32_doc(probe: canary_mod.Canary) -> dict[str, Any]:
    return state_receipts(Checkpoint(HEALTHY), probe)


@pytest.fixture(scope="module")
def bf16_doc(probe: canary_mod.Canary) -> dict[str, Any]:
    with precision_mode("bf16"):
        return state_receipts(Checkpoint(HEALTHY), probe)


# --- fp32 stays the reference, untouched ------------------------------------------------------------


def test_fp32_is_the_default_and_its_receipts_carry_no_precision(fp32_doc, probe) -> None:
    assert current() == "fp32"
    with precision_mode("fp32"):
        again = state_receipts(Checkpoint(HEALTHY), probe)
    assert json.dumps(again, sort_keys=True) == json.dumps(fp32_doc, sort_keys=True)
    assert "precision" not in fp32_doc["environment"] and "precision_agreement" not in fp32_doc


def test_tf32_off_cuda_runs_fp32_and_says_so(fp32_doc, probe) -> None:
    assert ran("tf32", None) == ran("tf32", "cpu") == "fp32" and ran("tf32", "cuda:0") == "tf32"
    with precision_mode("tf32"):
        doc = state_receipts(Checkpoint(HEALTHY), probe)
    assert doc["environment"].pop("precision") == "fp32"  # what ran; no agreement needed for fp32
    assert "precision_agreement" not in doc
    assert json.dumps(doc, sort_keys=True) == json.dumps(fp32_doc, sort_keys=True)


def test_tf32_products_are_scoped_to_cuda_replays() -> None:
    """On the CPU nothing changes inside the scope; the setting is restored either way."""
    from moeaudit.replay.device import replay_scope

    before = torch.backends.cuda.matmul.fp32_precision
    with precision_mode("tf32"), replay_scope(None):
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_tf32_inside_a_cuda_replay_scope_and_restored_after() -> None:
    """The CUDA branch's settings, checked without a GPU (the flags are plain settings)."""
    from moeaudit.replay.device import replay_scope

    before = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision)
    with precision_mode("tf32"), replay_scope("cuda:0"):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    with precision_mode("bf16"), replay_scope("cuda:0"):  # bf16 keeps the float32 products IEEE
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.conv.fp32_precision) == before


# --- the bf16 experts ---------------------------------------------------------------------------------


def _experts(E: int = 4, H: int = 16, I: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        {n: torch.randn(*s, generator=g) * 0.2 for n, s in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I)))}
        for _ in range(E)
    ]


def _inputs(N: int = 40, H: int = 16, E: int = 4, K: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4)
    y = torch.randn(N, H, generator=g)
    topk = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    topk[:, 0] = torch.where(topk[:, 0] == 3, 2, topk[:, 0])  # expert 3 never first: uneven groups
    topk[topk[:, 1] == topk[:, 0], 1] = (topk[topk[:, 1] == topk[:, 0], 0] + 1) % E
    return y, topk, torch.rand(N, K, generator=g), torch.randn(N, H, generator=g)


def _bf16_reference(experts, y, topk, c, gout):
    """The bf16 math written out per (token, slot), without the sweep's grouping or sorting."""
    N, K = topk.shape
    u = torch.zeros(N, K, y.shape[1])
    dy = torch.zeros_like(y)
    dc = torch.zeros(N, K)
    dW: dict[int, dict[str, torch.Tensor]] = {}
    for e, w in enumerate(experts):
        rows = (topk == e).nonzero()
        if not len(rows):
            continue
        order = (rows[:, 0] * K + rows[:, 1]).argsort()
        rows = rows[order]
        W = {n: t.to(torch.bfloat16) for n, t in w.items()}
        x = y[rows[:, 0]].to(torch.bfloat16)
        a1, a3 = F.linear(x, W["w1"]), F.linear(x, W["w3"])
        h = F.silu(a1) * a3
        u[rows[:, 0], rows[:, 1]] = F.linear(h, W["w2"]).float()
        cc = c[rows[:, 0], rows[:, 1]].to(torch.bfloat16)[:, None]
        g = gout[rows[:, 0]].to(torch.bfloat16)
        p = g @ W["w2"]
        dc[rows[:, 0], rows[:, 1]] = (h.float() * p.float()).sum(-1)
        dh = p * cc
        sig = torch.sigmoid(a1)
        da1 = dh * a3 * (sig * (1 + a1 * (1 - sig)))
        da3 = dh * F.silu(a1)
        dy.index_add_(0, rows[:, 0], (da1 @ W["w1"] + da3 @ W["w3"]).float())
        dW[e] = {"w1": da1.t() @ x, "w3": da3.t() @ x, "w2": (g * cc).t() @ h}
    sq = torch.zeros(len(experts), dtype=torch.float64)
    for e, d in dW.items():
        sq[e] = sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in d.values())
    return u, dy, dc, sq


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_bf16_experts_are_the_bf16_math_and_differ_from_fp32(kernel: str) -> None:
    experts = _experts()
    y, topk, c, gout = _inputs()
    with precision_mode("bf16", kernel=kernel):
        rp.KERNELS_RUN.clear()
        u = model.experts_forward(experts, y, topk)
        back = model.experts_backward(experts, y, topk, c, gout)
    assert rp.KERNELS_RUN == {rp.GROUPED if kernel == "grouped" else rp.PER_EXPERT}
    ref_u, ref_dy, ref_dc, ref_sq = _bf16_reference(experts, y, topk, c, gout)
    torch.testing.assert_close(u, ref_u, rtol=0, atol=0)
    torch.testing.assert_close(back.combine_NK, ref_dc, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(back.y_NH, ref_dy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(back.sq_E, ref_sq, rtol=1e-6, atol=0)
    assert back.sq_E[3] > 0 and int((topk == 3).sum()) > 0
    u32 = model.experts_forward(experts, y, topk)
    b32 = model.experts_backward(experts, y, topk, c, gout)
    rel = ((back.sq_E.sqrt() - b32.sq_E.sqrt()).abs() / b32.sq_E.sqrt()).max()
    assert 0 < float((u - u32).abs().max()) < 0.05 and 0 < float(rel) < 0.02


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="no torch._grouped_mm in this torch")
def test_grouped_and_per_expert_kernels_agree_bit_for_bit_on_the_cpu() -> None:
    experts = _experts()
    y, topk, c, gout = _inputs()
    out = {}
    for kernel in ("loop", "grouped"):
        with precision_mode("bf16", kernel=kernel):
            out[kernel] = (model.experts_forward(experts, y, topk), model.experts_backward(experts, y, topk, c, gout))
    (ul, bl), (ug, bg) = out["loop"], out["grouped"]
    assert torch.equal(ul, ug) and torch.equal(bl.y_NH, bg.y_NH)
    assert torch.equal(bl.combine_NK, bg.combine_NK) and torch.equal(bl.sq_E, bg.sq_E)


def test_the_grouped_kernel_is_chosen_on_sm90_only_and_aligned() -> None:
    cpu = torch.device("cpu")
    assert not rp.grouped_kernel(cpu, (16, 32))  # the CPU: per-expert matmuls unless forced
    with precision_mode("bf16", kernel="grouped"):
        assert rp.grouped_kernel(cpu, (16, 32)) == hasattr(torch, "_grouped_mm")
        assert not rp.grouped_kernel(cpu, (16, 36))  # 36 bf16 = 72 bytes: not a 16-byte stride


def test_bf16_refuses_what_it_does_not_cover(tmp_path: Path) -> None:
    tiny = pytest.importorskip("hfmodels")
    path = tiny.save_any(tmp_path / "gpt_oss", "gpt_oss")
    spec = Checkpoint(path).spec
    assert rp.unsupported(spec) == "its experts use a clamped GLU"
    assert rp.unsupported(Checkpoint(HEALTHY).spec) is None
    r = CliRunner().invoke(
        cli, ["receipts", str(path), "--canary", str(SAMPLES / "canary.safetensors"), "--precision", "bf16"]
    )
    assert r.exit_code in (4,), r.output


# --- the measured agreement ------------------------------------------------------------------------


def test_the_agreement_windows_are_seeded_by_the_canary(probe) -> None:
    w = agreement_windows(probe)
    assert w == agreement_windows(probe) and len(w) == min(probe.num_windows, 4) and w == sorted(set(w))
    g = torch.Generator().manual_seed(int(probe.digest[:15], 16))
    assert w == sorted(torch.randperm(probe.num_windows, generator=g)[:4].tolist())


def test_the_agreement_numbers_are_an_independent_computation(bf16_doc, fp32_doc, probe) -> None:
    a = bf16_doc["precision_agreement"]
    ckpt = Checkpoint(HEALTHY)
    tokens = probe.tokens[a["windows"]]
    ref = replay(ckpt, tokens)
    with precision_mode("bf16"):
        low = replay(ckpt, tokens)
    flips = {}
    for layer, r in ref.routing.items():
        a_sets = [set(row) for row in r.topk_NK.tolist()]
        b_sets = [set(row) for row in low.routing[layer].topk_NK.tolist()]
        flips[str(layer)] = sum(x != y for x, y in zip(a_sets, b_sets, strict=True)) / len(a_sets)
    assert a["topk_flip_rate"]["layers"] == flips
    assert a["topk_flip_rate"]["overall"] == pytest.approx(sum(flips.values()) / len(flips), abs=1e-15)
    assert a["nll"]["reference"] == ref.nll and a["nll"]["measured"] == low.nll
    assert a["nll"]["relative_difference"] == pytest.approx(abs(low.nll - ref.nll) / ref.nll, rel=1e-12)
    rel = [
        abs(y - x) / x
        for layer, g in ref.grads.items()
        for x, y in zip(g.experts_E.tolist(), low.grads[layer].experts_E.tolist(), strict=True)
        if x > 0
    ]
    gr = a["grad_norm_relative_difference"]
    assert gr["max"] == pytest.approx(max(rel), rel=1e-12) and gr["median"] == pytest.approx(statistics.median(rel))
    assert gr["experts"] == len(rel)
    # bf16 on the CPU: small but not zero
    assert 0 < a["nll"]["relative_difference"] < 1e-2 and 0 < gr["max"] < 0.1
    n = probe.num_windows * probe.window_len
    res = {str(e["layer"]): max(e["boundary"]["flip_rate"], 1 / n) for e in bf16_doc["layers"]}
    assert a["resolution"] == {"rule": RESOLUTION_RULE, "layers": res}
    assert a["within_resolution"] == all(flips[k] <= res[k] for k in flips)
    assert a["precision"] == "bf16" and a["reference"] == "fp32" and a["tokens_per_layer"] == 4 * probe.window_len
    assert bf16_doc["environment"]["precision"] == "bf16"
    assert bf16_doc["nll"] != fp32_doc["nll"]


def test_bf16_receipts_are_deterministic(bf16_doc, probe) -> None:
    """The same inputs give bit-identical receipts on the same machine, in bf16 too
    (docs/glossary.md, "Replay")."""
    with precision_mode("bf16"):
        again = state_receipts(Checkpoint(HEALTHY), probe)
    assert json.dumps(again, sort_keys=True) == json.dumps(bf16_doc, sort_keys=True)


def test_reduced_precision_receipts_validate_against_the_schema(bf16_doc) -> None:
    import schema_check

    schema_check.validate(schema_check.RECEIPTS, bf16_doc, "bf16 receipts")


def test_the_cache_keeps_precisions_apart(probe) -> None:
    from moeaudit.cache import ReceiptsCache
    from moeaudit.certify import _Replayer
    from moeaudit.policy import Policy

    replayer = _Replayer(probe, Policy(), ReceiptsCache(enabled=False), lambda _m: None, 1)
    ckpt = Checkpoint(HEALTHY)
    fp32 = replayer._key("receipts", ckpt)
    with precision_mode("bf16"):
        bf16 = replayer._key("receipts", ckpt)
    with precision_mode("tf32"):
        tf32 = replayer._key("receipts", ckpt)
    assert len({fp32, bf16, tf32}) == 3


# --- the verdict ---------------------------------------------------------------------------------------


def _agreement(flip: float, resolution: float, name: str = "checkpoint-1500") -> dict[str, Any]:
    return {
        "checkpoint": name,
        "step": 1500,
        "reference": "fp32",
        "precision": "bf16",
        "windows": [0, 1, 2, 3],
        "tokens_per_layer": 256,
        "topk_flip_rate": {"overall": flip / 2, "max": flip, "layers": {"1": 0.0, "2": flip}},
        "nll": {"reference": 1.0, "measured": 1.0001, "relative_difference": 1e-4},
        "grad_norm_relative_difference": {"max": 0.01, "median": 0.001, "experts": 8},
        "resolution": {"rule": RESOLUTION_RULE, "layers": {"1": resolution, "2": resolution}},
        "within_resolution": flip <= resolution,
    }


def _golden_evidence(**extra: Any) -> Evidence:
    pred = from_wire(json.loads(GOLDEN.read_text(encoding="utf-8"))["predicate"])
    return Evidence(
        stage=pred["run"]["stage"],
        gates=pred["gates"],
        margins=pred["margins"],
        envelope=pred["envelope"],
        envelope_reason=next(c["reason"] for c in pred["checks"] if c["name"] == "envelope"),
        band=pred["policy"]["gates"]["inconclusive_band"],
        **extra,
    )


def test_a_flip_rate_above_the_resolution_makes_the_verdict_inconclusive() -> None:
    assert decide(_golden_evidence())["verdict"] == "PASS"  # the golden run, fp32
    assert precision_check([]) is None
    inside = decide(_golden_evidence(precision_agreement=[_agreement(0.004, 0.008)]))
    assert inside["verdict"] == "PASS"
    assert [c["status"] for c in inside["checks"] if c["name"] == "precision"] == ["PASS"]
    at = precision_check([_agreement(0.008, 0.008)])
    assert at is not None and at["status"] == "PASS"  # at the resolution is not above it
    outside = decide(_golden_evidence(precision_agreement=[_agreement(0.0117, 0.0083)]))
    assert outside["verdict"] == "INCONCLUSIVE" and outside["promotion"] == "INCONCLUSIVE"
    (check,) = [c for c in outside["checks"] if c["name"] == "precision"]
    assert check["status"] == "INCONCLUSIVE" and "checkpoint-1500 layer 2: 0.0117 > 0.0083" in check["reason"]


def test_a_failure_stays_a_failure_under_reduced_precision() -> None:
    ev = _golden_evidence(precision_agreement=[_agreement(0.05, 0.008)])
    gates = copy.deepcopy(list(ev.gates))
    gates[-1]["status"] = "RED"
    bad = Evidence(**{**ev.__dict__, "gates": gates})
    assert decide(bad)["verdict"] == "FAIL"


# --- the command line --------------------------------------------------------------------------------


def test_receipts_precision_flag(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    r = CliRunner().invoke(cli, ["receipts", str(HEALTHY), "--precision", "bf16", "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["environment"]["precision"] == "bf16" and doc["precision_agreement"]["precision"] == "bf16"
    bad = CliRunner().invoke(cli, ["receipts", str(HEALTHY), "--precision", "fp16"])
    assert bad.exit_code == 2 and "--precision" in bad.output


@pytest.mark.parametrize("command", ["receipts", "compare", "certify", "gate"])
def test_every_replaying_command_takes_precision(command: str) -> None:
    r = CliRunner().invoke(cli, [command, "--help"])
    assert r.exit_code == 0 and "--precision [fp32|tf32|bf16]" in r.output


def test_bf16_with_ranks_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli, ["receipts", str(HEALTHY), "--precision", "bf16", "--nproc", "2"])
    assert r.exit_code == 2 and "one process" in r.output


def test_certify_records_precision_and_agreement(tmp_path: Path) -> None:
    """A bf16 certificate names its precision and each checkpoint's agreement (a two-checkpoint run)."""
    import shutil

    run = tmp_path / "run"
    for step in (250, 1500):
        shutil.copytree(SAMPLES / "healthy" / f"checkpoint-{step}", run / f"checkpoint-{step}")
    key = ROOT / "tests" / "golden" / "test-signing-key.pem"
    args = ["certify", str(run), "--canary", str(SAMPLES / "canary.safetensors"), "--key", str(key), "--no-cache"]
    r = CliRunner().invoke(cli, [*args, "--precision", "bf16", "--out", str(tmp_path / "c")])
    assert r.exit_code == 0, r.output
    env = json.loads((tmp_path / "c" / "certificate.json").read_text())
    import base64

    pred = from_wire(json.loads(base64.b64decode(env["payload"]))["predicate"])
    assert pred["precision"] == pred["environment"]["precision"] == "bf16"
    assert pred["environment"]["dtype"] == "float32"
    assert "precision bf16" in (tmp_path / "c" / "certificate.html").read_text(encoding="utf-8")
    assert [a["checkpoint"] for a in pred["precision_agreement"]] == ["checkpoint-250", "checkpoint-1500"]
    (check,) = [c for c in pred["checks"] if c["name"] == "precision"]
    assert check["status"] == (
        "PASS" if all(a["within_resolution"] for a in pred["precision_agreement"]) else "INCONCLUSIVE"
    )
    r32 = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "d")])
    assert r32.exit_code == 0, r32.output
    pred32 = from_wire(
        json.loads(base64.b64decode(json.loads((tmp_path / "d" / "certificate.json").read_text())["payload"]))[
            "predicate"
        ]
    )
    assert "precision" not in pred32 and "precision_agreement" not in pred32
    assert "precision" not in pred32["environment"]
    assert "precision" not in [c["name"] for c in pred32["checks"]]


# --- the GPU path, checked on the CPU (and on CUDA where there is one) -----------------------------


@pytest.mark.parametrize("kernel", ["loop", "grouped"])
def test_bf16_adds_no_host_synchronisation_per_layer(kernel: str) -> None:
    """The bf16 sweeps on the stand-in device (tests/device_meter.py): no more host syncs per
    routed layer than the fp32 sweeps' caps (tests/test_host_syncs.py), whatever the kernel."""
    pytest.importorskip("transformers")
    from device_meter import STANDIN, measure
    from support.host_syncs import CAP

    ckpt = Checkpoint(HEALTHY)
    tokens = canary_mod.load(SAMPLES / "canary.safetensors").tokens[:4, :16]
    with precision_mode("bf16", kernel=kernel):
        meter = measure(ckpt, lambda tick: replay(ckpt, tokens, progress=tick, device=STANDIN))
    for phase in ("forward", "backward"):
        for i in ckpt.spec.routed_layers:
            counts = meter.counts[f"{phase} {i}"]
            assert counts["sync"] <= CAP[phase]["sync"], (phase, i, dict(counts))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cuda_grouped_kernel_agrees_with_the_loop() -> None:
    """On a GPU the grouped kernel (CUTLASS on sm_90+) and the per-expert bf16 matmuls are the
    same products with different accumulation orders: equal to bf16 rounding, not bit for bit."""
    experts = [{n: t.cuda() for n, t in w.items()} for w in _experts()]
    y, topk, c, gout = (t.cuda() for t in _inputs())
    out = {}
    for kernel in ("loop", "grouped"):
        with precision_mode("bf16", kernel=kernel):
            out[kernel] = (model.experts_forward(experts, y, topk), model.experts_backward(experts, y, topk, c, gout))
    (ul, bl), (ug, bg) = out["loop"], out["grouped"]
    torch.testing.assert_close(ug, ul, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(bg.y_NH, bl.y_NH, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(bg.sq_E, bl.sq_E, rtol=2e-2, atol=1e-6)
    ref_u = _bf16_reference(_experts(), *_inputs())[0]
    torch.testing.assert_close(ug.cpu(), ref_u, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_cuda_receipts_record_the_grouped_kernel_on_sm90(probe) -> None:
    with precision_mode("bf16"):
        doc = state_receipts(Checkpoint(HEALTHY), probe, device="cuda")
    a = doc["precision_agreement"]
    grouped = torch.cuda.get_device_capability()[0] in (9, 10)
    assert a["expert_kernel"] == (rp.GROUPED if grouped else rp.PER_EXPERT)
    assert 0 <= a["nll"]["relative_difference"] < 1e-2 and a["grad_norm_relative_difference"]["max"] < 0.1


def test_gate_reads_the_precision_check(tmp_path: Path) -> None:
    """``moeaudit gate --precision bf16``: its exit code is the decision the precision check leaves
    (3 when the flip rate exceeds the resolution; the same gate in fp32 promotes)."""
    base, cand = str(SAMPLES / "healthy" / "checkpoint-250"), str(SAMPLES / "healthy" / "checkpoint-1500")
    out = tmp_path / "g.json"
    r = CliRunner().invoke(cli, ["gate", base, cand, "--precision", "bf16", "--json", str(out)])
    doc = json.loads(out.read_text())
    (check,) = [c for c in doc["checks"] if c["name"] == "precision"]
    assert r.exit_code == (3 if check["status"] == "INCONCLUSIVE" else 0), r.output
    assert doc["decision"] == ("INCONCLUSIVE" if check["status"] == "INCONCLUSIVE" else "PROMOTE")
    r32 = CliRunner().invoke(cli, ["gate", base, cand, "--json", str(tmp_path / "g32.json")])
    assert r32.exit_code == 0
    assert "precision" not in [c["name"] for c in json.loads((tmp_path / "g32.json").read_text())["checks"]]
