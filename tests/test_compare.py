"""`moeaudit compare` (`003` §5; README.md, "Commands"): the moeaudit.compare/v1 document, drift localised to the
layer that changed, the margins as Eq. 31–32 define them, and the input errors (exit 4)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from moeaudit import canary as canary_mod
from moeaudit.cli import cli
from moeaudit.policy import Policy

pytest.importorskip("transformers")

VOCAB = 96  # hfmodels.VOCAB
PROTECTED = 1  # default protected layers of a 3-layer model: the middle third, [1]
LAYER = "model.layers.{layer}."
EXPERT = LAYER + "block_sparse_moe.experts.{expert}.{w}.weight"
DRIFTS = ("coordinate", "boundary", "transition", "content")
RECEIPTS = "moeaudit.receipts/v1"


# ----- helpers ---------------------------------------------------------------------------


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy a checkpoint directory and edit its tensors in place."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    tensors = load_file(weights)
    edit(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})
    return dst


def make_canary(path: Path, *, vocab: int = VOCAB, seed: int = 3) -> Path:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (8, 16), generator=g, dtype=torch.int32)
    domains = torch.arange(8, dtype=torch.int32) % 2
    canary_mod.save(canary_mod.Canary(tokens, domains, ("code", "prose")), path)
    return path


def run(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stderr


def one_line_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def receipts_json(ckpt: Path, canary: Path, out: Path) -> Path:
    code, stderr = run("receipts", ckpt, "--canary", canary, "--json", out)
    assert code == 0, stderr
    return out


def compare_against(workspace: dict[str, Path], reference: Path, *more: str | Path) -> tuple[int, str]:
    """``compare base cand`` on the workspace canary with ``--reference``."""
    return run(
        "compare",
        workspace["base"],
        workspace["cand"],
        "--canary",
        workspace["canary"],
        "--reference",
        reference,
        *more,
    )


def expert_noise(layer: int, scale: float = 0.3, seed: int = 5) -> Callable[[dict[str, torch.Tensor]], None]:
    """Perturb every expert of one layer (not its router or gain)."""

    def edit(t: dict[str, torch.Tensor]) -> None:
        g = torch.Generator().manual_seed(seed)
        for e in range(4):
            for w in ("w1", "w2", "w3"):
                key = EXPERT.format(layer=layer, expert=e, w=w)
                t[key] = t[key] + scale * t[key].std() * torch.randn(t[key].shape, generator=g)

    return edit


@pytest.fixture(scope="module")
def workspace(hf_checkpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    base = root / "base"
    shutil.copytree(hf_checkpoint("mixtral"), base)
    return {
        "root": root,
        "base": base,
        "cand": rewrite(base, root / "cand", expert_noise(PROTECTED)),
        "canary": make_canary(root / "canary.safetensors"),
    }


@pytest.fixture(scope="module")
def noisy(workspace: dict[str, Path]) -> dict[str, Any]:
    """compare(base, base + noise in the protected layer's experts), reference = base."""
    out = workspace["root"] / "noisy.json"
    code, stderr = compare_against(workspace, workspace["base"], "--json", out)
    assert code == 0, stderr
    return json.loads(out.read_text())


def layer_of(doc: dict[str, Any], layer: int) -> dict[str, Any]:
    return next(entry for entry in doc["layers"] if entry["layer"] == layer)


# ----- the document -----------------------------------------------------------------------


def test_compare_document_shape(noisy: dict[str, Any], workspace: dict[str, Path]) -> None:
    assert noisy["schema"] == "moeaudit.compare/v1"
    canary_digest = canary_mod.load(workspace["canary"]).digest
    for side, name in (("base", "base"), ("candidate", "cand")):
        doc = noisy[side]
        assert doc["schema"] == RECEIPTS
        assert doc["checkpoint"]["name"] == name
        assert len(doc["checkpoint"]["digest"]["sha256"]) == 64
        assert doc["canary"]["digest"]["sha256"] == canary_digest
        assert isinstance(doc["nll"], float)
        assert [entry["layer"] for entry in doc["layers"]] == [0, 1, 2]
        for entry in doc["layers"]:
            assert {"counts", "pi", "pi_min", "dead", "cv", "entropy", "entropy_norm"} <= set(entry["occupancy"])
            assert {"margin_mean", "boundary_mass", "flip_rate"} <= set(entry["boundary"])
            assert {"c2", "c2_smooth"} <= set(entry["overlap"])
            assert {"grad_norms", "var_grad", "var_grad_norm"} <= set(entry["gradients"])
    assert noisy["base"]["checkpoint"]["digest"] != noisy["candidate"]["checkpoint"]["digest"]
    assert noisy["protected_layers"] == [PROTECTED]
    assert [entry["layer"] for entry in noisy["layers"]] == [0, 1, 2]
    for entry in noisy["layers"]:
        assert set(DRIFTS) <= set(entry["drift"])
        assert all(isinstance(entry["drift"][n], float) for n in DRIFTS)
    for margin in ("refinement", "handoff"):
        assert isinstance(noisy["margins"][margin]["exact"], float)
        assert isinstance(noisy["margins"][margin]["smooth"], float)
    assert noisy["policy"]["margins"]["tau"] == Policy().margins.tau


def test_expert_noise_shows_as_content_drift_on_its_layer_only(noisy: dict[str, Any]) -> None:
    changed = layer_of(noisy, PROTECTED)
    assert changed["drift"]["content"] > 0.0
    assert min(changed["weights"]["expert_relative_change"]) > 0.0
    assert changed["weights"]["router_drift"] == 0.0
    # Router and gain are untouched, so routing on the base-anchored state cannot move.
    for name in ("coordinate", "boundary", "transition"):
        assert changed["drift"][name] == 0.0, name
    # Layers on either side hold identical weights: nothing moves on base-anchored states ...
    for layer in (0, 2):
        entry = layer_of(noisy, layer)
        for name in ("boundary", "transition", "content"):
            assert entry["drift"][name] == 0.0, (layer, name)
    # ... but the path after the changed layer does (coordinate uses each checkpoint's own y).
    assert layer_of(noisy, 0)["drift"]["coordinate"] == 0.0
    assert layer_of(noisy, 2)["drift"]["coordinate"] > 0.0


def test_margins_are_eq_31_and_32_of_the_receipts(noisy: dict[str, Any]) -> None:
    m = Policy().margins
    base, cand = layer_of(noisy["base"], PROTECTED), layer_of(noisy["candidate"], PROTECTED)
    drift = layer_of(noisy, PROTECTED)["drift"]
    occ = 1.0 - cand["occupancy"]["pi_min"] / base["occupancy"]["pi_min"]
    load = m.mu1 * drift["boundary"] + m.mu2 * drift["content"] + m.mu3 * occ
    assert noisy["margins"]["refinement"]["exact"] == pytest.approx(m.tau - load, abs=1e-12)
    # The reference is the base itself.
    h = m.lambda1 * (cand["overlap"]["c2"] - base["overlap"]["c2"]) + m.lambda2 * (
        cand["occupancy"]["pi_min"] / base["occupancy"]["pi_min"] - 1.0
    )
    assert noisy["margins"]["handoff"]["exact"] == pytest.approx(h, abs=1e-12)
    assert noisy["margins"]["handoff"]["reference"] == "base"


# ----- --reference as a receipts file -----------------------------------------------------


def test_reference_receipts_json_gives_the_same_handoff(
    noisy: dict[str, Any], workspace: dict[str, Path], tmp_path: Path
) -> None:
    ref = receipts_json(workspace["base"], workspace["canary"], tmp_path / "ref.json")
    out = tmp_path / "out.json"
    code, stderr = compare_against(workspace, ref, "--json", out)
    assert code == 0, stderr
    assert json.loads(out.read_text())["margins"]["handoff"] == noisy["margins"]["handoff"]


def receipts_on_another_canary(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    other = make_canary(tmp_path / "other.safetensors", seed=4)
    return receipts_json(workspace["base"], other, tmp_path / "ref.json")


def not_receipts(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"schema": "moeaudit.compare/v1"}))
    return ref


def truncated_receipts(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    ref = tmp_path / "ref.json"
    ref.write_text('{"schema": "moeaudit.receipts/v1", "layers": [{"layer": 0, "occup')  # a copy cut short
    return ref


def receipts_of_another_moe_structure(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    return receipts_json(hf_checkpoint("mixtral", num_local_experts=3), workspace["canary"], tmp_path / "ref.json")


def _edited_receipts(workspace: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    ref = receipts_json(workspace["base"], workspace["canary"], tmp_path / "ref.json")
    doc = json.loads(ref.read_text())
    edit(doc)
    ref.write_text(json.dumps(doc))
    return ref


def receipts_without_canary(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    return _edited_receipts(workspace, tmp_path, lambda doc: doc.pop("canary"))


def receipts_without_occupancy(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    return _edited_receipts(workspace, tmp_path, lambda doc: [layer.pop("occupancy") for layer in doc["layers"]])


def receipts_with_a_repeated_key(hf_checkpoint, workspace: dict[str, Path], tmp_path: Path) -> Path:
    ref = receipts_json(workspace["base"], workspace["canary"], tmp_path / "ref.json")
    ref.write_text(ref.read_text().rstrip()[:-1] + ', "nll": 0.5}')
    return ref


@pytest.mark.parametrize(
    ("make_reference", "before_replay", "message"),
    [
        (receipts_on_another_canary, True, "another canary"),
        (not_receipts, True, RECEIPTS),
        (truncated_receipts, True, "neither a checkpoint directory nor receipts JSON (Unterminated string"),
        # untrusted receipts JSON read like every other input
        (receipts_without_canary, True, "reference receipts name no canary digest"),
        (receipts_without_occupancy, True, "lacks or garbles a field the handoff margin reads (KeyError: 'occupancy')"),
        (receipts_with_a_repeated_key, True, "repeats the key 'nll'"),
        # the MoE structure, with the candidate's (its spec, before its replay)
        (receipts_of_another_moe_structure, True, "different MoE structure (experts: 3 vs 4)"),
    ],
    ids=[
        "another-canary",
        "not-receipts",
        "truncated",
        "no-canary",
        "no-occupancy",
        "repeated-key",
        "another-moe-structure",
    ],
)
def test_unusable_reference_receipts_are_refused(
    hf_checkpoint,
    workspace: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make_reference: Callable[..., Path],
    before_replay: bool,
    message: str,
) -> None:
    ref = make_reference(hf_checkpoint, workspace, tmp_path)

    def no_replay(*_a: Any, **_k: Any) -> None:
        raise AssertionError("compare replayed a checkpoint before checking its reference")

    if before_replay:
        monkeypatch.setattr("moeaudit.receipts.state.run_state", no_replay)
    code, stderr = compare_against(workspace, ref)
    assert code == 4
    assert message in one_line_error(stderr)


# ----- input errors (exit 4) ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_local_experts": 3}, "num_experts"),
        ({"vocab_size": 128}, "vocab_size"),
    ],
    ids=["experts", "vocab"],
)
def test_different_architectures_are_an_input_error(
    hf_checkpoint, workspace: dict[str, Path], overrides: dict[str, int], field: str
) -> None:
    other = hf_checkpoint("mixtral", **overrides)
    code, stderr = run("compare", workspace["base"], other, "--canary", workspace["canary"])
    assert code == 4
    line = one_line_error(stderr)
    assert "different architectures" in line and field in line


def test_canary_outside_the_vocabulary_is_an_input_error(workspace: dict[str, Path], tmp_path: Path) -> None:
    wide = make_canary(tmp_path / "wide.safetensors", vocab=4 * VOCAB)
    code, stderr = run("compare", workspace["base"], workspace["cand"], "--canary", wide)
    assert code == 4
    assert f"outside the model vocabulary of size {VOCAB}" in one_line_error(stderr)


def dead_expert(
    layer: int, expert: int, j: int = 0, level: float = 2.0, push: float = 1e3
) -> Callable[[dict[str, torch.Tensor]], None]:
    """Kill one expert of ``layer`` with a bias-like direction.

    Hidden coordinate j of the residual stream is held at a positive constant up to ``layer``
    (constant embedding column; nothing writes to it: o_proj and expert down-projection rows
    j are zero), so z_j > 0 on every token; the router row −push·e_j then ranks the expert
    last everywhere, as a large negative router bias would.
    """

    def edit(t: dict[str, torch.Tensor]) -> None:
        t["model.embed_tokens.weight"][:, j] = level
        for i in range(layer + 1):
            t[LAYER.format(layer=i) + "self_attn.o_proj.weight"][j, :] = 0.0
            if i < layer:
                for e in range(4):
                    t[EXPERT.format(layer=i, expert=e, w="w2")][j, :] = 0.0
        t[LAYER.format(layer=layer) + "post_attention_layernorm.weight"][j] = 1.0
        row = torch.zeros_like(t[LAYER.format(layer=layer) + "block_sparse_moe.gate.weight"][expert])
        row[j] = -push
        t[LAYER.format(layer=layer) + "block_sparse_moe.gate.weight"][expert] = row

    return edit


def test_reference_with_a_dead_protected_expert_is_an_input_error(workspace: dict[str, Path], tmp_path: Path) -> None:
    ref = rewrite(workspace["base"], tmp_path / "dead-ref", dead_expert(PROTECTED, expert=3))
    receipts = receipts_json(ref, workspace["canary"], tmp_path / "dead.json")
    occupancy = layer_of(json.loads(receipts.read_text()), PROTECTED)["occupancy"]
    assert occupancy["counts"][3] == 0 and occupancy["pi_min"] == 0.0  # the construction worked
    for reference in (ref, receipts):  # as a checkpoint and as its receipts
        code, stderr = compare_against(workspace, reference)
        assert code == 4
        line = one_line_error(stderr)
        assert f"dead experts on protected layer {PROTECTED}" in line
