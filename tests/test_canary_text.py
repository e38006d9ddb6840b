"""Issue 15.3: `moeaudit canary build --text FILE.jsonl --tokenizer tokenizer.json` with a real
tokenizer, trained here by the tokenizers library on generated words (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from moeaudit.canary import load
from moeaudit.cli import cli
from moeaudit.errors import EXIT_INPUT, EXIT_USAGE, CanaryError

tokenizers = pytest.importorskip("tokenizers")
from moeaudit.canary_text import build_from_text  # noqa: E402

DOCS = [  # (domain, first word, words): code has two documents, prose one
    ("code", 0, 20), ("prose", 0, 30), ("code", 20, 20),
]


def _words(domain: str, first: int, n: int) -> str:
    return " ".join(f"{domain[0]}{i}" for i in range(first, first + n))


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    """A WordLevel tokenizer over the words of DOCS that adds [BOS] to every document."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator([_words(d, f, n) for d, f, n in DOCS],
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]"]))
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.fixture
def texts(tmp_path: Path) -> Path:
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": _words(d, f, n), "domain": d}) + "\n" for d, f, n in DOCS))
    return path


def _decode(tokenizer: Path, ids: list[int]) -> list[str]:
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    return [tok.id_to_token(i) for i in ids]


def test_windows_are_cut_evenly_from_each_domain(texts: Path, tokenizer: Path) -> None:
    c = build_from_text(texts, tokenizer, window_len=8, windows=5)
    assert c.domains == ("code", "prose") and c.domain_ids.tolist() == [0, 0, 0, 1, 1]
    # code: [BOS] c0..c19 [BOS] c20..c39 = 42 tokens = 5 whole windows; 3 taken at windows 0, 1, 3
    rows = [_decode(tokenizer, r) for r in c.tokens.tolist()]
    assert rows[0] == ["[BOS]"] + [f"c{i}" for i in range(7)]
    assert rows[1] == [f"c{i}" for i in range(7, 15)]
    assert rows[2] == [f"c{i}" for i in range(22, 30)]
    # prose: [BOS] p0..p29 = 31 tokens = 3 whole windows; 2 taken at windows 0 and 1
    assert rows[3] == ["[BOS]"] + [f"p{i}" for i in range(7)]
    assert rows[4] == [f"p{i}" for i in range(7, 15)]


def test_the_cli_builds_the_same_canary_deterministically(tmp_path: Path, texts: Path, tokenizer: Path) -> None:
    runner = CliRunner()
    digests = []
    for name in ("a", "b"):
        out = tmp_path / f"{name}.safetensors"
        result = runner.invoke(cli, ["canary", "build", "--text", str(texts), "--tokenizer", str(tokenizer),
                                     "--window-len", "8", "--windows", "5", "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "5 windows × 8 tokens, 2 domains" in result.output
        digests.append(load(out).digest)
    assert digests[0] == digests[1] == build_from_text(texts, tokenizer, window_len=8, windows=5).digest


@pytest.mark.parametrize(("lines", "windows", "window_len", "says"), [
    (['{"text": "c0 c1", "domain": "code"}', '{"text": "c2", '], 1, 2, "texts.jsonl:2: not valid JSON"),
    (['{"domain": "code"}'], 1, 2, 'texts.jsonl:1: missing "text"'),
    (['{"text": "c0 c1", "domain": ""}'], 1, 2, '"domain" must be a non-empty string'),
    (['["c0"]'], 1, 2, "texts.jsonl:1: expected a JSON object, got list"),
    ([], 1, 2, "no texts: the file has no non-blank lines"),
    (None, 9, 8, "the text gives 8 windows of 8 tokens (73 tokens), fewer than --windows 9 "
                 "(W×T = 72 tokens)"),
    (None, 2, 32, "domain 'prose' has 31 tokens, fewer than one window of 32"),
    (None, 1, 8, "1 window(s) cannot cover the 2 domains"),
])
def test_bad_text_is_one_clear_error(tmp_path: Path, texts: Path, tokenizer: Path, lines: list[str] | None,
                                     windows: int, window_len: int, says: str) -> None:
    if lines is not None:
        texts.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(cli, ["canary", "build", "--text", str(texts), "--tokenizer", str(tokenizer),
                                      "--windows", str(windows), "--window-len", str(window_len),
                                      "--out", str(tmp_path / "c.safetensors")])
    assert result.exit_code == EXIT_INPUT
    assert says in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "c.safetensors").exists()


def test_a_missing_or_broken_tokenizer_is_named(tmp_path: Path, texts: Path) -> None:
    with pytest.raises(CanaryError, match="no such tokenizer file"):
        build_from_text(texts, tmp_path / "nope.json", window_len=8, windows=2)
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model_type": "mixtral"}')
    with pytest.raises(CanaryError, match="not a tokenizer.json the tokenizers library can read"):
        build_from_text(texts, bad, window_len=8, windows=2)


@pytest.mark.parametrize(("argv", "says"), [
    (["--out", "c.safetensors"], "give exactly one of --tokens"),
    (["--text", "t.jsonl", "--out", "c.safetensors"], "--tokenizer goes with --text"),
    (["--tokens", "t.jsonl", "--windows", "3", "--out", "c.safetensors"], "apply to --text"),
])
def test_option_mistakes_are_usage_errors(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, ["canary", "build", *argv])
    assert result.exit_code == EXIT_USAGE and says in result.output
