"""FlexOlmo (``flex_olmo``) replayed against transformers' ``FlexOlmoForCausalLM``.

Three configurations (top-k, expert count, renormalisation, GQA or not, biases, tied embeddings
varied; FlexOlmo has no shared experts and no dense layers), each in float32 and from a bfloat16
checkpoint (transformers computing in float32 from the same stored values, as
``test_oracle_dtypes``), with the float32 tolerances of ``test_oracle``: NLL, hidden states and
router logits (``FORWARD``), gradient norms within 2e-3 relative (``GRADIENT``), identical top-k
sets on tokens whose k-th and (k+1)-th selection scores differ by more than ``TIE_GAP``.

OLMo-2 post-norm layers have no norm before the MoE block: the MoE input h is what ``mlp`` reads,
and the router reads it too (y = h, docs/decisions.md), which
``test_the_router_reads_the_residual_stream`` checks against transformers' own h. The attention
gradient norm covers the attention projections, the q/k norms and the norm on the attention
output (``post_attention_layernorm``), as the replay's attention group does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from support.oracle import FORWARD, Observed, assert_close_activations, transformers_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.model import MoETap, rms_norm  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}
SAMPLES = Path(__file__).resolve().parents[1] / "sample_checkpoints"

CASES: dict[str, dict[str, Any]] = {
    # 3 layers, top-2 of 6, not renormalised, GQA (4 heads, 2 kv heads)
    "top2-6-experts": {},
    # 4 layers, top-3 of 8 renormalised, full multi-head attention, q/k/v/o biases
    "top3-8-experts-renorm-mha-bias": {
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "norm_topk_prob": True,
        "num_key_value_heads": 4,
        "attention_bias": True,
    },
    # top-1 of 4 (no co-active pairs), tied embeddings, one kv head
    "top1-4-experts-tied-mqa": {
        "num_experts": 4,
        "num_experts_per_tok": 1,
        "tie_word_embeddings": True,
        "num_key_value_heads": 1,
    },
}


def flex_olmo_observed(model: Any, tokens_WT: torch.Tensor) -> Observed:
    """transformers' side: the MoE input h is what ``mlp`` reads (no norm precedes it; FlexOlmo's
    ``post_attention_layernorm`` norms the attention output), and the attention gradient norm
    takes in that norm's gain."""
    layers = model.model.layers
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Any:
        def hook(_module: Any, args: Any, _out: Any) -> None:
            seen[i] = args[0].detach().flatten(0, -2)

        return hook

    hooks = [layer.mlp.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    try:
        ref = transformers_observed(model, tokens_WT)
    finally:
        for h in hooks:
            h.remove()
    ref.moe_inputs = seen
    for i, layer in enumerate(layers):
        parts = ("self_attn.", "post_attention_layernorm.")
        grads = [p.grad for n, p in layer.named_parameters() if n.startswith(parts) and p.grad is not None]
        ref.attention_grads[i] = sum(float(g.double().pow(2).sum()) for g in grads) ** 0.5
    return ref


def _worst(ref: Observed, ours: Observed) -> dict[str, float]:
    """NLL abs, the worst relative gradient-norm difference (experts, attention, and the router
    where its norm is above 1e-4) and the worst absolute router-norm difference (a top-1 router
    whose softmax saturates has a gradient norm near 1e-5 made of float32 cancellation)."""
    rel, router_abs = [0.0], [0.0]
    for i in ref.scores:
        r, o = ref.expert_grads[i].double(), ours.expert_grads[i].double()
        keep = r > 1e-6
        rel.append(float(((o[keep] - r[keep]).abs() / r[keep]).max()) if keep.any() else 0.0)
        for name, floor in (("router_grads", 1e-4), ("attention_grads", 1e-6)):
            want, got = getattr(ref, name)[i], getattr(ours, name)[i]
            if want > floor:
                rel.append(abs(got - want) / want)
        router_abs.append(abs(ours.router_grads[i] - ref.router_grads[i]))
    return {
        "nll_abs": abs(float(ours.loss) - float(ref.loss)),
        "grad_rel": max(rel),
        "router_grad_abs": max(router_abs),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_flex_olmo_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, "flex_olmo", dtype=DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = flex_olmo_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    assert ckpt.warnings == [] and ckpt.notes == []
    spec = ckpt.spec
    assert spec.routed_layers == tuple(range(model.config.num_hidden_layers))
    assert (spec.top_k, spec.num_experts) == (model.config.num_experts_per_tok, model.config.num_experts)
    assert (
        not spec.settings.pre_norm
        and spec.settings.attn_out_norm
        and spec.settings.moe_out_norm
        and spec.settings.qk_norm == "full"
    )
    if log := os.environ.get("MOEAUDIT_FLEX_OLMO_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_the_router_reads_the_residual_stream(tmp_path: Path) -> None:
    """The receipts' gate input of a post-norm family is y = h (docs/decisions.md): the replay's
    tap hands y as h itself, and the router logits it exposes are W_r h with h transformers'
    own MoE input — not W_r applied to an RMS-normed h, which differs by far more than the
    tolerance (the test would catch a replay that normed the router's input)."""
    model = save_tiny(tmp_path, "flex_olmo")
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    ref = flex_olmo_observed(load(tmp_path), tokens)
    taps: dict[int, MoETap] = {}
    result = replay(ckpt, tokens, observers=[lambda tap, _lw: taps.__setitem__(tap.layer, tap)])
    for i, layer in enumerate(model.model.layers):
        tap, w_r = taps[i], layer.mlp.gate.weight.detach()
        assert tap.y_NH is tap.h_NH  # y = h: no gain, no norm
        h_ref = ref.moe_inputs[i]
        assert_close_activations(tap.h_NH, h_ref, FORWARD, f"MoE input {i}")
        want = F.linear(h_ref, w_r)
        assert_close_activations(result.routing[i].scores_NE, want, FORWARD, f"router logits {i}")
        normed = F.linear(rms_norm(h_ref, torch.ones(h_ref.shape[-1]), ckpt.spec.rms_eps), w_r)
        assert float((normed - want).abs().max()) > 1e-2
        # z = h / r stays the receipts' state (docs/glossary.md, "Taps"), defined without a norm
        r = h_ref.double().pow(2).mean(-1).add(ckpt.spec.rms_eps).sqrt()
        torch.testing.assert_close(tap.z_NH.double(), h_ref.double() / r[:, None], rtol=1e-4, atol=1e-5)


def test_flex_olmo_each_post_norm_matters(tmp_path: Path) -> None:
    """The replay reads each of the norms: a gain changed in the file changes the loss (a replay
    that skipped one would not move)."""
    import safetensors.torch as st

    save_tiny(tmp_path, "flex_olmo")
    tokens = random_tokens()
    base = observed(Checkpoint(tmp_path), tokens).loss
    (path,) = tmp_path.glob("*.safetensors")
    original = st.load_file(path)
    for key in (
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.2.self_attn.k_norm.weight",
    ):
        st.save_file({**original, key: original[key] * 3.0}, path, metadata={"format": "pt"})
        assert abs(float(observed(Checkpoint(tmp_path), tokens).loss) - float(base)) > 1e-3, key
    st.save_file(original, path, metadata={"format": "pt"})


def test_flex_olmo_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("flex_olmo")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_experts, spec.top_k, spec.expert_dim) == (7, 5, 11008)
    assert (spec.head_dim, spec.rms_eps, spec.rope.theta) == (128, 1e-6, 500000.0)
    assert spec.routed_layers == tuple(range(32)) and not spec.settings.norm_topk_prob and spec.shared_dim == 0
    assert (
        not spec.settings.pre_norm
        and spec.settings.attn_out_norm
        and spec.settings.moe_out_norm
        and not spec.settings.dense_out_norm
    )
    cfg = {k: v for k, v in hf.to_dict().items() if k not in ("rope_parameters", "rms_norm_eps", "norm_topk_prob")}
    absent = spec_from_config(cfg)  # the configuration class's defaults when the keys are absent
    assert (absent.rope.theta, absent.rms_eps, absent.settings.norm_topk_prob) == (500000.0, 1e-6, False)


def test_the_expert_parallel_replay_refuses_flex_olmo_by_name(tmp_path: Path) -> None:
    """``--nproc`` refuses the MoE-output norm (with afmoe and axk1) naming the family, and
    writes nothing."""
    save_tiny(tmp_path / "ckpt", "flex_olmo")
    out = tmp_path / "r.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MOEAUDIT_DIST_TIMEOUT": "90"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    args = ["receipts", str(tmp_path / "ckpt"), "--canary", str(SAMPLES / "canary.safetensors")]
    run = subprocess.run(
        [sys.executable, "-m", "moeaudit", *args, "--json", str(out), "--nproc", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode != 0
    message = "the expert-parallel replay does not replay flex_olmo's norm on the MoE output yet"
    assert message in run.stderr, run.stderr[-3000:]
    assert "without --nproc" in run.stderr
    assert not out.exists()


def _compare(base: Path, cand: Path, tmp_path: Path) -> dict[str, Any]:
    from click.testing import CliRunner

    from moeaudit.cli import cli

    out = tmp_path / f"{cand.name}.json"
    canary = str(SAMPLES / "canary.safetensors")
    args = ["compare", str(base), str(cand), "--canary", canary, "--reference", str(base), "--json", str(out)]
    result = CliRunner(env={"MOEAUDIT_CACHE_DIR": str(tmp_path / "cache")}).invoke(cli, args)
    assert result.exit_code == 0, result.output
    return json.loads(out.read_text())


def test_pair_receipts_anchor_on_the_base_stream(tmp_path: Path) -> None:
    """The pair receipts of a post-norm family (docs/decisions.md): y^(0→j) = h^(0), the base's
    stream read by each checkpoint's router, and no gain drift. A candidate that differs from the
    base only in layer 0's attention output projection moves every later stream (coordinate > 0)
    but routes and computes exactly as the base on the base's stream, so boundary, transition and
    content are exactly 0; a checkpoint compared with itself gives exactly 0 for all four."""
    import shutil

    import safetensors.torch as st

    base = tmp_path / "base"
    save_tiny(base, "flex_olmo")
    twin, cand = tmp_path / "twin", tmp_path / "cand"
    shutil.copytree(base, twin)
    shutil.copytree(base, cand)
    (path,) = cand.glob("*.safetensors")
    tensors = st.load_file(path)
    key = "model.layers.0.self_attn.o_proj.weight"
    noise = torch.randn(tensors[key].shape, generator=torch.Generator().manual_seed(3))
    tensors[key] = tensors[key] + 0.5 * tensors[key].std() * noise  # not a scale: the norm after it would undo one
    st.save_file(tensors, path, metadata={"format": "pt"})

    same, moved = _compare(base, twin, tmp_path), _compare(base, cand, tmp_path)
    for doc in (same, moved):
        assert [entry["layer"] for entry in doc["layers"]] == [0, 1, 2]
        for entry in doc["layers"]:
            assert entry["weights"]["gain_drift"] is None
            assert entry["weights"]["reason"] == "no pre-norm gain (post-norm family)"
            assert entry["weights"]["router_drift"] == 0.0
            for name in ("boundary", "transition", "content"):
                assert entry["drift"][name] == 0.0, (entry["layer"], name)
    assert all(entry["drift"]["coordinate"] == 0.0 for entry in same["layers"])
    assert all(entry["drift"]["coordinate"] > 1e-4 for entry in moved["layers"])
