"""Bounded fuzzing of every reader of untrusted bytes.

The law: whatever the input, the only exceptions that escape are ``MoeauditError`` subclasses
(which the CLI turns into one line and exit code 4, or 1 for a signature). Each target gets
random inputs *and* mutations of a valid input, since a mutation of a good file reaches the
deeper checks that random bytes never get past. Bounded (≤ 100 examples per target, no
deadline, a fixed sequence) so the module stays a few seconds in CI; set
``HYPOTHESIS_MAX_EXAMPLES=5000`` to search longer with fresh random inputs.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import make_bad_inputs as corpus
import pytest
import tomllib
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moeaudit import canary as canary_mod
from moeaudit import metrics, policy
from moeaudit.attest import signing
from moeaudit.attest.certificate import canonical_json, open_certificate
from moeaudit.checkpoint.safetensors import SafetensorsFile
from moeaudit.errors import MoeauditError
from moeaudit.families import spec_from_config

EXAMPLES = int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "75"))
DEEP_SEARCH = "HYPOTHESIS_MAX_EXAMPLES" in os.environ  # then random, not the fixed CI sequence
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not DEEP_SEARCH,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

scalars = st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=15,
)
DEEP = "[" * 5_000 + "]" * 5_000  # json raises RecursionError, not JSONDecodeError
HUGE_INT = "1" * 4_400  # json raises ValueError (int digit limit), not JSONDecodeError


def only_ours(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn``; an error of ours is an accepted outcome, anything else fails the test."""
    try:
        return fn(*args)
    except MoeauditError as exc:
        assert exc.diagnostics() and not {"\n", "\r"} & set(exc.diagnostics())
        return None


@st.composite
def mutated(draw: st.DrawFn, good: bytes) -> bytes:
    """``good`` with a few byte flips, a cut, an insertion or a deletion."""
    blob = bytearray(good)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(len(blob) - 1, 0)))
        if kind == "flip" and blob:
            blob[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and blob:
            blob[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            del blob[i:]
        elif kind == "insert":
            blob[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif blob:
            del blob[i : i + draw(st.integers(1, 16))]
    return bytes(blob)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _write(scratch: Path, name: str, data: bytes | str) -> Path:
    path = scratch / name
    path.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return path


# ----- safetensors headers ---------------------------------------------------------------------

SMALL = corpus.pack(
    {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.ones(4, dtype=torch.int32),
    },
    {"format": "pt"},
)
entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.sampled_from(["F32", "I32", "BF16", "F8_E4M3", "Q4", "", "f32"]) | json_values,
        "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
        "data_offsets": st.lists(st.integers(-8, 2**62), min_size=0, max_size=3) | json_values,
    },
)
headers = st.dictionaries(st.text(max_size=6) | st.just("__metadata__"), entries | json_values, max_size=4)


def _open_and_read(path: Path) -> None:
    sf = SafetensorsFile(path)
    for name in sf.tensors:
        sf.read(name)


@fuzz
@given(blob=st.binary(max_size=256) | mutated(SMALL))
@example(blob=struct.pack("<Q", len(DEEP)) + DEEP.encode())
@example(blob=struct.pack("<Q", len(HUGE_INT)) + HUGE_INT.encode())
@example(blob=struct.pack("<Q", 2**64 - 1))
def test_safetensors_bytes(scratch: Path, blob: bytes) -> None:
    only_ours(_open_and_read, _write(scratch, "x.safetensors", blob))


@fuzz
@given(header=headers, data=st.binary(max_size=64))
@example(header={"a": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}}, data=b"\0" * 8)
@example(header={"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4.0]}}, data=b"\0" * 4)
@example(header={"__metadata__": {"k": 1}}, data=b"")
def test_safetensors_headers(scratch: Path, header: dict[str, Any], data: bytes) -> None:
    text = json.dumps(header).encode("utf-8", "surrogatepass")
    only_ours(_open_and_read, _write(scratch, "h.safetensors", struct.pack("<Q", len(text)) + text + data))


# ----- canaries -------------------------------------------------------------------------------

GOOD_ROWS = corpus.canary_rows()
GOOD_JSONL = corpus.jsonl(GOOD_ROWS)


@pytest.fixture(scope="module")
def good_canary(scratch: Path) -> bytes:
    canary_mod.save(
        canary_mod.build_from_jsonl(_write(scratch, "good.jsonl", GOOD_JSONL)),
        scratch / "good.safetensors",
    )
    return (scratch / "good.safetensors").read_bytes()


@fuzz
@given(data=st.data())
def test_canary_load_mutated(scratch: Path, good_canary: bytes, data: st.DataObject) -> None:
    blob = data.draw(mutated(good_canary) | st.binary(max_size=128))
    only_ours(canary_mod.load, _write(scratch, "c.safetensors", blob))


metas = st.fixed_dictionaries(
    {},
    optional={
        "format": st.just(canary_mod.FORMAT) | st.text(max_size=5),
        "version": st.just(canary_mod.VERSION) | st.text(max_size=3),
        "domains": st.just('["code","prose"]') | json_values.map(json.dumps) | st.text(max_size=10),
        "digest": st.text(max_size=8),
    },
)


@fuzz
@given(
    meta=metas,
    tokens=st.lists(st.lists(st.integers(-3, 40), min_size=0, max_size=4), max_size=3),
    ids=st.lists(st.integers(-2, 3), max_size=4),
    dims=st.sampled_from(["2d", "1d", "3d"]),
)
def test_canary_load_headers(
    scratch: Path, meta: dict[str, str], tokens: list[list[int]], ids: list[int], dims: str
) -> None:
    width = min((len(r) for r in tokens), default=0)
    t = torch.tensor([r[:width] for r in tokens], dtype=torch.int32).reshape(len(tokens), width)
    t = {"2d": t, "1d": t.flatten(), "3d": t.unsqueeze(0)}[dims]
    blob = corpus.pack({"tokens": t, "domain_ids": torch.tensor(ids, dtype=torch.int32)}, meta)
    only_ours(canary_mod.load, _write(scratch, "m.safetensors", blob))


lines = (
    st.fixed_dictionaries(
        {},
        optional={
            "domain": st.sampled_from(["code", "prose", ""]) | json_values,
            "tokens": st.lists(st.integers(-1, 2**32), max_size=4) | json_values,
        },
    ).map(json.dumps)
    | st.text(max_size=30)
    | st.sampled_from(["", "  ", "\r", DEEP, HUGE_INT, '{"domain": "a", "domain": "b", "tokens": [1, 2]}'])
)


@fuzz
@given(text=st.lists(lines, max_size=5).map("\n".join) | mutated(GOOD_JSONL.encode()))
def test_canary_build_from_jsonl(scratch: Path, text: str | bytes) -> None:
    only_ours(canary_mod.build_from_jsonl, _write(scratch, "c.jsonl", text))


# ----- metrics.jsonl --------------------------------------------------------------------------

GOOD_METRICS = "".join(json.dumps(x) + "\n" for x in corpus.metrics_lines(3))
norm_tables = st.dictionaries(
    st.sampled_from(["0", "1", "x"]) | st.text(max_size=3),
    st.lists(st.floats() | st.none() | st.integers(-2, 2**70), max_size=4) | json_values,
    max_size=3,
)
metric_lines = (
    st.fixed_dictionaries(
        {},
        optional={
            "step": st.integers(-1, 2**70) | json_values,
            "loss": st.floats() | st.none() | json_values,
            "expert_grad_norms": norm_tables | json_values,
        },
    ).map(json.dumps)
    | st.text(max_size=30)
    | st.sampled_from([DEEP, HUGE_INT, '{"step": 1, "step": 2}', '{"step": 1, "loss": Infinity}'])
)


@fuzz
@given(
    text=st.lists(metric_lines, max_size=5).map("\n".join)
    | mutated(GOOD_METRICS.encode()).map(lambda b: b.decode("utf-8", "replace"))
)
def test_parse_metrics(text: str) -> None:
    series = only_ours(metrics.parse_metrics, text)
    if series is not None:  # what parsed is usable by the variance code
        for variant in metrics.VARIANTS:
            metrics.variance_series(series.norms, variant)


# ----- DSSE envelopes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def envelope() -> tuple[Any, bytes]:
    key = corpus.signing_key(b"fuzz")
    return key, json.dumps(corpus.certificate(key, "ab" * 32)).encode()


def _verify(raw: bytes, key: Any) -> None:
    verified = signing.verify_envelope(raw, key.public_key(), Path("cert.json"))
    assert verified.body  # only verified bytes come back


@fuzz
@given(data=st.data())
@example(data=None)
def test_verify_envelope(envelope: tuple[Any, bytes], data: st.DataObject | None) -> None:
    key, good = envelope
    if data is None:
        return only_ours(_verify, DEEP.encode(), key)
    kind = data.draw(st.sampled_from(["json", "fields", "bytes"]))
    if kind == "json":
        raw = json.dumps(data.draw(json_values)).encode("utf-8", "surrogatepass")
    elif kind == "fields":
        env = json.loads(good)
        target = data.draw(st.sampled_from(["payload", "payloadType", "signatures", "sig", "keyid"]))
        value = data.draw(json_values | st.text(alphabet="ABCD+/=", max_size=12))
        if target in ("sig", "keyid"):
            env["signatures"][0][target] = value
        else:
            env[target] = value
        raw = json.dumps(env).encode("utf-8", "surrogatepass")
    else:
        raw = data.draw(mutated(good))
    only_ours(_verify, raw, key)


@fuzz
@given(body=st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode("utf-8", "surrogatepass")))
@example(body=b"\xff")
@example(body=b"[1, 2]")
@example(body=canonical_json({"_type": "https://in-toto.io/Statement/v1"}))
def test_open_certificate_signed_garbage(scratch: Path, envelope: tuple[Any, bytes], body: bytes) -> None:
    """A valid signature over a body that is not a statement (only a key holder can make one)."""
    key, _ = envelope
    env = signing.sign_envelope(key, body)
    path = _write(scratch, "signed.json", json.dumps(env))
    only_ours(open_certificate, path, key.public_key())


# ----- policies -------------------------------------------------------------------------------

KNOWN = {name: [f.name for f in cls.__dataclass_fields__.values()] for name, cls in policy.SECTIONS.items()}
sections = st.sampled_from(sorted(KNOWN)).flatmap(
    lambda name: st.tuples(
        st.just(name),
        st.dictionaries(
            st.sampled_from(KNOWN[name]) | st.text(max_size=5),
            scalars | st.lists(scalars, max_size=3) | st.floats(allow_nan=True),
            max_size=4,
        ),
    )
)
policies = st.lists(sections, max_size=4).map(dict) | st.dictionaries(st.text(max_size=6), json_values, max_size=2)
GOOD_POLICY = policy.to_toml(policy.Policy())


@fuzz
@given(data=policies)
@example(data={"envelope": {"delta": 10**400}})
@example(data={"receipts": {"boundary_etas": [float("inf")]}})
@example(data={"receipts": {"boundary_etas": [10**400]}})
@example(data={"receipts": {"seed": 2**64}})
@example(data={"margins": {"protected_layers": [1.0]}})
@example(data={"envelope": {"alert_a": 1e-4, "alert_b": 0.02}})
def test_policy_from_dict(data: dict[str, Any]) -> None:
    got = only_ours(policy.policy_from_dict, data)
    if got is not None:  # what validated round-trips through TOML
        assert policy.policy_from_dict(tomllib.loads(policy.to_toml(got))).digest == got.digest


@fuzz
@given(text=mutated(GOOD_POLICY.encode()).map(lambda b: b.decode("utf-8", "replace")) | st.text(max_size=60))
@example(text="[receipts]\nseed = 99999999999999999999999\n")
@example(text="[envelope]\ndelta = inf\n")
def test_load_policy(scratch: Path, text: str) -> None:
    only_ours(policy.load_policy, _write(scratch, "policy.toml", text))


# ----- config.json (beyond the brief: the other JSON a checkpoint carries) ----------------------

config_fields = st.dictionaries(
    st.sampled_from(
        sorted(corpus.config())
        + [
            "head_dim",
            "rope_scaling",
            "decoder_sparse_step",
            "mlp_only_layers",
            "sliding_window",
            "layer_types",
            "num_experts",
            "moe_intermediate_size",
        ]
    ),
    scalars | json_values,
    max_size=4,
)


@fuzz
@given(changes=config_fields, family=st.sampled_from(["mixtral", "olmoe", "qwen2_moe", "qwen3_moe"]))
@example(changes={"num_attention_heads": 0}, family="mixtral")
@example(changes={"rope_theta": "fast"}, family="mixtral")
@example(changes={"rms_norm_eps": float("nan")}, family="mixtral")
@example(changes={"decoder_sparse_step": "2"}, family="qwen2_moe")
def test_spec_from_config(changes: dict[str, Any], family: str) -> None:
    cfg = {
        **corpus.config(),
        "model_type": family,
        "num_experts": 4,
        "moe_intermediate_size": 8,
        **changes,
    }
    only_ours(spec_from_config, cfg)


def test_the_good_inputs_the_fuzzer_mutates_are_accepted(
    scratch: Path, good_canary: bytes, envelope: tuple[Any, bytes]
) -> None:
    """The harness itself: without a mutation every target accepts its seed input."""
    assert metrics.parse_metrics(GOOD_METRICS).steps == (10, 20, 30)
    assert policy.policy_from_dict(tomllib.loads(GOOD_POLICY)).digest == policy.Policy().digest
    assert canary_mod.load(_write(scratch, "ok.safetensors", good_canary)).num_windows == 4
    assert SafetensorsFile(_write(scratch, "ok2.safetensors", SMALL)).tensors["a"].shape == (2, 3)
    key, raw = envelope
    assert json.loads(signing.verify_envelope(raw, key.public_key(), Path("c")).body)["_type"]
    assert spec_from_config(corpus.config()).num_experts == corpus.EXPERTS
