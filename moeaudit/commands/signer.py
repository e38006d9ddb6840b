"""The keys a command signs or verifies with: the given file, else your moeaudit key (created on
first use, as ``certify`` does). Shared by the commands that sign attestations."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from moeaudit.report.terminal import warn


def private_key(path: Path | None) -> Any:
    """The signing key at ``path`` (default: your moeaudit key, created on first use); a
    passphrase comes from $MOEAUDIT_KEY_PASSPHRASE or a prompt on a terminal."""
    from moeaudit.attest.signing import (
        PASSPHRASE_ENV,
        KeyNeedsPassphrase,
        default_key_path,
        ensure_key,
        load_private_key,
    )

    if path is None:
        path = default_key_path()
        if ensure_key(path):
            warn(f"created your signing key {path} (0600) and {path}.pub — keep the private key safe")
    try:
        key, warnings = load_private_key(path)
    except KeyNeedsPassphrase:
        if os.environ.get(PASSPHRASE_ENV) or not sys.stdin.isatty():
            raise
        given = click.prompt("key passphrase", hide_input=True, default="", show_default=False).encode()
        key, warnings = load_private_key(path, given or None)
    for w in warnings:
        warn(f"warning: {w}")
    return key


def public_keys(paths: Sequence[Path]) -> list[Any]:
    """The public keys named (default: your moeaudit key's ``.pub``)."""
    from moeaudit.attest.signing import default_public_key, load_public_key

    if not paths:
        mine = default_public_key()
        warn(f"verifying with your key {mine} (--pubkey names another)")
        paths = [mine]
    return [load_public_key(p) for p in paths]
