"""The training hook (docs/envelope.md, "Reading `metrics.jsonl`"): per-expert gradient norms appended to
``metrics.jsonl``.

The logged norms must be the norms of the parameters' gradients — on a transformers v5 model
(fused ``gate_up_proj``/``down_proj``), on per-expert parameters (transformers v4 / on-disk
names) and on our own ``LayerWeights`` — and must agree with the replay's per-expert
gradients on the same checkpoint and tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from support.hooks import _per_expert_params  # noqa: E402

from moeaudit.errors import InputError
from moeaudit.integrations.hooks import ExpertGradLogger, template_regex
from moeaudit.replay.model import rope_tables
from moeaudit.samples.train import Arch, forward_loss, init_model


def read_jsonl(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def check_spec_format(record: dict, layers: list[int], num_experts: int) -> None:
    """Step int, loss float, expert_grad_norms {"<layer>": [float x E]}."""
    assert isinstance(record["step"], int)
    assert isinstance(record["loss"], float)
    assert sorted(record["expert_grad_norms"]) == sorted(str(i) for i in layers)
    for norms in record["expert_grad_norms"].values():
        assert len(norms) == num_experts
        assert all(isinstance(g, float) and math.isfinite(g) and g >= 0 for g in norms)
    assert sorted(record["router_grad_norms"]) == sorted(str(i) for i in layers)


# --- transformers models -------------------------------------------------------------------------


def _hf_backward(family: str):
    pytest.importorskip("transformers")
    from hfmodels import random_tokens, tiny_model

    model = tiny_model(family)
    tokens = random_tokens(3, 12)
    out = model(input_ids=tokens.long(), labels=tokens.long())
    out.loss.backward()
    return model, out.loss, tokens


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_transformers_norms_equal_param_grads(tmp_path: Path, family: str) -> None:
    model, loss, _ = _hf_backward(family)
    logger = ExpertGradLogger(tmp_path / "metrics.jsonl", model, every=1)
    record = logger.log(1, loss)
    logger.close()
    layers = list(range(model.config.num_hidden_layers))
    E = model.config.num_local_experts if family == "mixtral" else model.config.num_experts
    check_spec_format(record, layers, E)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [record]
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        gate_up, down = mlp.experts.gate_up_proj.grad.double(), mlp.experts.down_proj.grad.double()
        want = [math.sqrt(float(gate_up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(E)]
        assert record["expert_grad_norms"][str(i)] == pytest.approx(want, rel=1e-12)
        router = float(mlp.gate.weight.grad.double().norm())
        assert record["router_grad_norms"][str(i)] == pytest.approx(router, rel=1e-12)
        if family == "qwen2_moe":
            shared = [*mlp.shared_expert.parameters(), mlp.shared_expert_gate.weight]
            want_shared = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in shared))
            assert record["shared_grad_norms"][str(i)] == pytest.approx(want_shared, rel=1e-12)
        else:
            assert "shared_grad_norms" not in record


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "dots1"])
def test_hook_on_transformers_deepseek_v3_and_glm(tmp_path: Path, family: str) -> None:
    """Dense first layer skipped, routed layers' fused experts, router weight (not the bias
    buffer), ungated shared experts."""
    model, loss, _ = _hf_backward(family)
    record = ExpertGradLogger(tmp_path / "metrics.jsonl", model, every=1).log(1, loss)
    routed = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    assert routed == [1, 2]
    E = model.config.n_routed_experts
    check_spec_format(record, routed, E)
    for i in routed:
        mlp = model.model.layers[i].mlp
        gate_up, down = mlp.experts.gate_up_proj.grad.double(), mlp.experts.down_proj.grad.double()
        want = [math.sqrt(float(gate_up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(E)]
        assert record["expert_grad_norms"][str(i)] == pytest.approx(want, rel=1e-12)
        assert record["router_grad_norms"][str(i)] == pytest.approx(
            float(mlp.gate.weight.grad.double().norm()), rel=1e-12
        )
        shared = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in mlp.shared_experts.parameters()))
        assert record["shared_grad_norms"][str(i)] == pytest.approx(shared, rel=1e-12)


def test_hook_on_transformers_hunyuan(tmp_path: Path) -> None:
    """Hunyuan's names: router ``mlp.gate.wg``, ungated shared MLP ``mlp.shared_mlp``."""
    model, loss, _ = _hf_backward("hunyuan_v1_moe")
    record = ExpertGradLogger(tmp_path / "metrics.jsonl", model, every=1).log(1, loss)
    E = model.config.num_experts
    check_spec_format(record, [0, 1, 2], E)
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp
        gate_up, down = mlp.experts.gate_up_proj.grad.double(), mlp.experts.down_proj.grad.double()
        want = [math.sqrt(float(gate_up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(E)]
        assert record["expert_grad_norms"][str(i)] == pytest.approx(want, rel=1e-12)
        assert record["router_grad_norms"][str(i)] == pytest.approx(
            float(mlp.gate.wg.weight.grad.double().norm()), rel=1e-12
        )
        shared = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in mlp.shared_mlp.parameters()))
        assert shared > 0 and record["shared_grad_norms"][str(i)] == pytest.approx(shared, rel=1e-12)


@pytest.mark.parametrize(
    "family, moe, router",
    [
        ("granitemoe", "block_sparse_moe", "router"),
        ("ernie4_5_moe", "mlp", "gate"),
        ("minimax_m2", "mlp", "gate"),
        ("llama4_text", "feed_forward", "router"),
        ("phimoe", "mlp", "router"),
    ],
)
def test_hook_on_registry_era_families(tmp_path: Path, family: str, moe: str, router: str) -> None:
    """The layouts' module-name alternatives find these families' live parameters: per-expert
    norms and the router norm equal the parameters' gradients."""
    model, loss, _ = _hf_backward(family)
    record = ExpertGradLogger(tmp_path / "metrics.jsonl", model, every=1).log(1, loss)
    routed = [i for i, layer in enumerate(model.model.layers) if hasattr(getattr(layer, moe), "experts")]
    assert routed and sorted(record["expert_grad_norms"]) == [str(i) for i in routed]
    for i in routed:
        block = getattr(model.model.layers[i], moe)
        gate_up, down = block.experts.gate_up_proj.grad.double(), block.experts.down_proj.grad.double()
        want = [math.sqrt(float(gate_up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(gate_up.shape[0])]
        assert record["expert_grad_norms"][str(i)] == pytest.approx(want, rel=1e-12)
        assert record["router_grad_norms"][str(i)] == pytest.approx(
            float(getattr(block, router).weight.grad.double().norm()), rel=1e-12
        )


def test_hook_on_transformers_gpt_oss(tmp_path: Path) -> None:
    """gpt-oss: an expert's norm covers its slices of the fused weights and biases; the
    router's covers its weight and its bias."""
    model, loss, _ = _hf_backward("gpt_oss")
    record = ExpertGradLogger(tmp_path / "metrics.jsonl", model, every=1).log(1, loss)
    E = model.config.num_local_experts
    check_spec_format(record, [0, 1, 2], E)
    for i, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        fused = [ex.gate_up_proj, ex.down_proj, ex.gate_up_proj_bias, ex.down_proj_bias]
        want = [math.sqrt(sum(float(p.grad[e].double().pow(2).sum()) for p in fused)) for e in range(E)]
        assert record["expert_grad_norms"][str(i)] == pytest.approx(want, rel=1e-12)
        router = layer.mlp.router
        want_router = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in (router.weight, router.bias)))
        assert router.bias.grad.abs().sum() > 0
        assert record["router_grad_norms"][str(i)] == pytest.approx(want_router, rel=1e-12)


def test_hook_agrees_with_replay_gradients(tmp_path: Path) -> None:
    """External check: autograd through transformers (hook) vs. our streaming replay."""
    pytest.importorskip("transformers")
    from hfmodels import load, random_tokens, save_tiny

    from moeaudit.checkpoint import Checkpoint
    from moeaudit.replay import replay

    save_tiny(tmp_path / "ckpt", "mixtral")
    model = load(tmp_path / "ckpt")
    tokens = random_tokens(3, 12)
    out = model(input_ids=tokens.long(), labels=tokens.long())
    out.loss.backward()
    record = ExpertGradLogger(tmp_path / "m.jsonl", model).log(1, out.loss)
    result = replay(Checkpoint(tmp_path / "ckpt"), tokens)
    assert record["loss"] == pytest.approx(result.nll, rel=1e-4)
    for layer, grads in result.grads.items():
        torch.testing.assert_close(
            torch.tensor(record["expert_grad_norms"][str(layer)], dtype=torch.float64),
            grads.experts_E,
            rtol=2e-3,
            atol=1e-7,
        )
        assert record["router_grad_norms"][str(layer)] == pytest.approx(grads.router, rel=2e-3)


def test_probe_on_transformers_equals_replay_and_leaves_grad_alone(tmp_path: Path) -> None:
    """The canary probe inside a transformers training step: its norms are the replay's on
    the same checkpoint and tokens (external check: HF autograd vs our streaming replay), and
    the training step's ``.grad`` are the same bytes before and after."""
    pytest.importorskip("transformers")
    from hfmodels import load, random_tokens, save_tiny

    from moeaudit.checkpoint import Checkpoint
    from moeaudit.replay import replay

    save_tiny(tmp_path / "ckpt", "qwen2_moe")
    model = load(tmp_path / "ckpt")
    batch, canary = random_tokens(2, 10, seed=2), random_tokens(3, 12)
    model(input_ids=batch.long(), labels=batch.long()).loss.backward()  # the training step's
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logger = ExpertGradLogger(tmp_path / "metrics.jsonl", model)
    probe_loss = model(input_ids=canary.long(), labels=canary.long()).loss
    record = logger.probe(250, probe_loss, canary="sha256:test")
    logger.close()
    after = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert read_jsonl(tmp_path / "canary_probe.jsonl") == [record]
    assert not (tmp_path / "metrics.jsonl").exists()
    assert record["step"] == 250 and record["canary"] == "sha256:test"
    result = replay(Checkpoint(tmp_path / "ckpt"), canary)
    assert record["loss"] == pytest.approx(result.nll, rel=1e-5)
    for layer, grads in result.grads.items():
        torch.testing.assert_close(
            torch.tensor(record["expert_grad_norms"][str(layer)], dtype=torch.float64),
            grads.experts_E,
            rtol=2e-4,
            atol=1e-9,
        )
        assert record["router_grad_norms"][str(layer)] == pytest.approx(grads.router, rel=2e-4)
        assert record["shared_grad_norms"][str(layer)] == pytest.approx(grads.shared, rel=2e-4)


def test_probe_needs_a_loss_with_a_graph(tmp_path: Path) -> None:
    logger = ExpertGradLogger(tmp_path / "m.jsonl", _per_expert_params())
    with pytest.raises(ValueError, match="scalar tensor with a graph"):
        logger.probe(1, torch.tensor(1.0))


def test_probe_file_repaired_on_resume(tmp_path: Path) -> None:
    named = _per_expert_params()
    probe = tmp_path / "canary_probe.jsonl"
    probe.write_text('{"step": 250, "loss": 1.0}\n{"step": 500, "loss": 1.0}\n{"step": 7')
    ExpertGradLogger(tmp_path / "metrics.jsonl", named, resume_step=250)
    assert probe.read_text() == '{"step": 250, "loss": 1.0}\n'


# --- per-expert names (transformers v4, on-disk layout) and our LayerWeights ---------------------


@pytest.mark.parametrize("prefix", ["", "module.", "base_model.model."])
def test_per_expert_names(tmp_path: Path, prefix: str) -> None:
    named = _per_expert_params(prefix)
    grads = {n: t.grad.double() for n, t in named}
    record = ExpertGradLogger(tmp_path / "m.jsonl", named, family="mixtral").log(5, 1.5)
    check_spec_format(record, [0, 1], 3)
    for layer in range(2):
        base = f"{prefix}model.layers.{layer}.block_sparse_moe."
        want = [
            math.sqrt(sum(float(grads[f"{base}experts.{e}.{w}.weight"].pow(2).sum()) for w in ("w1", "w3", "w2")))
            for e in range(3)
        ]
        assert record["expert_grad_norms"][str(layer)] == pytest.approx(want, rel=1e-12)
        assert record["router_grad_norms"][str(layer)] == pytest.approx(
            float(grads[base + "gate.weight"].norm()), rel=1e-12
        )


def test_unknown_family_tries_every_layout(tmp_path: Path) -> None:
    named = _per_expert_params()
    record = ExpertGradLogger(tmp_path / "m.jsonl", named).log(1, 0.5)
    assert sorted(record["expert_grad_norms"]) == ["0", "1"]


def test_missing_grad_counts_as_zero(tmp_path: Path) -> None:
    named = _per_expert_params()
    for name, t in named:
        if ".experts.1." in name:
            t.grad = None
    record = ExpertGradLogger(tmp_path / "m.jsonl", named).log(1, 0.5)
    assert record["expert_grad_norms"]["0"][1] == 0.0


def test_layer_weights_of_our_training_loop(tmp_path: Path) -> None:
    arch = Arch(hidden=16, layers=2, heads=2, kv_heads=1, experts=4, expert_dim=8)
    model = init_model(arch, seed=0)
    tokens = torch.randint(0, arch.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ce, _ = forward_loss(model, tokens, rope_tables(model.spec, 8))
    ce.backward()
    record = ExpertGradLogger(tmp_path / "m.jsonl", model.layers).log(2, ce)
    check_spec_format(record, [0, 1], 4)
    assert record["loss"] == pytest.approx(float(ce.detach()))
    for lw in model.layers:
        want = [math.sqrt(sum(float(t.grad.double().pow(2).sum()) for t in w.values())) for w in lw.experts]
        assert record["expert_grad_norms"][str(lw.layer)] == pytest.approx(want, rel=1e-12)


def test_qwen2_layout_regexes_come_from_the_layout_table() -> None:
    rx = template_regex("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight")
    m = rx.search("model.layers.12.mlp.experts.3.gate_proj.weight")
    assert m is not None and (m["layer"], m["expert"]) == ("12", "3")
    assert rx.search("layers.2.mlp.experts.0.gate_proj.weight") is not None  # bare base model
    assert rx.search("model.layers.2.mlp.experts.0.gate_proj.weight.extra") is None
    assert rx.search("model.xlayers.2.mlp.experts.0.gate_proj.weight") is None


# --- the file ------------------------------------------------------------------------------------


def test_every_k_steps(tmp_path: Path) -> None:
    named = _per_expert_params()
    with ExpertGradLogger(tmp_path / "m.jsonl", named, every=3) as logger:
        written = [logger.log(step, 1.0 / step) for step in range(1, 11)]
    assert [r is not None for r in written] == [s % 3 == 0 for s in range(1, 11)]
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [3, 6, 9]


def test_nonfinite_values_are_null_and_named(tmp_path: Path) -> None:
    named = _per_expert_params()
    dict(named)["model.layers.1.block_sparse_moe.experts.2.w3.weight"].grad[0, 0] = float("nan")
    with ExpertGradLogger(tmp_path / "m.jsonl", named) as logger:
        logger.log(1, float("inf"), lr=1e-3)
    (record,) = read_jsonl(tmp_path / "m.jsonl")  # strict JSON: no NaN/Infinity tokens
    assert "NaN" not in (tmp_path / "m.jsonl").read_text()
    assert record["loss"] is None
    assert record["expert_grad_norms"]["1"][2] is None
    assert record["expert_grad_norms"]["1"][1] is not None
    assert record["nonfinite"] == ["loss", "expert_grad_norms.1.2"]
    assert record["lr"] == 1e-3


def test_appends_and_repairs_on_resume(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    named = _per_expert_params()
    with ExpertGradLogger(path, named, every=10) as logger:
        for step in range(1, 51):
            logger.log(step, 1.0)
    with open(path, "a") as f:  # a crash in the middle of a write
        f.write('{"step": 60, "loss": 1.0, "expert_gr')
    with ExpertGradLogger(path, named, every=10, resume_step=30) as logger:
        for step in range(31, 41):
            logger.log(step, 2.0)
    records = read_jsonl(path)
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert records[-1]["loss"] == 2.0


def test_torn_line_dropped_without_resume(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    ExpertGradLogger(path, _per_expert_params())
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_no_moe_parameters_is_an_error(tmp_path: Path) -> None:
    dense = torch.nn.Linear(3, 3)
    with pytest.raises(InputError, match="no routed-expert parameters"):
        ExpertGradLogger(tmp_path / "m.jsonl", dense)
    with pytest.raises(InputError, match="unknown MoE family"):
        ExpertGradLogger(tmp_path / "m.jsonl", _per_expert_params(), family="gpt2")
    with pytest.raises(ValueError):
        ExpertGradLogger(tmp_path / "m.jsonl", _per_expert_params(), every=0)


# --- one fused pass, its accuracy, the global norm, ranks, durability ---------------------------


def test_large_tensors_chunked_norms_are_float64_accurate(tmp_path: Path) -> None:
    """Tensors past the small-tensor path (fused [E, ...] with a ragged tail, bf16, a 1-D
    router weight): float32 partial sums added in float64 stay within 1e-6 of float64 norms."""
    from moeaudit.integrations.gradnorms import CHUNK, SMALL

    gen = torch.Generator().manual_seed(0)
    E, rows, cols = 3, 301, 257  # rows·cols = 77357 ≥ SMALL, not a multiple of CHUNK
    assert rows * cols >= SMALL and (rows * cols) % CHUNK
    named = []
    for name, shape, dtype in [
        ("model.layers.0.mlp.experts.gate_up_proj", (E, rows, cols), torch.float32),
        ("model.layers.0.mlp.experts.down_proj", (E, cols, rows), torch.bfloat16),
        ("model.layers.0.mlp.gate.weight", (E, SMALL + 5), torch.float32),
    ]:
        t = torch.zeros(shape, dtype=dtype, requires_grad=True)
        t.grad = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
        named.append((name, t))
    logger = ExpertGradLogger(tmp_path / "m.jsonl", named, family="mixtral", total=True)
    record = logger.log(1, 0.0)
    up, down, router = (t.grad.double() for _, t in named)
    want = [math.sqrt(float(up[e].pow(2).sum() + down[e].pow(2).sum())) for e in range(E)]
    assert record["expert_grad_norms"]["0"] == pytest.approx(want, rel=1e-6)
    assert record["router_grad_norms"]["0"] == pytest.approx(float(router.norm()), rel=1e-6)
    total = math.sqrt(sum(float(g.pow(2).sum()) for g in (up, down, router)))
    assert math.sqrt(logger.measure().total) == pytest.approx(total, rel=1e-6)


def test_global_norm_from_the_same_pass(tmp_path: Path) -> None:
    """``total=True`` adds every other parameter (attention, embeddings …) once, tied ones once."""
    model, _, _ = _hf_backward("qwen2_moe")
    logger = ExpertGradLogger(tmp_path / "m.jsonl", model, total=True)
    want = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    assert math.sqrt(logger.measure().total) == pytest.approx(want, rel=1e-9)
    assert ExpertGradLogger(tmp_path / "n.jsonl", model).measure().total is None


def test_a_rank_that_does_not_write_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')  # not repaired either
    logger = ExpertGradLogger(tmp_path / "m.jsonl", _per_expert_params(), rank_zero=False, resume_step=0)
    assert logger.log(3, 1.0) is None
    logger.close()
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "lo'
    assert not (tmp_path / "canary_probe.jsonl").exists()


def test_lines_reach_the_file_before_any_sync(tmp_path: Path) -> None:
    """A logged line is in the file at once (a process that dies loses none), without fsync."""
    path = tmp_path / "m.jsonl"
    logger = ExpertGradLogger(path, _per_expert_params())
    logger.log(1, 1.0)
    logger.log(2, 1.0)
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]  # read before sync/close
    logger.close()


SIGTERM_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
import moeaudit.integrations.linelog as linelog
from support.hooks import _per_expert_params
from moeaudit.integrations.hooks import ExpertGradLogger
real_fsync = os.fsync
def fsync(fd):
    print("fsync", flush=True)
    real_fsync(fd)
linelog.os.fsync = fsync
logger = ExpertGradLogger({path!r}, _per_expert_params())
for step in (1, 2, 3):
    logger.log(step, 1.0)
print("ready", flush=True)
time.sleep(60)
"""


def test_sigterm_syncs_then_terminates(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    path = tmp_path / "m.jsonl"
    code = SIGTERM_CHILD.format(tests=str(Path(__file__).parent), path=str(path))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGTERM  # the default action still ends the process
    assert "fsync" in out  # the lines were made durable first
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
