"""DSSE envelopes signed with ECDSA P-256 (new keys) or Ed25519 (docs/security.md, "What the signature binds";
docs/decisions.md, "Certificates, keys and attestations").

The signature covers the DSSE pre-authentication encoding
``"DSSEv1" SP LEN(type) SP type SP LEN(body) SP body`` — for P-256 a DER ECDSA signature over
its SHA-256, as DSSE and cosign sign; verification checks it *before* the payload is parsed, and
hands back only verified bytes. Torch-free, so ``verify`` starts fast.
keyid = hex SHA-256 of the public key's DER SubjectPublicKeyInfo.

The same envelope also goes into a key-based Sigstore bundle v0.3 (:func:`to_bundle`), which
cosign verifies: ``verificationMaterial.publicKey.hint`` = hex SHA-256 of the PEM SPKI (what
OpenSSF model-signing 1.x writes and compares; cosign, given ``--key``, ignores the hint), no
transparency-log entries, the DSSE signature without a keyid. Reading one back, a bundle with log
entries or timestamps is refused: moeaudit does not verify them; the hint earlier versions wrote
(base64 SHA-256 of the DER SPKI) is still accepted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from moeaudit.errors import InputError, MoeauditError, PolicyFailed
from moeaudit.jsonio import DuplicateKey, atomic_write, check_output_target, no_duplicate_keys
from moeaudit.limits import MAX_KEY_BYTES, read_regular

PAYLOAD_TYPE = "application/vnd.in-toto+json"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
# the same version as cosign names it (`cosign attest-blob --new-bundle-format` writes this one)
BUNDLE_MEDIA_TYPES = (BUNDLE_MEDIA_TYPE, "application/vnd.dev.sigstore.bundle+json;version=0.3")
DEFAULT_ALGORITHM = "ecdsa-p256"  # cosign and model_signing verify P-256, not Ed25519
ALGORITHMS = ("ecdsa-p256", "ed25519")
PASSPHRASE_ENV = "MOEAUDIT_KEY_PASSPHRASE"

PrivateKey = ed25519.Ed25519PrivateKey | ec.EllipticCurvePrivateKey
PublicKey = ed25519.Ed25519PublicKey | ec.EllipticCurvePublicKey


class SignatureInvalid(PolicyFailed):
    """The envelope does not verify (exit 1, README.md, "Exit codes")."""


def pae(payload_type: str, body: bytes) -> bytes:
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def _spki_sha256(public_key: PublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).digest()


def keyid(public_key: PublicKey) -> str:
    return _spki_sha256(public_key).hex()


def key_hint(public_key: PublicKey) -> str:
    """The Sigstore bundle's ``publicKey.hint``: hex SHA-256 of the PEM SubjectPublicKeyInfo, as
    model-signing 1.x computes it from the public key it is given (a different hint is its "Key
    mismatch"). The hint is only a name to look the key up by; the signature decides."""
    pem = public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(pem).hexdigest()


def legacy_key_hint(public_key: PublicKey) -> str:
    """The hint bundles of earlier moeaudit versions carry: base64 SHA-256 of the DER SPKI."""
    return base64.b64encode(_spki_sha256(public_key)).decode("ascii")


def _check_supported(key: Any, path: Path) -> None:
    if isinstance(key, (ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey)):
        return
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) and isinstance(key.curve, ec.SECP256R1):
        return
    raise InputError("unsupported key type", path=path, hint="use Ed25519 or ECDSA P-256 keys")


def sign_bytes(key: PrivateKey, data: bytes) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    return key.sign(data, ec.ECDSA(hashes.SHA256()))


def verify_bytes(key: PublicKey, sig: bytes, data: bytes) -> bool:
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(sig, data)
        else:
            key.verify(sig, data, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def sign_envelope(key: PrivateKey, body: bytes, payload_type: str = PAYLOAD_TYPE) -> dict[str, Any]:
    sig = sign_bytes(key, pae(payload_type, body))
    return {
        "payload": base64.b64encode(body).decode("ascii"),
        "payloadType": payload_type,
        "signatures": [{"keyid": keyid(key.public_key()), "sig": base64.b64encode(sig).decode("ascii")}],
    }


@dataclass(frozen=True)
class Verified:
    payload_type: str
    body: bytes  # the verified payload bytes; parse only these
    keyid: str


def _b64(value: Any, what: str, path: Path) -> bytes:
    if not isinstance(value, str):
        raise SignatureInvalid(f"{what} is not a base64 string", path=path)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SignatureInvalid(f"{what} is not valid base64", path=path) from exc


ENVELOPE_KEYS = frozenset({"payload", "payloadType", "signatures"})
WHAT_A_CERTIFICATE_IS = (
    "give certificate.json (a DSSE envelope) or certificate.sigstore.json (a Sigstore bundle) as certify wrote it"
)


def _parse(raw: bytes, what: str, path: Path) -> Any:
    """The signed file as JSON. A file that is not a certificate at all — not JSON, or JSON with
    none of the envelope's or bundle's fields — is an input error (exit 4, docs/decisions.md, "A file that is not a
    certificate"); one that is a certificate in shape but altered (a field added, dropped or named twice) does not
    verify (exit 1)."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except DuplicateKey as exc:
        raise SignatureInvalid(f"not a {what} ({exc})", path=path) from exc
    except (ValueError, RecursionError) as exc:  # ValueError: bad UTF-8, JSON, huge ints
        raise InputError(f"not a certificate (not JSON: {exc})", path=path, hint=WHAT_A_CERTIFICATE_IS) from exc
    if not isinstance(doc, dict) or not (ENVELOPE_KEYS & set(doc) or "mediaType" in doc):
        unsigned = isinstance(doc, dict) and "_type" in doc and "predicate" in doc
        kind = "an unsigned in-toto statement" if unsigned else "JSON without a DSSE envelope's fields"
        raise InputError(f"not a certificate ({kind})", path=path, hint=WHAT_A_CERTIFICATE_IS)
    return doc


def verify_envelope(raw: bytes, public_key: PublicKey, path: Path) -> Verified:
    """Check the DSSE signature over the PAE; only then return the payload bytes."""
    return _verify_dsse(_parse(raw, "DSSE envelope", path), public_key, path, in_bundle=False)


def verify_signed(raw: bytes, public_key: PublicKey, path: Path) -> Verified:
    """A DSSE envelope, or a Sigstore bundle (told apart by its ``mediaType``): verified bytes."""
    doc = _parse(raw, "DSSE envelope", path)
    if isinstance(doc, dict) and "mediaType" in doc:
        return verify_bundle(doc, public_key, path)
    return _verify_dsse(doc, public_key, path, in_bundle=False)


def _verify_dsse(env: Any, public_key: PublicKey, path: Path, *, in_bundle: bool) -> Verified:
    where = "the bundle's dsseEnvelope is not a DSSE envelope" if in_bundle else "not a DSSE envelope"
    if not isinstance(env, dict) or set(env) != {"payload", "payloadType", "signatures"}:
        raise SignatureInvalid(f"{where} (needs exactly payload, payloadType, signatures)", path=path)
    if env["payloadType"] != PAYLOAD_TYPE:
        raise SignatureInvalid(f"payloadType is {env['payloadType']!r}, expected {PAYLOAD_TYPE!r}", path=path)
    sigs = env["signatures"]
    if not isinstance(sigs, list) or len(sigs) != 1:
        count = len(sigs) if isinstance(sigs, list) else "no"
        raise SignatureInvalid(f"expected exactly one signature, found {count}", path=path)
    entry = sigs[0]
    if not isinstance(entry, dict) or set(entry) - {"keyid", "sig"} or "sig" not in entry:
        raise SignatureInvalid("signature entry must be {keyid, sig}", path=path)
    want = keyid(public_key)
    # a bundle's signature carries no keyid (cosign writes none; sigstore-go would compare one
    # with an SSH fingerprint): its key is named by verificationMaterial.publicKey.hint instead
    if entry.get("keyid") != want and not (in_bundle and entry.get("keyid", "") == ""):
        raise SignatureInvalid(
            f"signed by key {str(entry.get('keyid'))[:16]}…, not by this public key ({want[:16]}…)", path=path
        )
    body, sig = _b64(env["payload"], "payload", path), _b64(entry["sig"], "signature", path)
    if not verify_bytes(public_key, sig, pae(PAYLOAD_TYPE, body)):
        raise SignatureInvalid(
            "signature does not verify: the certificate was modified or signed by another key", path=path
        )
    return Verified(PAYLOAD_TYPE, body, want)


def to_bundle(envelope: dict[str, Any], public_key: PublicKey) -> dict[str, Any]:
    """The signed envelope as a key-based Sigstore bundle v0.3: the same payload and signature."""
    return {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(public_key)}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": envelope["payload"],
            "payloadType": envelope["payloadType"],
            "signatures": [{"sig": s["sig"]} for s in envelope["signatures"]],
        },
    }


def verify_bundle(bundle: dict[str, Any], public_key: PublicKey, path: Path) -> Verified:
    """A key-based Sigstore bundle: the key named by its hint, then its DSSE envelope.

    moeaudit verifies against the public key it is given (cosign: ``--insecure-ignore-tlog``) and
    checks no transparency-log entry or timestamp, so a bundle that carries any is refused rather
    than accepted as if they had been checked (docs/decisions.md, "Sigstore bundles with tlog entries or timestamps"):
    its signer meant them to be verified."""
    if bundle.get("mediaType") not in BUNDLE_MEDIA_TYPES:
        raise SignatureInvalid(
            f"mediaType is {str(bundle.get('mediaType'))[:80]!r}, expected {BUNDLE_MEDIA_TYPE!r}", path=path
        )
    extra = set(bundle) - {"mediaType", "verificationMaterial", "dsseEnvelope"}
    if extra:
        what = (
            "a message signature, not an attestation"
            if "messageSignature" in extra
            else f"unexpected {', '.join(sorted(extra))}"
        )
        raise SignatureInvalid(f"not a moeaudit certificate bundle ({what})", path=path)
    material = bundle.get("verificationMaterial")
    if not isinstance(material, dict) or not isinstance(material.get("publicKey"), dict):
        raise SignatureInvalid(
            "the bundle is not key-based (no verificationMaterial.publicKey)",
            path=path,
            hint="verify certificate-based (keyless) bundles with cosign or sigstore",
        )
    if set(material) - {"publicKey", "tlogEntries", "timestampVerificationData"}:
        raise SignatureInvalid("the bundle's verificationMaterial holds a certificate and a key", path=path)
    _refuse_unverified_evidence(material, path)
    hint = material["publicKey"].get("hint")
    if hint is not None and hint not in (key_hint(public_key), legacy_key_hint(public_key)):
        raise SignatureInvalid(
            f"signed by key hint {str(hint)[:16]}…, not by this public key "
            f"(keyid {keyid(public_key)[:16]}…, key hint {key_hint(public_key)[:16]}…)",
            path=path,
        )
    return _verify_dsse(bundle.get("dsseEnvelope"), public_key, path, in_bundle=True)


def _refuse_unverified_evidence(material: dict[str, Any], path: Path) -> None:
    """Transparency-log entries or signed timestamps are evidence moeaudit does not verify: a
    bundle carrying any is refused (exit 1), never verified as if they had been checked."""
    tlog = material.get("tlogEntries", [])
    stamps = material.get("timestampVerificationData", {})
    if not isinstance(tlog, list) or not isinstance(stamps, dict):
        raise SignatureInvalid(
            "the bundle's tlogEntries is not a list or its timestampVerificationData not an object", path=path
        )
    timestamps = stamps.get("rfc3161Timestamps", [])
    if set(stamps) - {"rfc3161Timestamps"} or not isinstance(timestamps, list):
        raise SignatureInvalid("the bundle's timestampVerificationData holds more than rfc3161Timestamps", path=path)
    held = [
        f"{len(x)} {one if len(x) == 1 else many}"
        for x, one, many in (
            (tlog, "transparency-log entry", "transparency-log entries"),
            (timestamps, "RFC 3161 timestamp", "RFC 3161 timestamps"),
        )
        if x
    ]
    if held:
        raise SignatureInvalid(
            f"the bundle carries {' and '.join(held)}, which moeaudit does not verify",
            path=path,
            hint="verify it with cosign or sigstore, which check them; moeaudit "
            "verifies key-based bundles with no log entries and no timestamps",
        )


# ----- keys ------------------------------------------------------------------------------


def default_key_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "moeaudit" / "signing-key.pem"


def default_public_key() -> Path:
    """Your moeaudit key's ``.pub``, what ``verify`` and ``export`` use without ``--pubkey``; a
    reader who never certified anything has none yet, and is told how to name the signer's."""
    path = Path(str(default_key_path()) + ".pub")
    if not os.path.lexists(path):
        raise InputError(
            "no --pubkey given and you have no moeaudit key yet",
            path=path,
            hint="pass --pubkey KEY.pub, the public key of whoever signed the certificate "
            "(`moeaudit keygen --out KEY` writes KEY.pub; certify creates your key on "
            "first use)",
        )
    return path


def generate_key(
    path: Path, *, algorithm: str = DEFAULT_ALGORITHM, passphrase: bytes | None = None, force: bool = False
) -> PrivateKey:
    """Write KEY (PKCS#8 PEM, mode 0600) and KEY.pub (SPKI PEM) as a pair, under KEY.lock."""
    key = _new_key(algorithm)
    if not path.parent.is_dir():
        raise InputError(
            "output directory does not exist", path=path.parent, hint="create it first or choose another path"
        )
    _refuse_targets(path, force)  # before KEY.lock is made: a refusal leaves nothing behind
    with _key_lock(path):
        _write_pair(path, key, passphrase, force)
    return key


def ensure_key(path: Path) -> bool:
    """Create the default key pair at ``path`` unless it exists; True when this call created it.

    Two first-use runs at once: both take KEY.lock in turn; the second finds the first's key
    and uses it, so the private key and KEY.pub always match.
    """
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path.parent)) from exc
    with _key_lock(path):
        if os.path.lexists(path):
            return False
        pub = path.with_name(path.name + ".pub")
        if os.path.lexists(pub):
            raise InputError(
                "a public key exists without its private key",
                path=pub,
                hint="move it away to create a new key pair, or pass --key KEY",
            )
        _write_pair(path, _new_key(DEFAULT_ALGORITHM), None, force=False)
    return True


def _new_key(algorithm: str) -> PrivateKey:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown key algorithm {algorithm!r}")
    return ed25519.Ed25519PrivateKey.generate() if algorithm == "ed25519" else ec.generate_private_key(ec.SECP256R1())


@contextmanager
def _key_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on KEY.lock (left in place: removing it would race a waiter)."""
    import fcntl

    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(lock)) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_targets(path: Path, force: bool) -> None:
    """KEY and KEY.pub: never a link, device or FIFO; without ``force``, neither may exist."""
    for p in (path, path.with_name(path.name + ".pub")):
        check_output_target(p, force=True)  # a link, device or FIFO is never a key file
        if not force and os.path.lexists(p):
            raise InputError("key file exists", path=p, hint="pass --force to replace it")


def _write_pair(path: Path, key: PrivateKey, passphrase: bytes | None, force: bool) -> None:
    """Both files written to temps first; KEY.pub is linked into place before KEY, so a KEY
    that exists always has its KEY.pub. Without ``force`` the links fail if either exists."""
    enc = serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, enc)
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    pub_path = path.with_name(path.name + ".pub")
    _refuse_targets(path, force)
    atomic_write(pub_path, pub, mode=0o644, force=force)
    try:
        atomic_write(path, pem, mode=0o600, force=force)
    except BaseException:
        if not force:
            pub_path.unlink(missing_ok=True)  # ours: linked above, under the lock
        raise


def load_private_key(path: Path, passphrase: bytes | None = None) -> tuple[PrivateKey, list[str]]:
    """(key, warnings). The passphrase comes from the argument or $MOEAUDIT_KEY_PASSPHRASE."""
    warnings = []
    raw = read_regular(path, "private key", MAX_KEY_BYTES)
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise InputError(f"cannot read private key: {exc.strerror or exc}", path=path) from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.append(f"private key {path} is readable by other users; run: chmod 600 {path}")
    if passphrase is None and os.environ.get(PASSPHRASE_ENV):
        passphrase = os.environ[PASSPHRASE_ENV].encode("utf-8")
    try:
        key = serialization.load_pem_private_key(raw, password=passphrase)
    except TypeError as exc:
        raise KeyNeedsPassphrase(
            "private key is encrypted", path=path, hint=f"set {PASSPHRASE_ENV} or answer the prompt"
        ) from exc
    except ValueError as exc:
        if b"-----BEGIN PUBLIC KEY-----" in raw:
            raise InputError(
                "a public key, not a private key",
                path=path,
                hint="pass the private key KEY (KEY.pub is its public half)",
            ) from exc
        if passphrase is not None and b"ENCRYPTED" in raw:  # PKCS#8 "ENCRYPTED PRIVATE KEY" or legacy Proc-Type
            raise InputError(
                "the passphrase does not decrypt this private key",
                path=path,
                hint=f"check ${PASSPHRASE_ENV} or the passphrase typed",
            ) from exc
        raise InputError(
            f"not a usable PEM private key ({exc})", path=path, hint="create one with `moeaudit keygen --out KEY`"
        ) from exc
    _check_supported(key, path)
    return key, warnings  # type: ignore[return-value]


class KeyNeedsPassphrase(InputError):
    pass


def load_public_key(path: Path) -> PublicKey:
    raw = read_regular(path, "public key", MAX_KEY_BYTES)
    try:
        key = serialization.load_pem_public_key(raw)
    except ValueError as exc:
        raise InputError(
            "not a PEM public key", path=path, hint="pass the KEY.pub written by `moeaudit keygen`"
        ) from exc
    _check_supported(key, path)
    return key  # type: ignore[return-value]


__all__ = [
    "BUNDLE_MEDIA_TYPE",
    "MoeauditError",
    "SignatureInvalid",
    "Verified",
    "default_key_path",
    "default_public_key",
    "ensure_key",
    "generate_key",
    "key_hint",
    "keyid",
    "load_private_key",
    "load_public_key",
    "no_duplicate_keys",
    "pae",
    "sign_envelope",
    "to_bundle",
    "verify_bundle",
    "verify_envelope",
    "verify_signed",
]
