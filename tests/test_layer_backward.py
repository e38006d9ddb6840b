"""One layer backward (``moeaudit.replay.blocks.backward``) for the one-process and the
expert-parallel replay, its per-kind parts chosen by the MLP / MoE and residual record types:
each kind the families use has an entry, and for each residual wiring and MoE variant the
hand-written backward of a routed layer is autograd's through ``decoder_layer``."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import pytest
import torch

pytest.importorskip("transformers")

import hfmodels  # noqa: E402

from moeaudit.checkpoint.checkpoint import LayerWeights, expected_layer_names, expected_shapes  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import engine, sharded  # noqa: E402
from moeaudit.replay.blocks import backward  # noqa: E402
from moeaudit.replay.blocks.layer import FFNS  # noqa: E402
from moeaudit.replay.model import attention_block, decoder_layer, rms_norm, rope_tables  # noqa: E402
from moeaudit.spec import blocks  # noqa: E402
from moeaudit.spec.config import ModelSpec  # noqa: E402

# a family per residual wiring and MoE variant the routed backward distinguishes
WIRINGS = {
    "mixtral": "additive",
    "granitemoe": "residual multiplier",
    "minimax": "DeepNorm scales",
    "longcat_flash": "shortcut, zero-computation experts",
    "hy_v4": "hyper-connections",
    "axk1": "norm on the MoE output",
    "jetmoe": "bias on the MoE output",
    "qwen2_moe": "gated shared expert",
}


def _spec(family: str) -> ModelSpec:
    return spec_from_config(hfmodels.tiny_config(family).to_dict())


def test_local_and_sharded_replay_share_the_one_layer_backward() -> None:
    assert engine.layer_backward is backward.layer_backward
    assert sharded.layer_backward is backward.layer_backward
    assert not hasattr(sharded, "_backward_layer") and not hasattr(engine, "_hc_layer_backward")


@pytest.mark.parametrize("family", sorted(WIRINGS))
def test_every_block_kind_of_the_family_has_a_backward(family: str) -> None:
    spec = _spec(family)
    for layer in spec.layers:
        if layer.ffn is not None:
            assert type(layer.ffn) in backward.FFN_BACKWARDS
        assert backward.residual_backward(layer.residual) is backward.RESIDUALS[layer.residual.wiring]
    kinds = {type(backward.residual_backward(layer.residual)).__name__ for layer in spec.layers}
    expected = {"longcat_flash": "Shortcut", "hy_v4": "HyperConnected", "minimax": "DeepNorm"}.get(family, "Additive")
    assert kinds == {expected}


def _weights(spec: ModelSpec, i: int, seed: int) -> LayerWeights:
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(spec, None, i)
    params = {n: torch.randn(shapes[n], generator=gen) * 0.3 for n in expected_layer_names(spec, i)}
    names = ("w1", "w3", "w2") if "w3" in shapes else ("w1", "w2")
    experts = [{n: torch.randn(shapes[n], generator=gen) * 0.3 for n in names} for _ in range(spec.parametric_experts)]
    return LayerWeights(i, True, params, experts)


def _copy(lw: LayerWeights) -> LayerWeights:
    return LayerWeights(
        lw.layer,
        lw.routed,
        {n: t.clone() for n, t in lw.params.items()},
        [{n: t.clone() for n, t in e.items()} for e in lw.experts],
    )


@pytest.mark.parametrize("family", sorted(WIRINGS))
def test_routed_layer_backward_is_autograd_of_the_decoder_layer(family: str) -> None:
    spec = _spec(family)
    i = next(i for i in range(spec.num_layers) if spec.is_routed(i))
    lw = _weights(spec, i, 0)
    gen = torch.Generator().manual_seed(1)
    S = spec.layers[i].residual.hc
    shape = (2, 5, S.streams, spec.hidden_size) if S is not None else (2, 5, spec.hidden_size)
    x = torch.randn(shape, generator=gen)
    g = torch.randn(shape, generator=gen)
    rope = rope_tables(spec, 5)

    ref = _copy(lw).requires_grad_()
    for e in ref.experts:
        for t in e.values():
            t.requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    out, _ = decoder_layer(spec, ref, xr, rope)
    out.backward(g)

    mine = _copy(lw)
    dx, grads = backward.layer_backward(spec, mine, x, g, rope)
    assert grads is not None
    assert xr.grad is not None
    torch.testing.assert_close(dx, xr.grad, rtol=1e-4, atol=1e-5)
    for n, t in ref.params.items():
        got = mine.params[n].grad
        want = t.grad if t.grad is not None else torch.zeros_like(t)
        torch.testing.assert_close(got if got is not None else torch.zeros_like(t), want, rtol=1e-4, atol=1e-5, msg=n)
    norms = torch.stack(
        [sum((t.grad.square().sum() for t in e.values() if t.grad is not None), torch.zeros(())) for e in ref.experts]
    ).sqrt()
    assert float(norms.max()) > 0
    torch.testing.assert_close(grads.experts_E.float(), norms.float(), rtol=1e-4, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class _Scale(blocks.DenseMLP):
    """A toy MLP block, as a new kind would be added: FFN(y) = w ⊙ y."""

    KIND: ClassVar[str] = "scale"

    def names(self) -> list[str]:
        return ["mlp_scale"]

    def shapes(self, H: int) -> dict[str, tuple[int, ...]]:
        return {"mlp_scale": (H,)}


def _scale(spec: ModelSpec, lw: LayerWeights, ffn: _Scale, h: torch.Tensor, *_: object) -> tuple[torch.Tensor, ...]:
    y = rms_norm(h, lw.params["post_norm"], spec.rms_eps)
    return y * lw.params["mlp_scale"], y, None  # type: ignore[return-value]


def test_a_new_mlp_kind_is_its_record_its_forward_and_the_family_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/guides/block-kind.md: a new MLP kind is its record, one entry in ``FFNS`` for its
    forward and, where autograd is not its backward, one in ``FFN_BACKWARDS``; the decoder layer
    and the one layer backward need no edit."""
    monkeypatch.setitem(FFNS, _Scale, _scale)
    spec = _spec("mixtral")
    layers = tuple(blocks.Layer(layer.mixer, _Scale(0), layer.residual) for layer in spec.layers)
    toy = spec.revised(layer_blocks=layers)
    assert expected_layer_names(toy, 1)[-1] == "mlp_scale"
    gen = torch.Generator().manual_seed(3)
    shapes = expected_shapes(toy, None, 1)
    params = {n: torch.randn(shapes[n], generator=gen) for n in expected_layer_names(toy, 1)}
    x, g = torch.randn(2, 4, spec.hidden_size, generator=gen), torch.randn(2, 4, spec.hidden_size, generator=gen)
    rope = rope_tables(spec, 4)
    ref = LayerWeights(1, False, {n: t.clone().requires_grad_(True) for n, t in params.items()})
    xr = x.clone().requires_grad_(True)
    out, tap = decoder_layer(toy, ref, xr, rope)
    assert tap is None
    h = attention_block(toy, ref, xr, rope)
    torch.testing.assert_close(out, h + rms_norm(h, ref.params["post_norm"], spec.rms_eps) * ref.params["mlp_scale"])
    out.backward(g)
    mine = LayerWeights(1, False, {n: t.clone() for n, t in params.items()})
    dx, grads = backward.layer_backward(toy, mine, x, g, rope)
    assert grads is None
    torch.testing.assert_close(dx, xr.grad)
    scale = mine.params["mlp_scale"].grad
    assert scale is not None and float(scale.abs().sum()) > 0
    torch.testing.assert_close(scale, ref.params["mlp_scale"].grad)
