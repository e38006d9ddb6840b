"""`moeaudit canary build --text FILE.jsonl --tokenizer tokenizer.json` with a real
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
    ("code", 0, 20),
    ("prose", 0, 30),
    ("code", 20, 20),
]


def _words(domain: str, first: int, n: int) -> str:
    return " ".join(f"{domain[0]}{i}" for i in range(first, first + n))


@pytest.fixture
def tokenizer(tmp_path: Path) -> Path:
    """A WordLevel tokenizer over the words of DOCS that adds [BOS] to every document."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        [_words(d, f, n) for d, f, n in DOCS], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[BOS]"])
    )
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
        result = runner.invoke(
            cli,
            [
                "canary",
                "build",
                "--text",
                str(texts),
                "--tokenizer",
                str(tokenizer),
                "--window-len",
                "8",
                "--windows",
                "5",
                "--out",
                str(out),
            ],
        )
        assert result.exit_code == 0, result.output
        assert "5 windows × 8 tokens, 2 domains" in result.output
        digests.append(load(out).digest)
    assert digests[0] == digests[1] == build_from_text(texts, tokenizer, window_len=8, windows=5).digest


@pytest.mark.parametrize(
    ("lines", "windows", "window_len", "says"),
    [
        (['{"text": "c0 c1", "domain": "code"}', '{"text": "c2", '], 1, 2, "texts.jsonl:2: not valid JSON"),
        (['{"domain": "code"}'], 1, 2, 'texts.jsonl:1: missing "text"'),
        (['{"text": "c0 c1", "domain": ""}'], 1, 2, '"domain" must be a non-empty string'),
        (['["c0"]'], 1, 2, "texts.jsonl:1: expected a JSON object, got list"),
        ([], 1, 2, "no texts: the file has no non-blank lines"),
        (None, 9, 8, "the text gives 8 windows of 8 tokens (73 tokens), fewer than --windows 9 (W×T = 72 tokens)"),
        (None, 2, 32, "domain 'prose' has 31 tokens, fewer than one window of 32"),
        (None, 1, 8, "1 window(s) cannot cover the 2 domains"),
    ],
)
def test_bad_text_is_one_clear_error(
    tmp_path: Path, texts: Path, tokenizer: Path, lines: list[str] | None, windows: int, window_len: int, says: str
) -> None:
    if lines is not None:
        texts.write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(
        cli,
        [
            "canary",
            "build",
            "--text",
            str(texts),
            "--tokenizer",
            str(tokenizer),
            "--windows",
            str(windows),
            "--window-len",
            str(window_len),
            "--out",
            str(tmp_path / "c.safetensors"),
        ],
    )
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


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--out", "c.safetensors"], "give exactly one of --tokens"),
        (["--text", "t.jsonl", "--out", "c.safetensors"], "--tokenizer goes with --text"),
        (["--tokens", "t.jsonl", "--windows", "3", "--out", "c.safetensors"], "apply to --text"),
    ],
)
def test_option_mistakes_are_usage_errors(argv: list[str], says: str) -> None:
    result = CliRunner().invoke(cli, ["canary", "build", *argv])
    assert result.exit_code == EXIT_USAGE and says in result.output


def test_the_canary_names_its_tokenizer_and_text(tmp_path: Path, texts: Path, tokenizer: Path) -> None:
    """A text-built canary records the SHA-256 of the tokenizer.json and of the text file it was
    built from; they survive save and load, `canary show` lists them, and the digest is still that
    of the windows alone. A token-built canary has neither, and its file is as before."""
    import hashlib

    from moeaudit.canary import Canary, save

    out = tmp_path / "c.safetensors"
    result = CliRunner().invoke(
        cli,
        [
            "canary",
            "build",
            "--text",
            str(texts),
            "--tokenizer",
            str(tokenizer),
            "--window-len",
            "8",
            "--windows",
            "5",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    want = {
        "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
        "text_sha256": hashlib.sha256(texts.read_bytes()).hexdigest(),
    }
    c = load(out)
    assert c.built_from == want
    same_windows = Canary(c.tokens_array, c.domain_ids_array, c.domains)
    assert same_windows.built_from is None and same_windows.digest == c.digest
    shown = CliRunner().invoke(cli, ["canary", "show", "--json", str(out)])
    assert {k: json.loads(shown.stdout)[k] for k in want} == want
    # another text with the same windows: another text digest, the same canary digest
    texts.write_text(texts.read_text() + "\n")
    again = build_from_text(texts, tokenizer, window_len=8, windows=5)
    assert again.digest == c.digest and again.built_from is not None
    assert again.built_from["text_sha256"] == hashlib.sha256(texts.read_bytes()).hexdigest() != want["text_sha256"]
    # token windows: nothing recorded, nothing new in the header
    save(same_windows, tmp_path / "t.safetensors")
    from moeaudit.checkpoint.safetensors import SafetensorsFile

    assert set(SafetensorsFile(tmp_path / "t.safetensors").metadata) == {"format", "version", "domains", "digest"}
    assert load(tmp_path / "t.safetensors").built_from is None


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({"tokenizer_sha256": "ab" * 32}, "not both of tokenizer_sha256, text_sha256"),
        ({"tokenizer_sha256": "ab" * 32, "text_sha256": "XYZ"}, "metadata text_sha256 is not a hex SHA-256"),
    ],
)
def test_a_damaged_record_of_the_sources_is_refused(tmp_path: Path, metadata: dict[str, str], says: str) -> None:
    import numpy as np

    from moeaudit.canary import Canary, save
    from moeaudit.checkpoint.safetensors import SafetensorsFile, write_safetensors

    windows = np.array([[1, 2, 3]], dtype=np.int32)
    save(Canary(windows, np.array([0], dtype=np.int32), ["code"]), tmp_path / "c.safetensors")
    sf = SafetensorsFile(tmp_path / "c.safetensors")
    stored = load(tmp_path / "c.safetensors")
    tensors = {"tokens": stored.tokens, "domain_ids": stored.domain_ids}
    write_safetensors(tmp_path / "d.safetensors", tensors, {**sf.metadata, **metadata})
    with pytest.raises(CanaryError, match=says):
        load(tmp_path / "d.safetensors")


@pytest.mark.skipif(
    not (Path(__file__).resolve().parent.parent / "sample_checkpoints" / "healthy").is_dir(),
    reason="sample runs not built",
)
def test_a_certificate_signs_what_the_canary_was_built_from(tmp_path: Path, texts: Path, tokenizer: Path) -> None:
    import base64
    import shutil

    healthy = Path(__file__).resolve().parent.parent / "sample_checkpoints" / "healthy"
    canary = tmp_path / "c.safetensors"
    assert (
        CliRunner()
        .invoke(
            cli,
            [
                "canary",
                "build",
                "--text",
                str(texts),
                "--tokenizer",
                str(tokenizer),
                "--window-len",
                "8",
                "--windows",
                "4",
                "--out",
                str(canary),
            ],
        )
        .exit_code
        == 0
    )
    run = tmp_path / "run"
    for step in (1250, 1500):
        shutil.copytree(healthy / f"checkpoint-{step}", run / f"checkpoint-{step}")
    result = CliRunner(env={"XDG_CONFIG_HOME": str(tmp_path / "cfg")}).invoke(
        cli, ["certify", str(run), "--canary", str(canary), "--out", str(tmp_path / "out"), "--no-cache"]
    )
    assert result.exit_code == 0, result.output
    envelope = json.loads((tmp_path / "out" / "certificate.json").read_bytes())
    signed = json.loads(base64.b64decode(envelope["payload"]))["predicate"]["canary"]
    built_from = load(canary).built_from
    assert built_from is not None
    assert (signed["tokenizerSha256"], signed["textSha256"]) == (
        built_from["tokenizer_sha256"],
        built_from["text_sha256"],
    )
