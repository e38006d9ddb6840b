"""Helpers of tests/test_certify_families.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moeaudit.cli import cli  # noqa: E402
from support.naming import LOWER_CAMEL, _field_names  # noqa: E402

SAMPLES = Path(__file__).resolve().parents[2] / "sample_checkpoints"


def _nudged_copy(src: Path, dst: Path) -> None:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            gen = torch.Generator().manual_seed(7)
            t = load_file(str(f))
            t = {
                k: v + 0.02 * v.float().std() * torch.randn(v.shape, generator=gen) if v.dim() >= 2 else v
                for k, v in sorted(t.items())
            }
            save_file(t, str(dst / f.name), metadata={"format": "pt"})
        else:
            (dst / f.name).write_bytes(f.read_bytes())


def certify_and_verify(run: Path, tmp_path: Path) -> tuple[CliRunner, Path]:
    """``certify`` the run with a fresh key and the sample canary, then ``verify`` the
    certificate; (the runner, the output directory)."""
    env = {"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    runner = CliRunner(env=env)
    key, out = tmp_path / "key", tmp_path / "out"
    assert runner.invoke(cli, ["keygen", "--out", str(key)]).exit_code == 0
    result = runner.invoke(
        cli,
        ["certify", str(run), "--key", str(key), "--out", str(out), "--canary", str(SAMPLES / "canary.safetensors")],
    )
    assert result.exit_code == 0, result.output
    verified = runner.invoke(cli, ["verify", str(out / "certificate.json"), "--pubkey", str(key) + ".pub"])
    assert verified.exit_code == 0, verified.output
    signed = json.loads(base64.b64decode(json.loads((out / "certificate.json").read_text())["payload"]))
    odd = [name for name in _field_names(signed["predicate"]) if not LOWER_CAMEL.fullmatch(name[1])]
    assert odd == []  # in-toto naming on the wire, whatever the family's gate notes hold
    return runner, out
