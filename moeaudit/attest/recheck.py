"""``verify --recheck``: are the files a certificate binds still the files it certified?

Torch-free (tests/test_torch_free.py). A certificate binds by digest every checkpoint
(``subject``: the OpenSSF model-signing root digest), the run's logs (``inputs.metrics``,
``inputs.events``, ``inputs.probe``: the file's SHA-256), the policy file
(``inputs.policy_file``), a ``--reference`` (``inputs.reference``: a checkpoint's root digest or
a receipts file's SHA-256) and the canary (``canary.digest``: moeaudit's content digest,
docs/glossary.md, "Canary", so the canary is compared by its windows, not its file bytes). Each is looked for:

* checkpoints and logs: in the run directory (``--run-dir``, else the absolute ``run.path``),
  under the recorded name;
* the policy file: ``--policy``, else ``policy.source``;
* the canary: ``--canary``, else ``canary.path`` when recorded, else the path in
  ``canary.origin`` (``found at P, …``, or ``named with --canary at P``);
* the reference: ``--reference``, else ``inputs.reference.path`` when it is more than a bare
  name. certify records only the reference's name, which is not guessed at: it is missing.

A recorded relative path is relative to the directory certify ran in, which the certificate does
not record: it is looked for under the run directory and its ancestors, nearest first (certify's
directory is one of them whenever the run was below it), then under the current directory.

A checkpoint is compared file by file where the certificate signs its file list
(``checkpoint_files``: name, size, SHA-256 of every file its root digest covers): the root digest
alone does not bind names (two files renamed so that the sorted order is kept leave it unchanged),
so every file renamed, added, removed or changed is a finding naming the file. The signed list
must hash to the signed subject digest, or the certificate is not trusted (exit 4).

Every bound input that changed (or can no longer be read as what was certified) or is missing,
and every run log and checkpoint directory (as certify discovers them) added since, is one
:class:`Finding` — a certified checkpoint no longer in the run directory (renamed or removed)
included, and the rest is still checked. Only a run directory
that is not there, or that holds none of the certified checkpoints and none of the bound logs
under their certified names, is an input error (exit 4): that is not the run, or all of it moved,
and ``--run-dir`` says where it is (docs/security.md, "What the signature binds").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from moeaudit.errors import InputError, MoeauditError
from moeaudit.records import CanaryRecord, Inputs, Predicate, VerifiedStatement

# ``canary.origin`` as moeaudit.locate and the certify command write it
_CANARY_AT = re.compile(
    r"(?:found|named with --canary) at (?P<path>.+?)"
    r"(?:, outside the audited run(?:;.*)?)?",
    re.DOTALL,
)
_LOGS = {"metrics": "metrics log", "events": "events log", "probe": "canary probe log"}


@dataclass(frozen=True)
class Finding:
    """One bound input that is not as certified."""

    status: str  # changed | missing | added
    what: str  # "metrics log", "canary", …
    where: str  # the path looked at, or the name the certificate records
    detail: str

    def line(self) -> str:
        return f"{self.status}: {self.where} ({self.what}): {self.detail}"


@dataclass(frozen=True)
class Recheck:
    checkpoints: int  # subjects re-hashed
    matched: list[str]  # the other inputs that match, as "what where"
    findings: list[Finding]


@dataclass(frozen=True)
class _Bound:
    what: str
    where: str  # a path, or the recorded name when there is none
    path: Path | None  # None: nowhere to look (``unlocated`` says why)
    certified: str  # hex digest as signed
    digest: Callable[[Path], str]
    hint: str = ""  # what to pass when it is not found
    unlocated: str = ""
    files: list[dict[str, Any]] | None = None  # a checkpoint's signed file list, when signed


@dataclass(frozen=True)
class Overrides:
    """Where the inputs are now, when not where the certificate says (verify's options)."""

    run_dir: Path | None = None
    canary: Path | None = None
    policy: Path | None = None
    reference: Path | None = None


def recheck(stmt: VerifiedStatement, given: Overrides | None = None) -> Recheck:
    """Recompute the digest of every input ``stmt`` (a verified statement, moeaudit's field
    names) binds; raise for a checkpoint that is not there, report everything else."""
    given = given or Overrides()
    root = run_root(stmt, given.run_dir)
    pred = stmt["predicate"]
    inputs = pred.get("inputs")
    bound = [*_subjects(stmt, root), *_inputs(inputs, pred, root, given), *_canary(pred, root, given)]
    _check_overrides(given, bound)
    _check_is_the_run(root, bound, given.run_dir)
    findings: list[Finding] = []
    matched = []
    for item in bound:
        if item.files is not None and item.path is not None and item.path.is_dir():
            found = _check_files(item, item.files)
            findings += found
            if not found and item.what != "checkpoint":
                matched.append(f"{item.what} {item.where}")
            continue
        finding = _check(item)
        if finding is not None:
            findings.append(finding)
        elif item.what != "checkpoint":
            matched.append(f"{item.what} {item.where}")
    if isinstance(inputs, dict):
        findings += _added(inputs, root)
    findings += _added_checkpoints(stmt, root)
    return Recheck(len(stmt["subject"]), matched, findings)


def run_root(stmt: VerifiedStatement, run_dir: Path | None) -> Path:
    if run_dir is not None:
        root, where = Path(run_dir), "--run-dir"
    else:
        run = stmt["predicate"].get("run")
        recorded = run.get("path") if isinstance(run, dict) else None
        if not isinstance(recorded, str) or not recorded:
            raise InputError("the certificate records no run directory", hint="pass --run-dir RUN_DIR")
        root, where = Path(recorded), "the path the certificate records"
    if not root.is_dir():
        raise InputError(f"run directory not found ({where})", path=root, hint="pass --run-dir where the run is now")
    return root


def _check_is_the_run(root: Path, bound: list[_Bound], run_dir: Path | None) -> None:
    """``root`` must hold at least one certified checkpoint or bound log under its certified
    name: otherwise every one of them would be "missing", which says less than that the run is
    not here."""
    in_run = [b for b in bound if b.what == "checkpoint" or b.what in _LOGS.values()]
    if not in_run or any(b.path is not None and os.path.lexists(b.path) for b in in_run):
        return
    names = [Path(b.where).name for b in in_run]
    shown = ", ".join(names) if len(names) <= 4 else ", ".join(names[:3]) + f", … ({len(names)} in all)"
    where = "--run-dir" if run_dir is not None else "the path the certificate records"
    raise InputError(
        f"not the certified run ({where}): it holds none of the certified checkpoints and logs ({shown})",
        path=root,
        hint="pass --run-dir where the run is now",
    )


# ----- what is bound, and where it is now -------------------------------------------------


def _subjects(stmt: VerifiedStatement, root: Path) -> list[_Bound]:
    listed = _checkpoint_files(stmt)
    out = []
    for subject in stmt["subject"]:
        name = _bare_name(subject["name"], "subject name")
        path = root / name
        root_sha256 = subject["digest"]["sha256"]
        hint = "renamed or removed since certification"  # a missing checkpoint is a finding like any input
        out.append(_Bound("checkpoint", str(path), path, root_sha256, _root_digest, hint, files=listed.get(name)))
    return out


def _checkpoint_files(stmt: VerifiedStatement) -> dict[str, list[dict[str, Any]]]:
    """Subject name → its signed file list (none before certificates listed files). A list that
    does not hash to its subject's digest is refused: the signature holds, the content does not."""
    entries = stmt["predicate"].get("checkpoint_files")
    if entries is None:
        return {}
    roots = {s["name"]: s["digest"]["sha256"] for s in stmt["subject"]}
    out: dict[str, list[dict[str, Any]]] = {}
    for entry in entries if isinstance(entries, list) else [None]:
        name = entry.get("name") if isinstance(entry, dict) else None
        files = entry.get("resources") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in roots or name in out:
            raise InputError("the signed checkpoint_files names no subject, or one twice", hint=_UNTRUSTED)
        out[name] = _file_list(files, roots[name], f"file list of checkpoint {name}")
    return out


_UNTRUSTED = "moeaudit never writes one; do not trust this certificate"


def _file_list(files: Any, root: str, what: str) -> list[dict[str, Any]]:
    """``files`` checked to be a list of resources that hashes to the signed ``root``."""
    from moeaudit.checkpoint.digest import root_of

    if not isinstance(files, list) or not all(
        isinstance(f, dict)
        and isinstance(f.get("name"), str)
        and isinstance(f.get("size"), int)
        and isinstance(f.get("digest"), str)
        and re.fullmatch("[0-9a-f]{64}", f["digest"])
        for f in files
    ):
        raise InputError(f"the signed {what} is malformed", hint=_UNTRUSTED)
    if root_of(files) != root:
        raise InputError(f"the signed {what} does not hash to its root digest", hint=_UNTRUSTED)
    return files


def _check_files(item: _Bound, listed: list[dict[str, Any]]) -> list[Finding]:
    """Every file of the checkpoint ``item`` that was renamed (missing under its certified name,
    added under its new one), added, removed or changed since certification."""
    from moeaudit.checkpoint.digest import snapshot

    assert item.path is not None
    what = f"file of checkpoint {item.path.name}" if item.what == "checkpoint" else f"file of the {item.what}"
    try:
        now = {r["name"]: r for r in snapshot(item.path).resources}
    except (MoeauditError, OSError) as exc:
        why = exc.what if isinstance(exc, MoeauditError) else (exc.strerror or str(exc))
        where = exc.path if isinstance(exc, MoeauditError) else exc.filename
        if where is None or str(where) == str(item.path):
            return [Finding("changed", item.what, item.where, f"cannot be read as certified ({why})")]
        return [Finding("changed", what, str(where), f"cannot be read as certified ({why})")]
    certified = {r["name"]: r for r in listed}
    out = []
    for name in sorted(certified.keys() | now.keys()):
        where = str(item.path / name)
        was, got = certified.get(name), now.get(name)
        if got is None:
            out.append(Finding("missing", what, where, "certified, no longer in the checkpoint (removed or renamed)"))
        elif was is None:
            out.append(Finding("added", what, where, "not in the certified file list: added or renamed since"))
        elif (got["size"], got["digest"]) != (was["size"], was["digest"]):
            out.append(
                Finding(
                    "changed",
                    what,
                    where,
                    f"{got['size']} bytes, digest now {got['digest'][:16]}…; "
                    f"certified {was['size']} bytes, {was['digest'][:16]}…",
                )
            )
    return out


def _inputs(inputs: Any, pred: Predicate, root: Path, given: Overrides) -> list[_Bound]:
    if inputs is None:  # a certificate from before inputs were bound (checkpoints only)
        return []
    if not isinstance(inputs, dict):
        raise InputError(
            "the signed predicate's inputs is not an object",
            hint="moeaudit never writes one; do not trust this certificate",
        )
    out = []
    for key, entry in inputs.items():
        if key == "policy_file":
            out.append(_policy(entry, pred, root, given.policy))
        elif key == "reference":
            out.append(_reference(entry, root, given.reference))
        else:  # a run log (metrics, events, probe), or a file this version does not know
            out.append(_run_file(key, entry, root))
    return out


def _run_file(key: str, entry: Any, root: Path) -> _Bound:
    name = _bare_name(_field(entry, "path", key), f"inputs.{key}.path")
    path = root / name
    return _Bound(_LOGS.get(key, f"input {key}"), str(path), path, _field(entry, "sha256", key), _file_sha256)


def _policy(entry: Any, pred: Predicate, root: Path, given: Path | None) -> _Bound:
    certified = _field(entry, "sha256", "policy_file")
    source = pred.get("policy", {}).get("source") if isinstance(pred.get("policy"), dict) else None
    recorded = source if isinstance(source, str) and source else _field(entry, "path", "policy_file")
    return _placed("policy file", given, recorded, root, certified, _file_sha256, "pass --policy FILE")


def _reference(entry: Any, root: Path, given: Path | None) -> _Bound:
    recorded = _field(entry, "path", "reference")
    kind = entry.get("kind")
    certified = _field(entry, "root_sha256" if kind == "checkpoint" else "sha256", "reference")
    digest = _root_digest if kind == "checkpoint" else _file_sha256
    files = None
    if kind == "checkpoint" and "resources" in entry:
        files = _file_list(entry["resources"], certified, "file list of the reference")
    hint = "pass --reference PATH"
    if given is None and Path(recorded).name == recorded:  # a bare name: nowhere to look
        return _Bound("reference", recorded, None, certified, digest, hint, "the certificate records only its name")
    return replace(_placed("reference", given, recorded, root, certified, digest, hint), files=files)


def _canary(pred: Predicate, root: Path, given: Overrides) -> list[_Bound]:
    canary = pred.get("canary")
    digest = canary.get("digest") if isinstance(canary, dict) else None
    if not isinstance(canary, dict) or not isinstance(digest, dict) or not isinstance(digest.get("sha256"), str):
        return []  # nothing signed about a canary
    path = canary.get("path")  # (older certificates named the canary's file)
    recorded = path if isinstance(path, str) else _origin_path(canary)
    certified = f"sha256:{digest['sha256'][:16]}…"
    hint = "pass --canary FILE"
    if given.canary is None and recorded is None:
        return [
            _Bound(
                "canary",
                certified,
                None,
                digest["sha256"],
                _canary_digest,
                hint,
                "the certificate records no path for it",
            )
        ]
    return [_placed("canary", given.canary, recorded or "", root, digest["sha256"], _canary_digest, hint)]


def _origin_path(canary: CanaryRecord) -> str | None:
    origin = canary.get("origin")
    m = _CANARY_AT.fullmatch(origin) if isinstance(origin, str) else None
    return m.group("path") if m else None


def _placed(
    what: str, given: Path | None, recorded: str, root: Path, certified: str, digest: Callable[[Path], str], hint: str
) -> _Bound:
    """The input where it is: ``given`` as it is; a recorded absolute path as it is; a recorded
    relative one (relative to where certify ran) under the run directory and its ancestors,
    nearest first, then the current directory; nowhere when none of them has it."""
    if given is not None or Path(recorded).is_absolute():
        path = given if given is not None else Path(recorded)
        return _Bound(what, str(path), path, certified, digest, hint)
    for base in (root, *root.parents, Path.cwd()):
        if os.path.lexists(base / recorded):
            return _Bound(what, str(base / recorded), base / recorded, certified, digest, hint)
    return _Bound(
        what,
        recorded,
        None,
        certified,
        digest,
        hint,
        "not found under the run directory, its parents or the current directory",
    )


def _added(inputs: Inputs, root: Path) -> list[Finding]:
    """Run logs present now that the certificate does not bind: certify binds every log it
    finds, so each was added since (and could change the verdict: events, docs/decisions.md,
    "Events cannot improve a verdict")."""
    from moeaudit.run import PROBE_FILE

    names = {"metrics": "metrics.jsonl", "events": "events.jsonl", "probe": PROBE_FILE}
    return [
        Finding("added", _LOGS[key], str(root / name), "not bound by the certificate: added since certification")
        for key, name in names.items()
        if key not in inputs and os.path.lexists(root / name)
    ]


def _added_checkpoints(stmt: VerifiedStatement, root: Path) -> list[Finding]:
    """Checkpoint directories certify would now audit (its own discovery,
    :func:`moeaudit.run.checkpoint_dirs`) that the certificate neither lists nor recorded as
    skipped: each was added since, and a certify now would speak for it too."""
    from moeaudit.run import checkpoint_dirs

    run = stmt["predicate"].get("run")
    skipped = run.get("skipped") if isinstance(run, dict) else None
    known = {s["name"] for s in stmt["subject"]} | set(skipped if isinstance(skipped, list) else [])
    try:
        found = checkpoint_dirs(root)
    except InputError as exc:  # two entries of one step: certify would refuse the run as it is now
        where = str(exc.path) if exc.path is not None else str(root)
        return [Finding("added", "checkpoint directory", where, f"{exc.what}: certify would refuse the run now")]
    return [
        Finding("added", "checkpoint", str(path), "not certified: a checkpoint directory added since certification")
        for _, path in found
        if path.name not in known and path.is_dir()
    ]


def _check_overrides(given: Overrides, bound: list[_Bound]) -> None:
    for flag, value, what in (
        ("--canary", given.canary, "canary"),
        ("--policy", given.policy, "policy file"),
        ("--reference", given.reference, "reference"),
    ):
        if value is not None and not any(b.what == what for b in bound):
            from moeaudit.errors import UsageError

            raise UsageError(f"{flag} given, but the certificate binds no {what}", hint=f"drop {flag}")


# ----- digests ----------------------------------------------------------------------------


def _check(item: _Bound) -> Finding | None:
    if item.path is None:
        return Finding("missing", item.what, item.where, f"{item.unlocated} — {item.hint}")
    if not os.path.lexists(item.path):
        return Finding("missing", item.what, item.where, "not found" + (f" — {item.hint}" if item.hint else ""))
    try:
        now = item.digest(item.path)
    except (MoeauditError, OSError) as exc:
        why = exc.what if isinstance(exc, MoeauditError) else (exc.strerror or str(exc))
        return Finding("changed", item.what, item.where, f"cannot be read as certified ({why})")
    if now != item.certified:
        return Finding("changed", item.what, item.where, f"digest now {now[:16]}…, certified {item.certified[:16]}…")
    return None


def _file_sha256(path: Path) -> str:
    from moeaudit.limits import file_sha256

    return file_sha256(path, "certified input")


def _root_digest(path: Path) -> str:
    from moeaudit.checkpoint.digest import root_digest

    if not path.is_dir():
        raise InputError("not a checkpoint directory", path=path)
    return root_digest(path)[0]


def _canary_digest(path: Path) -> str:
    from moeaudit.canary import load

    return load(path).digest


def _bare_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise InputError(
            f"{what} {name!r} is not a file name in the run directory",
            hint="recheck only looks inside the run directory",
        )
    return name


def _field(entry: Any, key: str, name: str) -> Any:
    value = entry.get(key) if isinstance(entry, dict) else None
    if not isinstance(value, str) or not value:
        raise InputError(
            f"the signed inputs.{name} has no {key}", hint="moeaudit never writes one; do not trust this certificate"
        )
    return value
