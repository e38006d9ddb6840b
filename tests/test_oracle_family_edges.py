"""Family edge cases against transformers 5.24 (fp32, the worst difference logged, as the other
oracle tests): checkpoints with zero shared experts (``n_shared_experts = 0``: transformers saves
zero-width shared-expert tensors) for deepseek_v2, deepseek_v3, glm4_moe and afmoe."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import hf_models_afmoe  # noqa: E402, F401  (registers the tiny config)
from hf_models import load, random_tokens, save_tiny  # noqa: E402
from oracle_log import worst  # noqa: E402
from test_oracle import transformers_observed  # noqa: E402
from test_oracle_afmoe import afmoe_observed  # noqa: E402
from test_oracle_deepseek import assert_agree_deepseek, observed  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402

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
    from hf_models_longcat import save_longcat
    from test_oracle_longcat import longcat_observed

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
