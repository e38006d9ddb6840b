"""Sample training runs, trained for real on synthetic multi-domain data (issue 2, item 7).

``data`` makes the text and tokens, ``train`` is the CPU training loop over the replay's own
decoder, ``build`` defines the shipped runs (``build_samples``).
"""
