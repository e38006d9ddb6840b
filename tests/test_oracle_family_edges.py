"""Family edge cases transformers 5.24 runs, against it (fp32, the worst difference logged with
MOEAUDIT_FAMILY_EDGES_LOG, as the other oracle tests): zero shared experts (``n_shared_experts =
0``: transformers saves zero-width shared-expert tensors) for deepseek_v2, deepseek_v3, glm4_moe
and afmoe; LongCat-Flash's top-k over routed + zero-computation experts; Mistral 4's rotary
frequencies for int(head_dim × partial_rotary_factor) dims."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
from hfmodels import aliases2, load, random_tokens, save_tiny, tiny_config  # noqa: E402
from hfmodels.longcat import save_longcat  # noqa: E402
from oracle_log import worst  # noqa: E402
from support.oracle import transformers_observed  # noqa: E402
from support.oracle_afmoe import afmoe_observed  # noqa: E402
from support.oracle_aliases2 import Modules, agree, hf_observed  # noqa: E402
from support.oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402
from support.oracle_deepseek import observed as deepseek_observed  # noqa: E402
from support.oracle_longcat import longcat_observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.errors import CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

LOG = "MOEAUDIT_FAMILY_EDGES_LOG"


def _log(case: str, ref: Any, ours: Any) -> None:
    if path := os.environ.get(LOG):
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"case": case, **worst(ref, ours)}) + "\n")


ZERO_SHARED = {
    "deepseek_v2": "n_shared_experts",
    "deepseek_v3": "n_shared_experts",
    "glm4_moe": "n_shared_experts",
    "afmoe": "num_shared_experts",
}


@pytest.mark.parametrize("family", ZERO_SHARED)
def test_zero_shared_experts_replay_matches_transformers(family: str, tmp_path: Path) -> None:
    model = save_tiny(tmp_path, family, **{ZERO_SHARED[family]: 0})
    shared = [t for n, t in model.state_dict().items() if ".shared_expert" in n]
    assert shared and all(t.numel() == 0 for t in shared)  # what transformers saves
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.shared_dim == 0
    assert [lo.what for lo in ckpt.left_out] == ["zero-width shared experts"]
    assert ckpt.warnings == []
    tokens = random_tokens()
    hf = load(tmp_path)
    ref = afmoe_observed(hf, tokens) if family == "afmoe" else transformers_observed(hf, tokens)
    ours = observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    _log(f"{family} n_shared_experts=0", ref, ours)


# LongCat-Flash: the router's top-k is over routed + zero-computation experts, so moe_topk may
# exceed n_routed_experts (top-4 of 3 parametric + 2 identity experts: at least two identity
# or parametric picks per token either way)
LONGCAT_TOPK = {"n_routed_experts": 3, "zero_expert_num": 2, "num_experts_per_tok": 4}


def test_longcat_topk_over_routed_and_zero_experts_matches_transformers(tmp_path: Path) -> None:
    save_longcat(tmp_path, None, **LONGCAT_TOPK)
    ckpt = Checkpoint(tmp_path)
    spec = ckpt.spec
    assert (spec.top_k, spec.num_experts, spec.parametric_experts) == (4, 5, 3)
    tokens = random_tokens()
    model = load(tmp_path)
    assert model.config.moe_topk > model.config.n_routed_experts
    ref, ours = longcat_observed(model, tokens), observed(ckpt, tokens)
    assert_agree_deepseek(ref, ours, ckpt)
    for i in spec.routed_layers:  # identity experts are picked, and parametric ones
        picks = ours.topk[i].flatten()
        assert bool((picks >= 3).any()) and bool((picks < 3).any())
        assert ours.expert_grads[i].shape == (3,)
    _log("longcat_flash moe_topk=4 > n_routed_experts=3", ref, ours)


# Mistral 4: transformers computes the YaRN frequencies for int(head_dim × partial_rotary_factor)
# dims (head_dim = qk_nope + qk_rope = 12 here) and broadcasts that table over the qk_rope_head_dim
# (4) rotated dims; the replay did so for qk_rope_head_dim. (factor, interleaved) → the NLL shift
# the fix makes at least
MISTRAL4_ROPE = {
    "factor-0.2-interleaved-one-frequency": (0.2, True, 1e-3),  # 2 dims: one frequency for both pairs
    "factor-0.25-rotate-half-odd-width": (0.25, False, 1e-5),  # 3 dims: two frequencies over a 3-wide base
}


@pytest.mark.parametrize("case", MISTRAL4_ROPE)
def test_mistral4_partial_rotary_width_matches_transformers(case: str, tmp_path: Path) -> None:
    factor, interleave, moved = MISTRAL4_ROPE[case]
    rope = {**aliases2.TINY["mistral4"]["rope_parameters"], "partial_rotary_factor": factor}
    aliases2.save_causal(tmp_path, "mistral4", rope_interleave=interleave, rope_parameters=rope)
    ckpt, model = Checkpoint(tmp_path), aliases2.load_causal(tmp_path, "mistral4")
    width = int(model.config.head_dim * factor)
    assert width != model.config.qk_rope_head_dim and ckpt.spec.rope.freq_dim == width
    tokens = random_tokens()
    modules = Modules(shared=("mlp.shared_experts.",))
    nll_abs, grad_rel = agree(ckpt, model, tokens, modules)
    fixed = replay(ckpt, tokens).nll
    ckpt.spec = ckpt.spec.revised(rope_freq_dim=0)  # the frequencies for qk_rope_head_dim
    assert abs(replay(ckpt, tokens).nll - fixed) > moved
    before = worst(hf_observed(model, tokens, modules), deepseek_observed(ckpt, tokens))  # the replay before
    assert before["nll_abs"] > 10 * max(nll_abs, 1e-7) and before["grad_rel"] > 10 * grad_rel
    if path := os.environ.get(LOG):
        with open(path, "a", encoding="utf-8") as f:
            row = {"case": f"mistral4 {case}", "nll_abs": nll_abs, "grad_rel": grad_rel, "before": before}
            f.write(json.dumps(row) + "\n")


def test_mistral4_partial_rotary_transformers_cannot_apply_is_refused() -> None:
    """head_dim × factor = 6 dims: three frequencies for two rotated pairs; transformers' forward
    fails, so the replay refuses it by name."""
    cfg = tiny_config("mistral4").to_dict()
    cfg["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": 0.5}
    with pytest.raises(CheckpointError, match=r"'mistral4' with head_dim × partial_rotary_factor = 12 × 0.5 → 6"):
        spec_from_config(cfg)


def test_mistral4_reads_the_rotary_factor_from_rope_parameters_only(tmp_path: Path) -> None:
    """Mistral4Config sets rope_parameters' partial_rotary_factor by default and never reads a
    top-level one: a top-level factor changes nothing, in transformers and in the replay."""
    aliases2.save_causal(tmp_path, "mistral4")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"].pop("partial_rotary_factor", None)
    cfg["partial_rotary_factor"] = 0.2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model = aliases2.load_causal(tmp_path, "mistral4")
    assert model.model.rotary_emb.inv_freq.numel() == model.config.qk_rope_head_dim // 2
    assert Checkpoint(tmp_path).spec.rope.freq_dim == 0
