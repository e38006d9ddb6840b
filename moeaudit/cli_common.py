"""The command line's shared pieces: library errors turned into one line and an exit code
(``AuditGroup``), the options several commands take, and the hooks through which a command of
``moeaudit.commands`` reaches the terminal while it works. The commands are ``moeaudit.cli``.

Exit codes (README.md, "Exit codes"): 0 pass, 1 policy failed, 2 usage, 3 inconclusive, 4 input or operational
error, 130 Ctrl-C.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from moeaudit.commands.common import Hooks, UnusableDevice
from moeaudit.errors import EXIT_INPUT, EXIT_INTERRUPTED, MoeauditError, UsageError, from_os_error, short_line
from moeaudit.papers import named
from moeaudit.report.terminal import err, warn


class _Exit(click.ClickException):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        # click declares exit_code a ClassVar but reads it from the instance (Command.main): one
        # _Exit carries any of our codes, so it is set per instance.
        self.exit_code = code  # type: ignore[misc]

    def show(self, file: Any = None) -> None:
        click.echo(f"moeaudit: error: {named(self.message)}", err=True)


class AuditGroup(click.Group):
    """Turns library errors into a one-line message and a distinct exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except MoeauditError as exc:
            if ctx.meta.get("verbose"):
                traceback.print_exc()
            raise _Exit(exc.diagnostics(), exc.exit_code) from exc
        except KeyboardInterrupt as exc:
            raise _Exit("interrupted; no partial output was written", EXIT_INTERRUPTED) from exc
        except OSError as exc:  # full disk, permission, a directory where a file belongs
            if ctx.meta.get("verbose"):
                traceback.print_exc()
            raise _Exit(from_os_error(exc).diagnostics(), EXIT_INPUT) from exc
        except Exception as exc:  # a bug of ours: still one line unless --verbose
            if ctx.meta.get("verbose"):
                traceback.print_exc()
            from moeaudit.replay.dist import out_of_memory

            if (oom := out_of_memory(exc)) is not None:  # not a bug: the replay did not fit
                raise _Exit(
                    f"{oom}; nothing was written (hint: spread the routed experts over N processes with --nproc N)",
                    EXIT_INPUT,
                ) from exc
            msg = f"internal error: {type(exc).__name__}: {exc} (rerun with --verbose for a traceback)"
            raise _Exit(short_line(msg), EXIT_INPUT) from exc


def _verbose(ctx: click.Context, _param: Any, value: bool) -> bool:
    if value:
        ctx.meta["verbose"] = True
    return value


verbose_option = click.option(
    "--verbose",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_verbose,
    help="Show tracebacks on errors.",
)


nproc_option = click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Replay on N processes, each rank reading and computing its share of every layer's routed "
    "experts (torch.distributed: gloo on the CPU, NCCL on GPUs; `torchrun --nproc-per-node N -m "
    "moeaudit ...` does the same). Receipts equal one process's within float tolerance. Sharded: "
    "hashing and reading the weights, the receipts' forward and backward. On rank 0 alone: "
    "--conflict, --generate, pair receipts (compare, certify, gate) and DCP checkpoints.",
)


def precision_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--precision``: the command's replays compute in fp32 (the reference), tf32 or bf16
    (docs/policy.md, "Reduced precision"; ``moeaudit.precision``); a lower one records its measured agreement with
    fp32."""
    import functools

    from moeaudit.precision import PRECISIONS, precision_mode

    @click.option(
        "--precision",
        type=click.Choice(PRECISIONS),
        default="fp32",
        show_default=True,
        help="Compute precision of the replays: fp32 is the reference; tf32 (CUDA; elsewhere it runs fp32) "
        "and bf16 (the routed experts' products) record their measured agreement with fp32 on the canary, "
        "and boundary evidence inside that disagreement is INCONCLUSIVE.",
    )
    @functools.wraps(command)
    def run(*args: Any, precision: str, **kwargs: Any) -> Any:
        if precision == "bf16" and kwargs.get("nproc"):
            raise UsageError("--precision bf16 runs on one process: drop --nproc, or use --precision fp32")
        if precision == "tf32" and not str(kwargs.get("device") or "cpu").startswith("cuda"):  # precision.ran
            note("note: --precision tf32 applies on CUDA only: these replays run in fp32, the reference")
        with precision_mode(precision):
            return command(*args, **kwargs)

    return run


@contextmanager
def progress() -> Iterator[Callable[[str, int, int], None] | None]:
    """A progress callback for long library work (rich, on stderr, only on a terminal)."""
    if not err.is_terminal:
        yield None
        return
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    # per layer, forward then backward, with the time left of the current replay (ETA)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task("replay", total=1)

        def tick(stage: str, done: int, total: int) -> None:
            # redraw at every layer: a layer can take less than the bar's refresh interval
            bar.update(task, description=stage, completed=done, total=total, refresh=True)

        yield tick


def passphrase_prompt() -> bytes | None:
    import sys

    from moeaudit.attest.signing import PASSPHRASE_ENV

    if os.environ.get(PASSPHRASE_ENV):
        return os.environ[PASSPHRASE_ENV].encode()
    if sys.stdin.isatty():
        return click.prompt("key passphrase", hide_input=True, default="", show_default=False).encode() or None
    return None


def note(line: str) -> None:
    err.print(line, markup=False, soft_wrap=True)  # one line, as warn: CI logs are grepped


# What a command says while it works (moeaudit.commands.common.Hooks): notes and warnings on
# stderr, a progress bar on a terminal, the key's passphrase asked for when it is needed.
HOOKS = Hooks(note=note, warn=warn, progress=progress, passphrase=passphrase_prompt)


@contextmanager
def device_errors() -> Iterator[None]:
    """An unusable --device is a usage error (exit 2), reported as click reports a bad value."""
    try:
        yield
    except UnusableDevice as exc:
        raise click.BadParameter(str(exc), param_hint="--device") from exc


policy_option = click.option(
    "--policy",
    "policy_path",
    type=click.Path(path_type=Path),
    help="Policy TOML (default: policy.toml next to or above the input, else built-in).",
)


def emit_json(doc: Any, json_out: Path | None, show: Callable[[], None]) -> None:
    """``--json -``: the document on stdout only; ``--json FILE``: atomic write, then the table."""
    from moeaudit.jsonio import atomic_write, dumps

    if json_out is not None and str(json_out) == "-":
        click.echo(dumps(doc), nl=False)
        return
    if json_out is not None:
        atomic_write(json_out, dumps(doc))
    show()
    if json_out is not None:
        err.print(f"wrote {json_out}", markup=False)


def path_option(*decls: str, help: str, **kwargs: Any) -> Callable[[Any], Any]:  # noqa: A002 (click's name)
    """An option whose value is a path (``--flag``, optionally the parameter's name)."""
    return click.option(*decls, type=click.Path(path_type=Path), help=help, **kwargs)
