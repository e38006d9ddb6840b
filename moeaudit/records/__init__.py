"""The documents moeaudit writes and reads, as types: receipts, pair and compare documents, gate
entries, checks, margins, the envelope report, the promotion decision and the v2 predicate.

Torch-free, and nothing here runs: every record is a :class:`TypedDict`, so at runtime a record
is the plain ``dict`` moeaudit has always built, read and signed, and ``mypy`` catches a
misspelt or missing key where one is built or read. Field names are moeaudit's own
(snake_case); the signed v2 predicate carries their lowerCamelCase form
(:mod:`moeaudit.attest.naming`), except in the maps whose keys are data — layer indices, series
names, canary domain names — marked here ``Annotated[..., DATA_KEYS]``, which ``naming`` reads.

The JSON Schemas shipped in ``moeaudit/schemas/`` are generated from these types
(:mod:`moeaudit.schemas`); a test fails when a shipped schema and the types disagree.

A record listed in :data:`OPEN` may carry fields beyond the ones named (the machine description,
a family's router note, a receipt section that grows with the family): its schema allows them.
Every other record is closed.

One module per document — :mod:`~moeaudit.records.common` (the parts they share),
:mod:`~moeaudit.records.policy`, :mod:`~moeaudit.records.margins`,
:mod:`~moeaudit.records.receipts`, :mod:`~moeaudit.records.compare` (pair and compare),
:mod:`~moeaudit.records.gate` (gate entries), :mod:`~moeaudit.records.checks`,
:mod:`~moeaudit.records.envelope`, :mod:`~moeaudit.records.predicate` (and its statement),
:mod:`~moeaudit.records.promotion` (``gate --json``), :mod:`~moeaudit.records.intoto` (test-result
and SVR statements) — and :mod:`~moeaudit.records.introspect` for the readers of the types. Every
record is importable from here: ``from moeaudit.records import Predicate``.
"""

from moeaudit.records.checks import (
    Check,
    Decision,
    Unevaluable,
    Violation,
)
from moeaudit.records.common import (
    DATA_KEYS,
    CanaryMismatch,
    CanaryRecord,
    DataKeys,
    EnvironmentRecord,
    GateStatus,
    Interval,
    Promotion,
    Sha256,
    Status,
    Subject,
    ToolRecord,
)
from moeaudit.records.compare import (
    CompareDocument,
    ComparePolicy,
    PairDocument,
    PairLayer,
)
from moeaudit.records.envelope import (
    Alert,
    AlertRule,
    DeadExpert,
    DeadExpertRule,
    DiscreteRow,
    EnvelopeConstants,
    EnvelopeReport,
    EnvelopeRules,
    EnvelopeSample,
    EnvelopeWindow,
    LogFinding,
    Resampled,
    Sampling,
    ShownCount,
    ShownRows,
    SkippedCheck,
    Starvation,
    StarvationRule,
    StepWindow,
)
from moeaudit.records.gate import (
    Comparison,
    DriftLayer,
    DriftSummary,
    GateClaims,
    GateEntry,
    GateReceipts,
    Health,
    HealthFailure,
    LayerSummary,
    NllChange,
    Structural,
)
from moeaudit.records.intoto import (
    PolicyDescriptor,
    ResourceDescriptor,
    SvrPredicate,
    SvrStatement,
    SvrVerifier,
    TestResultPredicate,
    TestResultStatement,
)
from moeaudit.records.introspect import (
    data_map_paths,
    fields,
    is_data_map,
    is_record,
    required,
)
from moeaudit.records.margins import (
    AlsoAgainst,
    Margin,
    MarginLayer,
    Margins,
)
from moeaudit.records.policy import (
    EnvelopePolicy,
    GatesPolicy,
    MarginsPolicy,
    PolicyRecord,
    PolicySettings,
    ReceiptsPolicy,
)
from moeaudit.records.predicate import (
    Abandoned,
    CacheUse,
    CheckpointFiles,
    ClaimRow,
    DomainHeatmap,
    FileResource,
    Heatmaps,
    InputFile,
    Inputs,
    Occupancy,
    Predicate,
    ReferenceInput,
    RouterCheckpoint,
    RouterLayer,
    RouterSection,
    RunEvent,
    RunRecord,
    Statement,
)
from moeaudit.records.promotion import (
    Condition,
    ConditionFailure,
    GateDocument,
    GateResult,
    JudgedInRun,
)
from moeaudit.records.receipts import (
    CheckpointAgreement,
    FlipRates,
    GradNormAgreement,
    NllAgreement,
    NonFinite,
    PrecisionAgreement,
    Receipts,
    ReceiptsCheckpoint,
    ReceiptsLayer,
    ReceiptsSettings,
    Resolution,
)

# Records whose schema allows fields beyond the ones named (see the module docstring).
OPEN: frozenset[type] = frozenset(
    {EnvironmentRecord, ReceiptsLayer, PairLayer, CompareDocument, Abandoned, RouterSection, ReceiptsCheckpoint}
)

# The documents with a published schema: file name → (record, wire names?).
PUBLISHED: dict[str, tuple[type, bool]] = {
    "training-health-v2.predicate.schema.json": (Predicate, True),
    "receipts-v1.schema.json": (Receipts, False),
    "gate-v1.schema.json": (GateDocument, False),
    "test-result-v0.1.statement.schema.json": (TestResultStatement, False),
    "svr-v0.1.statement.schema.json": (SvrStatement, False),
}

__all__ = [
    "DataKeys",
    "DATA_KEYS",
    "Status",
    "GateStatus",
    "Promotion",
    "Interval",
    "Sha256",
    "ToolRecord",
    "EnvironmentRecord",
    "CanaryMismatch",
    "CanaryRecord",
    "Subject",
    "ReceiptsPolicy",
    "MarginsPolicy",
    "EnvelopePolicy",
    "GatesPolicy",
    "PolicySettings",
    "PolicyRecord",
    "MarginLayer",
    "AlsoAgainst",
    "Margin",
    "Margins",
    "ReceiptsCheckpoint",
    "ReceiptsSettings",
    "ReceiptsLayer",
    "NonFinite",
    "FlipRates",
    "NllAgreement",
    "GradNormAgreement",
    "Resolution",
    "PrecisionAgreement",
    "CheckpointAgreement",
    "Receipts",
    "PairLayer",
    "PairDocument",
    "ComparePolicy",
    "CompareDocument",
    "LayerSummary",
    "GateReceipts",
    "HealthFailure",
    "Health",
    "NllChange",
    "Comparison",
    "Structural",
    "GateClaims",
    "DriftLayer",
    "DriftSummary",
    "GateEntry",
    "Violation",
    "Unevaluable",
    "Check",
    "Decision",
    "EnvelopeSample",
    "EnvelopeWindow",
    "DiscreteRow",
    "Alert",
    "DeadExpert",
    "Starvation",
    "LogFinding",
    "SkippedCheck",
    "Resampled",
    "Sampling",
    "EnvelopeConstants",
    "AlertRule",
    "DeadExpertRule",
    "StarvationRule",
    "EnvelopeRules",
    "StepWindow",
    "ShownCount",
    "ShownRows",
    "EnvelopeReport",
    "RunEvent",
    "Abandoned",
    "RunRecord",
    "InputFile",
    "FileResource",
    "ReferenceInput",
    "Inputs",
    "Occupancy",
    "DomainHeatmap",
    "Heatmaps",
    "ClaimRow",
    "RouterCheckpoint",
    "RouterLayer",
    "RouterSection",
    "CacheUse",
    "CheckpointFiles",
    "Predicate",
    "Statement",
    "ConditionFailure",
    "Condition",
    "JudgedInRun",
    "GateResult",
    "GateDocument",
    "ResourceDescriptor",
    "TestResultPredicate",
    "TestResultStatement",
    "PolicyDescriptor",
    "SvrVerifier",
    "SvrPredicate",
    "SvrStatement",
    "is_record",
    "fields",
    "required",
    "is_data_map",
    "data_map_paths",
    "OPEN",
    "PUBLISHED",
]
