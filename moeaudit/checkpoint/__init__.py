"""Untrusted bytes → a typed checkpoint (SPEC §2.1)."""

from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights
from moeaudit.spec.config import ModelSpec

__all__ = ["Checkpoint", "LayerWeights", "ModelSpec"]
