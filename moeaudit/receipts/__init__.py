"""Replay taps → receipts (docs/glossary.md, "Per checkpoint (state receipts)", "Between checkpoints (pair receipts,
`003` §5)")."""
