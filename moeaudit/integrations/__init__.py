"""Callbacks that make a trainer write what ``moeaudit certify`` reads (SPEC §2.3).

* :mod:`moeaudit.integrations.transformers` — a ``transformers.TrainerCallback``;
* :mod:`moeaudit.integrations.lightning` — a Lightning ``Callback`` that also saves
  Hugging Face checkpoints (``RUN/checkpoint-<step>/``).

Both are thin adapters over :class:`moeaudit.integrations.core.RunRecorder`; each imports its
trainer library only in its own module, so neither library is a dependency of moeaudit.
"""
