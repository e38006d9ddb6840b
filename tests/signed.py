"""The statement a certificate signs, as moeaudit reads it (a v2 predicate's lowerCamelCase
field names converted back by ``moeaudit.attest.certificate.internal``), for tests that look
inside an envelope without verifying it again."""

from __future__ import annotations

import base64
import json
from typing import Any

from moeaudit.attest.certificate import internal


def signed_statement(envelope: dict[str, Any]) -> dict[str, Any]:
    return internal(json.loads(base64.b64decode(envelope["payload"])))
