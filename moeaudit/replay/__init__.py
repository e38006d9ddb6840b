"""Canary → replay taps (docs/glossary.md, "Replay", "Taps")."""

from moeaudit.replay.engine import replay
from moeaudit.replay.result import LayerGrads, ReplayResult

__all__ = ["LayerGrads", "ReplayResult", "replay"]
