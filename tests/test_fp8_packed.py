"""Quantised experts stay as stored until they reach the device that computes
(docs/decisions.md, "FP8 and MXFP4 weights").

Block-scaled FP8 experts (DeepSeek-V3 as released) are held as float8_e4m3fn bytes and their
block scales (``FP8Experts``), MXFP4 experts as codes and exponents (``MXFP4Experts``); expert
e is dequantised on access, after its stored bytes moved (``DeviceExperts``). Checked here: the
replay of an FP8 checkpoint is bit for bit that of its float32-dequantised twin; the host never
holds more than one expert's float32 matrices at a time; on a device (``cpu:0`` stands in) the
bytes that cross for the experts are the stored ones — a quarter of float32's plus the scales.
"""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from moeaudit import canary as canary_mod
from moeaudit.checkpoint import Checkpoint, mxfp4
from moeaudit.checkpoint import checkpoint as checkpoint_mod
from moeaudit.checkpoint import stored as stored_mod
from moeaudit.checkpoint.checkpoint import (
    SCALE_SUFFIX,
    FP8Experts,
    MXFP4Experts,
    dequantize_fp8,
    fp8_nonfinite_marker,
)
from moeaudit.receipts.state import state_receipts
from moeaudit.replay import replay
from moeaudit.replay.device import DeviceExperts

pytest.importorskip("transformers")

from device_meter import measure  # noqa: E402
from hfmodels import random_tokens, save_tiny  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from support.oracle_deepseek import _fp8_checkpoint  # noqa: E402
from support.oracle_gpt_oss import _mxfp4_checkpoint  # noqa: E402

STANDIN = "cpu:0"  # stands in for a GPU: the device branch, its copies counted (device_meter)
BLOCK = (4, 4)  # every tiny deepseek_v3 dimension divides by 4 (partial blocks: test_dequantise…)


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(FP8 checkpoint, its twin with every FP8 weight stored as the float32 w · s)."""
    root = tmp_path_factory.mktemp("fp8")
    save_tiny(root / "src", "deepseek_v3")
    packed = _fp8_checkpoint(root / "src", root / "fp8", BLOCK)
    return packed, _dequantised_twin(packed, root / "twin")


def _dequantised_twin(src: Path, dst: Path) -> Path:
    tensors = load_file(str(src / "model.safetensors"))
    out = {
        k: dequantize_fp8(t, tensors[k + SCALE_SUFFIX], BLOCK) if k + SCALE_SUFFIX in tensors else t
        for k, t in tensors.items()
        if not k.endswith(SCALE_SUFFIX)
    }
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _probe() -> canary_mod.Canary:
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (4, 16), generator=g, dtype=torch.int32)
    return canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose"))


def _without_environment(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("environment", "checkpoint", "quantization")}


# --- dequantisation ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape,block", [((8, 12), (4, 4)), ((56, 12), (5, 7)), ((3, 9), (4, 4)), ((16, 16), (16, 4))])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_dequantise_is_the_blockwise_product(
    shape: tuple[int, int], block: tuple[int, int], scale_dtype: torch.dtype
) -> None:
    """Blocks that tile the matrix (broadcast scales) and partial last blocks (expanded scales)
    both give w.float() · s of each block, bit for bit."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    bm, bn = block
    s = torch.rand(-(-shape[0] // bm), -(-shape[1] // bn), generator=g).to(scale_dtype)
    want = torch.empty(shape)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn)
            want[rows, cols] = w[rows, cols].float() * s[i, j].float()
    got = dequantize_fp8(w, s, block)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert w.dtype == torch.float8_e4m3fn  # the stored tensor is left as it was


@pytest.mark.parametrize(
    "case",
    [
        "finite",
        "nan_code",
        "neg_nan_code",
        "inf_scale",
        "nan_scale",
        "overflow",
        "near_overflow",
        "zero_block_inf_scale",
    ],
)
def test_the_nonfinite_marker_is_that_of_the_dequantised_weight(case: str) -> None:
    """NaN when w · s holds a NaN or Inf, else 0 — computed from the stored bytes, including a
    finite scale large enough that 448 · s overflows float32 (and one just below it)."""
    w = torch.full((8, 8), 2.0).to(torch.float8_e4m3fn)
    s = torch.ones(2, 2)
    if case in ("nan_code", "neg_nan_code"):
        w.view(torch.uint8)[3, 5] = 0x7F if case == "nan_code" else 0xFF
    elif case == "inf_scale":
        s[1, 0] = float("inf")
    elif case == "nan_scale":
        s[0, 1] = float("nan")
    elif case in ("overflow", "near_overflow"):
        w[0, 0] = 448.0
        s[0, 0] = torch.finfo(torch.float32).max / (300.0 if case == "overflow" else 500.0)
    elif case == "zero_block_inf_scale":
        w[:4, :4] = 0.0
        s[0, 0] = float("inf")  # 0 · Inf is NaN
    want_finite = bool(torch.isfinite(w.float() * s.repeat_interleave(4, 0).repeat_interleave(4, 1)).all())
    assert want_finite == (case in ("finite", "near_overflow"))
    marker = fp8_nonfinite_marker(w, s, (4, 4))
    assert marker.numel() == 1 and bool(torch.isfinite(marker)) == want_finite


@pytest.mark.parametrize("signs", ["mixed", "all_negative", "all_positive"])
def test_the_largest_code_comes_from_two_byte_reductions(signs: str) -> None:
    """``_largest_e4m3_code`` (uint8 and int8 maxima) is the largest |code|, NaN codes included."""
    from moeaudit.checkpoint.checkpoint import _largest_e4m3_code

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        b = torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).to(torch.uint8)
        b = b | 0x80 if signs == "all_negative" else b & 0x7F if signs == "all_positive" else b
        assert _largest_e4m3_code(b.view(torch.float8_e4m3fn)) == int((b & 0x7F).max()), b.tolist()


def test_a_nonfinite_fp8_expert_is_named_as_in_its_twin(fp8: tuple[Path, Path], tmp_path: Path) -> None:
    """The forward pass names the same non-finite weights for the FP8 checkpoint (from its bytes)
    as for the dequantised twin (from the float32 values)."""
    packed, _ = fp8
    tensors = load_file(str(packed / "model.safetensors"))
    tensors["model.layers.1.mlp.experts.2.down_proj.weight"].view(torch.uint8)[0, 1] = 0x7F
    tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale_inv"][0, 0] = 3e38  # |w| ≤ 448: overflows
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text((packed / "config.json").read_text())
    twin = _dequantised_twin(bad, tmp_path / "bad_twin")
    tokens = random_tokens()
    got = replay(Checkpoint(bad), tokens, backward=False).nonfinite_weights
    assert got == replay(Checkpoint(twin), tokens, backward=False).nonfinite_weights
    assert got == ["layer 1 expert 2 w2", "layer 2 expert 5 w3"]


# --- the experts stay packed on the host ------------------------------------------------------


def test_fp8_experts_are_held_as_stored(fp8: tuple[Path, Path]) -> None:
    """A routed layer holds float8 weights and their scales; expert e on access (host, and on a
    device after the move) is bit for bit ``Checkpoint.read``'s dequantised tensor, and the
    eager (trainer) form too."""
    ckpt = Checkpoint(fp8[0])
    layer = ckpt.spec.routed_layers[0]
    lazy = ckpt.layer_weights(layer, lazy_experts=True).experts
    assert isinstance(lazy, FP8Experts) and lazy.block == BLOCK
    assert {n: t.dtype for n, t in lazy.stored[0].items()} == {
        "w1": torch.float8_e4m3fn,
        "w1_scale_inv": torch.float32,
        "w3": torch.float8_e4m3fn,
        "w3_scale_inv": torch.float32,
        "w2": torch.float8_e4m3fn,
        "w2_scale_inv": torch.float32,
    }
    keys = ckpt.expert_keys(layer)
    assert isinstance(keys, list)
    eager = ckpt.layer_weights(layer).experts
    on_device = DeviceExperts(lazy, torch.device("cpu", 0))
    for e, table in enumerate(keys):
        for got in (lazy[e], eager[e], on_device[e]):
            assert list(got) == ["w1", "w3", "w2"]
            for n, key in table.items():
                assert got[n].dtype == torch.float32 and torch.equal(got[n], ckpt.read(key)), (e, n)


def test_fp8_receipts_are_those_of_the_dequantised_twin(fp8: tuple[Path, Path]) -> None:
    """Bit for bit, on the host and through the device branch: the replay sees the same float32
    products whether the file stored them or the experts were dequantised on access."""
    probe = _probe()
    twin = _without_environment(state_receipts(Checkpoint(fp8[1]), probe))
    assert _without_environment(state_receipts(Checkpoint(fp8[0]), probe)) == twin
    assert _without_environment(state_receipts(Checkpoint(fp8[0]), probe, device=STANDIN)) == twin


def test_the_host_never_holds_a_layer_of_float32_experts(
    fp8: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over a whole replay (forward, observers, backward; the host computing): no routed expert
    is read through the dequantising ``Checkpoint.read``, and every float32 expert matrix is
    formed on access and gone before the next expert's — at most one expert's three matrices
    alive at a time, where holding the layer would be 8 × 3."""
    ckpt = Checkpoint(fp8[0])
    tables = [ckpt.expert_keys(layer) for layer in ckpt.spec.routed_layers]
    expert_keys = {k for t in tables if isinstance(t, list) for table in t for k in table.values()}
    assert len(expert_keys) == 3 * 8 * len(tables)
    read_keys: list[str] = []
    real_read, real_stored, real_dequantize = Checkpoint.read, Checkpoint._stored_experts, dequantize_fp8
    expert_scales: list[torch.Tensor] = []  # the scale tensors held by the layers' FP8Experts
    alive: list[weakref.ref[torch.Tensor]] = []
    most = [0]

    def read(self: Checkpoint, key: str) -> torch.Tensor:
        read_keys.append(key)
        return real_read(self, key)

    def stored(self: Checkpoint, layer: int, dtype: torch.dtype) -> Any:
        experts = real_stored(self, layer, dtype)
        expert_scales[:] = [t for w in experts.stored for n, t in w.items() if n.endswith(SCALE_SUFFIX)]
        return experts

    def dequantize(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        out = real_dequantize(w, s, block)
        if any(s is t for t in expert_scales):
            alive[:] = [r for r in alive if r() is not None] + [weakref.ref(out)]
            most[0] = max(most[0], len(alive))
        return out

    monkeypatch.setattr(Checkpoint, "read", read)
    monkeypatch.setattr(Checkpoint, "_stored_experts", stored)
    monkeypatch.setattr(checkpoint_mod, "dequantize_fp8", dequantize)
    monkeypatch.setattr(stored_mod, "dequantize_fp8", dequantize)  # FP8Experts dequantises there
    state_receipts(ckpt, _probe(), conflict=True)
    assert read_keys and not expert_keys & set(read_keys)
    assert 3 <= most[0] <= 3, most[0]  # w1, w3, w2 of one expert; the previous one already freed


# --- what crosses to the device ---------------------------------------------------------------


def _layer_bytes(path: Path) -> dict[str, dict[str, int]]:
    ckpt = Checkpoint(path)
    meter = measure(ckpt, lambda tick: state_receipts(ckpt, _probe(), progress=tick, device=STANDIN))
    return {label: dict(c) for label, c in meter.counts.items()}


def _numel(ckpt: Checkpoint, key: str) -> int:
    return math.prod(ckpt.info(key).shape)


def test_fp8_experts_cross_as_stored_bytes(fp8: tuple[Path, Path]) -> None:
    """Per routed layer and pass, the device branch copies exactly as many bytes fewer than for
    the float32 twin as the crossing experts' float32 matrices exceed their FP8 bytes and
    scales: every expert crosses as stored (1 byte a value + its scales) and is converted on
    the device; the synchronisations and the copies back are unchanged."""
    packed, twin = _layer_bytes(fp8[0]), _layer_bytes(fp8[1])
    ckpt = Checkpoint(fp8[0])
    for layer in ckpt.spec.routed_layers:
        keys = ckpt.expert_keys(layer)
        assert isinstance(keys, list)
        values = sum(_numel(ckpt, k) for k in keys[0].values())  # every expert has the same shapes
        scales = sum(_numel(ckpt, ckpt.scales[k]) for k in keys[0].values())
        saved = 4 * values - (values + 4 * scales)  # per expert: float32 − (float8 + float32 scales)
        assert saved > 0.6 * 4 * values  # 4 × 4 blocks: the scales cost 1/16 of float32 here, 1/16384 at 128 × 128
        for phase in ("forward", "backward"):
            p, t = packed[f"{phase} {layer}"], twin[f"{phase} {layer}"]
            crossed, rest = divmod(p["h2d"] - t["h2d"], 3)  # each expert that crosses brings 3 scales
            assert rest == 0 and 1 <= crossed <= len(keys), (phase, layer, crossed)
            assert t["h2d_bytes"] - p["h2d_bytes"] == crossed * saved, (phase, layer)
            assert p["sync"] == t["sync"] and p["d2h_bytes"] == t["d2h_bytes"]
        assert packed[f"forward {layer}"]["h2d"] - twin[f"forward {layer}"]["h2d"] == 3 * len(keys)


def test_mxfp4_experts_cross_as_stored_bytes(tmp_path: Path, one_thread: None) -> None:
    """The same for gpt-oss's MXFP4 experts: held as uint8 codes and exponents, and what crosses
    per routed layer is the packed bytes, not the bfloat16 the twin stores."""
    save_tiny(tmp_path / "dense", "gpt_oss", intermediate_size=32)
    _mxfp4_checkpoint(tmp_path / "dense", tmp_path / "mxfp4")
    packed_t = load_file(str(tmp_path / "mxfp4" / "model.safetensors"))
    twin_t = {k: t for k, t in packed_t.items() if not k.endswith(("_blocks", "_scales"))}
    for k in packed_t:
        if k.endswith("_blocks"):
            stem = k.removesuffix("_blocks")
            twin_t[stem] = mxfp4.dequantize(packed_t[k], packed_t[stem + "_scales"], torch.bfloat16).contiguous()
    (tmp_path / "twin").mkdir()
    save_file(twin_t, str(tmp_path / "twin" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "twin" / "config.json").write_text(json.dumps(cfg))

    ckpt = Checkpoint(tmp_path / "mxfp4")
    layer = ckpt.spec.routed_layers[0]
    experts = ckpt.layer_weights(layer, lazy_experts=True).experts
    assert isinstance(experts, MXFP4Experts)
    assert {t.dtype for w in experts.stored for n, t in w.items() if not n.endswith("bias")} == {torch.uint8}
    packed, twin = _layer_bytes(tmp_path / "mxfp4"), _layer_bytes(tmp_path / "twin")
    keys = ckpt.expert_keys(layer)
    assert isinstance(keys, dict)
    stored = sum(_numel(ckpt, k) for stem in (keys["gate_up"], keys["down"]) for k in ckpt.packed[stem])
    values = sum(2 * _numel(ckpt, ckpt.packed[stem][0]) for stem in (keys["gate_up"], keys["down"]))
    for phase in ("forward", "backward"):
        p, t = packed[f"{phase} {layer}"], twin[f"{phase} {layer}"]
        assert t["h2d_bytes"] - p["h2d_bytes"] == 2 * values - stored, phase
        assert p["sync"] == t["sync"]
    probe = _probe()
    assert _without_environment(
        state_receipts(Checkpoint(tmp_path / "mxfp4"), probe, device=STANDIN)
    ) == _without_environment(state_receipts(Checkpoint(tmp_path / "twin"), probe))
