"""Replay taps → receipts (SPEC §4–§5)."""
