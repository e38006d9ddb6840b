"""A layer as typed blocks (``moeaudit.spec.blocks``): the tensors each family's layers hold and
their shapes, the gradient groups' summation order, and the expert-parallel replay's refusals, all
read off ``ModelSpec.layers``. The names and shapes are pinned by tests/golden/layer_tensors.json,
written by the checkpoint reader's per-flag code before the blocks replaced it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch

pytest.importorskip("transformers")

import hfmodels  # noqa: E402

from moeaudit.checkpoint.checkpoint import LayerWeights, expected_layer_names, expected_shapes  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import groups  # noqa: E402
from moeaudit.replay.model import MIXERS, decoder_layer, rms_norm, rope_tables  # noqa: E402
from moeaudit.spec import blocks  # noqa: E402
from moeaudit.spec.config import ModelSpec  # noqa: E402
from moeaudit.spec.settings import AttentionVariant  # noqa: E402

GOLDEN = Path(__file__).parent / "golden" / "layer_tensors.json"
TENSORS: dict[str, list[list[list[object]]]] = json.loads(GOLDEN.read_text())


def _spec(family: str) -> ModelSpec:
    return spec_from_config(hfmodels.tiny_config(family).to_dict())


@pytest.mark.parametrize("family", sorted(TENSORS))
def test_each_layer_holds_the_recorded_tensors_in_order(family: str) -> None:
    spec = _spec(family)
    assert len(spec.layers) == spec.num_layers == len(TENSORS[family])
    for layer, want in enumerate(TENSORS[family]):
        names = [n for n, _ in want if not str(n).startswith("expert:")]
        assert expected_layer_names(spec, layer) == spec.layers[layer].names() == names, layer
        shapes = expected_shapes(spec, None, layer)
        for name, shape in want:
            assert shapes[str(name).removeprefix("expert:")] == tuple(shape), (layer, name)  # type: ignore[arg-type]
        assert set(names) <= set(spec.layout.layer), layer  # each resolves to an on-disk key


# the order the squared norms of a layer's groups are summed in (the receipts' bits): as the
# groups were written out by hand before the blocks declared them
ATTENTION = (
    "q",
    "k",
    "v",
    "o",
    "q_bias",
    "k_bias",
    "v_bias",
    "o_bias",
    "q_norm",
    "k_norm",
    "input_norm",
    "input_norm_bias",
    "attn_out_norm",
    "q_a",
    "q_a_bias",
    "q_a_norm",
    "q_b",
    "kv_a",
    "kv_a_bias",
    "kv_a_norm",
    "kv_b",
    "sinks",
    "qkv",
    "qkv_bias",
    "g_proj",
    "s2_input_norm",
    "s2_q_a",
    "s2_q_a_bias",
    "s2_q_a_norm",
    "s2_q_b",
    "s2_kv_a",
    "s2_kv_a_bias",
    "s2_kv_a_norm",
    "s2_kv_b",
    "s2_o",
    "s2_o_bias",
    "light_qkv",
    "light_gate",
    "light_norm",
    "light_out",
    "lin_in",
    "lin_qkvz",
    "lin_ba",
    "lin_qkv",
    "lin_z",
    "lin_b",
    "lin_a",
    "lin_conv",
    "lin_dt_bias",
    "lin_A_log",
    "lin_norm",
    "lin_out",
    "kda_q",
    "kda_k",
    "kda_v",
    "kda_q_conv",
    "kda_k_conv",
    "kda_v_conv",
    "kda_f_a",
    "kda_f_b",
    "kda_f",
    "kda_dt_bias",
    "kda_A_log",
    "kda_b",
    "kda_g_a",
    "kda_g_b",
    "kda_g",
    "kda_norm",
    "kda_o",
    "ssm_in",
    "ssm_in_bias",
    "ssm_conv",
    "ssm_conv_bias",
    "ssm_x",
    "ssm_dt",
    "ssm_dt_bias",
    "ssm_A_log",
    "ssm_D",
    "ssm_dt_norm",
    "ssm_b_norm",
    "ssm_c_norm",
    "ssm_norm",
    "ssm_out",
    "ssm_out_bias",
    "conv_in",
    "conv_in_bias",
    "conv_w",
    "conv_bias",
    "conv_out",
    "conv_out_bias",
    "moa_router",
    "moa_q",
    "moa_o",
    "moa_bias",
    "kv",
    "attn_hc_fn",
    "attn_hc_base",
    "attn_hc_scale",
)


def test_gradient_groups_keep_their_summation_order() -> None:
    assert groups.ATTENTION == ATTENTION
    assert groups.ROUTER == ("router", "router_logit_bias")
    assert groups.SHARED_EXPERT == ("shared_w1", "shared_w3", "shared_w2", "shared_gate", "moe_bias")
    inputs = {"input_norm", "input_norm_bias", "s2_input_norm", "attn_hc_fn", "attn_hc_base", "attn_hc_scale"}
    assert groups.MIXER == tuple(n for n in ATTENTION if n not in inputs)
    assert groups.CONFLICT == (*groups.ROUTER, *groups.MIXER, *groups.SHARED_EXPERT)


def test_merge_keeps_every_order_and_places_each_name_once() -> None:
    assert groups.merge(("a", "c"), ("b", "c"), ("a", "b")) == ("a", "b", "c")
    assert groups.merge(("x", "y"), ("z",), ("y", "z")) == ("x", "y", "z")
    for kind in (blocks.Attention, blocks.MLAttention, blocks.DeltaNet, blocks.MambaMixer, blocks.MoA):
        order = kind.grads(blocks.Residual.INPUTS)
        assert [n for n in groups.ATTENTION if n in order] == list(order), kind


@pytest.mark.parametrize(
    ("family", "why"),
    [
        ("jetmoe", "mixture of attention heads and the bias on its MoE output"),
        ("minimax", "DeepNorm residuals"),
        ("kimi_linear", "Kimi Delta Attention layers"),
        ("bailing_hybrid", "Kimi Delta Attention layers"),
        ("axk1", "norm on the MoE output"),
        ("hy_v4", "hyper-connections (several residual streams mixed before and after each sub-block)"),
        ("mimo_v2_flash", "attention per kind of layer (head counts, head sizes, RoPE tables and sinks by layer type)"),
        ("longcat_flash", blocks.Residual.SHORTCUT),
        ("qwen3_next", None),
        ("deepseek_v3", None),
        ("nemotron_h", None),
        ("jamba", None),
    ],
)
def test_sharded_refusal_is_the_blocks(family: str, why: str | None) -> None:
    from moeaudit.errors import InputError
    from moeaudit.replay.sharded import check_shardable

    spec = _spec(family)
    got = next((w for layer in spec.layers if (w := layer.sharded_refusal()) is not None), None)
    assert got == why
    if why is None:
        check_shardable(spec)
        return
    with pytest.raises(InputError) as err:
        check_shardable(spec)
    assert str(err.value).startswith(f"the expert-parallel replay does not replay {family}'s {why} yet")


def test_layers_are_derived_once_and_anew_for_a_replaced_spec() -> None:
    spec = _spec("llama4_text")
    assert spec.layers is spec.layers  # cached on the frozen spec
    att = [layer.mixer for layer in spec.layers]
    assert all(isinstance(a, blocks.Attention) for a in att)
    assert [a.rope for a in att if isinstance(a, blocks.Attention)] == [
        i not in spec.nope_layers for i in range(spec.num_layers)
    ]
    nope = spec.revised(attention=blocks.uniform(spec.num_layers, AttentionVariant(rope=False)))
    assert all(isinstance(a, blocks.Attention) and not a.rope for a in (layer.mixer for layer in nope.layers))
    assert "layers" not in spec.to_json()  # derived, not part of the spec's signed JSON


def test_block_kinds_of_the_hybrids() -> None:
    kinds = {f: [type(layer.mixer).__name__ for layer in _spec(f).layers] for f in ("qwen3_next", "jamba", "lfm2_moe")}
    assert kinds["qwen3_next"][0] == "DeltaNet" and "Attention" in kinds["qwen3_next"]
    assert "MambaMixer" in kinds["jamba"] and "Attention" in kinds["jamba"]
    assert "ShortConv" in kinds["lfm2_moe"]
    nemotron = _spec("nemotron_h").layers
    assert all(layer.residual.single_block for layer in nemotron)
    assert "block_kinds" not in {f.name for f in dataclasses.fields(ModelSpec)}  # read off the given layers
    assert (
        set(_spec("nemotron_h").block_kinds) == {"mamba", "attention", "mlp", "moe"} and not _spec("jamba").block_kinds
    )
    assert {(type(layer.mixer).__name__, type(layer.ffn).__name__) for layer in nemotron} >= {
        ("MambaMixer", "NoneType"),
        ("NoneType", "MoE"),
    }


def _random_layer(spec: ModelSpec, i: int, gen: torch.Generator) -> LayerWeights:
    shapes = expected_shapes(spec, None, i)
    params = {n: torch.randn(shapes[n], generator=gen) * 0.3 for n in expected_layer_names(spec, i)}
    experts = []
    if spec.is_routed(i):
        experts = [{n: torch.randn(shapes[n], generator=gen) * 0.3 for n in ("w1", "w3", "w2")}]
        experts *= spec.num_experts
    return LayerWeights(i, spec.is_routed(i), params, experts)


def test_layers_a_family_gives_replay_as_the_derived_ones() -> None:
    spec = _spec("qwen2_moe")
    given = spec.revised(layer_blocks=spec.layers)
    assert "layer_blocks" not in spec.to_json()
    assert given.to_json() == spec.to_json()  # the blocks a family gives leave its signed JSON as it was
    written = [layer.to_json() for layer in given.settings.layer_blocks]
    assert [layer["mixer"]["kind"] for layer in written] == ["attention"] * spec.num_layers
    assert written[0]["ffn"]["kind"] == "moe" and written[0]["ffn"]["shared"]["dim"] == spec.shared_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, spec.hidden_size, generator=gen)
    rope = rope_tables(spec, 5)
    for i in range(spec.num_layers):
        lw = _random_layer(spec, i, gen)
        assert expected_layer_names(given, i) == expected_layer_names(spec, i)
        a, _ = decoder_layer(spec, lw, x, rope)
        b, _ = decoder_layer(given, lw, x, rope)
        assert torch.equal(a, b)
    with pytest.raises(KeyError, match="'sliding'"):
        blocks.per_layer_type(["full", "sliding"], {"full": spec.layers[0]})
    assert blocks.uniform(3, spec.layers[0]) == (spec.layers[0],) * 3


@dataclasses.dataclass(frozen=True)
class _Shift(blocks._Mixer):
    """A toy token mixer, as a new block kind would be added: out_t = w ⊙ x_{t-1}."""

    KIND: ClassVar[str] = "shift"
    NAMES: ClassVar[tuple[str, ...]] = ("shift_w",)

    def shapes(self, H: int) -> dict[str, tuple[int, ...]]:
        return {"shift_w": (H,)}


def _shift(
    spec: ModelSpec, m: _Shift, p: dict[str, torch.Tensor], x: torch.Tensor, rope: object, i: int
) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1] * p["shift_w"]


def test_a_new_mixer_kind_is_its_record_its_forward_and_the_family_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/guides/block-kind.md: the record (names, shapes, gradient group, sharded support), one
    registry entry for its forward, and the family's layers; the checkpoint reader's names and
    shapes, the decoder layer and the sharded replay's check need no edit."""
    monkeypatch.setitem(MIXERS, _Shift, _shift)
    spec = _spec("mixtral")
    toy = spec.revised(layer_blocks=tuple(blocks.Layer(_Shift(), l.ffn, l.residual) for l in spec.layers))  # type: ignore[arg-type]
    assert expected_layer_names(toy, 1) == ["input_norm", "post_norm", "shift_w", "router"]
    assert expected_shapes(toy, None, 1)["shift_w"] == (spec.hidden_size,)
    from moeaudit.replay.sharded import check_shardable

    check_shardable(toy)  # replayed expert-parallel unless the record says why not
    gen = torch.Generator().manual_seed(1)
    lw = _random_layer(toy, 1, gen).requires_grad_()
    x = torch.randn(2, 4, spec.hidden_size, generator=gen)
    out, tap = decoder_layer(toy, lw, x, rope_tables(spec, 4))
    assert tap is not None
    x_norm = rms_norm(x, lw.params["input_norm"], spec.rms_eps)
    h = x + torch.nn.functional.pad(x_norm, (0, 0, 1, 0))[:, :-1] * lw.params["shift_w"]
    assert torch.allclose(tap.h_NH, h.reshape(-1, spec.hidden_size))
    out.sum().backward()
    assert lw.params["shift_w"].grad is not None and float(lw.params["shift_w"].grad.abs().sum()) > 0


# family → (the per-layer tuple it no longer sets, the token mixer kind that tuple now reads from ``layers``)
GIVEN_LAYERS = {
    "qwen3_next": ("linear_layers", blocks.DeltaNet),
    "qwen3_5_moe_text": ("linear_layers", blocks.DeltaNet),
    "lara_mini": ("linear_layers", blocks.DeltaNet),
    "kimi_linear": ("kda_layers", blocks.KDA),
    "bailing_hybrid": ("kda_layers", blocks.KDA),
    "jamba": ("mamba_layers", blocks.MambaMixer),
    "granitemoehybrid": ("mamba_layers", blocks.MambaMixer),
    "nemotron_h": ("mamba_layers", blocks.MambaMixer),
    "minimax": ("lightning_layers", blocks.Lightning),
    "lfm2_moe": ("conv_layers", blocks.ShortConv),
}


@pytest.mark.parametrize("family", sorted(GIVEN_LAYERS))
def test_hybrid_families_give_their_layers_and_the_tuples_follow(family: str) -> None:
    spec = _spec(family)
    name, kind = GIVEN_LAYERS[family]
    assert name not in {f.name for f in dataclasses.fields(ModelSpec)}  # derived, not a field
    assert len(spec.settings.layer_blocks) == spec.num_layers and spec.layers is spec.settings.layer_blocks
    derived = getattr(spec, name)
    assert derived and derived == tuple(
        i for i, layer in enumerate(spec.settings.layer_blocks) if isinstance(layer.mixer, kind)
    )
    assert 0 < len(derived) < spec.num_layers  # a hybrid: some layers of another mixer
    assert list(spec.to_json()[name]) == list(derived) and "layer_blocks" not in spec.to_json()


def test_layers_the_fields_do_not_say_are_written_with_their_kinds() -> None:
    spec = _spec("qwen3_next")
    first = blocks.Layer(_Shift(), spec.layers[0].ffn, spec.layers[0].residual)  # type: ignore[arg-type]
    toy = spec.revised(layer_blocks=(first, *spec.layers[1:]))
    written = toy.to_json()["layer_blocks"]
    assert written[0]["mixer"]["kind"] == "shift" and written[1] == spec.layers[1].to_json()
    assert "layer_blocks" not in spec.to_json()
