"""The canary promises (docs/glossary.md, "Canary"): content-addressed digest, strict build and load."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moeaudit.canary import Canary, build_from_jsonl, load, save
from moeaudit.errors import EXIT_INPUT, CanaryError

LINES = [
    {"domain": "code", "tokens": [1, 2, 3, 4]},
    {"domain": "prose", "tokens": [5, 6, 7, 8]},
    {"domain": "code", "tokens": [9, 10, 11, 12]},
]


def write_jsonl(path: Path, lines: list, raw: str | None = None) -> Path:
    path.write_text(raw if raw is not None else "\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def make(tokens: list[list[int]], ids: list[int], domains: tuple[str, ...]) -> Canary:
    return Canary(torch.tensor(tokens, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32), domains)


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    return build_from_jsonl(write_jsonl(tmp_path / "c.jsonl", LINES))


def raw_safetensors(path: Path, header: list[tuple[str, object]], data: bytes) -> None:
    """A safetensors file with the header keys in exactly the given order."""
    text = "{" + ",".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in header) + "}"
    blob = text.encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def raises(match: str, fn, *args) -> CanaryError:
    with pytest.raises(CanaryError) as info:
        fn(*args)
    assert match in str(info.value), str(info.value)
    assert info.value.exit_code == EXIT_INPUT
    assert "\n" not in str(info.value)
    return info.value


# --- building and the in-memory object -------------------------------------------------------


def test_build_numbers_domains_by_first_appearance(canary: Canary) -> None:
    assert canary.domains == ("code", "prose")
    assert canary.domain_ids.tolist() == [0, 1, 0]
    assert canary.tokens.dtype == torch.int32 and canary.tokens.shape == (3, 4)
    assert (canary.num_windows, canary.window_len, canary.num_tokens) == (3, 4, 12)
    assert canary.windows_of("code").tolist() == [0, 2]
    assert canary.windows_of("prose").tolist() == [1]


def test_blank_lines_and_crlf_are_skipped(tmp_path: Path, canary: Canary) -> None:
    raw = "\n\n" + "\r\n  \r\n".join(json.dumps(x) for x in LINES) + "\r\n\n"
    assert build_from_jsonl(write_jsonl(tmp_path / "b.jsonl", [], raw)) == canary


def test_summary(canary: Canary) -> None:
    assert canary.summary() == {
        "format": "moeaudit.canary",
        "version": "1",
        "windows": 3,
        "window_len": 4,
        "tokens": 12,
        "domains": {"code": 2, "prose": 1},
        "digest": canary.digest,
    }


def test_windows_of_unknown_domain(canary: Canary) -> None:
    raises("no domain named 'math'", canary.windows_of, "math")


def test_check_vocab(canary: Canary) -> None:
    canary.check_vocab(13, "ckpt")
    err = raises("window 2, position 3 has token id 12", canary.check_vocab, 12, "ckpt/")
    assert "vocabulary of size 12" in str(err) and str(err).startswith("ckpt/: ")
    err = raises("token id 9", canary.check_vocab, 9, "ckpt/")
    assert "window 2, position 0" in str(err) and "4 such tokens" in str(err)


def test_check_context(canary: Canary) -> None:
    """Windows longer than the model's context are refused; a config that states none, or a
    window exactly as long as it, is not."""
    canary.check_context({"max_position_embeddings": 4}, "ckpt")
    canary.check_context({}, "ckpt")
    canary.check_context({"max_position_embeddings": None}, "ckpt")
    err = raises(
        "windows of 4 tokens, longer than the model's context of 3 positions",
        canary.check_context,
        {"max_position_embeddings": 3},
        "ckpt/",
    )
    assert str(err).startswith("ckpt/: ") and "at most 3 tokens" in str(err)


def test_receipts_refuse_a_canary_longer_than_the_context(tmp_path: Path) -> None:
    """A shipped sample (trained at 128 positions): a canary of 129-token windows exits 4 with one
    line naming both lengths, and writes nothing; 128-token windows replay."""
    from click.testing import CliRunner

    from moeaudit.cli import cli

    run = Path(__file__).resolve().parent.parent / "sample_checkpoints" / "healthy"
    ckpt = sorted(run.glob("checkpoint-*"))[0]
    context = json.loads((ckpt / "config.json").read_text())["max_position_embeddings"]
    for length, code in ((context + 1, EXIT_INPUT), (context, 0)):
        path = tmp_path / f"c{length}.safetensors"
        save(make([[(7 * w + t) % 50 for t in range(length)] for w in range(8)], [0] * 8, ("code",)), path)
        out = tmp_path / f"r{length}.json"
        result = CliRunner().invoke(cli, ["receipts", str(ckpt), "--canary", str(path), "--json", str(out)])
        assert result.exit_code == code, result.output
        if code:
            assert f"windows of {length} tokens, longer than the model's context of {context}" in result.output
            assert not out.exists()


# --- the digest ------------------------------------------------------------------------------


def test_digest_encoding_is_as_documented(canary: Canary) -> None:
    expected = (
        b"moeaudit.canary/v1\n"
        + struct.pack("<QQ", 3, 4)
        + struct.pack("<12i", *range(1, 5), *range(5, 9), *range(9, 13))
        + struct.pack("<3i", 0, 1, 0)
        + b'["code","prose"]'
    )
    assert canary.canonical_bytes() == expected
    assert canary.digest == hashlib.sha256(expected).hexdigest()


def test_digest_keeps_non_ascii_names_as_utf8() -> None:
    c = make([[1, 2]], [0], ("código",))
    assert c.canonical_bytes().endswith('["código"]'.encode())


def test_round_trip(tmp_path: Path, canary: Canary) -> None:
    save(canary, tmp_path / "c.safetensors")
    back = load(tmp_path / "c.safetensors")
    assert back == canary and back.digest == canary.digest
    assert back.summary() == canary.summary()


def test_digest_stable_across_saving_twice(tmp_path: Path, canary: Canary) -> None:
    save(canary, tmp_path / "a.safetensors")
    save(canary, tmp_path / "b.safetensors")
    save(canary, tmp_path / "a.safetensors")  # overwrite in place
    assert load(tmp_path / "a.safetensors").digest == load(tmp_path / "b.safetensors").digest
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_digest_stable_across_repackaging_with_save_file(tmp_path: Path, canary: Canary) -> None:
    path = tmp_path / "spaced.safetensors"
    metadata = {
        "digest": canary.digest,
        "domains": '[ "code" ,\n "prose" ]',
        "version": "1",
        "format": "moeaudit.canary",
    }
    save_file({"tokens": canary.tokens, "domain_ids": canary.domain_ids}, str(path), metadata)
    save(canary, tmp_path / "ours.safetensors")
    assert path.read_bytes() != (tmp_path / "ours.safetensors").read_bytes()
    assert load(path) == canary and load(path).digest == canary.digest


def test_digest_stable_across_hand_written_key_order(tmp_path: Path, canary: Canary) -> None:
    """Metadata keys reversed, tensors in the other order in the data section."""
    tok = canary.tokens.numpy().tobytes()
    ids = canary.domain_ids.numpy().tobytes()
    header = [
        ("tokens", {"dtype": "I32", "shape": [3, 4], "data_offsets": [0, len(tok)]}),
        ("domain_ids", {"dtype": "I32", "shape": [3], "data_offsets": [len(tok), len(tok) + 12]}),
        (
            "__metadata__",
            {
                "digest": canary.digest,
                "domains": '["code", "prose"]',
                "version": "1",
                "format": "moeaudit.canary",
            },
        ),
    ]
    raw_safetensors(tmp_path / "hand.safetensors", header, tok + ids)
    assert load(tmp_path / "hand.safetensors").digest == canary.digest


def test_digest_changes_with_one_token(canary: Canary) -> None:
    tokens = canary.tokens.clone()
    tokens[1, 2] += 1
    assert Canary(tokens, canary.domain_ids, canary.domains).digest != canary.digest


def test_digest_changes_with_a_domain_name(canary: Canary) -> None:
    assert Canary(canary.tokens, canary.domain_ids, ("code", "poetry")).digest != canary.digest


def test_digest_changes_when_names_are_reordered(canary: Canary) -> None:
    # Same windows, same labels as strings, but ids index a permuted list: a different file.
    other = Canary(canary.tokens, 1 - canary.domain_ids, ("prose", "code"))
    assert other.digest != canary.digest


def test_digest_changes_when_two_windows_swap(canary: Canary) -> None:
    order = torch.tensor([1, 0, 2])
    swapped = Canary(canary.tokens[order], canary.domain_ids[order], canary.domains)
    assert swapped.digest != canary.digest
    same_domain = torch.tensor([2, 1, 0])  # windows 0 and 2 share a domain: only tokens move
    assert Canary(canary.tokens[same_domain], canary.domain_ids, canary.domains) != canary
    assert Canary(canary.tokens[same_domain], canary.domain_ids, canary.domains).digest != canary.digest


# --- properties ------------------------------------------------------------------------------


@st.composite
def canaries(draw: st.DrawFn) -> Canary:
    domains = draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=3, unique=True))
    w = draw(st.integers(1, 4))
    t = draw(st.integers(2, 4))
    tok = st.integers(0, 2**31 - 1) | st.integers(0, 3)
    tokens = draw(st.lists(st.lists(tok, min_size=t, max_size=t), min_size=w, max_size=w))
    ids = draw(st.lists(st.integers(0, len(domains) - 1), min_size=w, max_size=w))
    return make(tokens, ids, tuple(domains))


def content(c: Canary) -> tuple:
    return (c.tokens.tolist(), c.domain_ids.tolist(), c.domains)


def decode(blob: bytes) -> tuple:
    """Inverse of the canonical encoding: its existence is the injectivity proof."""
    prefix = b"moeaudit.canary/v1\n"
    assert blob.startswith(prefix)
    w, t = struct.unpack_from("<QQ", blob, len(prefix))
    at = len(prefix) + 16
    flat = list(struct.unpack_from(f"<{w * t}i", blob, at))
    at += 4 * w * t
    ids = list(struct.unpack_from(f"<{w}i", blob, at))
    names = tuple(json.loads(blob[at + 4 * w :].decode("utf-8")))
    return ([flat[i * t : (i + 1) * t] for i in range(w)], ids, names)


@given(canaries())
def test_encoding_decodes_back(c: Canary) -> None:
    assert decode(c.canonical_bytes()) == content(c)


@given(canaries(), canaries())
def test_digest_is_deterministic_and_injective(a: Canary, b: Canary) -> None:
    twin = make(*content(a))
    assert twin.digest == a.digest
    assert (a.digest == b.digest) == (content(a) == content(b))


@given(canaries(), st.data())
def test_any_single_token_change_changes_digest(c: Canary, data: st.DataObject) -> None:
    w = data.draw(st.integers(0, c.num_windows - 1))
    t = data.draw(st.integers(0, c.window_len - 1))
    new = data.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != int(c.tokens[w, t])))
    tokens = c.tokens.clone()
    tokens[w, t] = new
    assert Canary(tokens, c.domain_ids, c.domains).digest != c.digest


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30)
@given(canaries())
def test_save_load_round_trip_property(tmp_path: Path, c: Canary) -> None:
    save(c, tmp_path / "p.safetensors")
    back = load(tmp_path / "p.safetensors")
    assert back == c and back.digest == c.digest


# --- build errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (
            '{"domain": "a", "tokens": [1, 2]}\n{"domain": "a", "tokens": [1, 2',
            "line 2: not valid JSON",
        ),
        ("[1, 2]", "line 1: expected a JSON object, got list"),
        ('{"tokens": [1, 2]}', 'line 1: missing "domain"'),
        ('{"domain": "a"}', 'line 1: missing "tokens"'),
        ('{"domain": 3, "tokens": [1, 2]}', 'line 1: "domain" must be a non-empty string, got 3'),
        ('{"domain": "", "tokens": [1, 2]}', '"domain" must be a non-empty string'),
        (
            '{"domain": "a", "tokens": "1 2"}',
            'line 1: "tokens" must be a list of token ids, got str',
        ),
        ('{"domain": "a", "tokens": [1, 2.5]}', "line 1: token 1 is 2.5, not an integer token id"),
        ('{"domain": "a", "tokens": [1, 2.0]}', "token 1 is 2.0, not an integer"),
        ('{"domain": "a", "tokens": [true, 2]}', "token 0 is True, not an integer"),
        ('{"domain": "a", "tokens": [1, "2"]}', "token 1 is '2', not an integer"),
        ('{"domain": "a", "tokens": [1, -1]}', "line 1: token 1 is -1, outside the token id range"),
        ('{"domain": "a", "tokens": [2147483648, 1]}', "token 0 is 2147483648, outside"),
        (
            '{"domain": "a", "tokens": [7]}',
            "line 1: window has 1 token(s); a window needs at least 2",
        ),
        ('{"domain": "a", "tokens": []}', "window has 0 token(s)"),
        ('{"domain": "a", "domain": "b", "tokens": [1, 2]}', "duplicate key 'domain'"),
        (
            '{"domain": "a", "tokens": [1, 2, 3]}\n\n{"domain": "b", "tokens": [1, 2]}',
            "line 3: window has 2 tokens but the window on line 1 has 3",
        ),
        ("", "no windows: the file has no non-blank lines"),
        ("\n  \n\n", "no windows"),
    ],
)
def test_build_errors(tmp_path: Path, text: str, problem: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [], text)
    err = raises(problem, build_from_jsonl, path)
    assert str(err).startswith(f"{path}: ")


def test_largest_token_id_is_accepted(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "big.jsonl", [{"domain": "a", "tokens": [2**31 - 1, 0]}])
    assert build_from_jsonl(path).tokens[0, 0] == 2**31 - 1


def test_build_missing_file(tmp_path: Path) -> None:
    raises("missing.jsonl: cannot read", build_from_jsonl, tmp_path / "missing.jsonl")


def test_build_directory_is_unreadable(tmp_path: Path) -> None:
    raises("cannot read", build_from_jsonl, tmp_path)


def test_build_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"domain": "a", "tokens": [1, 2]}\n{"domain": "\xe9", "tokens": [1, 2]}\n')
    raises("latin1.jsonl: line 2: not UTF-8", build_from_jsonl, path)


def test_build_lone_surrogate_domain(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "s.jsonl", [], '{"domain": "\\ud800", "tokens": [1, 2]}')
    raises("s.jsonl: line 1: \"domain\" '\\ud800' is not valid Unicode", build_from_jsonl, path)


# --- load errors -----------------------------------------------------------------------------


def good_parts(canary: Canary) -> tuple[dict, dict]:
    tensors = {"tokens": canary.tokens, "domain_ids": canary.domain_ids}
    metadata = {
        "format": "moeaudit.canary",
        "version": "1",
        "domains": '["code","prose"]',
        "digest": canary.digest,
    }
    return tensors, metadata


def test_load_accepts_good_parts(tmp_path: Path, canary: Canary) -> None:
    tensors, metadata = good_parts(canary)
    save_file(tensors, str(tmp_path / "ok.safetensors"), metadata)
    assert load(tmp_path / "ok.safetensors") == canary


def i32(*shape: int, fill: int = 1) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.int32)


LOAD_CASES = [
    (
        "format",
        lambda t, m: m.update(format="other"),
        "not a moeaudit canary (a safetensors file of 2 tensor(s) whose metadata format is 'other')",
    ),
    ("no-format", lambda t, m: m.pop("format"), "metadata format is None)"),
    ("version", lambda t, m: m.update(version="2"), "canary format version '2' is not supported"),
    ("no-domains", lambda t, m: m.pop("domains"), 'metadata has no "domains"'),
    ("no-digest", lambda t, m: m.pop("digest"), 'metadata has no "digest"'),
    (
        "extra-tensor",
        lambda t, m: t.update(extra=i32(1)),
        "found ['domain_ids', 'extra', 'tokens']",
    ),
    ("missing-tensor", lambda t, m: t.pop("domain_ids"), "expected exactly the tensors"),
    (
        "tokens-dtype",
        lambda t, m: t.update(tokens=t["tokens"].long()),
        "tensor 'tokens' is I64, expected I32",
    ),
    ("ids-dtype", lambda t, m: t.update(domain_ids=t["domain_ids"].float()), "'domain_ids' is F32"),
    ("tokens-1d", lambda t, m: t.update(tokens=i32(12)), "tokens must be 2-D"),
    ("tokens-3d", lambda t, m: t.update(tokens=i32(3, 2, 2)), "got shape [3, 2, 2]"),
    (
        "ids-2d",
        lambda t, m: t.update(domain_ids=i32(3, 1, fill=0)),
        "domain_ids must have shape [3]",
    ),
    ("ids-len", lambda t, m: t.update(domain_ids=i32(2, fill=0)), "got [2]"),
    ("empty", lambda t, m: t.update(tokens=i32(0, 4), domain_ids=i32(0)), "the canary is empty"),
    (
        "short",
        lambda t, m: t.update(tokens=i32(3, 1)),
        "window length is 1; a window needs at least 2",
    ),
    (
        "id-range",
        lambda t, m: t["domain_ids"].__setitem__(1, 2),
        "window 1 has domain id 2, but there are 2",
    ),
    ("id-neg", lambda t, m: t["domain_ids"].__setitem__(2, -1), "window 2 has domain id -1"),
    (
        "neg-token",
        lambda t, m: t["tokens"].__setitem__((1, 3), -5),
        "window 1, position 3 has negative token id -5",
    ),
    ("names-json", lambda t, m: m.update(domains="[code"), "metadata domains is not valid JSON"),
    ("names-type", lambda t, m: m.update(domains='{"a": 1}'), "must be a JSON list of strings"),
    ("names-ints", lambda t, m: m.update(domains="[1, 2]"), "must be a JSON list of strings"),
    ("names-empty", lambda t, m: m.update(domains="[]"), "the canary has no domain names"),
    (
        "names-blank",
        lambda t, m: m.update(domains='["code", ""]'),
        "domain name '' is not a non-empty",
    ),
    (
        "names-dupe",
        lambda t, m: m.update(domains='["code", "code"]'),
        "domain names repeat: 'code'",
    ),
]


@pytest.mark.parametrize(("name", "mutate", "problem"), LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_load_errors(tmp_path: Path, canary: Canary, name: str, mutate, problem: str) -> None:
    tensors, metadata = good_parts(canary)
    tensors = {k: v.clone() for k, v in tensors.items()}
    mutate(tensors, metadata)
    path = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(path), metadata)
    err = raises(problem, load, path)
    assert str(err).startswith(f"{path}: ")


def test_load_digest_mismatch(tmp_path: Path, canary: Canary) -> None:
    tensors, metadata = good_parts(canary)
    tensors["tokens"] = tensors["tokens"].clone()
    tensors["tokens"][0, 0] = 99
    path = tmp_path / "edited.safetensors"
    save_file(tensors, str(path), metadata)
    actual = Canary(tensors["tokens"], canary.domain_ids, canary.domains).digest
    raises(
        f"digest mismatch: file says {canary.digest}, content hashes to {actual} — the file was modified",
        load,
        path,
    )


def test_load_digest_mismatch_on_renamed_domain(tmp_path: Path, canary: Canary) -> None:
    tensors, metadata = good_parts(canary)
    metadata["domains"] = '["code","poetry"]'
    save_file(tensors, str(tmp_path / "renamed.safetensors"), metadata)
    raises("renamed.safetensors: digest mismatch", load, tmp_path / "renamed.safetensors")


def test_load_missing_file(tmp_path: Path) -> None:
    err = raises("nope.safetensors: no such canary file", load, tmp_path / "nope.safetensors")
    assert "moeaudit canary build" in str(err)


def test_load_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"domain": "a", "tokens": [1, 2]}\n')
    # the source of a canary, not the safetensors parser's header arithmetic (docs/decisions.md, "Not a canary")
    err = raises(
        "c.jsonl: not a moeaudit canary (a JSONL file of token windows (a canary's source), not a built canary)",
        load,
        path,
    )
    assert "header length" not in str(err) and "limit" not in str(err)
    assert f"moeaudit canary build --tokens {path} --out canary.safetensors" in str(err)


def test_load_truncated(tmp_path: Path, canary: Canary) -> None:
    save(canary, tmp_path / "c.safetensors")
    blob = (tmp_path / "c.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(blob[:-4])
    raises("cut.safetensors: tensor", load, tmp_path / "cut.safetensors")


def test_load_tiny_file(tmp_path: Path) -> None:
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    raises(
        "tiny.safetensors: not a moeaudit canary (not a safetensors file: file is 3 bytes, too short",
        load,
        tmp_path / "tiny.safetensors",
    )


def test_in_memory_invariants_are_checked() -> None:
    wide = torch.zeros(1, 2, dtype=torch.int64)
    raises("must be int32", Canary, wide, torch.zeros(1, dtype=torch.int32), ("a",))
    raises("domain names repeat", make, [[1, 2], [3, 4]], [0, 1], ("a", "a"))
    raises("window 0 has domain id 1", make, [[1, 2]], [1], ("a",))
    raises("is not valid Unicode text", make, [[1, 2]], [0], ("\ud800",))


# --- `canary show` on files that are not canaries -------------------------------------------


def _model_safetensors(path: Path) -> Path:
    save_file(
        {"model.embed_tokens.weight": torch.zeros(4, 2), "lm_head.weight": torch.zeros(4, 2)},
        str(path),
        {"format": "pt"},
    )
    return path


NOT_CANARIES = [
    (
        "model.safetensors",
        _model_safetensors,
        "not a moeaudit canary (a safetensors file of 2 tensor(s) whose metadata format is 'pt' — model weights",
    ),
    (
        "config.json",
        lambda p: p.write_text('{"model_type": "mixtral", "hidden_size": 32}') and p,
        "not a moeaudit canary (a JSON file, not a safetensors file)",
    ),
    (
        "random.bin",
        lambda p: p.write_bytes(bytes(range(256)) * 8) and p,
        "not a moeaudit canary (not a safetensors file: header length",
    ),
    ("tokens.jsonl", lambda p: write_jsonl(p, LINES), "not a moeaudit canary (a JSONL file of token windows"),
    (
        "texts.jsonl",
        lambda p: p.write_text('{"text": "hello", "domain": "a"}\n') and p,
        "not a moeaudit canary (a JSONL file of texts",
    ),
    (
        "notes.txt",
        lambda p: p.write_text("some notes\n") and p,
        "not a moeaudit canary (a text file, not a safetensors file)",
    ),
    ("a-directory", lambda p: p.mkdir(), "not a moeaudit canary (a directory)"),
]


@pytest.mark.parametrize(("name", "make_file", "says"), NOT_CANARIES, ids=[c[0] for c in NOT_CANARIES])
def test_canary_show_says_a_file_is_not_a_canary(tmp_path: Path, name: str, make_file, says: str) -> None:
    from click.testing import CliRunner

    from moeaudit.cli import cli

    path = tmp_path / name
    make_file(path)
    result = CliRunner().invoke(cli, ["canary", "show", str(path)])
    assert result.exit_code == EXIT_INPUT
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"moeaudit: error: {path}: {says}"), lines


def test_a_damaged_canary_is_still_called_a_canary(tmp_path: Path, canary: Canary) -> None:
    """A canary cut short in its data keeps its header: the error names the damage, not 'not a canary'."""
    save(canary, tmp_path / "c.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "c.safetensors").read_bytes()[:-4])
    err = raises("cut.safetensors: tensor", load, tmp_path / "cut.safetensors")
    assert "not a moeaudit canary" not in str(err)
