"""The parts every document shares: statuses, digests, the tool, the environment and the canary
(:mod:`moeaudit.records`)."""

import sys
from typing import Literal

if sys.version_info >= (3, 11):
    from typing import NotRequired, TypedDict
else:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired, TypedDict


class DataKeys:
    """Marks a ``dict`` whose keys are data (``Annotated[dict[str, X], DATA_KEYS]``): never renamed
    on the wire, and not field names in the schema."""

    def __repr__(self) -> str:
        return "DATA_KEYS"


DATA_KEYS = DataKeys()

Status = Literal["PASS", "FAIL", "INCONCLUSIVE"]
GateStatus = Literal["BASELINE", "GREEN", "YELLOW", "RED"]
Promotion = Literal["PROMOTE", "HOLD", "INCONCLUSIVE"]
Interval = list[float]  # a 95% interval [low, high]


class Sha256(TypedDict):
    sha256: str


# --- shared parts ----------------------------------------------------------------------------------


class ToolRecord(TypedDict):
    name: str
    version: str


class EnvironmentRecord(TypedDict):
    """What computed the numbers (open: the machine description may grow)."""

    torch: str
    python: str
    device: str
    dtype: str
    devices: NotRequired[dict[str, str]]  # part → device, when several computed them
    world_size: NotRequired[int]  # an expert-parallel replay's ranks (docs/decisions.md, "Expert-parallel replay")
    backend: NotRequired[str]  # its torch.distributed backend: gloo, nccl
    rank_devices: NotRequired[list[str]]  # each rank's compute device, by rank
    world_sizes: NotRequired[dict[str, int]]  # part → world size, when the parts' differ
    precision: NotRequired[str]  # --precision other than fp32: what ran (tf32 off CUDA ran fp32)


class CanaryMismatch(TypedDict):
    """Where the audited run records another canary than the one audited (signed only when
    certify was told to accept it)."""

    source: str  # canary_probe.jsonl, canary.safetensors, checkpoint-N/tokenizer.json
    recorded: str  # SHA-256: the digest the run records (a tokenizer.json's own)
    given: str  # SHA-256: the audited canary's digest (its tokenizer_sha256)


class CanaryRecord(TypedDict):
    digest: Sha256
    windows: int
    window_len: int
    domains: list[str]
    # repeated content (moeaudit/canary_units.py): written only where below windows / windows·window_len
    distinct_windows: NotRequired[int]
    distinct_contexts: NotRequired[int]
    origin: NotRequired[str]
    tokenizer_sha256: NotRequired[str]  # a canary built from text: its tokenizer.json's SHA-256
    text_sha256: NotRequired[str]  # … and its text file's
    mismatches: NotRequired[list[CanaryMismatch]]  # the run recorded another canary (accepted)


class Subject(TypedDict):
    name: str
    digest: dict[str, str]
