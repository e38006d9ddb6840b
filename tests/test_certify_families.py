"""``certify`` end to end on a two-checkpoint run of every family with a transformers class
(docs/families.md): the second checkpoint is the first with every matrix moved by 2 % of its spread,
so there is a pair to compare. Certify must write a certificate that verifies, whose receipts
name the family and carry finite NLL and per-layer receipts for exactly the routed layers.
The oracle tests check the numbers; this checks that every family goes through the product.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hfmodels import DEEPSEEK, FAMILIES, NEW_FAMILIES, save_any, save_tiny  # noqa: E402
from support.certify_families import _nudged_copy, certify_and_verify  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import FAMILIES as REGISTERED  # noqa: E402

TINY = (
    *FAMILIES,
    *DEEPSEEK,
    *NEW_FAMILIES,
    "deepseek_v32",
    "qwen3_next",
    "qwen3_5_moe_text",
    "jamba",
    "granitemoehybrid",
    "nemotron_h",
    "granitemoeshared",
    "granitemoe_swa",
    "aria_text",
    "mistral4",
    "glm4_moe_lite",
    "kimi_k2",
    "axk1",
    "cohere2_moe",
    "dbrx",
    "exaone_moe",
    "lfm2_moe",
    "sarvam_moe",
    "sarvam_mla",
    "solar_open",
    "hy_v3",
    "glm_moe_dsa",
    "minimax",
    "laguna",
    "afmoe",
    "kimi_linear",
    "bailing_hybrid",
    "flex_olmo",
    "jetmoe",
    "longcat_flash",
    "hy_v4",
    "flint",
    "mellum",
    "lara_mini",
    "mimo_v2_flash",
    # wrappers certified end to end too (tests/hfmodels/wrap.py, step.py save them)
    "nemotron_h_omni",
    "nemo_speechlm",
    "hy_v4_vl",
    "step3p5",
    "step3p7",
)
# vision-language / omni wrappers: their text decoder's family is certified above, the wrapper
# checked against transformers in its own oracle test (tests/test_oracle_aliases*.py, …)
WRAPPERS = {
    "qwen3_5_moe",
    "llama4",
    "kimi_k25",
    "qwen3_vl_moe",
    "glm4v_moe",
    "aria",
    "qwen3_omni_moe",
    "deepseek_ocr2",
    "ernie4_5_vl_moe",
    "unlimited_ocr",
}


def test_every_registered_family_is_exercised_here_or_has_its_own_wrapper_test() -> None:
    """Vision-language wrappers (qwen3_5_moe, llama4) are certified through their text decoder's
    family and checked against transformers in their own oracle tests."""
    assert set(REGISTERED) - set(TINY) <= WRAPPERS, set(REGISTERED) - set(TINY) - WRAPPERS


@pytest.mark.parametrize("family", TINY)
def test_certify_a_run_of_each_family(family: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    if family == "longcat_flash":  # as save_tiny writes it (save_any redraws its sub-block gains)
        save_tiny(run / "checkpoint-100", family)
    else:  # Mistral 4's LM class, kimi_k2's label and the wrappers through their savers
        save_any(run / "checkpoint-100", family)
    _nudged_copy(run / "checkpoint-100", run / "checkpoint-200")
    _, out = certify_and_verify(run, tmp_path)
    routed = list(Checkpoint(run / "checkpoint-100").spec.routed_layers)
    for step in (100, 200):
        receipt = json.loads((out / "receipts" / f"checkpoint-{step}.json").read_text())
        assert receipt["checkpoint"]["family"] == family
        assert math.isfinite(receipt["nll"]) and receipt["nonfinite_weights"] == []
        assert [layer["layer"] for layer in receipt["layers"]] == routed
    assert (out / "receipts" / "pair-200-vs-100.json").is_file()
