"""Where the shipped Jinja2 templates are: inside the installed package (wheel:
``moeaudit/_templates``), or ``templates/`` at the repository root (editable install)."""

from __future__ import annotations

from pathlib import Path


def templates_dir() -> Path:
    try:
        from importlib.resources import files

        packaged = Path(str(files("moeaudit._templates")))
        if packaged.is_dir():
            return packaged
    except ModuleNotFoundError:
        pass
    return Path(__file__).resolve().parent.parent / "templates"
