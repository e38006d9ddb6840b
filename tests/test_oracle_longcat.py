"""LongCat-Flash (``longcat_flash``) replayed against transformers' ``LongcatFlashForCausalLM``.

Three configurations (top-k, parametric and zero-computation expert counts, layer count,
attention biases, the scaling factor and YaRN RoPE varied; every LongCat layer is routed, so there is no
dense/sparse placement to vary), each in float32 and from a bfloat16 checkpoint (transformers
computing in float32 from the same stored values, as ``test_oracle_dtypes``), with the float32
tolerances of ``test_oracle``: NLL, hidden states, the MoE input h (what
``post_attention_layernorm[0]`` reads) and router logits (``FORWARD``), gradient norms within
2e-3 relative (``GRADIENT``), identical top-k sets on tokens whose k-th and (k+1)-th selection
scores differ by more than ``TIE_GAP``. The per-expert gradient norms are those of the parametric
experts (transformers' fused ``gate_up_proj`` has rows for the zero-computation experts too, which
nothing reads: their gradient is 0 and is not compared). The attention norm covers both MLA
sub-blocks and both input norms, as the replay's attention group does.

The selection bias is redrawn at std 0.02 (``hfmodels.core`` draws 0.2, which against softmax
probabilities near 1/E would choose the same experts for every token), and the sub-block norm
gains near 1 (``save_longcat``). ``moe_topk`` is set through its alias ``num_experts_per_tok``,
which ``hfmodels.core``'s common settings also set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens  # noqa: E402
from hfmodels.longcat import save_longcat  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle import Observed  # noqa: E402
from support.oracle_deepseek import YARN, assert_agree_deepseek, observed  # noqa: E402
from support.oracle_longcat import longcat_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError, InputError  # noqa: E402
from moeaudit.families import REFUSED, spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

DTYPES = {"fp32": None, "bf16": torch.bfloat16}

CASES: dict[str, dict[str, Any]] = {
    # 2 layers; top-2 of 6 parametric + 2 zero-computation experts, × 2.5
    "top2-6-experts-2-zero": {},
    # 3 layers; top-3 of 8 parametric + 4 zero-computation experts, MLA biases, × 6 (the default),
    # YaRN RoPE with mscale_all_dim (the softmax scale × mscale²)
    "top3-8-experts-4-zero-attention-bias-yarn": {
        "rope_parameters": {**YARN, "rope_theta": 1e7},
        "num_hidden_layers": 6,
        "n_routed_experts": 8,
        "zero_expert_num": 4,
        "num_experts_per_tok": 3,
        "attention_bias": True,
        "routed_scaling_factor": 6.0,
    },
    # no zero-computation experts: top-3 of 5 (top-1 does not run in transformers 5.24: its expert
    # loop's ``squeeze(0)`` drops the slot dimension of a one-slot mask)
    "top3-5-experts-no-zero": {"n_routed_experts": 5, "zero_expert_num": 0, "num_experts_per_tok": 3},
}


def _worst(ref: Observed, ours: Observed) -> dict[str, float]:
    """NLL abs and the worst relative gradient-norm difference (experts, router, attention)."""
    rel = [0.0]
    for i in ref.scores:
        r, o = ref.expert_grads[i].double(), ours.expert_grads[i].double()
        keep = r > 1e-6
        rel.append(float(((o[keep] - r[keep]).abs() / r[keep]).max()) if keep.any() else 0.0)
        for name in ("router_grads", "attention_grads"):
            want, got = getattr(ref, name)[i], getattr(ours, name)[i]
            if want > 1e-6:
                rel.append(abs(got - want) / want)
    return {"nll_abs": abs(float(ours.loss) - float(ref.loss)), "grad_rel": max(rel)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_longcat_replay_matches_transformers(case: str, dtype: str, tmp_path: Path) -> None:
    save_longcat(tmp_path, DTYPES[dtype], **CASES[case])
    ckpt = Checkpoint(tmp_path)
    tokens = random_tokens()
    model = load(tmp_path)
    ref, ours = longcat_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    cfg = model.config
    spec = ckpt.spec
    assert spec.num_layers == cfg.num_layers and spec.routed_layers == tuple(range(cfg.num_layers))
    assert (spec.num_experts, spec.zero_experts) == (cfg.n_routed_experts + cfg.zero_expert_num, cfg.zero_expert_num)
    assert ckpt.warnings == []
    # save_pretrained writes the identity experts' unused gate/up rows: recognised and left out
    assert [x.what for x in ckpt.left_out] == (
        ["gate/up weights stored for zero-computation experts, which never read them"] if cfg.zero_expert_num else []
    )
    # the routing is varied, and the identity experts are chosen, but not always
    for i in spec.routed_layers:
        counts = torch.bincount(ours.topk[i].flatten(), minlength=spec.num_experts)
        assert int((counts > 0).sum()) >= 3
        if spec.zero_experts:
            zero_share = float(counts[spec.parametric_experts :].sum()) / ours.topk[i].numel()
            assert 0.0 < zero_share < 1.0
        assert ours.expert_grads[i].shape == (spec.parametric_experts,)
    if log := os.environ.get("MOEAUDIT_LONGCAT_LOG"):
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, "dtype": dtype, **_worst(ref, ours)}) + "\n")


def test_longcat_each_sub_block_matters(tmp_path: Path) -> None:
    """The replay reads each sub-block of a layer: a gain changed in the file changes the loss
    (a replay that skipped the second attention, either dense MLP or the MoE would not move)."""
    save_longcat(tmp_path)
    tokens = random_tokens()
    base = replay(Checkpoint(tmp_path), tokens, backward=False).nll
    (path,) = tmp_path.glob("*.safetensors")
    original = load_file(path)
    for key in (
        "model.layers.0.input_layernorm.1.weight",  # the second attention's norm
        "model.layers.0.post_attention_layernorm.1.weight",  # the second MLP's norm
        "model.layers.0.mlps.0.down_proj.weight",  # the first MLP
        "model.layers.0.mlp.experts.0.down_proj.weight",  # a routed expert
    ):
        save_file({**original, key: original[key] * 3.0}, path, metadata={"format": "pt"})
        assert abs(replay(Checkpoint(tmp_path), tokens, backward=False).nll - base) > 1e-4, key
    save_file(original, path, metadata={"format": "pt"})


def test_longcat_config_defaults_match_transformers() -> None:
    import transformers

    hf = transformers.AutoConfig.for_model("longcat_flash")
    spec = spec_from_config(hf.to_dict())
    assert (spec.num_layers, spec.num_experts, spec.zero_experts, spec.top_k) == (28, 768, 256, 12)
    assert (spec.parametric_experts, spec.expert_dim, spec.dense_dim) == (512, 2048, 12288)
    assert (spec.rms_eps, spec.rope.theta, spec.gate.scaling, spec.head_dim) == (1e-5, 1e7, 6.0, 64)
    assert (
        spec.settings.shortcut_moe
        and spec.settings.mla_lora_scale
        and spec.mla is not None
        and spec.mla.rope_interleave
    )
    assert spec.routing == "softmax top-12 of 768 (256 zero-computation), selection bias, not renormalised, ×6"
    absent = {k: v for k, v in hf.to_dict().items() if k not in ("num_layers", "zero_expert_num", "head_dim")}
    assert spec_from_config(absent) == spec  # the configuration class's defaults when the keys are absent
    assert spec_from_config({**absent, "num_hidden_layers": 8}).num_layers == 4  # transformers' setter
    assert "longcat_flash" not in REFUSED


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"num_hidden_layers": 10}, "not twice num_layers"),
        ({"num_layers": "2"}, "'num_layers' must be int"),
        ({"head_dim": 32}, "differs from qk_rope_head_dim"),
        ({"qk_head_dim": 100}, "qk_head_dim=100"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"router_bias": True}, "moeaudit does not replay router_bias=true for longcat_flash yet"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_inconsistent_longcat_configs_are_refused(bad: dict[str, Any], message: str) -> None:
    import transformers

    with pytest.raises(CheckpointError, match=message):
        spec_from_config({**transformers.AutoConfig.for_model("longcat_flash").to_dict(), **bad})


def test_expert_parallel_replay_refuses_longcat(tmp_path: Path) -> None:
    from moeaudit.replay.sharded import sharded_replay

    save_longcat(tmp_path)
    with pytest.raises(InputError, match="does not replay longcat_flash's shortcut-connected MoE"):
        sharded_replay(
            None,  # type: ignore[arg-type]  (refused before the session is used)
            Checkpoint(tmp_path),
            random_tokens(),
            backward=True,
            observers=(),
            progress=None,
            dtype=torch.float32,
            device=None,
        )


def test_longcat_receipts_count_zero_experts_in_routing_not_in_gradients(tmp_path: Path) -> None:
    """docs/decisions.md (LongCat-Flash): occupancy, margins and overlap are over every expert, the
    identity ones included, with the share of routed slots the identity experts take beside them;
    the gradient norms and their statistics are over the parametric experts only."""
    from moeaudit.canary import Canary
    from moeaudit.receipts.state import state_receipts

    save_longcat(tmp_path)
    ckpt = Checkpoint(tmp_path)
    spec = ckpt.spec
    tokens = random_tokens(4, 16, seed=5)
    doc = state_receipts(ckpt, Canary(tokens.int(), torch.arange(4, dtype=torch.int32) % 2, ("code", "prose")))
    result = replay(ckpt, tokens)
    assert doc["checkpoint"]["experts"] == spec.num_experts == 8
    for layer in doc["layers"]:
        occupancy, i = layer["occupancy"], layer["layer"]
        counts = occupancy["counts"]
        assert len(counts) == len(occupancy["pi"]) == spec.num_experts
        assert counts == torch.bincount(result.routing[i].topk_NK.flatten(), minlength=8).tolist()
        share = sum(counts[spec.parametric_experts :]) / sum(counts)
        assert occupancy["zero_expert_share"] == pytest.approx(share) and 0 < share < 1
        grads = layer["gradients"]["grad_norms"]
        assert grads == result.grads[i].experts_E.tolist() and len(grads) == spec.parametric_experts
        assert layer["gradients"]["grad_mean"] == pytest.approx(sum(grads) / len(grads))
    assert len(doc["layers"]) == spec.num_layers


def test_other_families_have_no_zero_expert_share(tmp_path: Path) -> None:
    from moeaudit.receipts.occupancy import occupancy

    topk = torch.tensor([[0, 3], [1, 3], [2, 3]])
    probs = torch.full((3, 4), 0.25)
    assert "zero_expert_share" not in occupancy(topk, probs)
    assert occupancy(topk, probs, zero_experts=1)["zero_expert_share"] == pytest.approx(0.5)


def test_grad_logger_reads_parametric_experts_and_refuses_the_live_fused_model(tmp_path: Path) -> None:
    """``ExpertGradLogger``'s parameter collection: from LayerWeights the identity experts (no
    weights) are not experts to measure; a live transformers model (fused experts with identity
    rows) is refused by layer rather than measured wrong."""
    from hfmodels import tiny_model

    from moeaudit.integrations.hooks import collect_params

    save_longcat(tmp_path)
    ckpt = Checkpoint(tmp_path)
    layers = collect_params([ckpt.layer_weights(i) for i in range(ckpt.spec.num_layers)])
    assert [lp.num_experts() for lp in layers.values()] == [ckpt.spec.parametric_experts] * ckpt.spec.num_layers
    with pytest.raises(InputError, match="layer 0: a router but no expert parameters"):
        collect_params(tiny_model("longcat_flash"))


def test_longcat_mtp_module_is_left_out_by_name(tmp_path: Path) -> None:
    """The released checkpoints carry an MTP module under ``model.mtp.`` (transformers ignores it on
    loading): recognised and left out, the replay unchanged."""
    save_longcat(tmp_path)
    tokens = random_tokens()
    base = replay(Checkpoint(tmp_path), tokens, backward=False).nll
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(path)
    tensors["model.mtp.layers.0.eh_proj.weight"] = torch.ones(32, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    ckpt = Checkpoint(tmp_path)
    mtp = [x for x in ckpt.left_out if x.what.startswith("the multi-token-prediction module")]
    assert [x.keys for x in mtp] == [("model.mtp.layers.0.eh_proj.weight",)]
    assert replay(ckpt, tokens, backward=False).nll == base
