"""Issue 16 item 3: every option says what it is for, `moeaudit --help` summaries are whole, and
the README's command table matches the real command line."""

from __future__ import annotations

import re
from pathlib import Path

import click
from click.testing import CliRunner

from moeaudit.cli import cli

README = Path(__file__).resolve().parent.parent / "README.md"


def _commands(group: click.Group = cli, path: tuple[str, ...] = ()) -> dict[str, click.Command]:
    out: dict[str, click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_commands(cmd, (*path, name)))
        else:
            out[" ".join((*path, name))] = cmd
    return out


def test_every_option_has_help() -> None:
    missing = [f"{name} {p.opts[0]}" for name, cmd in _commands().items() for p in cmd.params
               if isinstance(p, click.Option) and not p.help]
    assert missing == []


def test_top_level_summaries_are_not_cut_off() -> None:
    text = CliRunner().invoke(cli, ["--help"]).output
    lines = text.split("Commands:")[1].strip().splitlines()
    assert len(lines) == len(cli.commands)
    assert not [line for line in lines if line.rstrip().endswith("...")]


def _readme_rows() -> dict[str, str]:
    table = README.read_text(encoding="utf-8").split("| command | what it does |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"\| `moeaudit ([a-z]+(?: [a-z]+)?)(?= |`)([^`]*)`", line)
        if m:
            words = m.group(1).split()
            name = " ".join(words[:2]) if words[0] in ("canary", "samples") else words[0]
            rows[name] = m.group(0)
    return rows


def test_readme_command_table_matches_the_cli() -> None:
    rows, commands = _readme_rows(), _commands()
    assert set(rows) == set(commands)
    for name, row in rows.items():
        known = {opt for p in commands[name].params for opt in getattr(p, "opts", [])}
        shown = set(re.findall(r"--[a-z][a-z-]*", row))
        assert shown <= known, (name, shown - known)
