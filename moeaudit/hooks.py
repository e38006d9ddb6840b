"""Deprecated import path, kept for training scripts written against earlier releases: the
expert gradient logger lives in :mod:`moeaudit.integrations.hooks` with the other trainer
integrations. Importing this module warns once and re-exports the same objects."""

from __future__ import annotations

import warnings

from moeaudit.integrations.hooks import ExpertGradLogger, template_regex

warnings.warn(
    "moeaudit.hooks is deprecated: import ExpertGradLogger from moeaudit.integrations.hooks",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ExpertGradLogger", "template_regex"]
