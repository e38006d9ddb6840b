"""The pair and compare documents: drift of a checkpoint against its baseline
(:mod:`moeaudit.records`)."""

import sys
from typing import Any, Literal

from moeaudit.records.common import EnvironmentRecord
from moeaudit.records.margins import Margins
from moeaudit.records.policy import PolicySettings
from moeaudit.records.receipts import NonFinite, Receipts

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


# --- pair and compare documents (moeaudit.pair/v1, moeaudit.compare/v1) ------------------------------


class PairLayer(TypedDict):
    """One layer of a pair receipt (open: the drift sections grow with the router)."""

    layer: int
    drift: dict[str, Any]
    weights: dict[str, Any]  # how far the layer's weights moved (receipts.drift.weight_change)
    selection_bias: NotRequired[dict[str, Any]]  # a biased router: its bias drift against the load


class PairSections(TypedDict):
    """A :class:`PairLayer` less ``layer``: what :func:`moeaudit.receipts.drift.pair_layer` measures."""

    drift: dict[str, Any]
    weights: dict[str, Any]
    selection_bias: NotRequired[dict[str, Any]]


class PairDocument(TypedDict):
    """``receipts/pair-<step>-vs-<base>.json``: drift of a checkpoint against its baseline."""

    schema: Literal["moeaudit.pair/v1"]
    base_step: int
    step: int
    environment: EnvironmentRecord
    layers: list[PairLayer]
    nonfinite: NotRequired[list[NonFinite]]


class ComparePolicy(PolicySettings):
    """The policy a compare document was computed under (:meth:`moeaudit.policy.Policy.to_json`)."""

    source: str
    digest: str


class CompareDocument(TypedDict):
    """``moeaudit compare --json`` (open: the report grows)."""

    schema: Literal["moeaudit.compare/v1"]
    base: Receipts
    candidate: Receipts
    protected_layers: list[int]
    policy: ComparePolicy
    layers: list[PairLayer]
    margins: Margins
    nonfinite: NotRequired[list[NonFinite]]
