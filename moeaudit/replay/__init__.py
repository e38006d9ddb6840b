"""Canary → replay taps (SPEC §3)."""

from moeaudit.replay.engine import LayerGrads, ReplayResult, replay

__all__ = ["LayerGrads", "ReplayResult", "replay"]
