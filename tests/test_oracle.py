"""Replay agrees with Hugging Face transformers on the same checkpoint (docs/glossary.md, "Replay").

transformers is the external oracle: it loads the directory ``save_pretrained`` wrote and
runs it in float32 with eager attention; moeaudit reads the same files with its own reader
and decoder. Router logits, active sets, combine weights, hidden states, loss and gradient
norms must agree to float32 tolerance. The last tests check laws of the replay itself:
storage layout (per-expert, fused, sharded) does not change a bit, two replays are
bit-identical, and relabelling experts consistently changes nothing but the labels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import FAMILIES, load, random_tokens, save_tiny, tiny_config  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from support.oracle import assert_identical, check_against_transformers, fuse_experts, rewrite  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.families import EXPERT_COUNT_KEYS, spec_from_config  # noqa: E402
from moeaudit.replay import ReplayResult, replay  # noqa: E402

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {}),
    "mixtral-tied-embeddings": ("mixtral", {"tie_word_embeddings": True}),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 5}),
    "olmoe": ("olmoe", {}),  # norm_topk_prob defaults to False
    "olmoe-norm-topk-attention-bias": ("olmoe", {"norm_topk_prob": True, "attention_bias": True}),
    "olmoe-clip-qkv": ("olmoe", {"clip_qkv": 0.5}),
    "qwen2_moe": ("qwen2_moe", {}),  # qkv bias, shared expert with sigmoid gate
    "qwen2_moe-dense-layer": ("qwen2_moe", {"mlp_only_layers": [1]}),
    "qwen2_moe-sparse-step": ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}),
    "qwen2_moe-sliding-layers": ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 5}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-norm-topk": ("qwen3_moe", {"norm_topk_prob": True}),
}


# ----- the oracle --------------------------------------------------------------------------


# ----- comparison --------------------------------------------------------------------------


# ----- agreement with transformers -----------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_replay_matches_transformers(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    model = save_tiny(tmp_path, family, **overrides)
    ckpt = check_against_transformers(tmp_path, random_tokens())
    routed = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert ckpt.spec.routed_layers == routed
    assert ckpt.warnings == []  # every tensor transformers wrote was resolved and used
    assert ckpt.summary(with_digest=False)["tied_embeddings"] == bool(overrides.get("tie_word_embeddings"))


def test_qwen2_moe_sliding_layers_without_layer_types(tmp_path: Path) -> None:
    """A config without ``layer_types`` (as v4 wrote) gets transformers' rule for them."""
    save_tiny(
        tmp_path,
        "qwen2_moe",
        use_sliding_window=True,
        sliding_window=5,
        num_hidden_layers=4,
        max_window_layers=3,
    )
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert cfg.pop("layer_types") == ["sliding_attention", "full_attention"] * 2
    cfg_path.write_text(json.dumps(cfg))
    ckpt = check_against_transformers(tmp_path, random_tokens())
    assert ckpt.spec.sliding_layers == (0, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_defaults_match_transformers(family: str) -> None:
    """RoPE θ and RMSNorm ε when config.json omits them; v4 top-level ``rope_theta``."""
    written = tiny_config(family).to_dict()
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps"):
        written.pop(key, None)
    hf = type(tiny_config(family))(**written)
    spec = spec_from_config(written)
    assert spec.rope.theta == hf.rope_parameters["rope_theta"]
    assert spec.rope.theta == (1e6 if family == "mixtral" else 1e4)
    assert spec.rms_eps == hf.rms_norm_eps
    assert spec.num_experts == hf.num_experts == 4
    legacy = {**written, "rope_theta": 5e5}
    assert spec_from_config(legacy).rope.theta == type(hf)(**legacy).rope_parameters["rope_theta"]
    for key in EXPERT_COUNT_KEYS[family]:  # either name transformers' attribute_map accepts
        renamed = {k: v for k, v in written.items() if k not in EXPERT_COUNT_KEYS[family]}
        renamed[key] = 6
        assert spec_from_config(renamed).num_experts == type(hf)(**renamed).num_experts == 6


def test_sharded_checkpoint_equals_single_file(hf_checkpoint, tmp_path: Path) -> None:
    save_tiny(tmp_path, "qwen2_moe", max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    tokens = random_tokens()
    single = replay(Checkpoint(hf_checkpoint("qwen2_moe")), tokens)
    sharded = replay(Checkpoint(tmp_path), tokens)
    assert_identical(single, sharded)


def test_bf16_checkpoint_matches_transformers_upcast(tmp_path: Path) -> None:
    """bf16 on disk, both sides compute in float32 from the same upcast weights."""
    save_tiny(tmp_path, "olmoe", dtype=torch.bfloat16)
    ckpt = check_against_transformers(
        tmp_path, random_tokens(), {"rtol": 1e-3, "atol": 1e-4}, {"rtol": 5e-3, "atol": 1e-5}
    )
    assert set(ckpt.summary(with_digest=False)["dtypes"]) == {"BF16"}


# ----- storage layout does not change a bit -------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_experts_on_disk_replay_bit_identical(family: str, hf_checkpoint, tmp_path: Path) -> None:
    src = hf_checkpoint(family)
    fused = rewrite(src, tmp_path / "fused", fuse_experts)
    model = load(src)
    on_disk = load_file(fused / "model.safetensors")
    for i in Checkpoint(src).spec.routed_layers:  # the layout transformers holds in memory
        experts = model.model.layers[i].mlp.experts
        assert torch.equal(on_disk[f"model.layers.{i}.mlp.experts.gate_up_proj"], experts.gate_up_proj.detach())
        assert torch.equal(on_disk[f"model.layers.{i}.mlp.experts.down_proj"], experts.down_proj.detach())
    reloaded = load(fused).state_dict()  # transformers reads the fused file as we do
    assert all(torch.equal(t, reloaded[name]) for name, t in model.state_dict().items())
    fused_ckpt = Checkpoint(fused)
    assert fused_ckpt.fused and fused_ckpt.warnings == []
    tokens = random_tokens()
    assert_identical(replay(Checkpoint(src), tokens), replay(fused_ckpt, tokens))


# ----- laws of the replay ------------------------------------------------------------------


def test_replay_is_deterministic(hf_checkpoint) -> None:
    ckpt = Checkpoint(hf_checkpoint("qwen2_moe", mlp_only_layers=[1]))
    tokens = random_tokens()
    assert_identical(replay(ckpt, tokens), replay(ckpt, tokens))


def relabel(perm: list[int]):
    """Expert e becomes expert perm[e]: router row and weights move together."""

    def edit(ckpt: Checkpoint, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = dict(tensors)
        for i in ckpt.spec.routed_layers:
            router = ckpt.layer_keys(i)["router"]
            out[router] = torch.empty_like(tensors[router])
            out[router][perm] = tensors[router]
            per_expert = ckpt.expert_keys(i)
            assert isinstance(per_expert, list)
            for e, keys in enumerate(per_expert):
                for name, key in keys.items():
                    out[per_expert[perm[e]][name]] = tensors[key]
        return out

    return edit


@pytest.fixture(scope="module")
def relabel_base(hf_checkpoint) -> tuple[Path, ReplayResult]:
    path = hf_checkpoint("qwen2_moe", num_experts=6)
    return path, replay(Checkpoint(path), random_tokens())


@settings(max_examples=10, deadline=None)
@given(perm=st.permutations(range(6)))
def test_relabelling_experts_changes_only_labels(perm: list[int], relabel_base, tmp_path_factory):
    path, base = relabel_base
    moved = rewrite(path, tmp_path_factory.mktemp("relabelled"), relabel(perm))
    got = replay(Checkpoint(moved), random_tokens())
    assert got.nll == pytest.approx(base.nll, abs=1e-6)
    for i, r in base.routing.items():
        counts = torch.bincount(r.topk_NK.flatten(), minlength=6)
        moved_counts = torch.bincount(got.routing[i].topk_NK.flatten(), minlength=6)
        assert sorted(moved_counts.tolist()) == sorted(counts.tolist())
        assert torch.equal(moved_counts[perm], counts)
        torch.testing.assert_close(got.grads[i].experts_E[perm], base.grads[i].experts_E, rtol=1e-5, atol=1e-8)


def test_replay_leaves_the_callers_torch_flags_alone(hf_checkpoint) -> None:
    """Deterministic algorithms on (docs/glossary.md, "Replay") during the replay only: moeaudit also runs inside
    training processes (the hook, library use), whose torch settings it must not change."""
    before = (torch.are_deterministic_algorithms_enabled(), torch._C._get_deterministic_fill_uninitialized_memory())
    seen = []
    replay(
        Checkpoint(hf_checkpoint("mixtral")),
        random_tokens(),
        observers=[lambda *_: seen.append(torch.are_deterministic_algorithms_enabled())],
    )
    assert seen and all(seen)
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch._C._get_deterministic_fill_uninitialized_memory(),
    ) == before
