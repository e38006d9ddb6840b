"""Canary → replay taps (SPEC §3)."""

from moeaudit.replay.engine import replay
from moeaudit.replay.result import LayerGrads, ReplayResult

__all__ = ["LayerGrads", "ReplayResult", "replay"]
