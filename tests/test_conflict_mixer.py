"""The domain conflict vector and the attention gradient norm cover a layer's whole token mixer:
MLA (deepseek_v3; longcat_flash's two MLA sub-blocks), Gated DeltaNet beside gated attention
(qwen3_next), Mamba beside attention (jamba), a mixture of attention heads (jetmoe). Checked
against transformers' gradients over the same parameters: each domain's conflict gradient, per
tensor and whole, the receipt's cosines, the attention gradient norm, and the document's
``parameters`` naming exactly the tensors used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hfmodels import load, random_tokens, save_tiny  # noqa: E402
from support.oracle import GRADIENT  # noqa: E402

from moeaudit.canary import Canary  # noqa: E402
from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.checkpoint.checkpoint import expected_layer_names  # noqa: E402
from moeaudit.receipts.conflict import _domain_grads, domain_conflict  # noqa: E402
from moeaudit.replay import replay  # noqa: E402
from moeaudit.replay.groups import ATTENTION, CONFLICT, present  # noqa: E402

# a tensor of each layer kind that the old fixed list (router, q/k/v/o, shared expert) missed
MIXER_PROBES = {
    "deepseek_v3": {"kv_b", "q_a"},
    "longcat_flash": {"kv_b", "s2_kv_b", "s2_o"},  # two MLA sub-blocks
    "qwen3_next": {"lin_out", "lin_conv"},
    "jamba": {"ssm_in", "ssm_out"},
    "jetmoe": {"moa_q", "moa_o", "kv"},  # a mixture of attention heads
}
DOMAINS_W = torch.tensor([0, 1, 0, 1, 1], dtype=torch.int32)


def _hf_grads(model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' gradient of the mean next-token NLL over ``tokens``, by parameter name."""
    model.zero_grad()
    model(input_ids=tokens, labels=tokens).loss.backward()
    return {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}


def _hf_vector(grads: dict[str, torch.Tensor], ckpt: Checkpoint, layer: int, names: list[str]) -> torch.Tensor:
    keys = ckpt.layer_keys(layer)
    missing = [n for n in names if keys[n] not in grads]
    assert missing == [], f"layer {layer}: no transformers gradient for {missing}"
    return torch.cat([grads[keys[n]].reshape(-1) for n in names])


@pytest.mark.parametrize("family", sorted(MIXER_PROBES))
def test_conflict_and_attention_gradients_cover_the_whole_mixer(family: str, tmp_path: Path) -> None:
    save_tiny(tmp_path, family)
    ckpt = Checkpoint(tmp_path)
    model = load(tmp_path)
    tokens = random_tokens(windows=len(DOMAINS_W))
    canary = Canary(tokens.to(torch.int32), DOMAINS_W, ("a", "b"))
    spec = ckpt.spec
    assert spec.routed_layers

    doc = domain_conflict(ckpt, canary)
    used_by_layer = {}
    for entry in doc["layers"]:
        layer = entry["layer"]
        used = entry.get("parameters", doc["parameters"])
        # exactly the layer's router, mixer and shared-expert tensors (no name it does not have)
        assert used == present(CONFLICT, expected_layer_names(spec, layer)), layer
        used_by_layer[layer] = used
    everything = {n for u in used_by_layer.values() for n in u}
    assert MIXER_PROBES[family] <= everything
    assert doc["parameters"] == [n for n in CONFLICT if n in everything]

    hf_by_domain = []
    for d in (0, 1):
        idx = (DOMAINS_W == d).nonzero().flatten()
        ours = _domain_grads(ckpt, tokens[idx], None)
        hf = _hf_grads(model, tokens[idx])
        hf_by_domain.append(hf)
        for layer, (names, vec) in ours.items():
            assert names == used_by_layer[layer]
            want = _hf_vector(hf, ckpt, layer, names)
            assert float(vec.norm()) == pytest.approx(float(want.norm()), rel=GRADIENT["rtol"]), (d, layer)
            keys = ckpt.layer_keys(layer)
            slices = vec.split([hf[keys[n]].numel() for n in names])
            for n, got in zip(names, slices, strict=True):  # each tensor's part, not only the total
                want_n = float(hf[keys[n]].norm())
                assert float(got.norm()) == pytest.approx(want_n, rel=GRADIENT["rtol"], abs=GRADIENT["atol"]), (d, n)

    for entry in doc["layers"]:  # the receipt's cosine is transformers' cosine over the same tensors
        layer, names = entry["layer"], used_by_layer[entry["layer"]]
        a, b = (_hf_vector(hf, ckpt, layer, names) for hf in hf_by_domain)
        cos = float(a @ b / (a.norm() * b.norm()))
        assert entry["cos"][0][1] == pytest.approx(cos, abs=1e-3), layer

    # the attention gradient norm: the same mixer plus what forms its input (the pre-norm)
    result = replay(ckpt, tokens)
    hf = _hf_grads(model, tokens)
    covered = set()
    for layer in spec.routed_layers:
        names = present(ATTENTION, expected_layer_names(spec, layer))
        covered |= set(names)
        want = float(_hf_vector(hf, ckpt, layer, names).norm())
        assert result.grads[layer].attention == pytest.approx(want, rel=GRADIENT["rtol"]), layer
    assert MIXER_PROBES[family] <= covered
