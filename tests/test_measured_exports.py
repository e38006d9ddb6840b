"""Exports filled from measurements: parameter counts from the weights, the audit's own FLOPs and
energy, the Model Documentation Form's two audiences (each signed over the same certificate
digest) and ISO/IEC 42001 Annex A (docs/compliance.md, "Measured quantities")."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moeaudit.attest.certificate import open_certificate, sign_statement
from moeaudit.attest.signing import SignatureInvalid, generate_key, load_public_key, verify_envelope
from moeaudit.jsonio import atomic_write, dumps
from moeaudit.receipts import compute as compute_mod
from moeaudit.receipts.compute import metered
from moeaudit.report.evidence import AIO, DP, NCA, two_significant
from moeaudit.report.export import EXPORT_PREDICATE, export, export_statement, run_signed_export, to_markdown
from moeaudit.report.frameworks import EU_GPAI_MDF, FORM_FIELDS, FRAMEWORKS

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden" / "healthy.statement.json"
SAMPLES = ROOT / "sample_checkpoints" / "healthy"


@pytest.fixture(scope="module")
def key_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    path = tmp_path_factory.mktemp("keys") / "signing-key.pem"
    return generate_key(path), Path(str(path) + ".pub")


def _certificate(stmt: dict[str, Any], key: Any, path: Path) -> Path:
    atomic_write(path, dumps(sign_statement(stmt, key, issued_at="2026-05-02T14:03:11Z")))
    return path


def _golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


def _verified(stmt: dict[str, Any], key_pair: tuple[Any, Path], tmp_path: Path) -> dict[str, Any]:
    cert = _certificate(stmt, key_pair[0], tmp_path / "certificate.json")
    return open_certificate(cert, load_public_key(key_pair[1]))


def _items(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {i["id"]: i for i in report["items"]}


# --- parameter counts: from the headers, against independent counts --------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_parameter_counts_equal_transformers_own_count(family: str, tmp_path: Path) -> None:
    """total = transformers' sum(p.numel()); routed and shared experts by transformers' parameter
    names; active = total - routed + routed * top_k / num_experts, computed here by hand."""
    pytest.importorskip("transformers")
    import hfmodels

    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.checkpoint.params import parameter_counts

    model = hfmodels.save_tiny(tmp_path / family, family)
    got = parameter_counts(Checkpoint(tmp_path / family))
    named = dict(model.named_parameters())
    routed = sum(p.numel() for n, p in named.items() if ".experts." in n and "shared_expert" not in n)
    shared = sum(p.numel() for n, p in named.items() if "shared_expert" in n)
    cfg = model.config
    k = cfg.num_experts_per_tok
    e = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    total = sum(p.numel() for p in model.parameters())
    assert got["total"] == total and got["routed_experts"] == routed and got["shared_experts"] == shared
    assert got["active"] * e == (total - routed) * e + routed * k  # exact: routed * k / e is whole here
    assert (got["top_k"], got["num_experts"]) == (k, e)
    assert routed > 0 and (shared > 0) == (family == "qwen2_moe")


def test_parameter_counts_equal_the_safetensors_headers_read_independently(tmp_path: Path) -> None:
    """DeepSeek-V3 stores its selection bias (a buffer, not a transformers parameter): the total
    is every stored value, as the safetensors library itself reads the shapes."""
    pytest.importorskip("transformers")
    import hfmodels
    from safetensors import safe_open

    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.checkpoint.params import parameter_counts

    model = hfmodels.save_tiny(tmp_path / "ds", "deepseek_v3")
    got = parameter_counts(Checkpoint(tmp_path / "ds"))
    stored = 0
    for f in (tmp_path / "ds").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                stored += n
    assert got["total"] == stored
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert stored == sum(p.numel() for p in model.parameters()) + biases


def test_the_golden_certificate_counts_the_sample_checkpoint(tmp_path: Path) -> None:
    """The signed count is the one the sample checkpoint's own header gives."""
    from safetensors import safe_open

    p = _golden()["predicate"]["parameters"]
    files = list((SAMPLES / p["checkpoint"]).glob("*.safetensors"))
    stored = 0
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            stored += sum(int(torch.Size(st.get_slice(n).get_shape()).numel()) for n in st.keys())
    assert p["total"] == stored == 186384
    assert p["active"] == p["total"] - p["routedExperts"] + p["routedExperts"] * p["topK"] // p["numExperts"]


@pytest.mark.parametrize(
    "n, text",
    [
        (46_702_792_704, "4.7*10^10"),  # Mixtral 8x7B total
        (12_879_925_248, "1.3*10^10"),  # its active
        (73_000_000_000, "7.3*10^10"),  # the Form's own example
        (186_384, "1.9*10^5"),
        (99_999, "1.0*10^5"),
        (12, "12"),
        (0, "0"),
        (0.0072, "0.0072"),
    ],
)
def test_two_significant_figures(n: float, text: str) -> None:
    assert two_significant(n) == text


# --- FLOPs: counted, against hand computations -------------------------------------------------------


def test_meter_counts_a_hand_computed_forward_and_backward() -> None:
    x = torch.randn(5, 6)
    w1 = torch.randn(6, 7, requires_grad=True)
    w2 = torch.randn(7, 3, requires_grad=True)
    with metered() as m:
        ((x @ w1).relu() @ w2).sum().backward()
    forward = 2 * 5 * 6 * 7 + 2 * 5 * 7 * 3
    backward = 2 * 5 * 7 * 3 * 2 + 2 * 5 * 6 * 7  # w2 and the hidden input; w1 only (x needs none)
    assert m.flops == forward + backward == 1470


def test_meter_counts_attention_on_the_cpu_kernel_too() -> None:
    """torch has no formula for the CPU flash kernel; ours is torch's own: 4·B·h·T²·d forward,
    2.5 times that backward."""
    b, h, t, d = 2, 3, 8, 4
    q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
    with metered() as m:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert m.flops == 4 * b * h * t * t * d * 7 // 2 == 21504


def test_grouped_products_count_as_the_per_expert_matmuls() -> None:
    """torch._grouped_mm (the bf16 experts' grouped GEMM) has no torch formula; counted as the
    per-group matmuls: row groups of a against b's G matrices, and the weight-gradient form
    (groups along the contraction)."""
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    bf = torch.bfloat16
    sizes, k, n = [3, 0, 5, 8], 16, 24
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    a, b = torch.randn(16, k, dtype=bf), torch.randn(4, k, n, dtype=bf)
    with metered() as m:
        torch._grouped_mm(a, b, offs=offs)
    assert m.flops == sum(2 * r * k * n for r in sizes) == 2 * 16 * 16 * 24
    g = torch.randn(16, n, dtype=bf)
    with metered() as m:
        torch._grouped_mm(a.t(), g, offs=offs)  # per group a_jᵀ @ g_j: [4, k, n]
    assert m.flops == sum(2 * k * r * n for r in sizes) == 12288
    with metered() as m:  # one matrix per group, both sides
        torch._grouped_mm(torch.randn(4, 8, k, dtype=bf), b)
    assert m.flops == 4 * 2 * 8 * k * n == 24576
    with metered() as m:  # a's groups against column groups of b: [8, 4 * 8]
        torch._grouped_mm(
            torch.randn(4, 8, k, dtype=bf), torch.randn(k, 32, dtype=bf), offs=offs.new_tensor([8, 16, 24, 32])
        )
    assert m.flops == 4 * 2 * 8 * k * 8 == 8192


def test_bf16_experts_count_the_same_grouped_or_one_matmul_per_expert(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bf16 replay's experts through the grouped kernel count what the per-expert loop counts
    (before its formula, the grouped products counted nothing: 31408128 against 57458688). The
    fp32 agreement replay keeps every layer's expert products (the count depends on it)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("MOEAUDIT_ACTIVATION_BUDGET", "inf")
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    import hfmodels

    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.policy import Policy
    from moeaudit.precision import precision_mode
    from moeaudit.receipts.state import run_state

    hfmodels.save_tiny(tmp_path / "m", "mixtral")
    ckpt = Checkpoint(tmp_path / "m")
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    canary = canary_mod.Canary(tokens, torch.tensor([0, 1, 0, 1], dtype=torch.int32), ("a", "b"))
    counts, kernels = [], []
    for kernel in ("loop", "grouped"):
        with precision_mode("bf16", kernel), metered() as m:
            doc, _ = run_state(ckpt, canary, Policy())
        counts.append(m.flops)
        kernels.append(doc["precision_agreement"]["expert_kernel"])
    assert kernels == ["per-expert matmul", "grouped_mm"]
    assert counts[0] == counts[1] == 57_458_688


@pytest.mark.parametrize("family, expected", [("mixtral", 4_571_136), ("qwen2_moe", 4_878_336)])
def test_the_replays_forward_is_counted_exactly_as_by_hand(family: str, expected: int, tmp_path: Path) -> None:
    """The replay's own decoder forward (moeaudit.replay.engine.forward_pass), 4 windows of 16
    tokens: per layer q/k/v/o, attention (4·W·heads·T²·head_dim), the router, the routed experts
    for N·top_k routed rows (however the tokens were routed), the shared expert and its gate."""
    pytest.importorskip("transformers")
    import hfmodels

    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.replay import engine

    hfmodels.save_tiny(tmp_path / family, family)
    ckpt = Checkpoint(tmp_path / family)
    s = ckpt.spec
    w, t = 4, 16
    tokens = torch.randint(0, hfmodels.VOCAB, (w, t), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    with metered() as m:
        engine.forward_pass(ckpt, tokens, engine.rope_tables(s, t))
    n, h, hd = w * t, s.hidden_size, s.head_dim
    proj = 2 * n * h * (2 * s.num_heads * hd + 2 * s.num_kv_heads * hd)
    attention = 4 * w * s.num_heads * t * t * hd
    router = 2 * n * h * s.num_experts
    experts = n * s.top_k * 2 * 3 * h * s.expert_dim
    shared = 2 * n * 3 * h * s.shared_dim + (2 * n * h if s.shared_dim else 0)  # Qwen2-MoE: its sigmoid gate
    assert m.flops == s.num_layers * (proj + attention + router + experts + shared) == expected


def _tiny_replay(windows: int, tmp_path: Path) -> tuple[int, dict[str, Any], Any]:
    pytest.importorskip("transformers")
    import hfmodels

    from moeaudit import canary as canary_mod
    from moeaudit.checkpoint.checkpoint import Checkpoint
    from moeaudit.policy import Policy
    from moeaudit.receipts.state import run_state

    path = tmp_path / "mixtral"
    if not path.exists():
        hfmodels.save_tiny(path, "mixtral")
    tokens = torch.randint(0, hfmodels.VOCAB, (4, 16), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    tokens = tokens.repeat(windows // 4, 1)
    canary = canary_mod.Canary(tokens, torch.zeros(windows, dtype=torch.int32), ("web",))
    ckpt = Checkpoint(path)
    with metered() as m:
        doc, _ = run_state(ckpt, canary, Policy())
    return m.flops, doc, ckpt.spec


def test_replay_flops_are_tokens_times_per_token_and_bound_the_hand_forward(tmp_path: Path) -> None:
    """Twice the windows, twice the FLOPs (each window is replayed alone); and the count covers
    at least the forward and the backward of every product the model computes, by hand:
    q/k/v/o, attention, router, the experts for the tokens routed to them, the LM head."""
    flops4, doc, s = _tiny_replay(4, tmp_path)
    flops8, _, _ = _tiny_replay(8, tmp_path)
    assert flops8 == 2 * flops4
    n, t, w = 4 * 16, 16, 4
    hd = s.head_dim
    proj = 2 * n * s.hidden_size * (2 * s.num_heads * hd + 2 * s.num_kv_heads * hd)
    attention = 4 * w * s.num_heads * t * t * hd
    router = 2 * n * s.hidden_size * s.num_experts
    per_layer = [sum(layer["occupancy"]["counts"]) * 2 * 3 * s.hidden_size * s.expert_dim for layer in doc["layers"]]
    assert all(c == n * s.top_k * 2 * 3 * s.hidden_size * s.expert_dim for c in per_layer)  # every slot routed
    head = 2 * w * (t - 1) * s.hidden_size * s.vocab_size  # the next-token positions
    forward = s.num_layers * (proj + attention + router) + sum(per_layer) + head
    assert forward == 4_939_776
    assert 3 * forward <= flops4 == 22_953_984  # docs/compliance.md quotes both numbers


# --- energy: NVML or "not measured" ------------------------------------------------------------------


def test_energy_on_the_cpu_is_not_measured() -> None:
    with metered() as m:
        torch.ones(1, 2) @ torch.ones(2, 1)  # 2·1·2·1
    assert m.energy_joules is None and "CPU" in m.energy_reason
    assert m.record() == {"flops": 4, "energy_joules": None, "energy_reason": m.energy_reason}


def test_energy_without_pynvml_is_not_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with metered("cuda:0") as m:
        pass
    assert m.energy_joules is None and m.energy_reason == "not measured: pynvml (nvidia-ml-py) is not installed"


def test_energy_is_nvmls_counter_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in pynvml whose counter reads 1000 mJ, then 4600 mJ: 3.6 J, on the GPU matched by UUID."""
    readings = iter([1000, 1000, 4600])
    seen: list[str] = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: seen.append(uuid) or "handle",
        nvmlDeviceGetTotalEnergyConsumption=lambda handle: next(readings),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid="abc"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    with metered("cuda:0") as m:
        pass
    assert seen == ["GPU-abc"] and m.energy_joules == 3.6 and m.record() == {"flops": 0, "energy_joules": 3.6}
    assert compute_mod.COUNTER.startswith("torch.utils.flop_counter.FlopCounterMode")


# --- the certificate and the Form ---------------------------------------------------------------------


def test_the_golden_certificate_signs_the_audits_compute() -> None:
    c = _golden()["predicate"]["compute"]
    assert c["flops"] == sum(r["flops"] for r in c["replays"]) == 6 * 1_745_676_288
    assert [r["receipt"] for r in c["replays"]] == [f"checkpoint-{s}.json" for s in (250, 500, 750, 1000, 1250, 1500)]
    assert c["energyJoules"] is None and c["energyReason"].startswith("not measured")
    # the first replay metered, the five others carry its count (receipts.flop_reuse)
    assert [r.get("flopsFrom") for r in c["replays"]] == [None] + ["checkpoint-250.json"] * 5
    assert "flopsFrom was not metered" in c["countedBy"]


def test_gpai_form_shows_parameters_flops_and_why_no_energy(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    items = _items(export(_verified(_golden(), key_pair, tmp_path), "eu-ai-act-gpai"))
    size = next(e for e in items["MDF 2 model properties"]["evidence"] if e["field"] == "predicate.parameters")
    assert "1.9*10^5 parameters in total (186384)" in size["summary"]
    assert "7.6*10^4 active per token (75792)" in size["summary"] and "top-2/8" in size["summary"]
    assert items["MDF 2 model properties"]["status"] == "partial"
    assert "not a parameter count" not in json.dumps(items["MDF 2 model properties"])
    flops = next(e for e in items["MDF computational resources"]["evidence"] if e["field"] == "predicate.compute.flops")
    assert flops["summary"].startswith("1.0*10^10 FLOPs (10474057728) used by the audit's 6 replay(s)")
    assert "checkpoint-250.json" in flops["summary"] and "not the training's" in flops["summary"]
    assert "6 replay(s) (1 metered; 5 ran the same products on the same shapes as a metered one" in flops["summary"]
    assert "lower bound" not in flops["summary"]
    energy = items["MDF energy consumption"]
    assert energy["status"] == "not covered" and energy["evidence"] == []
    gap = next(g for g in energy["not_shown"] if "audit's own energy" in g["aspect"])
    assert gap["reason"] == "not measured: the replay ran on the CPU, and NVML measures NVIDIA GPUs only"


def test_an_expert_parallel_replay_counts_rank_0_only(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    stmt = _golden()
    stmt["predicate"]["environment"].update(worldSize=2, backend="gloo", rankDevices=["cpu", "cpu"])
    items = _items(export(_verified(stmt, key_pair, tmp_path), "eu-ai-act-gpai"))
    flops = next(e for e in items["MDF computational resources"]["evidence"] if e["field"] == "predicate.compute.flops")
    assert "(10474057728); rank 0's share of a 2-rank replay: a lower bound" in flops["summary"]


def test_measured_energy_is_given_in_mwh(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    stmt = _golden()
    c = stmt["predicate"]["compute"]
    c["energyJoules"] = 7.2e9
    del c["energyReason"]
    energy = _items(export(_verified(stmt, key_pair, tmp_path), "eu-ai-act-gpai"))["MDF energy consumption"]
    assert energy["status"] == "partial"
    assert energy["evidence"][0]["summary"].startswith("2.0 MWh (7.2e+09 J) used by the GPU during the audit's 6")


def _fields(report: dict[str, Any]) -> set[tuple[str, str]]:
    return {(i["id"], x["aspect"]) for i in report["items"] for x in i["evidence"] + i["not_shown"]}


def _form_fields(report: dict[str, Any]) -> set[str]:
    """The Form's fields (FORM_FIELDS keys) a report's aspects answer."""
    aspects = {(i.id, a.what): a for i in EU_GPAI_MDF.items for a in i.aspects}
    return {f for key in _fields(report) for f in aspects[key].fields}


def test_the_form_flags_as_transcribed() -> None:
    """The flags the sources show (docs/compliance.md, "Two audiences"), and the fallback's."""
    flags = {k: (f.aio, f.ncas, f.dps) for k, f in FORM_FIELDS.items()}
    assert flags["ModelAuthenticity"] == (True, True, False)  # read, not derived
    assert flags["TrainingTime"] == (True, True, False)
    assert flags["TrainingEnergy"] == (True, None, None)  # the transcription shows only its AIO flag
    found_for_all = ("LegalNameProvider", "ModelName", "ReleaseDate", "UnionMarketReleaseDate", "ModelDependencies")
    for k in (*found_for_all, "Architecture", "AcceptableUsePolicy", "DataType"):
        assert flags[k] == (True, True, True), k
    assert all(f.source for f in FORM_FIELDS.values() if (f.aio, f.ncas, f.dps) != (None, None, None))
    assert not any(f.source for f in FORM_FIELDS.values() if (f.aio, f.ncas, f.dps) == (None, None, None))
    # the explicit fallback: authorities always, downstream providers only for Annex XII content
    assert FORM_FIELDS["TrainingCompute"].resolved() == (True, True, False)
    assert FORM_FIELDS["TrainingEnergy"].resolved() == (True, True, False)
    assert FORM_FIELDS["DesignSpecifications"].resolved() == (True, True, False)
    assert FORM_FIELDS["TotalParameters"].resolved() == (True, True, True)
    assert FORM_FIELDS["DataProvenance"].resolved() == (True, True, True)


def test_every_aspect_answers_form_fields_and_takes_their_common_flags() -> None:
    for item in EU_GPAI_MDF.items:
        for a in item.aspects:
            assert a.fields and set(a.fields) <= set(FORM_FIELDS), a.what
            common = {AIO, NCA, DP}
            for f in a.fields:
                common &= set(FORM_FIELDS[f].audiences())
            assert set(a.audiences) == common, a.what
    # every field of the Form is answered by some aspect
    assert {f for i in EU_GPAI_MDF.items for a in i.aspects for f in a.fields} == set(FORM_FIELDS)


def test_the_two_audiences_field_sets(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    stmt = _verified(_golden(), key_pair, tmp_path)
    authority, downstream = (export(stmt, f"eu-ai-act-gpai-{a}") for a in ("authority", "downstream"))

    def flagged(*who: str) -> set[tuple[str, str]]:
        return {
            (i.id, a.what)
            for i in EU_GPAI_MDF.items
            for a in i.aspects
            if all(any(w in FORM_FIELDS[f].audiences() for w in who) for f in a.fields)
        }

    whole = {(i.id, a.what) for i in EU_GPAI_MDF.items for a in i.aspects}
    assert _fields(authority) == flagged(AIO, NCA) == whole  # every field is flagged AIO or NCAs
    assert _fields(downstream) == flagged(DP) < whole
    dps = {k for k, f in FORM_FIELDS.items() if f.resolved()[2]}
    assert _form_fields(downstream) <= dps
    assert _form_fields(authority) == set(FORM_FIELDS)
    # the Form's own flags, not Annex XII's reading of them: no authenticity, time, compute or energy
    gone = {"ModelAuthenticity", "TrainingTime", "TrainingCompute", "ComputeMethodology", "TrainingEnergy"}
    assert not gone & _form_fields(downstream) and gone <= _form_fields(authority)
    assert "MDF 1.3 model authenticity" not in _items(downstream)
    assert "MDF 1.3 model authenticity" in _items(authority)
    assert "MDF computational resources" not in _items(downstream)
    assert "MDF energy consumption" not in _items(downstream)
    assert {"training data: type and modality", "architecture"} <= {a for _, a in _fields(downstream)}
    assert downstream["framework"]["audience"] == "downstream providers"
    assert authority["framework"]["audience"] == "the AI Office and national competent authorities"
    assert authority["certificate"]["sha256"] == downstream["certificate"]["sha256"] == stmt["_sha256"]
    assert "| certificate file | sha256 " + stmt["_sha256"] in to_markdown(downstream)


def test_the_docs_table_is_the_code_table() -> None:
    """docs/compliance.md ("Two audiences") shows FORM_FIELDS, flag for flag, with its sources."""
    text = (ROOT / "docs" / "compliance.md").read_text(encoding="utf-8")
    section = text[text.index("### Two audiences") :]
    section = section[: section.index("\n### ", 4)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells[1:]
    assert set(rows) == set(FORM_FIELDS)

    def shown(flag: bool | None, resolved: bool) -> str:
        return ("yes" if resolved else "no") + ("" if flag is not None else " (fallback)")

    for key, f in FORM_FIELDS.items():
        title, aio, ncas, dps, source = rows[key]
        assert title == f.title, key
        got = [shown(flag, r) for flag, r in zip((f.aio, f.ncas, f.dps), f.resolved(), strict=True)]
        assert [aio, ncas, dps] == got, key
        assert source == (f.source or "not found"), key


def test_both_audiences_are_signed_over_the_same_certificate_digest(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    key, pub = key_pair
    cert = _certificate(_golden(), key, tmp_path / "certificate.json")
    digest = hashlib.sha256(cert.read_bytes()).hexdigest()
    opened, digests, item_sets = [], [], []
    for audience in ("authority", "downstream"):
        env = run_signed_export(cert, pub, f"eu-ai-act-gpai-{audience}", key)
        raw = dumps(env).encode()
        body = json.loads(verify_envelope(raw, load_public_key(pub), tmp_path / "x").body)
        assert body["subject"] == [{"name": "certificate.json", "digest": {"sha256": digest}}]
        assert body["predicateType"] == EXPORT_PREDICATE
        assert body["predicate"]["certificate"]["sha256"] == digest
        opened.append(body["predicate"]["framework"]["audience"])
        digests.append(body["predicate"]["certificate"]["sha256"])
        item_sets.append(json.dumps(sorted(i["id"] for i in body["predicate"]["items"])))
        tampered = json.loads(raw)
        tampered["payload"] = tampered["payload"][:-8] + (
            "A" * 8 if not tampered["payload"].endswith("A" * 8) else "B" * 8
        )
        with pytest.raises(SignatureInvalid):
            verify_envelope(dumps(tampered).encode(), load_public_key(pub), tmp_path / "x")
    assert opened == ["the AI Office and national competent authorities", "downstream providers"]
    assert digests[0] == digests[1] == digest  # both audiences' signed reports name one certificate
    assert len(set(item_sets)) == 2  # ... over two different reports
    other = generate_key(tmp_path / "other.pem")
    with pytest.raises(SignatureInvalid):
        verify_envelope(
            dumps(run_signed_export(cert, pub, "eu-ai-act-gpai-downstream", other)).encode(),
            load_public_key(pub),
            tmp_path / "x",
        )


def test_export_statement_needs_a_verified_certificate() -> None:
    from moeaudit.errors import InputError

    with pytest.raises(InputError, match="verified"):
        export_statement({}, {"_keyid": "k"}, certificate_name="certificate.json")


def test_cli_sign_writes_the_signed_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from moeaudit.attest.signing import default_key_path
    from moeaudit.cli import cli

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    default_key_path().parent.mkdir(parents=True)
    key = generate_key(default_key_path())
    cert = _certificate(_golden(), key, tmp_path / "certificate.json")
    out = tmp_path / "downstream.md"
    args = ["export", str(cert), "--framework", "eu-ai-act-gpai-downstream", "--out", str(out), "--sign"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    signed = Path(str(out) + ".dsse.json")
    body = json.loads(
        verify_envelope(signed.read_bytes(), load_public_key(Path(str(default_key_path()) + ".pub")), signed).body
    )
    assert body["predicate"]["framework"]["key"] == "eu-ai-act-gpai-downstream"
    assert "downstream providers" in out.read_text()


# --- ISO/IEC 42001 Annex A ----------------------------------------------------------------------------


def test_iso_42001_controls_cite_the_certificate_or_say_not_shown(key_pair: tuple[Any, Path], tmp_path: Path) -> None:
    items = _items(export(_verified(_golden(), key_pair, tmp_path), "iso-42001"))
    assert list(items) == [
        "A.6.2.4 verification and validation",
        "A.6.2.6 operation and monitoring",
        "A.6.2.7 technical documentation",
        "A.6.2.8 recording of event logs",
        "A.7.5 data provenance",
    ]

    def cited(item: str) -> set[str]:
        return {e["field"] for e in items[item]["evidence"]}

    assert "predicate.policy" in cited("A.6.2.4 verification and validation")
    pre = next(g for g in items["A.6.2.4 verification and validation"]["not_shown"] if "preregistration" in g["aspect"])
    assert pre["reason"].startswith("no preregistration")
    assert {"predicate.envelope", "predicate.inputs.metrics, predicate.inputs.probe"} <= cited(
        "A.6.2.6 operation and monitoring"
    )
    assert {
        "predicate.claims, predicate.gates[].claims",
        "predicate.checkpointFiles",
        "predicate.parameters",
    } <= cited("A.6.2.7 technical documentation")
    assert {"DSSE signature, predicate.issuedAt", "predicate.gates[].receipts"} <= cited(
        "A.6.2.8 recording of event logs"
    )
    assert cited("A.7.5 data provenance") == {"predicate.canary"}
    assert all(item["status"] == "partial" for item in items.values())  # none is claimed whole
    # without an envelope or the callback's logs, monitoring says why
    stmt = copy.deepcopy(_golden())
    stmt["predicate"]["inputs"] = {}
    stmt["predicate"]["envelope"] = None
    mon = _items(export(_verified(stmt, key_pair, tmp_path), "iso-42001"))["A.6.2.6 operation and monitoring"]
    reasons = " ".join(g["reason"] for g in mon["not_shown"])
    assert "no training log or canary probe log was bound" in reasons and "not evaluated" in reasons
    assert re.search(r"\bA\.7\.5\b", (ROOT / "docs" / "compliance.md").read_text())


def test_every_framework_is_listed_by_the_cli() -> None:
    from moeaudit.cli import cli

    choice = next(p for p in cli.commands["export"].params if p.name == "framework")
    assert set(choice.type.choices) == set(FRAMEWORKS)  # type: ignore[attr-defined]


def test_iso_42001_preregistration_is_evidence_only_when_matched_and_before() -> None:
    """A.6.2.4's "criteria fixed before the evidence" cites the signed preregistration record as
    certify judged it: absent, a mismatch and a preregistration after the first checkpoint are
    not shown (with the signed summary), only matched-and-before is evidence."""
    from moeaudit.report.evidence import preregistration

    def rec(status: str, ordering: str, summary: str) -> dict[str, Any]:
        return {"predicate": {"preregistration": {"status": status, "ordering": ordering, "summary": summary}}}

    absent = preregistration(rec("absent", "unknown", "not preregistered (none given)"))
    assert (absent.shown, absent.summary) == (False, "no preregistration: not preregistered (none given)")
    mismatch = preregistration(rec("mismatch", "before", "does NOT match: policy"))
    assert (mismatch.shown, mismatch.summary) == (False, "does NOT match: policy")
    after = preregistration(rec("matched", "after", "preregistered T, AFTER the first audited checkpoint"))
    assert not after.shown and "AFTER" in after.summary
    before = preregistration(rec("matched", "before", "preregistered T, before the first audited checkpoint"))
    assert (before.shown, before.summary) == (True, "preregistered T, before the first audited checkpoint")
    assert not preregistration({"predicate": {}}).shown
