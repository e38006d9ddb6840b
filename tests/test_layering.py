"""The import structure: no cycles between moeaudit's packages and top-level modules, none between
its modules either, and every import goes down the declared tiers (docs/architecture.md).
Imports are read from the source (``ast``), function-level (lazy) ones included: a lazy import
hides a cycle from Python, not from a reader. The torch-free packages are checked by importing
every module they hold."""

from __future__ import annotations

import ast
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import moeaudit

ROOT = Path(moeaudit.__file__).resolve().parent

# Bottom to top. A unit is a subpackage (``moeaudit.replay``) or a top-level module
# (``moeaudit.cli``); a unit may import units of its own tier or below, never above.
TIERS: list[tuple[str, set[str]]] = [
    ("base", {"moeaudit", "errors", "limits", "locate", "output", "papers", "resources", "jsonio", "precision"}),
    ("documents and rules", {"records", "policy", "margins", "metrics"}),
    ("model description", {"spec"}),
    ("families", {"families"}),
    ("inputs", {"checkpoint", "canary", "canary_units", "canary_text", "run", "run_names", "lineage"}),
    ("replay", {"replay"}),
    ("receipts", {"receipts", "cache"}),
    ("decision", {"judge"}),
    ("attestation", {"attest"}),
    ("publication", {"schemas", "report"}),
    ("trainer integrations", {"integrations", "hooks"}),
    ("use cases", {"certify", "calibrate", "series", "samples"}),
    ("commands", {"commands"}),
    ("command line", {"cli", "cli_common", "cli_claims", "__main__"}),
]
TORCH_FREE = [
    "moeaudit.spec",
    "moeaudit.judge",
    "moeaudit.attest",
    "moeaudit.report",
    "moeaudit.schemas",
    "moeaudit.records",
    "moeaudit.policy",
    "moeaudit.margins",
    "moeaudit.jsonio",
    "moeaudit.precision",
]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        name = ".".join(("moeaudit", *path.relative_to(ROOT).with_suffix("").parts))
        found[name.removesuffix(".__init__")] = path
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) → the modules where the import is written."""
    mods = _modules()
    out: dict[tuple[str, str], list[str]] = {}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [
                    f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods
                ]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t == "moeaudit" or t.startswith("moeaudit."):
                    pair = (_unit(name), _unit(t))
                    if pair[0] != pair[1]:
                        out.setdefault(pair, []).append(name)
    return out


def test_every_unit_has_a_tier() -> None:
    tiered = {u for _, units in TIERS for u in units}
    units = {_unit(m) for m in _modules()}
    assert units - tiered == set(), "place these in TIERS (and docs/architecture.md)"
    assert tiered - units == set(), "TIERS names units that no longer exist"


def test_no_import_goes_up_a_tier() -> None:
    tier = {u: i for i, (_, units) in enumerate(TIERS) for u in units}
    upward = {
        f"{a} → {b} (in {', '.join(sorted(set(where)))})"
        for (a, b), where in edges().items()
        if tier.get(b, -1) > tier.get(a, -1)
    }
    assert upward == set()


def module_edges() -> dict[str, set[str]]:
    """Module → the moeaudit modules it imports. ``from P import m`` where P.m is a module is an
    edge to P.m alone (P's ``__init__`` runs before any of its submodules: that is no edge of
    the importer's); names taken from P itself make an edge to P."""
    mods = _modules()
    out: dict[str, set[str]] = {}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs + ([node.module] if len(subs) < len(node.names) else [])
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            out.setdefault(name, set()).update(t for t in targets if t in mods and t != name)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): each is a set of
    nodes that import each other around a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_cycles_between_units() -> None:
    graph: dict[str, set[str]] = {}
    for a, b in edges():
        graph.setdefault(a, set()).add(b)
    assert cycles(graph) == []


def test_no_cycles_between_modules() -> None:
    """Inside a package too: no module imports itself around a loop, lazily or not (a shared
    piece moves down into a module both sides import)."""
    assert cycles(module_edges()) == []


def test_the_cycle_check_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert cycles(graph) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": {"c"}}) == []


def test_the_graph_is_read_at_all() -> None:
    """The checks above cannot pass vacuously: known edges are seen, lazy ones included."""
    seen = edges()
    assert ("commands", "certify") in seen and ("receipts", "replay") in seen
    assert ("replay", "checkpoint") in seen and ("families", "spec") in seen
    mods = module_edges()
    assert len(mods) > 150 and sum(map(len, mods.values())) > 500
    assert "moeaudit.replay.sharded" in mods["moeaudit.replay.engine"]  # lazy, inside replay()
    assert "moeaudit.receipts.conflict" in mods["moeaudit.receipts.state"]  # lazy, inside run_state()
    assert "moeaudit.replay.dist" in mods["moeaudit.replay.engine"]  # `from moeaudit.replay import dist`
    assert "moeaudit.replay" not in mods["moeaudit.replay.engine"]


# What a command does is moeaudit.commands; the command line parses, prints and exits. These
# are the units whose work a command wraps: the command line reaches them through the commands.
WRAPPED = {"certify", "calibrate", "series", "samples", "receipts", "checkpoint", "canary", "judge", "cache", "policy"}
CLI_MAX_LINES = 800


def _parses_or_prints(tree: ast.AST) -> list[str]:
    """What a use case may not do: import an argument parser, a console or the command line,
    or call print()."""
    banned = (
        "argparse",
        "click",
        "rich",
        "moeaudit.cli",
        "moeaudit.cli_common",
        "moeaudit.cli_claims",
        "moeaudit.report.terminal",
    )
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith(banned)]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(banned):
            found.append(node.module or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append("print()")
    return found


def test_commands_parse_no_arguments_and_print_nothing() -> None:
    """The use cases take typed arguments and return typed results: a line for the user goes
    through the Hooks the command line passes in."""
    paths = sorted((ROOT / "commands").glob("*.py"))
    assert len(paths) >= 12  # every command has its module
    found = {p.name: _parses_or_prints(ast.parse(p.read_text(encoding="utf-8"))) for p in paths}
    assert {name: what for name, what in found.items() if what} == {}


def test_the_command_check_sees_what_it_forbids() -> None:
    source = "import argparse\nimport json\nfrom rich.table import Table\nfrom moeaudit.cli import cli\nprint(1)\n"
    assert _parses_or_prints(ast.parse(source)) == ["argparse", "rich.table", "moeaudit.cli", "print()"]


def test_the_command_line_is_arguments_printing_and_exit_codes() -> None:
    """cli.py stays small, and reaches the work it runs only through moeaudit.commands."""
    lines = (ROOT / "cli.py").read_text(encoding="utf-8").count("\n")
    assert lines <= CLI_MAX_LINES, f"cli.py has {lines} lines: move the work into moeaudit/commands/"
    seen = edges()
    assert ("cli", "commands") in seen and ("commands", "certify") in seen
    assert {b for (a, b) in seen if a in ("cli", "cli_common", "cli_claims")} & WRAPPED == set()


def _torch_free_modules() -> list[str]:
    names = []
    for pkg in TORCH_FREE:
        module = __import__(pkg, fromlist=["_"])
        names.append(pkg)
        if hasattr(module, "__path__"):
            names += [info.name for info in pkgutil.walk_packages(module.__path__, prefix=f"{pkg}.")]
    return sorted(set(names))


def test_torch_free_packages_import_no_torch() -> None:
    """Every module of the decision, attestation and report packages, and of the model
    description, imports without torch (walked, not listed: a new module is covered)."""
    names = _torch_free_modules()
    assert len(names) > 20
    code = (
        "import importlib, json, sys\n"
        f"for n in {names!r}:\n"
        "    importlib.import_module(n)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'numpy') if m in sys.modules)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_old_hooks_path_still_imports_with_a_warning() -> None:
    """Training scripts written against earlier releases import moeaudit.hooks."""
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "try:\n    import moeaudit.hooks\nexcept DeprecationWarning as w:\n    print('warned', w)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT.parent)
    assert done.returncode == 0, done.stderr
    assert "warned moeaudit.hooks is deprecated" in done.stdout
    from moeaudit.integrations.hooks import ExpertGradLogger

    with __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore", DeprecationWarning)
        import moeaudit.hooks as old
    assert old.ExpertGradLogger is ExpertGradLogger


def _reads_layer_settings(tree: ast.AST) -> list[int]:
    """The lines where an expression named ``spec`` (``spec``, ``ckpt.spec``, ``self.spec`` …) has
    its ``settings`` read."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "settings":
            base = node.value
            name = base.attr if isinstance(base, ast.Attribute) else base.id if isinstance(base, ast.Name) else ""
            if name in ("spec", "s", "arch"):
                lines.append(node.lineno)
    return lines


def test_only_the_model_description_and_the_families_read_the_layer_settings() -> None:
    """``ModelSpec.settings`` is the family's description as read; everything else (the replay, the
    checkpoint reader, the receipts) reads the typed blocks of ``ModelSpec.layers``."""
    readers = {
        module: found
        for module, path in _modules().items()
        if _unit(module) not in ("spec", "families")
        and (found := _reads_layer_settings(ast.parse(path.read_text(encoding="utf-8"))))
    }
    assert readers == {}
    probe = ast.parse("def f(spec, ckpt):\n    return spec.settings.qk_norm, ckpt.spec.settings\n")
    assert _reads_layer_settings(probe) == [2, 2]  # the check sees what it forbids
