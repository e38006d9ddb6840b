"""Helpers of tests/test_host_syncs.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


# per routed layer: the forward reads the tokens per expert (1) and the layer's receipts, computed
# on the device, in one copy (1: tests/test_device_receipts.py caps its bytes); the backward the
# tokens per expert (1) and the layer's gradient norms (1); the head its loss (1) and, once for the
# whole forward, the finiteness flags of the weights that crossed in their on-disk dtype (1)
CAP = {"forward": {"sync": 2, "d2h": 2}, "backward": {"sync": 2, "d2h": 2}, "head": {"sync": 2, "d2h": 4}}
