"""The command-line contract (README.md, "Commands", "Exit codes", "Schemas"): commands, JSON fields, one-line errors,
exit codes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeaudit import canary as canary_mod
from moeaudit.checkpoint.safetensors import SafetensorsFile
from moeaudit.cli import cli

pytest.importorskip("transformers")


@pytest.fixture()
def ckpt(hf_checkpoint, tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("mixtral"), dst)
    return dst


@pytest.fixture()
def probe(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 96, (6, 12), generator=g, dtype=torch.int32)
    c = canary_mod.Canary(tokens, torch.tensor([0, 0, 1, 1, 2, 2], dtype=torch.int32), ("a", "b", "c"))
    canary_mod.save(c, tmp_path / "canary.safetensors")
    return tmp_path / "canary.safetensors"


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_inspect_json_is_header_only(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_reads(*_a, **_k):
        raise AssertionError("inspect must not read tensor data")

    monkeypatch.setattr(SafetensorsFile, "read", no_reads)
    code, stdout, _ = run("inspect", str(ckpt), "--json")
    assert code == 0
    info = json.loads(stdout)
    assert info["family"] == "mixtral" and info["experts"] == 4 and info["top_k"] == 2
    assert info["routed_layers"] == [0, 1, 2] and info["vocab_size"] == 96
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    root = hashlib.sha256(b"".join(hashlib.sha256(p.read_bytes()).digest() for p in files))
    assert info["digest"]["sha256"] == root.hexdigest()


def test_inspect_table(ckpt: Path) -> None:
    code, stdout, _ = run("inspect", str(ckpt))
    assert code == 0 and "mixtral" in stdout and "routing" in stdout


def test_receipts_json_schema_and_determinism(ckpt: Path, probe: Path, tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run("receipts", str(ckpt), "--canary", str(probe), "--json", str(a))[0] == 0
    assert run("receipts", str(ckpt), "--canary", str(probe), "--json", str(b))[0] == 0
    assert a.read_bytes() == b.read_bytes()
    doc = json.loads(a.read_text())
    assert doc["schema"] == "moeaudit.receipts/v1"
    assert set(doc["nll_by_domain"]) == {"a", "b", "c"}
    assert doc["canary"]["digest"]["sha256"] == canary_mod.load(probe).digest
    layer = doc["layers"][0]
    assert {"counts", "pi", "pi_min", "dead", "cv", "imbalance", "entropy", "entropy_norm"} <= set(layer["occupancy"])
    assert sum(layer["occupancy"]["counts"]) == 2 * 6 * 12
    assert {"grad_norms", "var_grad", "var_grad_norm"} <= set(layer["gradients"])
    assert set(layer["boundary"]["boundary_mass"]) == {"0.01", "0.02", "0.05", "0.1", "0.2", "0.5", "1.0"}
    assert {"c2", "c2_smooth"} <= set(layer["overlap"])


def test_receipts_refuses_overwrite_without_force(ckpt: Path, probe: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    out.write_text("keep me")
    code, _, stderr = run("receipts", str(ckpt), "--canary", str(probe), "--json", str(out))
    assert code == 4 and "--force" in one_line_error(stderr)
    assert out.read_text() == "keep me"
    assert run("receipts", str(ckpt), "--canary", str(probe), "--json", str(out), "--force")[0] == 0


def test_receipts_json_to_stdout_and_canary_discovery(ckpt: Path, probe: Path) -> None:
    assert probe.parent == ckpt.parent  # canary.safetensors one level above the checkpoint
    code, stdout, _ = run("receipts", str(ckpt), "--json", "-")
    assert code == 0 and json.loads(stdout)["schema"] == "moeaudit.receipts/v1"


def _shape_mismatch(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["hidden_size"] = 40
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _unknown_family(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _refused_family(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "vitpose"
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _truncate(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _pickle_only(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")


def _missing_expert(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    "breaks, message",
    [
        (_shape_mismatch, "config.json implies"),
        (_unknown_family, "unknown model family 'llama'"),
        (_refused_family, "model family 'vitpose' cannot be replayed: a pose-estimation vision model"),
        (_truncate, "truncated"),
        (_pickle_only, "pickled weights are never loaded"),
        (_missing_expert, "missing tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'"),
        (lambda c: (c / "config.json").unlink(), "no config.json"),
    ],
)
def test_bad_checkpoints_exit_4(ckpt: Path, probe: Path, tmp_path: Path, breaks, message: str) -> None:
    breaks(ckpt)
    out = tmp_path / "out.json"
    for args in (["inspect", str(ckpt)], ["receipts", str(ckpt), "--canary", str(probe), "--json", str(out)]):
        code, _, stderr = run(*args)
        assert code == 4, stderr
        assert message in one_line_error(stderr)
    assert not out.exists()


def test_missing_checkpoint_and_verbose_traceback(tmp_path: Path) -> None:
    code, _, stderr = run("inspect", str(tmp_path / "nope"))
    assert code == 4 and "no such checkpoint directory" in one_line_error(stderr)
    code, _, stderr = run("--verbose", "inspect", str(tmp_path / "nope"))
    assert code == 4 and "Traceback" in stderr


def test_out_of_vocabulary_canary(ckpt: Path, tmp_path: Path) -> None:
    c = canary_mod.Canary(torch.full((2, 8), 500, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), ("x",))
    canary_mod.save(c, tmp_path / "oov.safetensors")
    code, _, stderr = run("receipts", str(ckpt), "--canary", str(tmp_path / "oov.safetensors"))
    assert code == 4 and "outside the model vocabulary" in one_line_error(stderr)


def test_canary_build_unequal_windows(tmp_path: Path) -> None:
    src = tmp_path / "c.jsonl"
    src.write_text('{"domain": "a", "tokens": [1, 2, 3]}\n{"domain": "b", "tokens": [1, 2]}\n')
    out = tmp_path / "c.safetensors"
    code, _, stderr = run("canary", "build", "--tokens", str(src), "--out", str(out))
    assert code == 4 and "c.jsonl" in one_line_error(stderr)
    assert not out.exists()


def test_usage_error_exit_2() -> None:
    assert run("receipts")[0] == 2
    assert run("no-such-command")[0] == 2


def test_python_dash_m() -> None:
    proc = subprocess.run([sys.executable, "-m", "moeaudit", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "receipts" in proc.stdout
