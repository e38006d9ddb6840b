"""The exit-code matrix (README.md, "Exit codes"), pinned on the generated bad-input corpus.

For each corpus item: the command that reads it, its exact exit code (0 only warned about,
1 signature invalid, 2 usage, 4 input error, 130 Ctrl-C), exactly one ``moeaudit: error:``
line on stderr naming the file and what is wrong, no traceback, and no output file left
behind when one was requested. The corpus comes from ``make_bad_inputs.build`` into a temp
directory; one tiny checkpoint is reused throughout. Only the NaN/Inf and run-directory items
replay it (and the link / pipe items under ``receipts``, which hashes the checkpoint only
after its replay), always with a policy that skips the window bootstrap.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import make_bad_inputs
import pytest
from click.testing import CliRunner

from moeaudit.cli import cli


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_bad_inputs.build(tmp_path_factory.mktemp("corpus"))


def run(*args: str | Path) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def one_error(stderr: str) -> str:
    """The single ``moeaudit: error:`` line; nothing else may look like an error."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0], lines[0]
    return lines[0]


def no_error(stderr: str) -> None:
    assert "Traceback" not in stderr and "moeaudit: error:" not in stderr, stderr


def _no_constant(token: str) -> Any:
    raise AssertionError(f"{token} reached the JSON output")


def strict_json(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN / Infinity (README.md, "Schemas": never in an output)."""
    return json.loads(text, parse_constant=_no_constant)


FAST = ["--canary", "{good_canary_safetensors}", "--policy", "{good_fast_toml}"]


def replaying(corpus: dict[str, Path], *argv: str | Path) -> list[str | Path]:
    """A command that replays: the good canary, and a policy without the window bootstrap."""
    return [
        *argv,
        "--canary",
        corpus["good_canary_safetensors"],
        "--policy",
        corpus["good_fast_toml"],
    ]


def certify(corpus: dict[str, Path], run_dir: Path, out: Path) -> list[str | Path]:
    key = ["--key", corpus["good_key_pem"], "--out", out, "--no-cache"]
    return [*replaying(corpus, "certify", run_dir), *key]


def check_matrix(corpus: dict[str, Path], out_dir: Path, argv: list[str], code: int, needles: list[str]) -> str:
    """Run ``argv`` (``{name}`` = a corpus path, ``{out}`` = an output path) and check the row."""
    paths = {k: str(v) for k, v in corpus.items()} | {"out": str(out_dir / "out.json")}
    got, _, stderr = run(*[a.format(**paths) for a in argv])
    line = one_error(stderr)
    assert got == code, (got, line)
    for needle in needles:
        assert needle.format(**paths) in line, (needle, line)
    assert list(out_dir.iterdir()) == [], "an output (or a temp file) was left behind"
    return line


# ----- checkpoints: inspect, and receipts --json (nothing written) -------------------------------

ST = "{%s}/model.safetensors"
CHECKPOINTS = [  # corpus item, what the one line must say (after the file it names)
    ("truncated_empty", [ST, "file is 0 bytes, too short for a safetensors header", "truncated"]),
    ("truncated_in_length", [ST, "file is 5 bytes, too short", "truncated"]),
    ("truncated_in_header", [ST, "header length", "runs past the end of the"]),
    ("truncated_at_data", [ST, "past the 0-byte data section", "truncated"]),
    ("truncated_in_data", [ST, "data_offsets end", "data section", "truncated"]),
    ("truncated_last_byte", [ST, "tensor 'model.norm.weight': data_offsets end", "truncated"]),
    ("header_too_long", [ST, "header length", "runs past the end", "not a safetensors file"]),
    ("header_not_json", [ST, "header is not valid JSON"]),
    (
        "offsets_overlap",
        [ST, "'model.layers.0.block_sparse_moe.gate.weight' overlap in the data section"],
    ),
    (
        "offsets_past_end",
        [ST, "tensor 'model.layers.0.block_sparse_moe.gate.weight': data_offsets end", "past the"],
    ),
    (
        "dtype_not_float",
        [ST, "'model.layers.0.block_sparse_moe.gate.weight' has non-float dtype I32"],
    ),
    ("dtype_size_mismatch", [ST, "256 bytes on disk but shape [4, 16] F16 needs 128"]),
    (
        "shape_contradicts_config",
        [ST, "gate.weight' has shape [16, 4] but config.json implies [4, 16]"],
    ),
    (
        "config_contradicts_shapes",
        [ST, "'model.embed_tokens.weight' has shape [32, 16] but config.json implies [40, 16]"],
    ),
    (
        "missing_expert",
        [
            "{%s}: missing tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'",
            "incomplete",
        ],
    ),
    (
        "missing_shard",
        ["{%s}/model.safetensors.index.json: index names shard 'model-00002-of-00002.safetensors', which is missing"],
    ),
    ("symlink_loop_files", ["{%s}/extra/a.safetensors: symbolic links are not followed"]),
    ("symlink_loop_dir", ["{%s}/loop: symbolic links are not followed"]),
    ("named_pipe", ["{%s}/train.log: not a regular file"]),
    ("pickle_only", ["{%s}: no safetensors weights", "pickled weights are never loaded"]),
    # inputs that two readers would read differently, and sizes that crash later
    (
        "ambiguous_weights",
        [
            "{%s}: both model.safetensors and model.safetensors.index.json",
            "ambiguous",
            "transformers would load model.safetensors",
        ],
    ),
    (
        "header_duplicate_key",
        [ST, "header repeats the key 'model.layers.0.block_sparse_moe.gate.weight'"],
    ),
    ("config_duplicate_key", ["{%s}/config.json: repeats the key 'vocab_size'"]),
    ("config_no_layers", ["{%s}/config.json: num_hidden_layers must be ≥ 1, got 0"]),
    ("config_huge", ["{%s}/config.json: 17825792 bytes, over the 16777216-byte limit for this file"]),
    ("index_huge", ["{%s}/model.safetensors.index.json: 68157440 bytes, over the 67108864-byte limit"]),
    (
        "config_odd_head_dim",
        ["{%s}/config.json: the attention head size must be even and ≥ 2", "head_dim 3"],
    ),
    # docs/decisions.md, "Extra tensors": a tensor the replay would not read is refused by name, never warned about and
    # dropped
    (
        "extra_tensors",
        [
            "{%s}: 2 tensor(s) that moeaudit's mixtral replay does not use: "
            "model.layers.0.block_sparse_moe.experts.4.w1.weight, optimizer.step",
            "moeaudit does not replay them yet",
        ],
    ),
]


@pytest.mark.parametrize("item, needles", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_bad_checkpoint_inspect(corpus: dict[str, Path], tmp_path: Path, item: str, needles: list[str]) -> None:
    needles = [n % f"ckpt_{item}" if "%s" in n else n for n in needles]
    check_matrix(corpus, tmp_path, ["inspect", f"{{ckpt_{item}}}"], 4, needles)


@pytest.mark.parametrize("item, needles", CHECKPOINTS, ids=[c[0] for c in CHECKPOINTS])
def test_bad_checkpoint_receipts_writes_nothing(
    corpus: dict[str, Path], tmp_path: Path, item: str, needles: list[str]
) -> None:
    needles = [n % f"ckpt_{item}" if "%s" in n else n for n in needles]
    argv = ["receipts", f"{{ckpt_{item}}}", *FAST, "--json", "{out}"]
    check_matrix(corpus, tmp_path, argv, 4, needles)


def test_a_pickle_is_never_unpickled(corpus: dict[str, Path]) -> None:
    """The pickle-only checkpoint holds a payload that writes PWNED when unpickled."""
    for argv in (
        ["inspect", corpus["ckpt_pickle_only"]],
        replaying(corpus, "receipts", corpus["ckpt_pickle_only"]),
    ):
        assert run(*argv)[0] == 4
    assert not (corpus["ckpt_pickle_only"].parent / "PWNED").exists()


def test_good_inputs_pass(corpus: dict[str, Path]) -> None:
    """The matrix below means something only if the undamaged corpus is accepted."""
    assert run("inspect", corpus["good_ckpt"])[0] == 0
    assert run("canary", "show", corpus["good_canary_safetensors"])[0] == 0
    assert run("verify", corpus["good_certificate_json"], "--pubkey", corpus["good_key_pub"])[0] == 0
    # ran: compliant, not, or a gated rule not evaluable
    assert run("envelope", corpus["good_metrics_jsonl"])[0] in (0, 1, 3)


# ----- NaN / Inf in weights ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "item, names",
    [
        ("nonfinite_weights", ["layer 1 expert 2 w1", "lm_head"]),
        ("nonfinite_router", ["layer 0 router"]),
    ],
)
def test_nonfinite_weights_are_reported_not_crashed_on(
    corpus: dict[str, Path], tmp_path: Path, item: str, names: list[str]
) -> None:
    out = tmp_path / "receipts.json"
    code, _, stderr = run(*replaying(corpus, "receipts", corpus[f"ckpt_{item}"]), "--json", out)
    no_error(stderr)
    assert code == 0
    doc = strict_json(out.read_text())  # no NaN / Infinity token anywhere
    assert doc["nonfinite_weights"] == names
    assert doc["nll"] is None and any(f["path"] == "nll" for f in doc["nonfinite"])


def test_nonfinite_weights_warn_in_one_line(corpus: dict[str, Path], tmp_path: Path) -> None:
    """One NaN weight spoils ~30 receipt values; that used to print one
    warning per value. Now one line names the weights and counts the nulled values."""
    out = tmp_path / "receipts.json"
    args = replaying(corpus, "receipts", corpus["ckpt_nonfinite_weights"])
    code, _, stderr = run(*args, "--json", out)
    assert code == 0
    nulled = len(strict_json(out.read_text())["nonfinite"])
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: NaN/Inf in weights layer 1 expert 2 w1, lm_head; {nulled} receipt values "
        "became null (nll, nll_by_domain.code, nll_by_domain.prose, …; all listed under "
        '"nonfinite" in the JSON)'
    ]
    assert nulled > 20


def test_nonfinite_weights_hold_the_gate(corpus: dict[str, Path]) -> None:
    code, stdout, stderr = run(*replaying(corpus, "gate", corpus["good_ckpt"], corpus["ckpt_nonfinite_weights"]))
    no_error(stderr)
    assert code == 1 and "HOLD" in stdout
    expected = "finite: NaN/Inf found: nonfinite_weights: weight layer 1 expert 2 w1; nonfinite_weights: weight lm_head"
    assert expected in stdout.replace("\n", "")


def test_nan_router_holds_the_gate(corpus: dict[str, Path]) -> None:
    code, stdout, stderr = run(*replaying(corpus, "gate", corpus["good_ckpt"], corpus["ckpt_nonfinite_router"]))
    no_error(stderr)
    assert code == 1 and "finite: NaN/Inf found: nonfinite_router: weight layer 0 router" in stdout.replace("\n", "")


def _signed_statement(cert: Path) -> dict[str, Any]:
    return strict_json(base64.b64decode(json.loads(cert.read_text())["payload"]))


def test_nonfinite_weights_fail_the_certificate(corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cert"
    code, _, stderr = run(*certify(corpus, corpus["run_nonfinite"], out))
    no_error(stderr)
    assert code == 0  # a certificate was written; the verdict is in it
    assert run("verify", out / "certificate.json", "--pubkey", corpus["good_key_pub"])[0] == 0
    pred = _signed_statement(out / "certificate.json")["predicate"]
    assert pred["verdict"] == "FAIL"
    finite = next(c for c in pred["checks"] if c["name"] == "finite")
    assert finite["status"] == "FAIL" and "weight layer 1 expert 2 w1" in finite["reason"]
    for receipt in (out / "receipts").iterdir():
        strict_json(receipt.read_text())


# ----- a run directory with a checkpoint still being written -------------------------------------


def test_checkpoint_being_written_is_skipped_with_a_warning(corpus: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cert"
    code, _, stderr = run(*certify(corpus, corpus["run_writing"], out))
    no_error(stderr)
    assert code == 0
    warnings = " ".join(stderr.split())  # rich wraps long warnings at 140 columns
    assert "warning: skipped checkpoint-300: " in warnings and "not a directory" in warnings
    assert "warning: skipped checkpoint-500: " in warnings and "truncated" in warnings
    run_info = _signed_statement(out / "certificate.json")["predicate"]["run"]
    assert run_info["checkpoints"] == [100] and run_info["skipped"] == [
        "checkpoint-300",
        "checkpoint-500",
    ]


@pytest.mark.parametrize(
    "item, needles",
    [
        (
            "run_duplicate_step",
            [
                "{run_duplicate_step}: checkpoint-0100 and checkpoint-100 are both step 100",
                "one checkpoint directory per step",
            ],
        ),
        (
            "run_non_ascii_step",
            [
                "{run_non_ascii_step}/checkpoint-\u0663\u0660\u0660: step "
                "'\u0663\u0660\u0660' is not written in ASCII digits"
            ],
        ),
    ],
)
def test_ambiguous_steps_are_refused(corpus: dict[str, Path], tmp_path: Path, item: str, needles: list[str]) -> None:
    """Two directories for one step, or a step int() reads from non-ASCII
    digits, would give one checkpoint's receipts another's name; certify refuses the run."""
    argv = [*certify(corpus, Path(f"{{{item}}}"), tmp_path / "cert")]
    check_matrix(corpus, tmp_path, [str(a) for a in argv], 4, needles)


def test_envelope_on_a_run_warns_about_the_partial_checkpoint(corpus: dict[str, Path]) -> None:
    code, _, stderr = run("envelope", corpus["run_writing"])
    no_error(stderr)
    assert code in (0, 1, 3) and "checkpoint-500" in stderr


# ----- canaries --------------------------------------------------------------------------------

CANARIES = [  # corpus item, command, what the one line must say
    ("canary_empty", "build", ["{canary_empty}: no windows"]),
    ("canary_blank_lines", "build", ["{canary_blank_lines}: no windows"]),
    (
        "canary_unequal_windows",
        "build",
        ["{canary_unequal_windows}: line 3: window has 5 tokens but the window on line 1 has 8"],
    ),
    ("canary_out_of_range_id", "build", ["{canary_out_of_range_id}: line 2: token 1 is -3"]),
    ("canary_not_json", "build", ["{canary_not_json}: line 2: not valid JSON"]),
    ("canary_empty_file", "show", ["{canary_empty_file}: the canary is empty (0 windows)"]),
    (
        "canary_wrong_digest_file",
        "show",
        ["{canary_wrong_digest_file}: digest mismatch", "modified"],
    ),
    ("canary_truncated_file", "show", ["{canary_truncated_file}: ", "truncated"]),
    (
        "canary_out_of_vocabulary_file",
        "receipts",
        [
            "{good_ckpt}: canary {canary_out_of_vocabulary_file} window 1, position 5 has "
            "token id 39, outside the model vocabulary of size 32"
        ],
    ),
]
CANARY_ARGV = {
    "build": ["canary", "build", "--tokens", "{%s}", "--out", "{out}"],
    "show": ["canary", "show", "{%s}"],
    "receipts": ["receipts", "{good_ckpt}", "--canary", "{%s}", "--json", "{out}"],
}


@pytest.mark.parametrize("item, command, needles", CANARIES, ids=[c[0] for c in CANARIES])
def test_bad_canary(corpus: dict[str, Path], tmp_path: Path, item: str, command: str, needles: list[str]) -> None:
    argv = [a % item if "%s" in a else a for a in CANARY_ARGV[command]]
    check_matrix(corpus, tmp_path, argv, 4, needles)


# ----- metrics.jsonl ---------------------------------------------------------------------------

METRICS = [
    ("not_json", "{%s}:3: line is not valid JSON"),
    ("nan_literal", "{%s}:3: line is not valid JSON (NaN is not JSON"),
    ("not_object", "{%s}:3: line is not a JSON object"),
    ("step_missing", "{%s}:3: line has no 'step'"),
    ("step_repeated", "{%s}:4: step 30 is duplicate"),
    ("negative_norm", "{%s}:3: expert_grad_norms['0'][0] = -"),
    ("expert_count_changes", "{%s}:3: layer '0' logs 5 experts here but 4 at line 1"),
    ("deep_nesting", "{%s}:3: line is not valid JSON (maximum recursion depth exceeded"),
    ("empty", "{%s}: metrics log has no logged steps"),
]


@pytest.mark.parametrize("item, needle", METRICS, ids=[m[0] for m in METRICS])
def test_bad_metrics(corpus: dict[str, Path], tmp_path: Path, item: str, needle: str) -> None:
    name = f"metrics_{item}"
    check_matrix(corpus, tmp_path, ["envelope", f"{{{name}}}", "--json", "{out}"], 4, [needle % name])


# ----- policies ----------------------------------------------------------------------------------

POLICIES = [
    ("unknown_key", "unknown key(s) in [envelope]: 'dleta'"),
    ("unknown_section", "unknown policy section(s): 'gate'"),
    ("policy_table", "unknown policy section(s): 'policy'"),
    ("wrong_type", "envelope.delta must be a finite number, got '0.05'"),
    ("int_wanted", "envelope.window must be an integer, got 10.5"),
    ("section_not_table", "[receipts] must be a table"),
    ("out_of_range", "envelope.delta must be in (0, 1)"),
    ("negative_bootstrap", "receipts.bootstrap must be ≥ 0"),
    ("huge_bootstrap", "receipts.bootstrap must be ≤ 100000"),
    ("nan_value", "margins.beta_h must be a finite number, got nan"),
    ("never_fires", "envelope.alert_a / alert_b: the alert rule can never fire"),
    ("not_toml", "policy is not valid TOML"),
]


@pytest.mark.parametrize("item, needle", POLICIES, ids=[p[0] for p in POLICIES])
def test_bad_policy(corpus: dict[str, Path], tmp_path: Path, item: str, needle: str) -> None:
    name = f"policy_{item}"
    argv = ["envelope", "{good_metrics_jsonl}", "--policy", f"{{{name}}}", "--json", "{out}"]
    check_matrix(corpus, tmp_path, argv, 4, [f"{{{name}}}: {needle}"])


# ----- certificates and keys -------------------------------------------------------------------

CERTIFICATES = [  # certificate, public key, exit code, what the one line must say
    (
        "cert_flipped_payload",
        "good_key_pub",
        1,
        "{cert_flipped_payload}: signature does not verify",
    ),
    (
        "cert_flipped_signature",
        "good_key_pub",
        1,
        "{cert_flipped_signature}: signature does not verify",
    ),
    ("cert_wrong_keyid", "good_key_pub", 1, "{cert_wrong_keyid}: signed by key "),
    (
        "cert_swapped_payload_type",
        "good_key_pub",
        1,
        "{cert_swapped_payload_type}: payloadType is 'application/json'",
    ),
    (
        "cert_two_signatures",
        "good_key_pub",
        1,
        "{cert_two_signatures}: expected exactly one signature, found 2",
    ),
    # not JSON any more: not a certificate, an input error (docs/decisions.md, "A file that is not a certificate"), not
    # an invalid signature
    ("cert_truncated", "good_key_pub", 4, "{cert_truncated}: not a certificate (not JSON"),
    (
        "cert_duplicate_key",
        "good_key_pub",
        1,
        "{cert_duplicate_key}: not a DSSE envelope (duplicate key 'payloadType')",
    ),
    (
        "cert_payload_duplicate_key",
        "good_key_pub",
        4,
        "{cert_payload_duplicate_key}: signed payload names a key twice (duplicate key 'verdict')",
    ),
    ("good_certificate_json", "pubkey_garbage", 4, "{pubkey_garbage}: not a PEM public key"),
    ("good_certificate_json", "pubkey_wrong", 1, "{good_certificate_json}: signed by key "),
]


@pytest.mark.parametrize("cert, pub, code, needle", CERTIFICATES, ids=[f"{c[0]}-{c[1]}" for c in CERTIFICATES])
def test_bad_certificate(corpus: dict[str, Path], tmp_path: Path, cert: str, pub: str, code: int, needle: str) -> None:
    check_matrix(corpus, tmp_path, ["verify", f"{{{cert}}}", "--pubkey", f"{{{pub}}}"], code, [needle])


# ----- output targets -------------------------------------------------------------------------


def test_gate_junit_follows_the_overwrite_rule(corpus: dict[str, Path], tmp_path: Path) -> None:
    junit = tmp_path / "gate.xml"
    junit.write_text("the previous report\n")
    copy = tmp_path / "copy"  # the same bytes at another path: a promotion gate judges (one path twice is refused)
    shutil.copytree(corpus["good_ckpt"], copy)
    argv = replaying(corpus, "gate", corpus["good_ckpt"], copy)
    code, stdout, stderr = run(*argv, "--junit", junit)
    assert code == 4 and stdout == ""  # refused before any replay
    assert one_error(stderr) == (f"moeaudit: error: {junit}: output exists — pass --force to overwrite it")
    assert junit.read_text() == "the previous report\n"
    code, _, stderr = run(*argv, "--junit", junit, "--force")
    no_error(stderr)
    assert code in (0, 1, 3) and "<testcase" in junit.read_text()


# ----- verify --recheck -----------------------------------------------------------------------


def test_recheck_works_from_another_directory(
    corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """certify records the run's absolute path, so a relative RUN_DIR still rechecks later."""
    monkeypatch.chdir(corpus["run_writing"].parent)
    out = tmp_path / "cert"
    code, _, stderr = run(*certify(corpus, Path("writing"), out))
    no_error(stderr)
    assert code == 0
    run_info = _signed_statement(out / "certificate.json")["predicate"]["run"]
    assert run_info["path"] == str(corpus["run_writing"].resolve())
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run("verify", out / "certificate.json", "--pubkey", corpus["good_key_pub"], "--recheck")
    no_error(stderr)
    assert code == 0 and "recheck: all 1 checkpoint digests match" in stdout


def _signed_for_run(corpus: dict[str, Path], run_path: Path, out: Path) -> Path:
    from moeaudit.attest.certificate import sign_statement, statement
    from moeaudit.attest.signing import load_private_key

    predicate = {"verdict": "PASS", "gates": [], "run": {"name": "run", "path": str(run_path)}}
    stmt = statement([{"name": "checkpoint-100", "digest": {"sha256": "ab" * 32}}], predicate)
    out.write_text(json.dumps(sign_statement(stmt, load_private_key(corpus["good_key_pem"])[0])))
    return out


def test_recheck_of_a_directory_without_the_run_is_an_input_error(corpus: dict[str, Path], tmp_path: Path) -> None:
    """A directory holding none of the certified checkpoints (and logs) is not the run: exit 4.
    One certified checkpoint missing from the run is a finding instead (test_recheck_inputs.py)."""
    (tmp_path / "run").mkdir()  # the run directory is there, the certified checkpoint is not
    cert = _signed_for_run(corpus, tmp_path / "run", tmp_path / "c.json")
    code, _, stderr = run("verify", cert, "--pubkey", corpus["good_key_pub"], "--recheck")
    assert code == 4
    assert one_error(stderr) == (
        f"moeaudit: error: {tmp_path / 'run'}: not the certified run (the path the certificate records): "
        "it holds none of the certified checkpoints and logs (checkpoint-100) — pass --run-dir where the run is now"
    )
    cert = _signed_for_run(corpus, tmp_path / "moved", tmp_path / "c2.json")
    code, _, stderr = run("verify", cert, "--pubkey", corpus["good_key_pub"], "--recheck")
    assert code == 4 and (
        f"{tmp_path / 'moved'}: run directory not found (the path the certificate records)" in one_error(stderr)
    )


# ----- usage and interruption ------------------------------------------------------------------


def test_usage_error_is_2(corpus: dict[str, Path]) -> None:
    code, _, stderr = run("receipts", corpus["good_ckpt"], "--no-such-option")
    assert code == 2 and "Traceback" not in stderr


def test_ctrl_c_is_130_and_writes_nothing(
    corpus: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moeaudit.receipts.state as state

    def interrupted(*_a: Any, **_k: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(state, "state_receipts", interrupted)
    argv = ["receipts", "{good_ckpt}", "--canary", "{good_canary_safetensors}", "--json", "{out}"]
    check_matrix(corpus, tmp_path, argv, 130, ["interrupted"])
