"""The audit policy: every constant a verdict depends on, from TOML, validated, digested.

Torch-free (STYLE: policy, verdict and signing take plain data). Unknown keys are errors,
never silently ignored; the built-in default is named as such wherever it is used.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast

import tomllib

from moeaudit.errors import InputError
from moeaudit.limits import MAX_BOOTSTRAP, MAX_POLICY_BYTES, read_regular
from moeaudit.records import InputFile, PolicySettings

BUILTIN = "built-in default"


@dataclass(frozen=True)
class ReceiptSettings:
    """Receipt constants (docs/glossary.md, "Per checkpoint (state receipts)")."""

    seed: int = 0
    flip_sigma: float = 0.01
    boundary_etas: tuple[float, ...] = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
    boundary_layer_eta: float = 0.1  # tokens with m_t < this are "boundary-layer" tokens
    beta_adj: float = 1.0
    bootstrap: int = 1000  # window-bootstrap resamples for ci95 (`003` §5); 0 disables


@dataclass(frozen=True)
class MarginSettings:
    """`003` Eq. 25–32; docs/policy.md, "[margins]"."""

    protected_layers: tuple[int, ...] | None = None  # None: middle third of routed layers
    # `003` uses one β per soft operator; one β for all three makes π̃_tail ≤ 0 for E ≳ 20
    # (smin undershoots min by up to ln(E)/β). β_π = 0: 10·E·ln(E)/k, so the undershoot is at
    # most a tenth of the uniform share k/E.
    beta_pi: float = 0.0  # smin over experts of π̃ (Eq. 24)
    beta_h: float = 50.0  # smin over protected layers of the handoff terms (Eq. 26)
    beta_r: float = 50.0  # smax over protected layers of the refinement loads (Eq. 30)
    lambda1: float = 1.0
    lambda2: float = 1.0
    mu1: float = 1.0
    mu2: float = 1.0
    mu3: float = 1.0
    tau: float = 0.25


@dataclass(frozen=True)
class EnvelopeSettings:
    """`000` Table 6; docs/envelope.md."""

    variant: str = "raw"  # "raw" var_grad or "normalized" var_grad_norm
    source: str = "auto"  # which series is gated: "logs", "replay", "probe", or "auto" (logs when present)
    delta: float = 0.05
    epsilon: float = 1e-5
    window: int = 1000  # τ, compliance window in steps
    sampling_interval: int = 250
    calibrated: bool = False
    provenance: str = "000 Table 6 (illustrative)"
    warmup_steps: int = 0  # samples before this step are warm-up: reported, not checked
    # What calibrated constants apply to ("" = anything, as for the illustrative Table 6 clause):
    # constants fitted on one model in one stage license no claim about another (docs/envelope.md).
    calibrated_stage: str = ""
    calibrated_model: str = ""
    alert_a: float = 1e-4
    # `000` Table 6 has b = 0.02, which can never fire with a = 1e-4 (var < a²/4 = 2.5e-9);
    # a²/400 is 1% of that ceiling (std of the suppressed norms > a/20). docs/envelope.md.
    alert_b: float = 2.5e-11
    alert_n: int = 3
    dead_grad: float = 1e-6
    dead_steps: int = 100
    # The level (starvation) side of `000` §8.1 / Eq. 13: every expert keeps a share of the
    # gradient signal, g_e / mean_e g ≥ starve_share, never below it for more than starve_steps
    # steps. The variance bound alone cannot see starvation of raw norms (they shrink with it).
    starve_share: float = 0.01
    starve_steps: int = 100
    # ... on at least this fraction of the logged samples of some starve_steps window (docs/decisions.md,
    # "Starvation is a fraction of a window": starvation that comes and goes is starvation; 1.0 would be one unbroken
    # stretch).
    starve_fraction: float = 0.5
    calibration_c: float = 0.0  # the c of Eq. 16 the constants were fitted with (0: not fitted)


@dataclass(frozen=True)
class GateSettings:
    """`003` Tables 11, 13; docs/policy.md, "The rules in one place"."""

    # None: not stated — `certify` then takes the run's own stage (events.jsonl) or pretraining,
    # and `gate` treats a promotion as post-training (docs/policy.md, "The rules in one place").
    stage: str | None = None
    escalate_after: int = 4
    # A protected layer's C2 has fallen when it drops by more than the largest of tol_c2,
    # tol_c2_rel × |C2 of the baseline| (scale-free: C2's level depends on the model's width,
    # experts and k) and the canary's own bootstrap noise of the difference.
    # docs/policy.md; `calibrate` fits tol_c2_rel on a healthy run.
    tol_c2: float = 0.02
    tol_c2_rel: float = 0.5
    tol_dead: int = 0
    pi_min_ratio_floor: float = 0.5
    entropy_ratio_floor: float = 0.9
    nll_tol: float = 1e-3  # |ΔNLL| below this is "no change" (and so is a change inside its noise)
    inconclusive_band: float = 0.01  # evidence within this of a threshold is INCONCLUSIVE
    # Absolute health floors, on every checkpoint including baselines (docs/policy.md).
    floor_dead_fraction: float = 0.0  # at most this fraction of a layer's experts dead
    floor_pi_share: float = 0.1  # π_min ≥ this × the uniform share k/E
    floor_entropy_norm: float = 0.6  # normalised load entropy H/ln E
    calibrated: bool = False  # set by `moeaudit calibrate` (which fits tol_c2_rel and the ratio floors)
    provenance: str = "built-in defaults"


@dataclass(frozen=True)
class Policy:
    receipts: ReceiptSettings = field(default_factory=ReceiptSettings)
    margins: MarginSettings = field(default_factory=MarginSettings)
    envelope: EnvelopeSettings = field(default_factory=EnvelopeSettings)
    gates: GateSettings = field(default_factory=GateSettings)
    source: str = BUILTIN
    origin: str = ""  # how it was chosen (--policy, found outside the run, built-in): not hashed
    # (SHA-256, length) of the file bytes these settings were parsed from, and the settings'
    # digest then: a policy changed since (``replace``) no longer claims that file.
    parsed_from: tuple[str, int, str] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> PolicySettings:
        out = asdict(self)
        out.pop("source")
        out.pop("origin")
        out.pop("parsed_from")
        return cast(PolicySettings, json.loads(json.dumps(out)))  # tuples → lists, as written

    @property
    def digest(self) -> str:
        canonical = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def file_input(self) -> InputFile | None:
        """The ``predicate.inputs.policy_file`` entry: the file's SHA-256 and length of the very
        bytes these settings were parsed from (one read, docs/security.md); None when they were
        not parsed from a file, or were changed since."""
        if self.parsed_from is None or self.parsed_from[2] != self.digest:
            return None
        sha, size, _ = self.parsed_from
        return {"path": Path(self.source).name, "sha256": sha, "bytes": size}


SECTIONS = {"receipts": ReceiptSettings, "margins": MarginSettings, "envelope": EnvelopeSettings, "gates": GateSettings}


def load_policy(path: str | Path | None) -> Policy:
    if path is None:
        return Policy()
    path = Path(path)
    raw = read_regular(path, "policy file", MAX_POLICY_BYTES)  # no FIFO, device or directory
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # ValueError: UTF-8, TOML, huge ints
        raise InputError(f"policy is not valid TOML ({exc})", path=path) from exc
    policy = policy_from_dict(data, path)
    return replace(policy, parsed_from=(hashlib.sha256(raw).hexdigest(), len(raw), policy.digest))


def policy_from_dict(data: dict[str, Any], path: str | Path = "<policy>") -> Policy:
    unknown = set(data) - set(SECTIONS)  # a [policy] table too: nothing read from it
    if unknown:
        shown = ", ".join(map(repr, sorted(unknown)))
        raise InputError(
            f"unknown policy section(s): {shown}", path=path, hint=f"known sections: {', '.join(SECTIONS)}"
        )
    parts = {name: _section(cls, data.get(name, {}), name, path) for name, cls in SECTIONS.items()}
    policy = Policy(**parts, source=str(path))
    validate(policy, path)
    return policy


def _section(cls: type, raw: Any, name: str, path: str | Path) -> Any:
    if not isinstance(raw, dict):
        raise InputError(f"[{name}] must be a table", path=path)
    known = {f.name: f for f in fields(cls)}
    if name == "margins" and "beta" in raw:  # a policy from before β was split
        raise InputError(
            "margins.beta was split into beta_pi, beta_h and beta_r (003 uses one β per soft operator)",
            path=path,
            hint="replace `beta = …` by beta_h / beta_r (and beta_pi, 0 = auto)",
        )
    unknown = set(raw) - set(known)
    if unknown:
        shown = ", ".join(map(repr, sorted(unknown)))
        raise InputError(f"unknown key(s) in [{name}]: {shown}", path=path, hint=f"known keys: {', '.join(known)}")
    default = cls()
    values = {}
    for key, value in raw.items():
        values[key] = _coerce(getattr(default, key), value, f"{name}.{key}", path)
    return replace(default, **values)


def _coerce(default: Any, value: Any, where: str, path: str | Path) -> Any:
    def bad(kind: str) -> InputError:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)  # TOML's true, not True
        return InputError(f"{where} must be {kind}, got {shown}", path=path)

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if not isinstance(value, int) or isinstance(value, bool):
            raise bad("an integer")
        if abs(value) > MAX_SETTING_INT:
            raise _overflows(where, value, f"2⁵³ = {MAX_SETTING_INT}", path)
        return value
    if isinstance(default, float):
        if _finite(value) is None:
            raise bad("a finite number")
        if abs(float(value)) > MAX_SETTING:
            raise _overflows(where, value, f"{MAX_SETTING:g}", path)
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if where == "gates.stage":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if isinstance(default, tuple) or default is None:  # lists of numbers / layer indices
        if not isinstance(value, list) or not all(_finite(v) is not None for v in value):
            raise bad("a list of finite numbers")
        if any(abs(v) > MAX_SETTING for v in value):
            raise _overflows(where, max(value, key=abs), f"{MAX_SETTING:g}", path)
        if where.endswith("protected_layers"):
            if not all(isinstance(v, int) for v in value) or not value:
                raise bad("a non-empty list of layer indices")
            return tuple(value)
        return tuple(float(v) for v in value)
    raise bad(type(default).__name__)


# The largest magnitude a policy constant may take. A finite constant can still overflow what it
# enters: ε/δ, ε·Δ over a window, β·x inside a soft minimum, a² of the alert rule. Every constant
# of `000` Table 6 and `003` is within 1e-11..1e3; at most 1e12, a product of two constants and a
# receipt value stays far inside the float range, so a verdict never ends in inf after the
# replays (docs/policy.md, "Ranges").
MAX_SETTING = 1e12
MAX_SETTING_INT = 2**53  # steps, windows and counts: every integer up to it is exact as a float


def _overflows(where: str, value: Any, cap: str, path: str | Path) -> InputError:
    shown = repr(value) if len(repr(value)) <= 24 else f"{str(value)[:8]}… ({len(str(abs(value)))} digits)"
    return InputError(
        f"{where} = {shown} is out of range: a policy constant is at most {cap} in magnitude "
        "(larger ones overflow the checks they enter)",
        path=path,
    )


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, or None (not a number, a bool, NaN, ±Inf, or too large)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:  # an integer beyond the float range
        return None
    return as_float if math.isfinite(as_float) else None


def validate(policy: Policy, path: str | Path = "<policy>") -> None:
    """Range checks; a constant out of range is an input error naming the key."""
    r, m, e, g = policy.receipts, policy.margins, policy.envelope, policy.gates
    checks = [
        (0 <= r.seed < 2**32, "receipts.seed must be in 0..2³²−1"),
        (r.flip_sigma > 0, "receipts.flip_sigma must be > 0"),
        (
            bool(r.boundary_etas) and all(x > 0 for x in r.boundary_etas),
            "receipts.boundary_etas must be a non-empty list of values > 0",
        ),
        (r.boundary_layer_eta > 0 and r.beta_adj > 0, "receipts.boundary_layer_eta and beta_adj must be > 0"),
        (r.bootstrap >= 0, "receipts.bootstrap must be ≥ 0"),
        (
            r.bootstrap <= MAX_BOOTSTRAP,
            f"receipts.bootstrap must be ≤ {MAX_BOOTSTRAP} (1000 is the "
            f"default; {MAX_BOOTSTRAP // 10} resamples are plenty for a 95% interval)",
        ),
        (
            m.beta_pi >= 0 and m.beta_h > 0 and m.beta_r > 0,
            "margins.beta_h and beta_r must be > 0, beta_pi ≥ 0 (0: 10·E·ln(E)/k)",
        ),
        (
            min(m.lambda1, m.lambda2, m.mu1, m.mu2, m.mu3, m.tau) >= 0,
            "margins.lambda1, lambda2, mu1, mu2, mu3 and tau must be ≥ 0",
        ),
        (
            m.protected_layers is None or all(i >= 0 for i in m.protected_layers),
            "margins.protected_layers must be layer indices ≥ 0",
        ),
        (e.variant in ("raw", "normalized"), "envelope.variant must be 'raw' or 'normalized'"),
        (
            e.source in ("auto", "logs", "replay", "probe"),
            "envelope.source must be 'auto', 'logs', 'replay' or 'probe'",
        ),
        (0 < e.delta < 1, "envelope.delta must be in (0, 1)"),
        (e.epsilon >= 0, "envelope.epsilon must be ≥ 0"),
        (e.window > 0 and e.sampling_interval > 0, "envelope.window and sampling_interval must be > 0"),
        (
            e.alert_n >= 1 and e.dead_steps >= 1 and e.starve_steps >= 1,
            "envelope.alert_n, dead_steps and starve_steps must be ≥ 1",
        ),
        (0 <= e.starve_share < 1, "envelope.starve_share must be in [0, 1)"),
        (0 < e.starve_fraction <= 1, "envelope.starve_fraction must be in (0, 1]"),
        (
            e.window >= 3 / e.delta if 0 < e.delta < 1 else True,
            f"envelope.window must be ≥ 3/δ (000 Eq. 17: three time constants), here "
            f"{e.window} < {3 / e.delta if 0 < e.delta < 1 else 0:.0f}",
        ),
        (g.stage in (None, "pretraining", "post-training"), "gates.stage must be 'pretraining' or 'post-training'"),
        (g.escalate_after >= 1, "gates.escalate_after must be ≥ 1"),
        (g.tol_c2 >= 0 and g.tol_dead >= 0, "gates tolerances must be ≥ 0"),
        (
            0 <= g.tol_c2_rel < 1,
            "gates.tol_c2_rel must be in [0, 1): at 1 a protected layer's C2 could fall to 0 and still pass",
        ),
        (
            0 <= g.floor_dead_fraction <= 1 and g.floor_pi_share >= 0 and 0 <= g.floor_entropy_norm <= 1,
            "gates.floor_dead_fraction and floor_entropy_norm must be in [0, 1], floor_pi_share ≥ 0",
        ),
        (
            min(g.pi_min_ratio_floor, g.entropy_ratio_floor, g.nll_tol, g.inconclusive_band) >= 0,
            "gates.pi_min_ratio_floor, entropy_ratio_floor, nll_tol, inconclusive_band must be ≥ 0",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise InputError(message, path=path)
    validate_envelope(policy, path)


def validate_envelope(policy: Policy, path: str | Path = "<policy>") -> None:
    """Envelope rules that can never fire are refused, with the reason (`000` Eq. 21; docs/envelope.md).

    Only what is knowable without the model: the raw-variance ceiling a²/4. The bounds that
    depend on the expert count E are checked when the series is evaluated (envelope.py).
    """
    e = policy.envelope
    checks = [
        (e.alert_b >= 0, "envelope.alert_b must be ≥ 0 (a variance is never negative)"),
        (e.dead_grad > 0, "envelope.dead_grad must be > 0 (norms are ≥ 0; 0 marks no expert dead)"),
    ]
    for ok, message in checks:
        if not ok:
            raise InputError(message, path=path)
    why = alert_rule_problem(e.alert_a, e.alert_b, e.variant)
    if why:
        raise InputError(
            f"envelope.alert_a / alert_b: {why}",
            path=path,
            hint="000 Table 6 / Eq. 21 as written (a = 1e-4, b = 0.02) is such a rule",
        )


def alert_rule_problem(a: float, b: float, variant: str, num_experts: int | None = None) -> str | None:
    """Why ``max_e g_e < a ∧ V > b`` can never hold, or None if it can.

    Norms are ≥ 0, so ``max_e g_e < a`` puts every g_e in [0, a): their population variance is
    below a²·⌊E/2⌋⌈E/2⌉/E² ≤ a²/4 (half the experts at 0, half at a). The scale-free
    ``var/ḡ²`` of E non-negative values is at most E − 1 (one non-zero expert), whatever a is.
    """
    if a <= 0:
        return f"alert_a = {a:g} ≤ 0, but gradient norms are ≥ 0, so max_e g_e < a never holds"
    if variant == "raw":
        if num_experts is None:
            cap, what = a * a / 4, f"a²/4 = {a * a / 4:.6g}"
        else:
            lo, hi = num_experts // 2, (num_experts + 1) // 2
            cap = a * a * lo * hi / num_experts**2
            what = f"a²·⌊E/2⌋⌈E/2⌉/E² = {cap:.6g} for E = {num_experts} experts"
        if b >= cap:
            return (
                f"the alert rule can never fire: max_e g_e < a = {a:g} puts every g_e in "
                f"[0, a), so var_grad < {what}, never > b = {b:g}; choose b < {cap:.6g} "
                f"(e.g. b = a²/400 = {a * a / 400:.6g})"
            )
    elif num_experts is not None and b >= num_experts - 1:
        return (
            f"the alert rule can never fire: var_grad_norm = var/ḡ² of {num_experts} "
            f"non-negative norms is at most E − 1 = {num_experts - 1}, never > b = {b:g}; "
            f"choose b < {num_experts - 1}"
        )
    return None


def protected_layers(policy: Policy, routed: tuple[int, ...] | list[int], where: str = "") -> list[int]:
    """Default: the middle third of the routed layers (at least one); docs/policy.md, "[margins]"."""
    routed = list(routed)
    chosen = policy.margins.protected_layers
    if chosen is None:
        n = len(routed)
        lo, hi = n // 3, n - n // 3
        return routed[lo:hi] or routed[n // 2 : n // 2 + 1]
    missing = [i for i in chosen if i not in routed]
    if missing:
        raise InputError(
            f"protected layers {missing} are not routed layers of {where or 'the model'}",
            hint=f"routed layers: {routed}",
        )
    return list(chosen)


def to_toml(policy: Policy, header: str = "") -> str:
    """The policy as TOML that ``load_policy`` reads back to an equal policy."""
    lines = [f"# {line}" for line in header.splitlines()]
    settings: Mapping[str, object] = policy.to_json()  # section name → its settings
    for name, section in settings.items():
        if not isinstance(section, dict):
            continue  # every section is a table
        lines += ["", f"[{name}]"]
        for key, value in section.items():
            if value is None:
                continue  # absent = the default (e.g. protected_layers = middle third)
            lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
