"""Helpers of tests/test_device_receipts.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import pytest
import torch

from moeaudit import canary as canary_mod

pytest.importorskip("transformers")
import hfmodels  # noqa: E402


def _probe(windows: int = 4, T: int = 16) -> canary_mod.Canary:
    tokens = torch.randint(
        0, hfmodels.VOCAB, (windows, T), generator=torch.Generator().manual_seed(5), dtype=torch.int32
    )
    return canary_mod.Canary(tokens, torch.arange(windows, dtype=torch.int32) % 2, ("code", "prose"))
