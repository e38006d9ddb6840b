"""The residual wiring of a decoder layer (``spec.blocks.Residual.wiring``): one kind per layer,
and the forward's and the backward's registries (``replay.blocks.layer.RESIDUALS``,
``replay.blocks.backward.RESIDUALS``) each have an entry for every kind a family's layers use, so
that a new wiring without its forward or backward fails here rather than in a replay."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hfmodels  # noqa: E402

from moeaudit.checkpoint.checkpoint import LayerWeights, expected_layer_names, expected_shapes  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay.blocks import backward, layer  # noqa: E402
from moeaudit.replay.model import decoder_layer, rope_tables  # noqa: E402
from moeaudit.spec import blocks  # noqa: E402
from moeaudit.spec.config import ModelSpec  # noqa: E402

# the wiring of the families that have one other than "sequential"
WIRED = {
    "cohere2_moe": "parallel",
    "hy_v4": "hyper_connection",
    "longcat_flash": "shortcut",
    "minimax": "deepnorm",
    "nemotron_h": "single_block",
}


def _spec(family: str) -> ModelSpec:
    return spec_from_config(hfmodels.tiny_config(family).to_dict())


@pytest.mark.parametrize("family", sorted(hfmodels.REGISTRY))
def test_each_family_wiring_has_a_forward_and_a_backward(family: str) -> None:
    spec = _spec(family)
    wirings = {lay.residual.wiring for lay in spec.layers}
    assert wirings == {WIRED.get(family, "sequential")}
    assert wirings <= set(layer.RESIDUALS) and wirings <= set(backward.RESIDUALS)


def test_the_forward_and_the_backward_key_on_the_same_wirings() -> None:
    assert set(layer.RESIDUALS) == set(backward.RESIDUALS)


@pytest.mark.parametrize(
    ("residual", "wiring"),
    [
        (blocks.Residual(), "sequential"),
        (blocks.Residual(multiplier=0.25, pre_norm=False), "sequential"),
        (blocks.Residual(parallel=True), "parallel"),
        (blocks.Residual(single_block=True), "single_block"),
        (blocks.Residual(scales=((1.0, 2.0), (3.0, 4.0))), "deepnorm"),
        (blocks.Residual(shortcut=blocks.DenseMLP(8)), "shortcut"),
        (blocks.Residual(hc=blocks.HyperConnection(4, 20)), "hyper_connection"),
        # a record no family gives: the order of ``Residual.wiring`` decides
        (blocks.Residual(hc=blocks.HyperConnection(4, 20), shortcut=blocks.DenseMLP(8)), "hyper_connection"),
        (blocks.Residual(single_block=True, parallel=True), "single_block"),
    ],
)
def test_each_residual_flag_names_a_registered_wiring(residual: blocks.Residual, wiring: str) -> None:
    assert residual.wiring == wiring
    assert wiring in layer.RESIDUALS and wiring in backward.RESIDUALS


def test_the_decoder_layer_is_the_registered_wiring(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decoder_layer`` has no branch of its own: what the wiring's entry returns is the layer's."""
    spec = _spec("mixtral")
    gen = torch.Generator().manual_seed(0)
    shapes = expected_shapes(spec, None, 0)
    lw = LayerWeights(0, False, {n: torch.randn(shapes[n], generator=gen) for n in expected_layer_names(spec, 0)})
    x = torch.randn(1, 3, spec.hidden_size, generator=gen)
    seen: list[tuple[torch.Tensor, int]] = []

    def doubled(spec: ModelSpec, lw: LayerWeights, x_BTH: torch.Tensor, *_: object) -> layer.Tapped:
        seen.append((x_BTH, lw.layer))
        return 2 * x_BTH, None

    monkeypatch.setitem(layer.RESIDUALS, "sequential", doubled)
    out, tap = decoder_layer(spec, lw, x, rope_tables(spec, 3))
    assert torch.equal(out, 2 * x) and tap is None
    assert len(seen) == 1 and seen[0][0] is x and seen[0][1] == 0
