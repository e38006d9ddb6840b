"""Every MoE model type transformers ships is either replayed, with an oracle test, or refused
with a reason: never "unknown model family".

The inventory walks transformers' model registry (``CONFIG_MAPPING``): each model type's default
configuration is built and its keys searched, sub-configurations included (``text_config``,
``thinker_config.text_config``, DBRX's ``ffn_config``), for an expert count or a routed top-k. A
configuration that cannot be built with its defaults is listed below with how it is built or why
it is classified without one, and the test fails when that stops being true. As a second,
independent signal, a model directory whose modeling file defines an experts / sparse-MoE class
must contain at least one type the key search found, so a MoE with unfamiliar key names cannot
slip through unseen.
"""

from __future__ import annotations

import re
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES  # noqa: E402

from moeaudit.families import FAMILIES, HUB_ONLY, REFUSED, family_of  # noqa: E402

TESTS = Path(__file__).parent

# a key naming the expert count or the routed top-k of a MoE layer
MOE_KEY = re.compile(
    r"^(num_experts|num_local_experts|n_routed_experts|moe_num_experts|num_experts_per_tok|"
    r"num_experts_per_token|moe_topk|moe_k|moe_top_k|top_k_experts|zero_expert_num)$"
)
# a class of a modeling file that holds routed experts
EXPERT_CLASS = re.compile(r"^class \w*(Experts|SparseMoe\w*|MoE\w*|Moe\w*)\(", re.M)

# default construction fails: how the type is built instead, or (None) why it is classified
# without a config; the test checks that the default construction still fails
NO_DEFAULT: dict[str, tuple[dict[str, Any] | None, str]] = {
    # its text_config defaults to gemma4_text's, whose per-layer inputs the assistant forbids
    "gemma4_assistant": ({"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}}, ""),
    # its encoder sub-config type donut_swin is not registered: an image-to-text OCR model
    # (Swin encoder, mBART decoder) with no experts (its modeling directory has none: checked)
    "nougat": (None, "not MoE: Swin encoder + mBART decoder"),
}


def _keys(cfg: dict[str, Any]) -> list[str]:
    out = []
    for key, value in cfg.items():
        if isinstance(value, dict):
            out += _keys(value)
        elif isinstance(key, str) and MOE_KEY.match(key):
            out.append(key)
    return out


def _config(model_type: str) -> dict[str, Any] | None:
    cls = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_type in NO_DEFAULT:
            with pytest.raises(Exception):  # noqa: B017 (any construction error: a stale entry fails)
                cls()
            kwargs, _ = NO_DEFAULT[model_type]
            return None if kwargs is None else cls(**kwargs).to_dict()
        return cls().to_dict()


@cache
def inventory() -> dict[str, list[str]]:
    """Every model type of transformers' registry whose configuration has MoE keys → those keys."""
    found = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        cfg = _config(model_type)
        keys = _keys(cfg) if cfg is not None else []
        if keys:
            found[model_type] = keys
    return found


def _model_dir(model_type: str) -> Path:
    return Path(transformers.__file__).parent / "models" / CONFIG_MAPPING[model_type].__module__.split(".")[-2]


def test_the_inventory_is_the_size_we_expect() -> None:
    """A sanity floor: the key search finds the families moeaudit replays and many more."""
    moe = inventory()
    assert {"mixtral", "deepseek_v3", "qwen3_vl_moe", "nllb-moe", "dbrx", "kimi_k25"} <= set(moe)
    assert len(moe) >= 100, len(moe)


def test_every_moe_model_type_is_replayed_or_refused_with_a_reason() -> None:
    unknown = [t for t in inventory() if t not in FAMILIES and t not in REFUSED]
    assert unknown == [], f"MoE model types answered 'unknown model family': {unknown}"
    for model_type in inventory():
        if model_type in REFUSED:
            reason = REFUSED[model_type]
            assert len(reason) > 10 and reason == reason.strip(), (model_type, reason)


@pytest.mark.parametrize("model_type", ["qwen3_vl_moe", "nllb-moe", "gemma4_assistant"])
def test_a_refused_or_replayed_type_never_reads_unknown(model_type: str) -> None:
    if model_type in FAMILIES:
        assert family_of(model_type) is FAMILIES[model_type]
        return
    with pytest.raises(Exception, match=f"model family '{model_type}' cannot be replayed: "):
        family_of(model_type)


def test_every_refusal_names_a_moe_model_type() -> None:
    """No stale keys: each refused type is a MoE type of transformers' registry (under the name
    transformers uses, ``nllb-moe``) or a named hub-only MoE type."""
    moe = inventory()
    stale = [t for t in REFUSED if t not in moe and t not in HUB_ONLY]
    assert stale == []
    assert not set(HUB_ONLY) & set(CONFIG_MAPPING_NAMES)  # hub-only means transformers lacks it


def test_every_replayed_family_has_an_oracle_test() -> None:
    """Each family file's model type appears as a quoted name in a ``tests/test_oracle*.py``
    (the oracle tests name the family they save and compare)."""
    text = "\n".join(p.read_text() for p in sorted(TESTS.glob("test_oracle*.py")))
    untested = [f for f in FAMILIES if f'"{f}"' not in text and f"'{f}'" not in text]
    assert untested == []


def test_every_modeling_directory_with_experts_has_a_type_the_key_search_found() -> None:
    moe = inventory()
    dirs: dict[Path, list[str]] = {}
    for model_type in CONFIG_MAPPING_NAMES:
        dirs.setdefault(_model_dir(model_type), []).append(model_type)
    missed = []
    for folder, types in sorted(dirs.items()):
        has_experts = any(EXPERT_CLASS.search(p.read_text()) for p in folder.glob("modeling_*.py"))
        if has_experts and not set(types) & set(moe):
            missed.append((folder.name, types))
    assert missed == []
    # and the types classified without a config really have no experts
    for model_type, (kwargs, _) in NO_DEFAULT.items():
        if kwargs is None:
            assert not any(EXPERT_CLASS.search(p.read_text()) for p in _model_dir(model_type).glob("modeling_*.py"))
