"""The family registry: discovery, refused vs unknown families, and the ModelSpec JSON of the
families that predate it (new fields stay out of it at their defaults)."""

from __future__ import annotations

import json

import pytest

from moeaudit.errors import EXIT_INPUT, CheckpointError
from moeaudit.families import EXPERT_COUNT_KEYS, FAMILIES, REFUSED, family_of, spec_from_config
from moeaudit.samples.train import Arch, hf_config
from moeaudit.spec.config import LAYOUTS as LAYOUTS
from moeaudit.spec.config import ModelSpec

OLD = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")


def test_every_family_file_is_discovered_with_its_layout() -> None:
    assert tuple(FAMILIES)[:6] == OLD
    for name, fam in FAMILIES.items():
        assert fam.name == name == fam.layout.family
        assert LAYOUTS[name] is fam.layout
        assert EXPERT_COUNT_KEYS[name] == fam.expert_count_keys
    assert not set(FAMILIES) & set(REFUSED)  # a family file overrides a stale refusal


@pytest.mark.parametrize("model_type", ["nllb-moe", "switch_transformers", "vitpose"])
def test_refused_family_names_itself_and_why(model_type: str) -> None:
    cfg = {**hf_config(Arch()), "model_type": model_type}
    with pytest.raises(CheckpointError) as err:
        spec_from_config(cfg)
    want = f"config.json: model family {model_type!r} cannot be replayed: {REFUSED[model_type]}"
    assert str(err.value).startswith(want)
    assert err.value.exit_code == EXIT_INPUT


@pytest.mark.parametrize("model_type", ["llama", None, 3, ""])
def test_unknown_family_is_not_called_refused(model_type: object) -> None:
    with pytest.raises(CheckpointError) as err:
        family_of(model_type)
    assert str(err.value).startswith(f"config.json: unknown model family {model_type!r}")
    assert "cannot be replayed" not in str(err.value)
    assert err.value.exit_code == EXIT_INPUT


def test_new_spec_fields_stay_out_of_old_families_json() -> None:
    spec = spec_from_config(hf_config(Arch(family="mixtral")))
    assert spec.settings.o_bias is True and "o_bias" not in spec.to_json()
    qwen = spec_from_config(hf_config(Arch(family="qwen2_moe", shared_dim=48)))
    assert qwen.settings.o_bias is False and qwen.to_json()["o_bias"] is False
    # the mixtral spec JSON as it was before the registry (keys and values)
    assert json.dumps(spec.to_json(), sort_keys=True) == json.dumps(
        {
            "attention_bias": False,
            "attention_scale": None,
            "clip_qkv": None,
            "dense_dim": 0,
            "expert_dim": 32,
            "extra": {},
            "family": "mixtral",
            "gate": {
                "group_score": "none",
                "n_group": 1,
                "scaling": 1.0,
                "scoring": "softmax",
                "selection_bias": False,
                "topk_group": 1,
            },
            "head_dim": 12,
            "hidden_size": 48,
            "mtp_layers": 0,
            "norm_topk_prob": True,
            "num_experts": 8,
            "num_heads": 4,
            "num_kv_heads": 2,
            "num_layers": 4,
            "qk_norm": "none",
            "rms_eps": 1e-05,
            "rope_theta": 10000.0,
            "routed_layers": [0, 1, 2, 3],
            "routing": "softmax top-2 of 8, renormalised",
            "shared_dim": 0,
            "shared_gated": False,
            "sliding_layers": [],
            "sliding_window": None,
            "tie_embeddings": False,
            "top_k": 2,
            "vocab_size": spec.vocab_size,
            "yarn": None,
        },
        sort_keys=True,
    )
    assert isinstance(spec, ModelSpec)


@pytest.mark.parametrize("family", ["hy_v3", "laguna", "mellum", "kimi_linear", "axk1", "glm4_moe_lite"])
def test_mlp_layer_types_are_read_by_one_rule(family: str) -> None:
    pytest.importorskip("transformers")
    import hfmodels

    cfg = hfmodels.tiny_config(family).to_dict()
    n = cfg["num_hidden_layers"]
    cfg["mlp_layer_types"] = ["dense"] + ["sparse"] * (n - 1)
    assert spec_from_config(cfg).routed_layers == tuple(range(1, n))
    for bad in (["sparse"] * (n - 1), [["sparse"]] * n, ["dense", "moe"] + ["sparse"] * (n - 2)):
        cfg["mlp_layer_types"] = bad  # too short, an unhashable entry, an unknown kind: one message
        with pytest.raises(CheckpointError, match=f"mlp_layer_types must list {n} layers, each 'dense' or 'sparse'"):
            spec_from_config(cfg)
