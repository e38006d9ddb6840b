"""The transformers and Lightning callbacks write a run that `moeaudit certify` reads.

Each test trains a tiny Mixtral for 6 real optimizer steps (checkpoints at 3 and 6), then
checks the callback's numbers against an independent computation — step 1's per-expert
gradient norms from a copy of the initial model, the canary probe against the replay's own
receipts — and certifies the run."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from moeaudit.canary import Canary
from moeaudit.cli import cli
from moeaudit.metrics import read_metrics, var_grad

transformers = pytest.importorskip("transformers")
from hfmodels import VOCAB, tiny_model  # noqa: E402

STEPS, SAVE, BATCH, SEQ = 6, 3, 8, 32
REL = 2e-3  # the replay oracle's gradient-norm tolerance (tests/test_oracle.py)


def _canary() -> Canary:
    rng = np.random.default_rng(1)
    return Canary(
        rng.integers(0, VOCAB, (8, 16)).astype("int32"), np.array([0, 0, 0, 0, 1, 1, 1, 1], "int32"), ("code", "prose")
    )


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (8 * BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _step1(model: torch.nn.Module, batch: torch.Tensor) -> tuple[float, dict[str, list[float]], float]:
    """(loss, per-layer per-expert gradient norms, global gradient norm) of one step on ``batch``,
    read straight off Mixtral's fused expert tensors of an untouched copy of ``model``."""
    model = copy.deepcopy(model).train()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    loss = loss.detach()
    norms = {}
    for i, layer in enumerate(model.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj.grad, layer.mlp.experts.down_proj.grad
        norms[str(i)] = [
            math.sqrt(float(gate_up[e].double().pow(2).sum() + down[e].double().pow(2).sum()))
            for e in range(gate_up.shape[0])
        ]
    total = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    return float(loss), norms, total


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _close(a: list[float], b: list[float], rel: float) -> bool:
    return all(math.isclose(x, y, rel_tol=rel, abs_tol=1e-9) for x, y in zip(a, b, strict=True))


def _certify_and_check(run: Path, canary: Canary, tmp_path: Path) -> None:
    """certify reads both checkpoints, builds the envelope from the callback's metrics.jsonl, and
    the canary probe written at each save equals the replay of that checkpoint."""
    runner = CliRunner()
    key = tmp_path / "key"
    assert runner.invoke(cli, ["keygen", "--out", str(key)]).exit_code == 0
    out = tmp_path / "cert"
    result = runner.invoke(
        cli,
        [
            "certify",
            str(run),
            "--canary",
            str(run / "canary.safetensors"),
            "--key",
            str(key),
            "--out",
            str(out),
            "--no-cache",
        ],
    )
    assert result.exit_code == 0, result.output  # a certificate was written (README.md, "Exit codes")
    receipts = {s: json.loads((out / "receipts" / f"checkpoint-{s}.json").read_text()) for s in (3, 6)}
    assert all(r["canary"]["digest"]["sha256"] == canary.digest for r in receipts.values())
    assert all(math.isfinite(r["nll"]) and r["nonfinite_weights"] == [] for r in receipts.values())

    envelope = json.loads((out / "receipts" / "envelope.json").read_text())
    assert envelope["source"] == "logs" and envelope["origin"].endswith("metrics.jsonl")
    logged = {line["step"]: line for line in _lines(run / "metrics.jsonl")}
    assert sorted(logged) == list(range(1, STEPS + 1))
    pooled = envelope["series"]["pooled"]
    assert pooled, "the envelope has no samples"
    for sample in pooled:  # each V is the variance of the logged norms of that step
        g = [
            x
            for layer in sorted(logged[sample["step"]]["expert_grad_norms"], key=int)
            for x in logged[sample["step"]]["expert_grad_norms"][layer]
        ]
        assert math.isclose(sample["value"], var_grad(g), rel_tol=1e-9)
        assert math.isfinite(sample["bound"])

    payload = json.loads(base64.b64decode(json.loads((out / "certificate.json").read_text())["payload"]))
    inputs = payload["predicate"]["inputs"]
    assert inputs["metrics"]["sha256"] == hashlib.sha256((run / "metrics.jsonl").read_bytes()).hexdigest()
    assert "probe" in inputs

    probes = _lines(run / "canary_probe.jsonl")
    assert [p["step"] for p in probes] == [3, 6]
    for p in probes:
        assert p["canary"] == canary.digest
        r = receipts[p["step"]]
        assert math.isclose(p["loss"], r["nll"], rel_tol=1e-5)
        for layer in r["layers"]:
            assert _close(p["expert_grad_norms"][str(layer["layer"])], layer["gradients"]["grad_norms"], REL)


def test_transformers_trainer_run_is_certified(tmp_path: Path) -> None:
    from moeaudit.integrations.transformers import MoeauditCallback

    run, canary, tokens = tmp_path / "run", _canary(), _tokens()
    model = tiny_model("mixtral")
    loss1, norms1, total1 = _step1(model, tokens[:BATCH])
    data = [{"input_ids": row, "labels": row} for row in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS,
        save_steps=SAVE,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        train_sampling_strategy="sequential",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=1,
        save_only_model=True,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[MoeauditCallback(canary)])
    trainer.train()

    first = _lines(run / "metrics.jsonl")[0]
    assert first["step"] == 1 and math.isclose(first["loss"], loss1, rel_tol=1e-5)
    # on_pre_optimizer_step sees the clipped gradient: every norm scaled by 1/(total + 1e-6)
    assert total1 > 1.0 and first["clipped"] is True
    scale = 1.0 / (total1 + 1e-6)
    for layer, norms in norms1.items():
        assert _close(first["expert_grad_norms"][layer], [g * scale for g in norms], 1e-4)
    assert read_metrics(run / "metrics.jsonl").findings == ()
    assert _load(run / "canary.safetensors") == canary
    _certify_and_check(run, canary, tmp_path)


def test_lightning_run_is_certified(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from moeaudit.integrations.lightning import MoeauditCallback

    class Module(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    run, canary, tokens = tmp_path / "run", _canary(), _tokens()
    model = tiny_model("mixtral")
    loss1, norms1, total1 = _step1(model, tokens[:BATCH])
    trainer = L.Trainer(
        max_steps=STEPS,
        default_root_dir=str(run),
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[MoeauditCallback(canary, save_every=SAVE)],
    )
    trainer.fit(Module(model), torch.utils.data.DataLoader(tokens, batch_size=BATCH))

    assert sorted(p.name for p in run.iterdir()) == [
        "canary.safetensors",
        "canary_probe.jsonl",
        "checkpoint-3",
        "checkpoint-6",
        "metrics.jsonl",
    ]
    first = _lines(run / "metrics.jsonl")[0]
    assert first["step"] == 1 and math.isclose(first["loss"], loss1, rel_tol=1e-5)
    # Lightning calls on_before_optimizer_step before clipping: the unclipped norms
    assert total1 > 1.0
    for layer, norms in norms1.items():
        assert _close(first["expert_grad_norms"][layer], norms, 1e-4)
    _certify_and_check(run, canary, tmp_path)


def test_lightning_refuses_to_overwrite_a_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from moeaudit.errors import InputError
    from moeaudit.integrations.lightning import save_checkpoint

    target = tmp_path / "checkpoint-3"
    target.mkdir()
    (target / "config.json").write_text("{}")
    with pytest.raises(InputError, match="already exists"):
        save_checkpoint(tiny_model("mixtral"), target)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-3"]  # no staging left behind


def test_a_different_canary_in_the_run_is_refused(tmp_path: Path) -> None:
    from moeaudit import canary as canary_mod
    from moeaudit.errors import CanaryError
    from moeaudit.integrations.core import RunRecorder

    other = Canary(np.zeros((2, 4), "int32"), np.zeros(2, "int32"), ("x",))
    canary_mod.save(other, tmp_path / "canary.safetensors")
    with pytest.raises(CanaryError, match="different canary"):
        RunRecorder(tmp_path, tiny_model("mixtral"), canary=_canary(), every=1, probe=True, resume_step=None)
    assert not (tmp_path / "metrics.jsonl").exists()


def _load(path: Path) -> Canary:
    from moeaudit import canary as canary_mod

    return canary_mod.load(path)


def test_transformers_resume_keeps_one_line_per_step(tmp_path: Path) -> None:
    """Resuming from checkpoint-3 drops the interrupted process's lines after step 3 (else the
    reader refuses step 4 as out of order) and logs steps 4-6 again from the resumed weights."""
    from moeaudit.integrations.transformers import MoeauditCallback

    run, canary, tokens = tmp_path / "run", _canary(), _tokens()
    data = [{"input_ids": row, "labels": row} for row in tokens]

    def train(resume: bool) -> None:
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
        )
        # transformers 5.24's Trainer resume does not map Mixtral's saved per-expert names back to
        # its fused experts (the resumed loss differs from checkpoint-3's): start from_pretrained
        model = (
            transformers.AutoModelForCausalLM.from_pretrained(
                run / "checkpoint-3", dtype=torch.float32, attn_implementation="eager"
            )
            if resume
            else tiny_model("mixtral")
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[MoeauditCallback(canary)])
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-3") if resume else None)

    train(resume=False)
    before = _lines(run / "metrics.jsonl")
    train(resume=True)
    after = _lines(run / "metrics.jsonl")
    assert [line["step"] for line in after] == list(range(1, STEPS + 1))
    assert after[:3] == before[:3]  # kept as written
    for old, new in zip(before[3:], after[3:]):  # the same data and weights: the same numbers again
        assert math.isclose(old["loss"], new["loss"], rel_tol=1e-5)
        assert _close(old["expert_grad_norms"]["0"], new["expert_grad_norms"]["0"], 1e-4)
    assert [p["step"] for p in _lines(run / "canary_probe.jsonl")] == [3, 6]
    read_metrics(run / "metrics.jsonl")  # a strict reader accepts it


def test_transformers_gradient_accumulation_logs_the_whole_step(tmp_path: Path) -> None:
    """Two micro-batches of 4 per optimizer step: one line per optimizer step, with the loss and
    the per-expert norms of the whole 8-row step (the Trainer normalises by the step's tokens)."""
    from moeaudit.integrations.transformers import MoeauditCallback

    run, tokens = tmp_path / "run", _tokens()
    model = tiny_model("mixtral")
    loss1, norms1, total1 = _step1(model, tokens[:BATCH])
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=2,
        per_device_train_batch_size=BATCH // 2,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        max_grad_norm=1.0,
        report_to=[],
        train_sampling_strategy="sequential",
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    trainer = transformers.Trainer(
        model=model,
        args=args,
        callbacks=[MoeauditCallback()],
        train_dataset=[{"input_ids": r, "labels": r} for r in tokens],
    )
    trainer.train()
    lines = _lines(run / "metrics.jsonl")
    assert [line["step"] for line in lines] == [1, 2]
    first = lines[0]
    assert math.isclose(first["loss"], loss1, rel_tol=1e-5)
    assert total1 > 1.0 and first["clipped"] is True
    for layer, norms in norms1.items():
        assert _close(first["expert_grad_norms"][layer], [g / (total1 + 1e-6) for g in norms], 1e-4)


def test_transformers_bf16_probe_is_float32_as_the_replay(tmp_path: Path) -> None:
    """With ``bf16=True`` accelerate wraps the model's forward in bf16 autocast for every call;
    the canary probe at a save must still be the float32 quantity a replay of that checkpoint
    computes, not its bf16 approximation (about 1% off in the per-expert norms)."""
    from moeaudit.integrations.core import canary_loss
    from moeaudit.integrations.transformers import MoeauditCallback

    run, canary, tokens = tmp_path / "run", _canary(), _tokens()
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=BATCH,
        learning_rate=3e-3,
        bf16=True,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_only_model=True,
    )
    trainer = transformers.Trainer(
        model=tiny_model("mixtral"),
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in tokens],
        callbacks=[MoeauditCallback(canary)],
    )
    trainer.train()
    (probe,) = _lines(run / "canary_probe.jsonl")
    saved = transformers.AutoModelForCausalLM.from_pretrained(
        run / "checkpoint-2", dtype=torch.float32, attn_implementation="eager"
    ).eval()
    loss = canary_loss(saved, canary)
    loss.backward()
    assert math.isclose(probe["loss"], float(loss.detach()), rel_tol=1e-7)
    for i, layer in enumerate(saved.model.layers):
        gate_up, down = layer.mlp.experts.gate_up_proj.grad, layer.mlp.experts.down_proj.grad
        norms = [math.sqrt(float(gate_up[e].double().pow(2).sum() + down[e].double().pow(2).sum())) for e in range(4)]
        assert _close(probe["expert_grad_norms"][str(i)], norms, 1e-5)


def test_a_dense_model_is_refused_naming_it_and_writing_nothing(tmp_path: Path) -> None:
    """A callback on a model with no routed experts (a dense Llama) is refused before anything
    is written into the run: no canary copy is left behind, and the error names the model."""
    from moeaudit.errors import InputError
    from moeaudit.integrations.core import RunRecorder

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    refused = r"no routed-expert parameters found in LlamaForCausalLM \(model_type 'llama'\)"
    with pytest.raises(InputError, match=refused):
        RunRecorder(tmp_path / "run", model, canary=_canary(), every=1, probe=True, resume_step=None)
    assert not (tmp_path / "run").exists()


def test_lightning_resume_below_kept_saves_is_refused_before_training(tmp_path: Path) -> None:
    """Resuming from step 3 a run that already saved checkpoint-6 would train three steps and
    then stop at the save of checkpoint-6 (never overwritten). It is refused at the start,
    naming the saves above the resume step, before the logs are rewound."""
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from moeaudit.errors import InputError
    from moeaudit.integrations.lightning import MoeauditCallback

    run = tmp_path / "run"
    for step in (3, 6, 9):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    log = b"".join(json.dumps({"step": s}).encode() + b"\n" for s in range(1, 10))
    (run / "metrics.jsonl").write_bytes(log)
    callback = MoeauditCallback(_canary(), save_every=3, run_dir=run)
    trainer = SimpleNamespace(global_step=3, default_root_dir=str(tmp_path), is_global_zero=True)
    with pytest.raises(InputError, match=r"checkpoint-6, checkpoint-9 .*above the resume step 3") as raised:
        callback.on_train_start(trainer, tiny_model("mixtral"))
    assert str(run) in str(raised.value)
    assert (run / "metrics.jsonl").read_bytes() == log  # not rewound
    assert not (run / "canary.safetensors").exists()
    last = SimpleNamespace(global_step=9, default_root_dir=str(tmp_path), is_global_zero=True)
    callback.on_train_start(last, tiny_model("mixtral"))
    assert callback.recorder is not None  # resuming from the last save is fine


def test_a_resume_is_declared_in_events_so_abandoned_saves_are_named(tmp_path: Path) -> None:
    """A callback resumed at step 3 rewinds the logs to step 3 and declares the resume in
    ``events.jsonl`` (once, however often it is resumed there), so certify can name the saves
    the resume abandoned (checkpoint-6, checkpoint-9 of the branch that went past step 3)."""
    from types import SimpleNamespace

    from moeaudit.integrations.core import RunRecorder
    from moeaudit.lineage import abandoned
    from moeaudit.run import Run, read_events

    run = tmp_path / "run"
    run.mkdir()
    norms = {str(i): [0.1] * 4 for i in range(3)}
    lines = [json.dumps({"step": s, "loss": 1.0, "expert_grad_norms": norms}) + "\n" for s in range(1, 10)]
    (run / "metrics.jsonl").write_text("".join(lines))
    RunRecorder(tmp_path / "fresh", tiny_model("mixtral"), canary=None, every=1, probe=False, resume_step=None).close()
    assert not (tmp_path / "fresh" / "events.jsonl").exists()  # a fresh start declares nothing
    for _ in range(2):
        RunRecorder(run, tiny_model("mixtral"), canary=None, every=1, probe=False, resume_step=3).close()
    events, _ = read_events(run / "events.jsonl")
    assert [(e.step, e.event) for e in events] == [(3, "resume")]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    ckpts = [(s, SimpleNamespace(path=run / f"checkpoint-{s}")) for s in (3, 6, 9)]
    found = abandoned(Run(run, ckpts, events=events, metrics=run / "metrics.jsonl"))  # type: ignore[arg-type]
    assert [(a.name, a.resume_step) for a in found] == [("checkpoint-6", 3), ("checkpoint-9", 3)]


@pytest.mark.parametrize("log", ["metrics.jsonl", "canary_probe.jsonl"])
def test_a_fresh_start_into_a_logged_run_is_refused_before_training(tmp_path: Path, log: str) -> None:
    """Training from step 0 again into a directory that already holds a run's logs (the same
    script run twice) would append a second step 1 after the first run's last step: certify
    then refuses the log as out of order, after the whole training. The callbacks refuse at
    the start instead, naming the log, and leave every file as it was."""
    from moeaudit.errors import InputError
    from moeaudit.integrations.core import RunRecorder
    from moeaudit.integrations.transformers import MoeauditCallback

    run = tmp_path / "run"
    run.mkdir()
    earlier = json.dumps({"step": 6, "loss": 1.0, "expert_grad_norms": {"0": [0.1] * 4}}) + "\n"
    (run / log).write_text(earlier)
    refused = rf"{log} already holds the log of an earlier run \(last step 6\)"
    with pytest.raises(InputError, match=refused):
        RunRecorder(run, tiny_model("mixtral"), canary=_canary(), every=1, probe=True, resume_step=None)
    assert sorted(p.name for p in run.iterdir()) == [log] and (run / log).read_text() == earlier
    args = transformers.TrainingArguments(
        output_dir=str(run), max_steps=1, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True
    )
    trainer = transformers.Trainer(
        model=tiny_model("mixtral"),
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in _tokens()[:8]],
        callbacks=[MoeauditCallback(_canary())],
    )
    with pytest.raises(InputError, match=refused):
        trainer.train()
    assert sorted(p.name for p in run.iterdir()) == [log] and (run / log).read_text() == earlier


def test_lightning_without_save_every_warns_that_nothing_will_be_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MoeauditCallback(canary=...) without save_every (as the transformers callback is written)
    saves no checkpoint-<step>/ and so no probe: certify would find nothing after the whole
    training. One warning at the start says so; with save_every there is none."""
    pytest.importorskip("lightning")
    import logging
    from types import SimpleNamespace

    from moeaudit.integrations.lightning import MoeauditCallback

    trainer = SimpleNamespace(global_step=0, default_root_dir=str(tmp_path / "run"), is_global_zero=True)
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        MoeauditCallback(_canary()).on_train_start(trainer, tiny_model("mixtral"))
    (record,) = [r for r in caplog.records if r.name == "moeaudit"]
    assert "(save_every=None): no checkpoint-<step>/ is saved" in record.getMessage()
    assert "\n" not in record.getMessage()
    caplog.clear()
    saving = SimpleNamespace(global_step=0, default_root_dir=str(tmp_path / "run2"), is_global_zero=True)
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        MoeauditCallback(_canary(), save_every=3).on_train_start(saving, tiny_model("mixtral"))
    assert [r for r in caplog.records if r.name == "moeaudit"] == []


def test_a_model_in_bf16_weights_warns_that_its_probe_is_not_the_replays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights held in bf16 (not mixed precision) make the probe compute in bf16 while a replay
    computes in float32 (V 3.4 % apart on a tiny Mixtral): one warning line says so; float32
    weights (mixed precision keeps them) and a run without a probe get none."""
    import logging

    from moeaudit.integrations.core import RunRecorder

    cases = ((torch.bfloat16, True, True), (torch.float32, True, False), (torch.bfloat16, False, False))
    for dtype, probe, warned in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moeaudit"):
            model = tiny_model("mixtral").to(dtype)
            RunRecorder(
                tmp_path / f"{dtype}-{probe}", model, canary=_canary(), every=1, probe=probe, resume_step=None
            ).close()
        lines = [r.getMessage() for r in caplog.records if r.name == "moeaudit" and "weights are" in r.getMessage()]
        assert len(lines) == int(warned), (dtype, probe, lines)
        if warned:
            assert "weights are bfloat16, so the canary probe computes in bfloat16" in lines[0]
            assert "\n" not in lines[0]
