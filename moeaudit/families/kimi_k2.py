"""Kimi-K2 (``kimi_k2``, Moonshot's label in the released config.json; transformers reads it as
``deepseek_v3``): DeepSeek-V3's architecture and names, replayed as
:mod:`moeaudit.families.deepseek_v3`."""

from __future__ import annotations

import dataclasses

from moeaudit.families import deepseek_v3

FAMILY = dataclasses.replace(
    deepseek_v3.FAMILY,
    name="kimi_k2",
    layout=dataclasses.replace(deepseek_v3.LAYOUT, family="kimi_k2"),
    audits="Kimi-K2, replayed as DeepSeek-V3 (the architecture transformers reads kimi_k2 as)",
)
