"""Where defaults are found: SPEC §10 looks for ``canary.safetensors`` / ``policy.toml`` in
the directory named on the command line, then in its parents, up to two levels."""

from __future__ import annotations

from pathlib import Path

from moeaudit.errors import InputError


def find_upwards(start: str | Path, name: str, levels: int = 2) -> Path | None:
    here = Path(start).resolve()
    if here.is_file():
        here = here.parent
    for candidate in [here, *here.parents][: levels + 1]:
        if (candidate / name).is_file():
            return _relative(candidate / name)
    return None


def _relative(path: Path) -> Path:
    """Relative to the working directory when below it, so outputs do not embed where a
    checkout happens to live."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def require_canary(given: str | None, start: str | Path) -> Path:
    if given:
        return Path(given)
    found = find_upwards(start, "canary.safetensors")
    if found is None:
        raise InputError(
            "no canary given and no canary.safetensors found here or up to two levels above",
            path=start,
            hint="pass --canary FILE (build one with `moeaudit canary build`)",
        )
    return found
