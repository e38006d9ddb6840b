"""Where the shipped Jinja2 templates are: inside the installed package (wheel:
``moeaudit/_templates``, a namespace package — it has no ``__init__.py``), where an editable
install maps ``moeaudit._templates``, or ``templates/`` at the repository root (source tree)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

MAIN_TEMPLATE = "certificate.html.j2"


def templates_dir() -> Path:
    try:
        spec = importlib.util.find_spec("moeaudit._templates")
    except ModuleNotFoundError:
        spec = None
    # a namespace package's files() is a MultiplexedPath, not a directory: read its locations
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(location) / MAIN_TEMPLATE).is_file():
            return Path(location)
    return Path(__file__).resolve().parent.parent / "templates"
