"""Callbacks that make a trainer write what ``moeaudit certify`` reads (README.md, "Logging from your training loop").

* :mod:`moeaudit.integrations.transformers` — a ``transformers.TrainerCallback``;
* :mod:`moeaudit.integrations.lightning` — a Lightning ``Callback`` that also saves
  Hugging Face checkpoints (``RUN/checkpoint-<step>/``);
* :mod:`moeaudit.integrations.loop` — a hook for a hand-written or torchtitan loop.

All three are thin adapters over :class:`moeaudit.integrations.core.RunRecorder`, which joins
the pieces, one module each: the fused gradient-norm pass (``gradnorms``), the metrics files
and what a crash can cost (``linelog``), the envelope rules evaluated online (``online``) and
the per-layer tracker scalars (``summary``). Each adapter imports its trainer library only in
its own module, so neither library is a dependency of moeaudit.
"""
