"""A PEFT (LoRA) fine-tune of an MoE model, end to end (docs/decisions.md, "PEFT / LoRA fine-tunes").

The Trainer callback on a ``PeftModel`` logs no per-step line (the frozen experts get no training
gradient; zeros would read as healthy experts) and a canary probe at each save that equals the
replay of the merged checkpoint; the run's adapter-only checkpoints are refused with one line
(exit 4) before anything is written; a merged run is certified. Tiny Mixtral, 6 steps."""

from __future__ import annotations

import json
import logging
import math
import shutil
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

STEPS, SAVE, BATCH, SEQ = 6, 3, 8, 32
REL = 2e-3  # the replay oracle's gradient-norm tolerance (tests/test_integrations.py)
ADAPTER_REFUSED = "holds a PEFT adapter (adapter_config.json), not the model weights a replay runs"


def _canary() -> Canary:
    rng = np.random.default_rng(1)
    return Canary(
        rng.integers(0, VOCAB, (8, 16)).astype("int32"), np.array([0, 0, 0, 0, 1, 1, 1, 1], "int32"), ("code", "prose")
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_model("mixtral")


LORA = {
    "attention": {"target_modules": ["q_proj", "v_proj"]},
    # transformers 5 fuses Mixtral's experts into 3-D parameters: peft adapts them by name
    "experts": {"target_modules": ["q_proj"], "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]},
}


def _train(run: Path, lora: dict[str, Any], caplog: pytest.LogCaptureFixture) -> Any:
    peft = pytest.importorskip("peft")
    from moeaudit.integrations.transformers import MoeauditCallback

    model = peft.get_peft_model(_base(), peft.LoraConfig(r=4, **lora))
    tokens = torch.randint(0, VOCAB, (8 * BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS,
        save_steps=SAVE,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_only_model=True,
    )
    data = [{"input_ids": r, "labels": r} for r in tokens]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[MoeauditCallback(_canary())])
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        trainer.train()
    return model


def _merge(run: Path, out: Path) -> None:
    """What the README tells a PEFT user to do: each adapter merged onto its base, saved as a
    full checkpoint, beside the run's canary and probe."""
    peft = pytest.importorskip("peft")
    for ckpt in sorted(run.glob("checkpoint-*")):
        peft.PeftModel.from_pretrained(_base(), ckpt).merge_and_unload().save_pretrained(out / ckpt.name)
    for name in ("canary.safetensors", "canary_probe.jsonl"):
        shutil.copy(run / name, out / name)


def _certify(run: Path, tmp_path: Path, name: str) -> Any:
    runner = CliRunner()
    key = tmp_path / "key"
    if not key.exists():
        assert runner.invoke(cli, ["keygen", "--out", str(key)]).exit_code == 0
    args = ["certify", str(run), "--canary", str(run / "canary.safetensors"), "--key", str(key)]
    return runner.invoke(cli, [*args, "--out", str(tmp_path / name), "--no-cache"])


@pytest.mark.parametrize("target", sorted(LORA))
def test_lora_run_probes_the_merged_weights_and_refuses_its_adapters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, target: str
) -> None:
    run, merged = tmp_path / "run", tmp_path / "merged"
    model = _train(run, LORA[target], caplog)

    # no per-step line: the frozen experts had no training gradient (zeros would pass the envelope)
    assert sorted(p.name for p in run.iterdir()) == [
        "canary.safetensors",
        "canary_probe.jsonl",
        "checkpoint-3",
        "checkpoint-6",
    ]
    (warned,) = [r.getMessage() for r in caplog.records if "are frozen" in r.getMessage()]
    assert "metrics.jsonl is not written" in warned and "\n" not in warned
    # the probe thawed the base weights only while it ran
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)

    # the Trainer saved adapters only: certify refuses the run in one line, exit 4, writing nothing
    refused = _certify(run, tmp_path, "refused")
    assert refused.exit_code == 4, refused.output
    assert ADAPTER_REFUSED in refused.output and "merge_and_unload()" in refused.output
    assert not (tmp_path / "refused").exists()

    # merged checkpoints are certified, and the probe is the replay of each of them
    _merge(run, merged)
    result = _certify(merged, tmp_path, "cert")
    assert result.exit_code == 0, result.output
    for probe in _lines(run / "canary_probe.jsonl"):
        receipts = json.loads((tmp_path / "cert" / "receipts" / f"checkpoint-{probe['step']}.json").read_text())
        assert math.isclose(probe["loss"], receipts["nll"], rel_tol=1e-5)
        for layer in receipts["layers"]:
            logged, replayed = probe["expert_grad_norms"][str(layer["layer"])], layer["gradients"]["grad_norms"]
            assert min(replayed) > 0
            assert all(math.isclose(a, b, rel_tol=REL) for a, b in zip(logged, replayed, strict=True))


def _adapter_dir(path: Path, base: str | None = "mistralai/Mixtral-8x7B-v0.1") -> Path:
    """A checkpoint as a Trainer saves a PeftModel: adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": base}))
    save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)},
        path / "adapter_model.safetensors",
    )
    return path


def test_an_adapter_checkpoint_is_refused_by_every_command(tmp_path: Path) -> None:
    """receipts, compare, gate, inspect and certify name the adapter and its base and say to
    merge; a run holding a full checkpoint beside an adapter is refused, not certified on the
    full one alone (exit 4, nothing written)."""
    from hfmodels import save_tiny

    from moeaudit import canary as canary_mod

    canary = tmp_path / "canary.safetensors"
    canary_mod.save(_canary(), canary)
    adapter = _adapter_dir(tmp_path / "run" / "checkpoint-6")
    full = tmp_path / "run" / "checkpoint-3"
    save_tiny(full, "mixtral")
    runner = CliRunner()
    for args in (
        ["inspect", str(adapter)],
        ["receipts", str(adapter), "--canary", str(canary)],
        ["compare", str(full), str(adapter), "--canary", str(canary)],
        ["gate", str(full), str(adapter), "--canary", str(canary)],
        ["certify", str(tmp_path / "run"), "--canary", str(canary), "--out", str(tmp_path / "out")],
    ):
        result = runner.invoke(cli, args)
        assert result.exit_code == 4, (args, result.output)
        (line,) = [ln for ln in result.output.splitlines() if ln.startswith("moeaudit: error:")]
        assert f"checkpoint-6: {ADAPTER_REFUSED}" in line, line
        assert "merge it onto its base (mistralai/Mixtral-8x7B-v0.1)" in line
    assert not (tmp_path / "out").exists()


def test_a_hand_written_loop_over_frozen_experts_is_refused_not_logged_as_zeros(tmp_path: Path) -> None:
    """ExpertGradLogger over frozen experts: a per-step line, or a probe outside probe_scope(),
    would log 0 for every expert; both are refused and nothing is written. Inside
    probe_scope() the probe equals the gradient of the same weights left trainable."""
    from moeaudit.errors import InputError
    from moeaudit.integrations.core import canary_loss
    from moeaudit.integrations.hooks import ExpertGradLogger

    trainable, frozen = _base().eval(), _base().eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    logger = ExpertGradLogger(tmp_path / "metrics.jsonl", frozen)
    with pytest.raises(InputError, match="6 routed-expert weight tensors are frozen"):
        logger.log(1, 1.0)
    with pytest.raises(InputError, match="inside ExpertGradLogger.probe_scope"):
        logger.probe(3, canary_loss(trainable, _canary()))
    assert not list(tmp_path.iterdir())
    with logger.probe_scope():
        record = logger.probe(3, canary_loss(frozen, _canary()))
    assert all(not p.requires_grad for p in frozen.parameters())
    reference = ExpertGradLogger(tmp_path / "ref.jsonl", trainable).probe(3, canary_loss(trainable, _canary()))
    assert record is not None and reference is not None
    assert record["expert_grad_norms"] == reference["expert_grad_norms"]
    assert record["router_grad_norms"] == reference["router_grad_norms"]


def test_peft_wrapped_names_are_read_as_the_layouts_names() -> None:
    """LoRA on per-expert Linear modules (``…w1.base_layer.weight``, transformers 4's layout) and a
    router in ``modules_to_save`` (the trained copy, not ``original_module``) are the layout's
    tensors; the LoRA factors are not experts."""
    from moeaudit.integrations.hooks import collect_params

    t = {name: torch.zeros(1) for name in ("w1", "w3", "w2", "lora", "gate", "orig")}
    prefix = "base_model.model.model.layers.0.block_sparse_moe"
    named = [
        *((f"{prefix}.experts.{e}.{w}.base_layer.weight", t[w]) for e in range(2) for w in ("w1", "w3", "w2")),
        *((f"{prefix}.experts.{e}.w1.lora_A.default.weight", t["lora"]) for e in range(2)),
        (f"{prefix}.gate.original_module.weight", t["orig"]),
        (f"{prefix}.gate.modules_to_save.default.weight", t["gate"]),
    ]
    (layer,) = collect_params(named, "mixtral").values()
    assert {e: [id(x) for x in ts] for e, ts in layer.experts.items()} == {
        e: [id(t["w1"]), id(t["w3"]), id(t["w2"])] for e in range(2)
    }
    assert [id(x) for x in layer.router] == [id(t["gate"])]


def test_lightning_on_a_peft_model_logs_the_probe_only(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The Lightning callback finds the PeftModel inside a LightningModule-like wrapper, writes no
    per-step line over its frozen experts (one warning), and probes at a save."""
    pytest.importorskip("lightning")
    peft = pytest.importorskip("peft")
    from types import SimpleNamespace

    from moeaudit.integrations.lightning import MoeauditCallback

    class Wrapper(torch.nn.Module):
        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

    module = Wrapper(peft.get_peft_model(_base(), peft.LoraConfig(r=4, **LORA["attention"])))
    trainer = SimpleNamespace(global_step=0, default_root_dir=str(tmp_path / "run"), is_global_zero=True)
    callback = MoeauditCallback(_canary(), save_every=3)
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        callback.on_train_start(trainer, module)
    assert callback.recorder is not None and callback.recorder.per_step is False
    assert [r for r in caplog.records if "metrics.jsonl is not written" in r.getMessage()]
    assert callback.recorder.log_step(1, 1.0) is None
    record = callback.recorder.probe(3)
    assert record is not None and min(record["expert_grad_norms"]["0"]) > 0
    callback.recorder.close()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["canary.safetensors", "canary_probe.jsonl"]


def test_quantized_frozen_experts_are_refused_at_the_start(tmp_path: Path) -> None:
    """Experts held frozen in a quantized dtype (a QLoRA base) have no gradient a step or the
    probe could take: refused when the recorder is made (the callback's train start), writing
    nothing, rather than at the first save mid-training."""
    from moeaudit.errors import InputError
    from moeaudit.integrations.core import RunRecorder

    model = _base()
    for p in model.parameters():
        p.requires_grad_(False)
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.to(torch.int8), requires_grad=False)
    with pytest.raises(InputError, match=r"frozen and stored as int8 \(a quantized base, e.g. QLoRA\)"):
        RunRecorder(tmp_path / "run", model, canary=_canary(), every=1, probe=True, resume_step=None)
    assert not (tmp_path / "run").exists()
