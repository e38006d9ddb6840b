"""Golden certificate of the healthy sample run. Goldens pin what is deterministic; replayed
floats are compared within a stated tolerance, because float kernels differ between CPUs
(docs/decisions.md, "Goldens pin what is deterministic; replayed floats have stated tolerances").

**Rendering is pinned, byte for byte.** ``golden/healthy.statement.json`` is a statement as
signed: data here, nothing is replayed. certify's writer signs it with the fixed Ed25519 test key
(Ed25519 is deterministic) at its fixed issue time and renders it; the signature and the SHA-256
of certificate.json, certificate.sigstore.json and certificate.html are ``golden/healthy.pins.json``.

**The replay matches the golden statement within tolerance.** Replaying
``sample_checkpoints/healthy`` must give that statement: every discrete field exactly (verdict,
statuses, reasons, claims wording, booleans, integers, steps, digests, key sets, list lengths;
numbers inside text to one unit of their last printed digit) and every float within its
quantity's tolerance, ``|replayed - golden| <= max(rel * |golden|, abs)``:

===============  ===========  ============================================================
quantity         rel / abs    why
===============  ===========  ============================================================
nll              1e-5 / 1e-6  float32 forward, summed in an order set by the SIMD width,
                              GEMM blocking and threads (u = 2^-24 = 6e-8). On one AVX-512
                              CPU, switching kernels (ATEN_CPU_CAPABILITY default / avx2 /
                              avx512, MKL_CBWR=COMPATIBLE, 1 or 2 threads) moves it 1.7e-7
nll change       0 / 4e-5     a difference of two NLLs, or (bootstrap interval) of
                              per-window NLLs <= 2: absolute, 2 x 1e-5 x 2 (measured 1.8e-7)
replayed         1e-5 / 1e-6  C2, state1, drift coordinate / transition / content and their
                              bootstrap intervals: float64 arithmetic on float32 states
                              (measured <= 5e-8 rel)
replayed change  0 / 1e-5     differences of two C2s (C2 <= 0.3): absolute
margin           1e-5 / 1e-5  refinement loads and margins: sums of the above
count            0 / 1e-12    top-k shares (pi, pi_min, domain pi, drift boundary): integer
                              counts over N tokens, exact up to float64 summation order
count statistic  1e-9 / 1e-12 entropy, CV and ratios of those counts (float64 libm ulps)
(anything else)  1e-9 / 1e-12 not replayed: the policy, the envelope and training losses from
                              the logs (float64; numpy/libm SIMD variants differ by ulps)
===============  ===========  ============================================================

``environment.torch`` and ``environment.python`` name the machine, not the replay: not compared.

**Top-k counts** (``golden/healthy.routing.json``, every checkpoint and routed layer) match
exactly unless a token sits at a float tie: its k-th and (k+1)-th router scores closer than
``tie_margin`` = 1e-4 (across those kernel paths the scores differ by up to 3.3e-6, so a margin
by up to 6.7e-6; this run has margins down to 5.4e-6, so a count can move on another CPU).
Where counts moved, the first layer that moved must have moved at most its near-tie tokens
(counted when the golden was made); later layers may follow, the token's state having changed.
Every float and every number in the text of a gate, a margin or the heatmaps that rests on a
checkpoint (or pair) whose routing moved then gets ``TIE_SLACK / N`` (32 / N, N canary tokens)
more per moved assignment, times max(1, |golden|): a token's terms are bounded by 2 (cosines,
shares), ratios divide by pi_min >= 0.13 (x 8) and a bootstrap quantile weights a window about
twice (x 2). With no moved counts — the usual case — nothing is loosened.

After an intended change to receipts, verdict rules or rendering, regenerate with
``MOEAUDIT_UPDATE_GOLDEN=1 python3 -m pytest tests/test_golden_certificate.py`` (the whole
file: the replay test writes the statement and the routing file, the rendering test the pins)
and review the diff.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from moeaudit.attest.certificate import canonical_json, internal
from moeaudit.attest.naming import DATA_MAPS, camel
from moeaudit.attest.signing import load_private_key, load_public_key, verify_envelope
from moeaudit.canary import load
from moeaudit.certify import Audit, audit_run, write_outputs
from moeaudit.policy import load_policy
from moeaudit.run import Run

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
STATEMENT = GOLDEN / "healthy.statement.json"
PINS = GOLDEN / "healthy.pins.json"
ROUTING = GOLDEN / "healthy.routing.json"
KEY = GOLDEN / "test-signing-key.pem"
RUN = "sample_checkpoints/healthy"  # relative: the statement records the paths certify was given
ISSUED_AT = "2026-01-01T00:00:00Z"
UPDATE = bool(os.environ.get("MOEAUDIT_UPDATE_GOLDEN"))

TOLERANCES: dict[str, tuple[float, float]] = {  # quantity: (rel, abs), as in the docstring
    "nll": (1e-5, 1e-6),
    "nll change": (0.0, 4e-5),
    "replayed": (1e-5, 1e-6),
    "replayed change": (0.0, 1e-5),
    "margin": (1e-5, 1e-5),
    "count": (0.0, 1e-12),
    "count statistic": (1e-9, 1e-12),
    "not replayed": (1e-9, 1e-12),
}
QUANTITY = {  # predicate paths in wire names ([] a list's items, * a data map's keys)
    **dict.fromkeys(
        ("gates[].receipts.nll", "gates[].receipts.nllByDomain.*", "gates[].nllChange.from", "gates[].nllChange.to"),
        "nll",
    ),
    **dict.fromkeys(("gates[].nllChange.delta", "gates[].nllChange.ci95[]"), "nll change"),
    **dict.fromkeys(
        (
            "gates[].receipts.perLayer[].c2",
            "gates[].receipts.perLayer[].c2Ci95[]",
            "gates[].receipts.c2Mean",
            "gates[].structural.c2Tolerance.*",
            "gates[].receipts.perLayer[].state1",
            "gates[].receipts.state1Mean",
            *(
                f"gates[].drift.layers[].{name}"
                for name in (
                    "coordinate",
                    "transition",
                    "content",
                    "ci95.coordinate[]",
                    "ci95.transition[]",
                    "ci95.content[]",
                )
            ),
        ),
        "replayed",
    ),
    **dict.fromkeys(("gates[].structural.c2Deltas.*", "gates[].structural.c2MinDelta"), "replayed change"),
    **dict.fromkeys(
        (
            "margins.refinement.exact",
            "margins.refinement.smooth",
            "margins.refinement.ci95[]",
            "margins.refinement.perLayer[].loadExact",
            "margins.refinement.perLayer[].loadSmooth",
            "margins.refinement.perLayer[].loadCi95[]",
            "checks[].value",
            "checks[].ci95[]",
        ),
        "margin",
    ),
    **dict.fromkeys(
        (
            "gates[].receipts.perLayer[].piMin",
            "heatmaps.occupancy.pi[][]",
            "heatmaps.domains.layers.*.*[]",
            "gates[].drift.layers[].boundary",
            "gates[].drift.layers[].ci95.boundary[]",
        ),
        "count",
    ),
    **dict.fromkeys(
        (
            "gates[].receipts.perLayer[].entropyNorm",
            "gates[].receipts.entropyNormMin",
            "gates[].receipts.cvMean",
            "gates[].structural.piMinRatio",
            "gates[].structural.entropyRatio",
        ),
        "count statistic",
    ),
}
MACHINE = {"environment.torch", "environment.python"}
WIRE_DATA_MAPS = {
    ".".join(camel(part.removesuffix("[]")) + "[]" * part.endswith("[]") for part in path.split("."))
    for path in DATA_MAPS
}
TIE_MARGIN = 1e-4
TIE_SLACK = 32.0
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")

needs_samples = pytest.mark.skipif(not (ROOT / RUN).is_dir(), reason="sample runs not built")


@dataclass(frozen=True)
class Certified:
    statement: dict[str, Any]  # as signed (wire names)
    receipts: dict[str, dict[str, Any]]
    certificate: bytes
    html: bytes


def _certify(out: Path) -> Certified:
    key, _ = load_private_key(KEY)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        audit = audit_run(
            Path(RUN),
            load(ROOT / "sample_checkpoints/canary.safetensors"),
            load_policy(Path("sample_checkpoints/policy.toml")),
        )
        paths = write_outputs(audit, key, out, issued_at=ISSUED_AT)
    cert = paths["certificate"].read_bytes()
    body = verify_envelope(cert, load_public_key(KEY.with_suffix(".pem.pub")), out / "c.json").body
    return Certified(json.loads(body), audit.receipts, cert, paths["html"].read_bytes())


@pytest.fixture(scope="module")
def certified(tmp_path_factory: pytest.TempPathFactory) -> Certified:
    return _certify(tmp_path_factory.mktemp("golden") / "a")


# --- the replay: the golden statement within tolerance ------------------------------------------


@needs_samples
def test_replay_matches_the_golden_statement(certified: Certified) -> None:
    if UPDATE:
        text = json.dumps(certified.statement, indent=1, sort_keys=True, ensure_ascii=False)
        STATEMENT.write_text(text + "\n", encoding="utf-8")
        ROUTING.write_text(json.dumps(_routing(certified), indent=1) + "\n", encoding="utf-8")
    golden = json.loads(STATEMENT.read_text(encoding="utf-8"))
    routing = json.loads(ROUTING.read_text(encoding="utf-8"))
    got = certified.statement
    assert got["predicate"]["verdict"] == golden["predicate"]["verdict"] == "PASS"
    moved = _moved(certified, got, golden, routing)
    slack = _slack(golden["predicate"], moved, routing["tokens"])
    problems: list[str] = []
    rest = [k for k in set(got) | set(golden) if k != "predicate"]
    _compare({k: got.get(k) for k in rest}, {k: golden.get(k) for k in rest}, "", problems, slack)
    _compare(got["predicate"], golden["predicate"], "", problems, slack)
    assert not problems, f"{len(problems)} differences beyond tolerance:\n" + "\n".join(problems[:30])


@needs_samples
def test_same_inputs_same_bytes(certified: Certified, tmp_path: Path) -> None:
    """On one machine certify is deterministic: the same inputs give the same bytes."""
    again = _certify(tmp_path / "b")
    assert again.certificate == certified.certificate and again.html == certified.html


# --- rendering: pinned bytes on every machine (after the replay test, which updates the statement)


def test_rendering_the_golden_statement_gives_the_pinned_bytes(tmp_path: Path) -> None:
    golden = json.loads(STATEMENT.read_text(encoding="utf-8"))
    key, _ = load_private_key(KEY)
    audit = Audit(run=cast(Run, None), statement=internal(golden))  # the writer never reads run
    paths = write_outputs(audit, key, tmp_path / "out", issued_at=golden["predicate"]["issuedAt"])
    cert = paths["certificate"].read_bytes()
    verified = verify_envelope(cert, load_public_key(KEY.with_suffix(".pem.pub")), tmp_path / "c.json")
    assert verified.body == canonical_json(golden)  # the signed payload is the golden statement
    pins = {
        "signature": json.loads(cert)["signatures"][0]["sig"],
        "certificate_sha256": hashlib.sha256(cert).hexdigest(),
        "bundle_sha256": hashlib.sha256(paths["bundle"].read_bytes()).hexdigest(),
        "html_sha256": hashlib.sha256(paths["html"].read_bytes()).hexdigest(),
    }
    if UPDATE:
        PINS.write_text(json.dumps(pins, indent=1) + "\n", encoding="utf-8")
    assert pins == json.loads(PINS.read_text(encoding="utf-8"))


# --- comparison --------------------------------------------------------------------------------


def _compare(got: Any, want: Any, path: str, problems: list[str], slack: dict[Any, Any], where: str = "") -> None:
    """Append to ``problems`` every difference beyond the tolerance of its quantity. ``path``
    names the quantity (``[]`` for list items, ``*`` for data keys), ``where`` the place."""
    if path in MACHINE:
        return
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            problems.append(f"{where}: keys {sorted(set(got) ^ set(want))} only on one side")
        data = path in WIRE_DATA_MAPS
        for key in sorted(set(got) & set(want)):
            _compare(
                got[key],
                want[key],
                f"{path}.{'*' if data else key}".lstrip("."),
                problems,
                _narrow(slack, key),
                f"{where}.{key}".lstrip("."),
            )
    elif isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            problems.append(f"{where}: {len(got)} items, golden {len(want)}")
        for i, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, f"{path}[]", problems, _narrow(slack, i), f"{where}[{i}]")
    elif isinstance(want, float) and type(got) is float:
        quantity = QUANTITY.get(path, "not replayed")
        rel, abs_ = TOLERANCES[quantity]
        allowed = max(rel * abs(want), abs_) + slack[""] * max(1.0, abs(want))
        if not abs(got - want) <= allowed:
            problems.append(
                f"{where} ({quantity}): {got!r}, golden {want!r}, off by {abs(got - want):.2e} > {allowed:.2e}"
            )
    elif isinstance(want, str) and isinstance(got, str):
        if _text_differs(got, want, slack[""]):
            problems.append(f"{where}: {got!r}\n  golden {want!r}")
    elif type(got) is not type(want) or got != want:
        problems.append(f"{where}: {got!r}, golden {want!r}")


def _text_differs(got: str, want: str, slack: float) -> bool:
    """Same words; each number the same, or (printed with decimals) within one unit of its last
    digit plus the tie slack."""
    if got == want:
        return False
    if NUMBER.split(got) != NUMBER.split(want):
        return True
    for g, w in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True):
        if "." not in w or "." not in g:
            if g != w:
                return True
        elif abs(float(g) - float(w)) > 10.0 ** -len(w.split(".")[1]) * 1.01 + slack * max(1.0, abs(float(w))):
            return True
    return False


# --- top-k counts and float ties ----------------------------------------------------------------


def _counts(receipts: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[int]]]:
    out = {}
    for name, doc in receipts.items():
        if name.startswith("checkpoint-"):
            step = name.removeprefix("checkpoint-").removesuffix(".json")
            out[step] = {str(e["layer"]): e["occupancy"]["counts"] for e in doc["layers"]}
    return out


def _moved(
    certified: Certified, got: dict[str, Any], golden: dict[str, Any], routing: dict[str, Any]
) -> dict[str, int]:
    """Assignments moved per checkpoint (``"step"``) and per pair (``"base-step"``), after
    checking that each divergence starts at a float tie."""
    moved: dict[str, int] = {}
    for step, layers in _counts(certified.receipts).items():
        want = routing["checkpoints"][step]
        per_layer = {
            i: sum(abs(a - b) for a, b in zip(c, want["counts"][i], strict=True)) // 2 for i, c in layers.items()
        }
        first = next((i for i in sorted(per_layer, key=int) if per_layer[i]), None)
        if first is not None:
            assert per_layer[first] <= want["near_ties"][first], (
                f"checkpoint-{step} layer {first}: {per_layer[first]} top-k assignments moved, "
                f"more than its {want['near_ties'][first]} tokens at a float tie"
            )
        moved[step] = sum(per_layer.values())
    n_k = routing["tokens"] * routing["top_k"]
    for g, w in zip(got["predicate"]["gates"], golden["predicate"]["gates"], strict=True):
        if not w.get("drift"):
            continue
        base, step = str(w["drift"]["againstStep"]), str(w["step"])
        for lg, lw in zip(g["drift"]["layers"], w["drift"]["layers"], strict=True):
            n = round(abs(lg["boundary"] - lw["boundary"]) * n_k)
            ties = routing["pairs"][f"{base}-{step}"][str(lw["layer"])]
            assert n <= ties or moved[base] or moved[step], (
                f"pair {base}-{step} layer {lw['layer']}: {n} active-set members moved, more "
                f"than its {ties} tokens at a float tie"
            )
            moved[f"{base}-{step}"] = moved.get(f"{base}-{step}", 0) + n
    return moved


def _slack(predicate: dict[str, Any], moved: dict[str, int], tokens: int) -> dict[Any, Any]:
    """Tie slack as a tree over the predicate (``""``: this node's own, inherited below)."""
    per = TIE_SLACK / tokens

    def of(*keys: Any) -> float:
        return per * sum(moved.get(str(k), 0) for k in keys)

    gates, previous = [], None
    for gate in predicate["gates"]:
        against = (gate.get("drift") or {}).get("againstStep", gate["baseline"])
        gates.append({"": of(gate["step"], previous, gate["baseline"], against, f"{against}-{gate['step']}")})
        previous = gate["step"]
    last = predicate["run"]["checkpoints"][-1]
    ref = (predicate["margins"].get("refinement") or {}).get("againstStep")
    margin = of(last, ref, f"{ref}-{last}")
    checks = [{"": margin if c["name"] == "refinement" else 0.0} for c in predicate["checks"]]
    return {
        "": 0.0,
        "gates": {"": 0.0, **dict(enumerate(gates))},
        "heatmaps": {"": of(last)},
        "margins": {"": margin},
        "checks": {"": 0.0, **dict(enumerate(checks))},
    }


def _narrow(slack: dict[Any, Any], key: Any) -> dict[Any, Any]:
    below = slack.get(key)
    return below if isinstance(below, dict) else {"": slack[""]}


def _routing(certified: Certified) -> dict[str, Any]:
    """The golden routing facts: top-k counts of every checkpoint and layer (from the receipts),
    and how many tokens sit at a float tie in each routing the statement rests on."""
    import torch

    from moeaudit.receipts.boundary import selection_margin
    from moeaudit.receipts.state import run_state
    from moeaudit.replay.model import route_layer
    from moeaudit.run import discover

    canary = load(ROOT / "sample_checkpoints/canary.safetensors")
    policy = load_policy(ROOT / "sample_checkpoints/policy.toml")
    run = discover(ROOT / RUN)
    spec = run.checkpoints[0][1].spec
    states, params = {}, {}
    for step, ckpt in run.checkpoints:
        states[step] = run_state(ckpt, canary, policy, keep_states=True)[1].states
        params[step] = {i: ckpt.layer_weights(i).params for i in spec.routed_layers}

    def near(step: int, layer: int, y: torch.Tensor) -> torch.Tensor:
        margin = selection_margin(route_layer(spec, params[step][layer], y).scores_NE, spec.top_k)
        return margin < TIE_MARGIN

    def anchored(step: int, layer: int, z: torch.Tensor) -> torch.Tensor:  # receipts/drift.py
        p = params[step][layer]
        return p["post_norm"] * z + p.get("post_norm_bias", 0.0)

    counts = _counts(certified.receipts)
    out: dict[str, Any] = {
        "tie_margin": TIE_MARGIN,
        "tokens": canary.num_windows * canary.window_len,
        "top_k": spec.top_k,
        "checkpoints": {},
        "pairs": {},
    }
    for step, layers in states.items():
        out["checkpoints"][str(step)] = {
            "counts": counts[str(step)],
            "near_ties": {str(i): int(near(step, i, s.y_NH).sum()) for i, s in layers.items()},
        }
    for gate in certified.statement["predicate"]["gates"]:
        if gate.get("drift"):
            b, s = gate["drift"]["againstStep"], gate["step"]
            out["pairs"][f"{b}-{s}"] = {
                str(i): int((near(b, i, anchored(b, i, st.z_NH)) | near(s, i, anchored(s, i, st.z_NH))).sum())
                for i, st in states[b].items()
            }
    return out
