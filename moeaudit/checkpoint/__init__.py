"""Untrusted bytes → a typed checkpoint (docs/decisions.md, "Checkpoints")."""

from moeaudit.checkpoint.checkpoint import Checkpoint, LayerWeights
from moeaudit.spec.config import ModelSpec

__all__ = ["Checkpoint", "LayerWeights", "ModelSpec"]
