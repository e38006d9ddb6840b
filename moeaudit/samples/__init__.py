"""Sample training runs, trained for real on synthetic multi-domain data (sample_checkpoints/README.md).

``data`` makes the text and tokens, ``train`` is the CPU training loop over the replay's own
decoder, ``build`` defines the shipped runs (``build_samples``).
"""
