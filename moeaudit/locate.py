"""Where defaults are found (README.md, "Commands"): moeaudit looks for ``canary.safetensors`` / ``policy.toml`` in
the directory named on the command line, then in its parents, up to two levels — except inside
the audited run itself (docs/decisions.md, "Discovery"): a policy or canary placed there was supplied by the audited
party, and the audit would sign its constants. Only ``--policy`` / ``--canary`` can name one."""

from __future__ import annotations

from pathlib import Path

from moeaudit.errors import InputError

CHECKPOINT_PREFIXES = ("checkpoint-", "step-")  # torchtitan: step-<N>


def _is_run(path: Path) -> bool:
    try:
        return any(p.name.startswith(CHECKPOINT_PREFIXES) for p in path.iterdir())
    except OSError:
        return False


def audited_dirs(*starts: str | Path) -> set[Path]:
    """The directories that belong to the audited party: each checkpoint named and its run,
    each run directory named."""
    out: set[Path] = set()
    for start in starts:
        here = Path(start).resolve()
        if here.is_file():
            here = here.parent
        if here.name.startswith(CHECKPOINT_PREFIXES) or (here / "config.json").is_file():
            out.add(here)
            if _is_run(here.parent):
                out.add(here.parent)
        elif _is_run(here) or (here / "metrics.jsonl").exists():
            out.add(here)
    return out


def find_upwards(
    start: str | Path, name: str, levels: int = 2, also: tuple[str | Path, ...] = ()
) -> tuple[Path | None, list[Path]]:
    """(the first ``name`` found upwards from ``start`` outside the audited directories,
    the copies that were passed over because they sit inside them)."""
    here = Path(start).resolve()
    if here.is_file():
        here = here.parent
    skip = audited_dirs(start, *also)
    ignored = []
    for candidate in [here, *here.parents][: levels + 1]:
        if not (candidate / name).is_file():
            continue
        if candidate in skip:
            ignored.append(_relative(candidate / name))
            continue
        return _relative(candidate / name), ignored
    return None, ignored


def _relative(path: Path) -> Path:
    """Relative to the working directory when below it, so outputs do not embed where a
    checkout happens to live."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def origin(given: str | Path | None, found: Path | None, ignored: list[Path], flag: str) -> str:
    """How an input was chosen, for the certificate and the terminal."""
    if given:
        return f"named with {flag}"
    passed = (
        (f"; ignored {', '.join(map(str, ignored))} inside the audited run (name it with {flag} to use it)")
        if ignored
        else ""
    )
    if found is None:
        return "none found outside the audited run" + passed
    return f"found at {found}, outside the audited run{passed}"


def require_canary(given: str | Path | None, start: str | Path, also: tuple[str | Path, ...] = ()) -> Path:
    return locate_canary(given, start, also)[0]


def locate_canary(given: str | Path | None, start: str | Path, also: tuple[str | Path, ...] = ()) -> tuple[Path, str]:
    if given:
        return Path(given), origin(given, None, [], "--canary")
    found, ignored = find_upwards(start, "canary.safetensors", also=also)
    if found is None:
        inside = (
            (f" (the one at {ignored[0]} is inside the audited run and is not used unless named)") if ignored else ""
        )
        raise InputError(
            "no canary given and no canary.safetensors found here or up to two levels above" + inside,
            path=start,
            hint="pass --canary FILE (build one with `moeaudit canary build`)",
        )
    return found, origin(None, found, ignored, "--canary")
