"""``moeaudit keygen``: a signing key pair, KEY (mode 0600) and KEY.pub."""

from __future__ import annotations

import os
from pathlib import Path

from moeaudit.errors import InputError, UsageError


def keygen(out: Path, *, key_type: str = "ecdsa-p256", passphrase_env: bool = False, force: bool = False) -> str:
    """Write the pair (``passphrase_env``: the private key encrypted with
    $MOEAUDIT_KEY_PASSPHRASE) and return the public key's keyid."""
    from moeaudit.attest.signing import PASSPHRASE_ENV, generate_key, keyid

    if str(out) == "-":
        raise UsageError("--out is the private key file (KEY.pub beside it), not stdout", path="-")
    passphrase = None
    if passphrase_env:
        if not os.environ.get(PASSPHRASE_ENV):
            raise InputError(f"--passphrase-env given but ${PASSPHRASE_ENV} is empty")
        passphrase = os.environ[PASSPHRASE_ENV].encode()
    key = generate_key(out, algorithm=key_type, passphrase=passphrase, force=force)
    return keyid(key.public_key())
