"""Every command says what it is for and shows how to run it — every option
has help text, every command's --help ends with an "Examples:" block of 1–3 invocations on the
shipped samples that click parses (the read-only ones are run), no summary is cut off with
"...", and the README's command table matches the real command line."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from moeaudit.cli import cli

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# `moeaudit --help` at 80 columns: 78 − 2·2 indent − 2 gap − the longest command name (calibrate)
SUMMARY_WIDTH = 78 - 6 - max(map(len, cli.commands))


def _commands(group: click.Group = cli, path: tuple[str, ...] = (), groups: bool = False) -> dict[str, click.Command]:
    out: dict[str, click.Command] = {" ".join(path): group} if groups else {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, (*path, name), groups))
        else:
            out[" ".join((*path, name))] = cmd
    return out


def _help(name: str) -> str:
    result = CliRunner().invoke(cli, [*name.split(), "--help"])
    assert result.exit_code == 0, result.output
    return result.output


def _examples(text: str) -> list[str]:
    """The invocations under "Examples:" in a --help page (one per line, never rewrapped)."""
    if "\nExamples:\n" not in text and "\n  Examples:\n" not in text:
        return []
    block = re.split(r"\n *Examples:\n", text)[1].split("\n\n")[0]
    return [line.strip() for line in block.splitlines()]


def _parse(argv: list[str]) -> tuple[str, click.Context]:
    """The command an invocation reaches and its parsed context (click's own parsing, no call)."""
    cmd: click.Command = cli
    ctx: click.Context | None = None
    name, path = "moeaudit", []
    while True:
        ctx = cmd.make_context(name, list(argv), parent=ctx)
        if not isinstance(cmd, click.Group):
            return " ".join(path), ctx
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        found, sub, argv = cmd.resolve_command(ctx, rest)
        assert found is not None and sub is not None
        name, cmd = found, sub
        path.append(found)


def test_every_option_has_help() -> None:
    missing = [
        f"{name or 'moeaudit'} {p.opts[0]}"
        for name, cmd in _commands(groups=True).items()
        for p in cmd.params
        if isinstance(p, click.Option) and not p.help
    ]
    assert missing == []


def test_no_summary_is_cut_off() -> None:
    truncated = [
        name
        for name, cmd in _commands(groups=True).items()
        if name and cmd.get_short_help_str(limit=SUMMARY_WIDTH).endswith("...")
    ]
    assert truncated == []
    for group in ("", "canary", "samples"):
        listing = _help(group).split("Commands:")[1].strip().splitlines()
        names = cli.commands if not group else cli.commands[group].commands  # type: ignore[attr-defined]
        assert len(listing) == len(names), listing  # one line each: nothing wrapped
        assert not [line for line in listing if line.rstrip().endswith("...")]


@pytest.mark.parametrize("name", sorted(_commands(groups=True)))
def test_every_command_has_examples_that_parse(name: str) -> None:
    examples = _examples(_help(name))
    assert 1 <= len(examples) <= 3, examples
    for example in examples:
        argv = shlex.split(example)
        assert argv[0] == "moeaudit", example
        reached, _ = _parse(argv[1:])
        assert reached == name or (reached.startswith(name) if name else True), (example, reached)
        for arg in argv[1:]:
            if arg.startswith("sample_checkpoints/"):
                assert (ROOT / arg).exists(), (example, arg)
    # on the shipped samples, except where the input is a key, a certificate or nothing at all
    assert any("sample_checkpoints/" in e for e in examples) or name in (
        "keygen",
        "verify",
        "export",
        "samples",
        "samples build",
    )


def test_examples_block_is_required() -> None:
    """The checks above fail on a command without examples (not vacuous)."""
    assert _examples("Usage: x\n\n  Does a thing.\n\nOptions:\n  -h  Help.\n") == []
    bare = click.Command("x", help="Does a thing.")
    assert _examples(CliRunner().invoke(bare, ["--help"]).output) == []


def test_read_only_examples_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """inspect, canary show and envelope examples, run as written from the repository root."""
    monkeypatch.chdir(ROOT)
    ran = 0
    for name in ("inspect", "canary show", "envelope"):
        for example in _examples(_help(name)):
            argv = shlex.split(example)[1:]
            if "--compare" in argv:
                continue  # replays every checkpoint: the envelope-source tests run it
            result = CliRunner().invoke(cli, argv)
            assert result.exit_code in ((0, 1) if name == "envelope" else (0,)), (example, result.output)
            assert "error" not in result.stderr, (example, result.stderr)
            ran += 1
    assert ran >= 5


def _readme_rows() -> dict[str, str]:
    table = README.read_text(encoding="utf-8").split("| command | what it does |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `moeaudit ([a-z]+(?: [a-z]+)?)(?= |`)([^`]*)`", line)
        if m:
            words = m.group(1).split()
            name = " ".join(words[:2]) if words[0] in ("canary", "samples", "claims") else words[0]
            rows[name] = m.group(0)
    return rows


def test_readme_command_table_matches_the_cli() -> None:
    rows, commands = _readme_rows(), _commands()
    assert set(rows) == set(commands)
    for name, row in rows.items():
        known = {opt for p in commands[name].params for opt in getattr(p, "opts", [])}
        shown = set(re.findall(r"--[a-z][a-z-]*", row))
        assert shown <= known, (name, shown - known)


def test_every_command_accepts_verbose() -> None:
    """The README: "Every command accepts `--verbose` (tracebacks on errors)" — subcommands of a
    group too (`claims add`), not only the top level."""
    missing = [name for name, cmd in _commands().items() if not any("--verbose" in p.opts for p in cmd.params)]
    assert missing == []
    result = CliRunner().invoke(cli, ["claims", "list", "/nonexistent-model-dir", "--verbose"])
    assert result.exit_code == 4 and "No such option" not in result.output


def test_examples_are_not_joined_by_a_line_continuation() -> None:
    """A backslash at the end of a docstring line joins it to the next with its indentation: the
    example then shows a run of blanks mid-command."""
    runs = {name: ex for name in _commands() for ex in _examples(_help(name)) if "  " in ex}
    assert runs == {}
