"""The expert-parallel replay of flint, mellum and lara_mini (tests/hfmodels/more.py):
2 real ranks over gloo give one process's receipts, as :mod:`test_sharded` checks for its four
families. The three run the ranks' attention block (sinks, NoPE full layers, Lara-Mini's DeltaNet
with its fused ``in_proj``) and router (Flint's top-k on σ) unchanged, so none is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import sharded_worker  # noqa: E402
from hfmodels import save_tiny  # noqa: E402
from support.sharded import _launch, _without_environment, same  # noqa: E402

from moeaudit import canary as canary_mod  # noqa: E402

FAMILIES = ("flint", "mellum", "lara_mini")


def test_two_ranks_give_one_process_receipts(tmp_path: Path) -> None:
    ckpts = []
    for family in FAMILIES:
        save_tiny(tmp_path / family, family, max_shard_size="40KB")
        ckpts.append(str(tmp_path / family))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 96, (4, 16), generator=g, dtype=torch.int32)
    canary = tmp_path / "canary.safetensors"
    canary_mod.save(canary_mod.Canary(tokens, torch.arange(4, dtype=torch.int32) % 2, ("code", "prose")), canary)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread setting: bit-identity is claimed per thread count
    try:
        want = sharded_worker.audit(ckpts, str(canary))
    finally:
        torch.set_num_threads(threads)
    _launch(2, tmp_path / "out.json", canary, ckpts)
    got = json.loads((tmp_path / "out.json").read_text())
    assert set(got) == set(FAMILIES)
    for family in FAMILIES:
        gf, wf = got[family], want[family]
        assert gf["digest"] == wf["digest"] and gf["topk"] == wf["topk"] and gf["routing"] == wf["routing"]
        assert gf["expert_norms"] == wf["expert_norms"]
        assert gf["receipts"]["nll"] == wf["receipts"]["nll"]
        assert same(_without_environment(wf["receipts"]), _without_environment(gf["receipts"])) == [], family
