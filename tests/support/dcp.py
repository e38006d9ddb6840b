"""Helpers of tests/test_dcp.py that other test modules (or their subprocesses) use too."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moeaudit.checkpoint import Checkpoint


def save(state: dict, directory: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(directory))  # no init_process_group: single process


def assert_same_weights(a: Checkpoint, b: Checkpoint) -> int:
    """Every tensor the replay reads, bit for bit; returns how many were compared."""
    n = 0
    for name in ("embed", "final_norm", "lm_head"):
        assert torch.equal(a.read_global(name, dtype=None), b.read_global(name, dtype=None))
        n += 1
    for layer in range(a.spec.num_layers):
        x, y = a.layer_weights(layer), b.layer_weights(layer)
        assert x.params.keys() == y.params.keys()
        for k in x.params:
            assert x.params[k].dtype == y.params[k].dtype and torch.equal(x.params[k], y.params[k]), k
            n += 1
        assert len(x.experts) == len(y.experts) == (a.spec.num_experts if a.spec.is_routed(layer) else 0)
        for u, v in zip(x.experts, y.experts):
            for k in u:
                assert torch.equal(u[k], v[k]), (layer, k)
                n += 1
    return n
