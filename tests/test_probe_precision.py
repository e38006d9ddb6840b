"""A canary probe of a model whose weights are bf16 (not bf16 autocast: the parameters themselves)
computes in bf16 while a replay computes in float32; each probe line says so (``"precision"``),
and the envelope report of the probe series carries it, so ``envelope --compare`` and a
certificate built on the probe name it (docs/decisions.md, "Training integrations")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moeaudit.canary import Canary
from moeaudit.cli import cli

transformers = pytest.importorskip("transformers")
from hfmodels import VOCAB, tiny_model  # noqa: E402


def _canary() -> Canary:
    rng = np.random.default_rng(1)
    return Canary(
        rng.integers(0, VOCAB, (8, 16)).astype("int32"), np.array([0, 0, 0, 0, 1, 1, 1, 1], "int32"), ("code", "prose")
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(run: Path, dtype: torch.dtype) -> None:
    from moeaudit.integrations.transformers import MoeauditCallback

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (32, 32), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_only_model=True,
    )
    trainer = transformers.Trainer(
        model=tiny_model("mixtral").to(dtype),
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in tokens],
        callbacks=[MoeauditCallback(_canary())],
    )
    trainer.train()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_probe_records_its_precision_and_compare_names_it(tmp_path: Path, dtype: torch.dtype) -> None:
    run, out = tmp_path / "run", tmp_path / "envelope.json"
    _train(run, dtype)
    probes = _lines(run / "canary_probe.jsonl")
    assert [p["step"] for p in probes] == [2, 4]
    low = dtype == torch.bfloat16
    assert [p.get("precision") for p in probes] == (["bfloat16"] * 2 if low else [None, None])

    args = ["envelope", str(run), "--compare", "--canary", str(run / "canary.safetensors"), "--no-cache"]
    result = CliRunner().invoke(cli, [*args, "--json", str(out)])
    assert result.exit_code in (0, 3), result.output
    report = json.loads(out.read_text())
    assert report["source"] == "logs" and "precision" not in report  # the training log is not the probe's
    probe_report = report["comparison"]["probe_report"]
    assert probe_report.get("precision") == ("bfloat16" if low else None)
    gap = report["comparison"]["probe_vs_replay"]["max_rel_diff"]
    shown = CliRunner().invoke(cli, args)
    named = "(the probe computed in bfloat16, the replay in float32)"
    if low:
        assert gap > 1e-3  # bf16 rounding, not float32's (V 17 % apart on this tiny Mixtral)
        assert named in " ".join(shown.output.split())
    else:
        assert gap < 1e-4 and named not in shown.output

    probe_only = CliRunner().invoke(cli, ["envelope", str(run), "--source", "probe", "--json", str(out), "--force"])
    assert probe_only.exit_code in (0, 3), probe_only.output
    assert json.loads(out.read_text()).get("precision") == ("bfloat16" if low else None)


def test_a_certificate_on_a_bf16_probe_says_so(tmp_path: Path) -> None:
    """A policy whose envelope reads the probe: the signed predicate's envelope names its precision,
    and the certificate page's envelope section says it."""
    import base64

    run = tmp_path / "run"
    _train(run, torch.bfloat16)
    policy = tmp_path / "policy.toml"
    policy.write_text('[envelope]\nsource = "probe"\n')
    runner = CliRunner()
    assert runner.invoke(cli, ["keygen", "--out", str(tmp_path / "key")]).exit_code == 0
    args = ["certify", str(run), "--canary", str(run / "canary.safetensors"), "--policy", str(policy)]
    result = runner.invoke(cli, [*args, "--key", str(tmp_path / "key"), "--out", str(tmp_path / "cert"), "--no-cache"])
    assert result.exit_code == 0, result.output
    envelope = json.loads(
        base64.b64decode(json.loads((tmp_path / "cert" / "certificate.json").read_text())["payload"])
    )["predicate"]["envelope"]
    assert envelope["source"] == "probe" and envelope["precision"] == "bfloat16"
    page = (tmp_path / "cert" / "certificate.html").read_text(encoding="utf-8")
    assert "from probe, computed in bfloat16 (a replay computes in float32)</dd>" in page
