"""In a real training run: the per-layer ``moe/…`` scalars reach the tracker
the trainer reports to (a TensorBoard event file read back with the ``tensorboard`` package; the
Trainer's ``log_history``; Lightning's loggers), and envelope events raised online reach the
training log and the tracker with the same result as ``moeaudit envelope`` on the written log."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from moeaudit.cli import cli
from moeaudit.integrations.online import events_of_report

transformers = pytest.importorskip("transformers")
from hfmodels import VOCAB, tiny_model  # noqa: E402

STEPS, LOG_EVERY, BATCH, SEQ = 4, 2, 8, 16
POLICY = "[envelope]\nstarve_share = 0.9\nstarve_steps = 2\n"  # fires on a tiny random model
LAYER_TAGS = (
    "pi_min",
    "load_entropy_norm",
    "dead_experts",
    "near_dead_experts",
    "grad_norm_max",
    "grad_norm_min",
    "envelope_margin",
)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _routing_pi_min(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict[str, float]:
    """π_min per layer over ``batches`` from the router logits of an untouched copy (lr = 0:
    the weights the Trainer routed with)."""
    model = copy.deepcopy(model).train()
    k, E = model.config.num_experts_per_tok, model.config.num_local_experts
    counts: dict[int, torch.Tensor] = {}
    tokens = 0
    with torch.no_grad():
        for b in batches:
            out = model(input_ids=b, output_router_logits=True)
            for i, logits in enumerate(out.router_logits):
                c = torch.bincount(logits.topk(k, dim=-1).indices.reshape(-1), minlength=E)
                counts[i] = counts.get(i, 0) + c
            tokens += b.numel()
    return {str(i): float(c.min()) / tokens for i, c in counts.items()}


def _scalars(logdir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(logdir.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    # the Trainer's rewrite_logs files every training key under train/ (train/loss too)
    return {tag.removeprefix("train/"): {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_trainer_reports_moe_scalars_to_tensorboard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("tensorboard")
    from moeaudit.integrations.transformers import MoeauditCallback

    run, tokens = tmp_path / "run", _tokens()
    (tmp_path / "policy.toml").write_text(POLICY)
    model = tiny_model("mixtral")
    want_pi = _routing_pi_min(model, [tokens[:BATCH], tokens[BATCH : 2 * BATCH]])
    args = transformers.TrainingArguments(
        output_dir=str(run),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.0,
        report_to=["tensorboard"],
        logging_steps=LOG_EVERY,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in tokens]
    )
    MoeauditCallback(envelope=tmp_path / "policy.toml").attach(trainer)
    with caplog.at_level(logging.WARNING, logger="moeaudit"):
        trainer.train()

    scalars = _scalars(run)
    lines = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    layers = [str(i) for i in range(model.config.num_hidden_layers)]
    for layer in layers:
        for tag in LAYER_TAGS:
            assert set(scalars[f"moe/layer_{layer}/{tag}"]) == {2, 4}, tag
        # the routing of steps 1-2, counted by the hook = recomputed from the router logits
        assert scalars[f"moe/layer_{layer}/pi_min"][2] == pytest.approx(want_pi[layer], rel=1e-6)
        for step in (2, 4):  # gradient scalars: those of the logged step
            g = lines[step]["expert_grad_norms"][layer]
            assert scalars[f"moe/layer_{layer}/grad_norm_max"][step] == pytest.approx(max(g), rel=1e-6)
            assert scalars[f"moe/layer_{layer}/grad_norm_min"][step] == pytest.approx(min(g), rel=1e-6)
    assert set(scalars["moe/pooled/envelope_margin"]) == {2, 4}

    # the Trainer's own log: the same scalars in log_history (→ trainer_state.json)
    history = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert history[2]["moe/layer_0/pi_min"] == pytest.approx(scalars["moe/layer_0/pi_min"][2], rel=1e-6)

    # online events: warnings in the training log, counted in the tracker, = the CLI's report
    report_path = tmp_path / "report.json"
    result = CliRunner().invoke(
        cli,
        ["envelope", str(run / "metrics.jsonl"), "--policy", str(tmp_path / "policy.toml"), "--json", str(report_path)],
    )
    assert result.exit_code in (0, 1), result.output
    want = events_of_report(json.loads(report_path.read_text()), calibrated=False)
    assert want and all(e.kind == "starvation" for e in want)
    warned = [r.getMessage() for r in caplog.records if r.name == "moeaudit"]
    assert sorted(warned) == sorted(e.message() for e in want)
    assert scalars["moe/envelope_events"][4] == len(want)


def test_lightning_reports_moe_scalars_to_its_logger(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from lightning.pytorch.loggers import CSVLogger

    from moeaudit.integrations.lightning import MoeauditCallback

    class Module(L.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self, model: torch.nn.Module):
            super().__init__()
            self.model = model

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    model = tiny_model("mixtral")
    tokens = _tokens()
    want_pi = _routing_pi_min(model, [tokens[:BATCH], tokens[BATCH : 2 * BATCH]])
    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    trainer = L.Trainer(
        max_steps=STEPS,
        default_root_dir=str(tmp_path / "run"),
        accelerator="cpu",
        logger=logger,
        log_every_n_steps=LOG_EVERY,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[MoeauditCallback()],
    )
    trainer.fit(Module(model), torch.utils.data.DataLoader(tokens, batch_size=BATCH))
    import csv

    (metrics,) = list((tmp_path / "logs").rglob("metrics.csv"))
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("moe/layer_0/pi_min")]
    assert [int(r["step"]) for r in rows] == [2, 4]
    assert float(rows[0]["moe/layer_0/pi_min"]) == pytest.approx(want_pi["0"], rel=1e-6)
    assert all(r.get(f"moe/layer_2/{tag}") for r in rows for tag in LAYER_TAGS)
