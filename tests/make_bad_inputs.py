"""Generate the bad-input corpus into a directory (small, deterministic).

    python tests/make_bad_inputs.py OUT_DIR     # writes the corpus, prints one path per item

Importable too: :func:`build` writes everything and returns ``{item name: path}``. Nothing here
depends on transformers: the one good checkpoint is a tiny Mixtral (~40 KB) written with the
key names of transformers' Mixtral and seeded weights, and every bad item is a copy of a good
file with one defect. Every build writes the same bytes, except the pickle trap, which names
its own output directory. The tests generate the corpus into a temp directory; it is never
committed. ``tests/test_bad_inputs.py`` pins what moeaudit answers to each item.

Layout of OUT_DIR (~1 MB)::

    good/         ckpt/ canary.safetensors canary.jsonl metrics.jsonl key.pem key.pub
                  certificate.json fast.toml (a valid policy without bootstrap, for speed)
    checkpoints/  <item>/          one defect each (truncated, overlapping, NaN, ...)
    canaries/     <item>.jsonl | <item>.safetensors
    metrics/      <item>.jsonl
    policies/     <item>.toml
    certificates/ <item>.json | <item>.pub
    runs/         writing/ (checkpoint-100 complete, checkpoint-300 a symlink loop,
                           checkpoint-500 still being written, metrics.jsonl)
                  nonfinite/ (checkpoint-100 with a NaN and an Inf weight)
                  duplicate_step/ (checkpoint-100 and checkpoint-0100)
                  non_ascii_step/ (checkpoint-100 and checkpoint-٣٠٠)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, INTER = 32, 16, 2, 2, 1, 4, 2, 8
HEAD_DIM = HIDDEN // HEADS
P = "model.layers.{layer}."
E = P + "block_sparse_moe.experts.{expert}."
MISSING_EXPERT = E.format(layer=1, expert=3) + "w2.weight"
NAN_TENSOR = E.format(layer=1, expert=2) + "w1.weight"
INF_TENSOR = "lm_head.weight"
ROUTER = P.format(layer=0) + "block_sparse_moe.gate.weight"
ISSUED_AT = "2026-01-01T00:00:00Z"
ST_DTYPES = {torch.float32: "F32", torch.int32: "I32"}

Tensors = dict[str, torch.Tensor]
Header = dict[str, Any]


# ----- the one good checkpoint ----------------------------------------------------------------


def config() -> dict[str, Any]:
    return {
        "model_type": "mixtral",
        "architectures": ["MixtralForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_local_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "intermediate_size": INTER,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny Mixtral, under transformers' v4 key names."""
    kv = KV_HEADS * HEAD_DIM
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }
    for layer in range(LAYERS):
        p = P.format(layer=layer)
        out |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "block_sparse_moe.gate.weight": (EXPERTS, HIDDEN),
        }
        for expert in range(EXPERTS):
            e = E.format(layer=layer, expert=expert)
            out |= {
                e + "w1.weight": (INTER, HIDDEN),
                e + "w3.weight": (INTER, HIDDEN),
                e + "w2.weight": (HIDDEN, INTER),
            }
    return out


def tensors(seed: int = 0) -> Tensors:
    """Seeded weights: matrices at std 1/sqrt(fan_in) (decisive routing), gains near 1."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(shapes().items()):
        noise = torch.randn(shape, generator=gen)
        out[name] = noise / shape[-1] ** 0.5 if len(shape) == 2 else 1.0 + 0.1 * noise
    return out


# ----- raw safetensors --------------------------------------------------------------------------


def pack(ts: Tensors, metadata: dict[str, str] | None = None) -> bytes:
    """safetensors bytes: keys sorted, data contiguous, header padded to 8 bytes with spaces."""
    header: Header = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, t in sorted(ts.items()):
        raw = t.contiguous().numpy().tobytes()
        header[name] = {
            "dtype": ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    return pack_header(header) + b"".join(blobs)


def pack_header(header: Header) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def split(blob: bytes) -> tuple[Header, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def edit_header(path: Path, change: Callable[[Header], None]) -> None:
    header, data = split(path.read_bytes())
    change(header)
    path.write_bytes(pack_header(header) + data)


def save_checkpoint(path: Path, ts: Tensors, cfg: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg or config(), indent=2) + "\n")
    (path / "model.safetensors").write_bytes(pack(ts, {"format": "pt"}))
    return path


# ----- checkpoints with one defect -------------------------------------------------------------


def _weights(ckpt: Path) -> Path:
    return ckpt / "model.safetensors"


def _truncate_at(offset: Callable[[bytes], int]) -> Callable[[Path], None]:
    def cut(ckpt: Path) -> None:
        blob = _weights(ckpt).read_bytes()
        _weights(ckpt).write_bytes(blob[: offset(blob)])

    return cut


def _header_end(blob: bytes) -> int:
    return 8 + struct.unpack("<Q", blob[:8])[0]


def _header_too_long(ckpt: Path) -> None:
    blob = _weights(ckpt).read_bytes()
    _weights(ckpt).write_bytes(struct.pack("<Q", 2 * len(blob)) + blob[8:])


def _header_not_json(ckpt: Path) -> None:
    blob = _weights(ckpt).read_bytes()
    n = _header_end(blob) - 8
    garbage = (b"<html>this is not a safetensors header</html>" * (n // 40 + 1))[:n]
    _weights(ckpt).write_bytes(blob[:8] + garbage + blob[8 + n :])


def _overlap(ckpt: Path) -> None:
    def change(h: Header) -> None:  # the router starts 4 bytes before its true place
        b, e = h[ROUTER]["data_offsets"]
        h[ROUTER]["data_offsets"] = [b - 4, e - 4]

    edit_header(_weights(ckpt), change)


def _past_end(ckpt: Path) -> None:
    def change(h: Header) -> None:
        size = h[ROUTER]["data_offsets"][1] - h[ROUTER]["data_offsets"][0]
        end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
        h[ROUTER]["data_offsets"] = [end + 64, end + 64 + size]

    edit_header(_weights(ckpt), change)


def _set_entry(key: str, **entry: Any) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        edit_header(_weights(ckpt), lambda h: h[key].update(entry))

    return mutate


def _config(**changes: Any) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        (ckpt / "config.json").write_text(json.dumps({**config(), **changes}, indent=2) + "\n")

    return mutate


def _rewrite(change: Callable[[Tensors], None]) -> Callable[[Path], None]:
    def mutate(ckpt: Path) -> None:
        ts = tensors()
        change(ts)
        _weights(ckpt).write_bytes(pack(ts, {"format": "pt"}))

    return mutate


def _drop_expert(ts: Tensors) -> None:
    del ts[MISSING_EXPERT]


def _extra_tensors(ts: Tensors) -> None:
    ts[E.format(layer=0, expert=EXPERTS) + "w1.weight"] = torch.zeros(INTER, HIDDEN)
    ts["optimizer.step"] = torch.zeros(1)


def _nonfinite(ts: Tensors) -> None:
    ts[NAN_TENSOR][0, 0] = float("nan")
    ts[INF_TENSOR][3, 1] = float("inf")


def _nonfinite_router(ts: Tensors) -> None:  # NaN from the first layer on: every receipt is NaN
    ts[ROUTER][0, 0] = float("nan")


def _shard(ckpt: Path) -> None:
    """Write the weights as two shards and their index (and leave model.safetensors alone)."""
    ts = tensors()
    names = sorted(ts)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    weight_map = {}
    for shard, keys in shards.items():
        (ckpt / shard).write_bytes(pack({k: ts[k] for k in keys}, {"format": "pt"}))
        weight_map |= dict.fromkeys(keys, shard)
    index = {
        "metadata": {"total_size": sum(t.numel() * 4 for t in ts.values())},
        "weight_map": weight_map,
    }
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _missing_shard(ckpt: Path) -> None:
    _shard(ckpt)
    _weights(ckpt).unlink()
    (ckpt / "model-00002-of-00002.safetensors").unlink()


def _header_duplicate_key(ckpt: Path) -> None:
    """The router's entry twice: the second copy points at layer 1's router (same shape). A
    JSON reader keeps one of them; which one is up to the reader."""
    header, data = split(_weights(ckpt).read_bytes())
    other = header[ROUTER.replace("layers.0", "layers.1")]
    text = json.dumps(header, separators=(",", ":"))
    text = text[:-1] + "," + json.dumps(ROUTER) + ":" + json.dumps(other) + "}"
    blob = text.encode() + b" " * (-len(text.encode()) % 8)
    _weights(ckpt).write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def _config_duplicate_key(ckpt: Path) -> None:
    text = json.dumps(config(), indent=2)
    (ckpt / "config.json").write_text(text[:-2] + f',\n  "vocab_size": {VOCAB * 2}\n}}\n')


def _sparse_tail(name: str, size: int) -> Callable[[Path], None]:
    """The file grown to ``size`` bytes by a sparse tail (no disk used): a reader that holds the
    whole file before looking at its size would allocate all of it."""

    def edit(ckpt: Path) -> None:
        if name == "model.safetensors.index.json":
            _shard(ckpt)
            _weights(ckpt).unlink()
        os.truncate(ckpt / name, size)

    return edit


def _file_symlink_loop(ckpt: Path) -> None:
    (ckpt / "extra").mkdir()
    os.symlink("b.safetensors", ckpt / "extra" / "a.safetensors")
    os.symlink("a.safetensors", ckpt / "extra" / "b.safetensors")


def _dir_symlink_loop(ckpt: Path) -> None:
    os.symlink("..", ckpt / "loop", target_is_directory=True)


def _named_pipe(ckpt: Path) -> None:
    os.mkfifo(ckpt / "train.log")  # reading it would block until someone writes


class _Trap:
    """Unpickling this writes ``marker``: the proof that a pickle was (wrongly) loaded."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (Path(self.marker), "a pickle from the checkpoint was executed\n"))


def _pickle_only(ckpt: Path) -> None:
    import pickle

    _weights(ckpt).unlink()
    payload = {"model.embed_tokens.weight": [0.0] * 4, "__trap__": _Trap(ckpt.parent / "PWNED")}
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(payload, protocol=4))


CHECKPOINT_DEFECTS: dict[str, Callable[[Path], None]] = {
    "truncated_empty": _truncate_at(lambda b: 0),
    "truncated_in_length": _truncate_at(lambda b: 5),
    "truncated_in_header": _truncate_at(lambda b: _header_end(b) // 2),
    "truncated_at_data": _truncate_at(_header_end),
    "truncated_in_data": _truncate_at(lambda b: (_header_end(b) + len(b)) // 2),
    "truncated_last_byte": _truncate_at(lambda b: len(b) - 1),
    "header_too_long": _header_too_long,
    "header_not_json": _header_not_json,
    "offsets_overlap": _overlap,
    "offsets_past_end": _past_end,
    "dtype_not_float": _set_entry(ROUTER, dtype="I32"),
    "dtype_size_mismatch": _set_entry(ROUTER, dtype="F16"),
    "shape_contradicts_config": _set_entry(ROUTER, shape=[HIDDEN, EXPERTS]),
    "config_contradicts_shapes": _config(vocab_size=VOCAB + 8),
    "missing_expert": _rewrite(_drop_expert),
    "extra_tensors": _rewrite(_extra_tensors),
    "nonfinite_weights": _rewrite(_nonfinite),
    "nonfinite_router": _rewrite(_nonfinite_router),
    "missing_shard": _missing_shard,
    # model.safetensors and a shard index side by side (docs/decisions.md, "Ambiguous weights")
    "ambiguous_weights": _shard,
    "header_duplicate_key": _header_duplicate_key,
    "config_duplicate_key": _config_duplicate_key,
    "config_no_layers": _config(num_hidden_layers=0),
    "config_huge": _sparse_tail("config.json", 17 << 20),
    "index_huge": _sparse_tail("model.safetensors.index.json", 65 << 20),
    "config_odd_head_dim": _config(head_dim=3),
    "symlink_loop_files": _file_symlink_loop,
    "symlink_loop_dir": _dir_symlink_loop,
    "named_pipe": _named_pipe,
    "pickle_only": _pickle_only,
}


# ----- canaries ---------------------------------------------------------------------------------


def canary_rows(windows: int = 4, length: int = 8, seed: int = 1) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (windows, length), generator=gen).tolist()
    return [{"domain": ("code", "prose")[i % 2], "tokens": row} for i, row in enumerate(tokens)]


def jsonl(rows: list[Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _canary_file(
    path: Path,
    tokens_WT: torch.Tensor,
    ids_W: torch.Tensor,
    domains: list[str],
    digest: str | None = None,
) -> None:
    """A canary file written by hand, so that it can hold what ``canary.save`` refuses."""
    from moeaudit.canary import FORMAT, VERSION, Canary

    if digest is None:
        digest = Canary(tokens_WT, ids_W, tuple(domains)).digest
    meta = {"format": FORMAT, "version": VERSION, "domains": json.dumps(domains), "digest": digest}
    path.write_bytes(pack({"tokens": tokens_WT, "domain_ids": ids_W}, meta))


def write_canaries(good: Path, out: Path) -> dict[str, Path]:
    from moeaudit import canary as canary_mod

    rows = canary_rows()
    (good / "canary.jsonl").write_text(jsonl(rows))
    probe = canary_mod.build_from_jsonl(good / "canary.jsonl")
    tokens, ids = probe.tokens, probe.domain_ids
    # by hand, not canary.save: the safetensors library writes metadata in hash-map order
    _canary_file(good / "canary.safetensors", tokens, ids, list(probe.domains))
    out.mkdir(parents=True, exist_ok=True)
    uneven = [dict(r) for r in rows]
    uneven[2]["tokens"] = uneven[2]["tokens"][:5]
    texts = {
        "empty.jsonl": "",
        "blank_lines.jsonl": "\n  \n\n",
        "unequal_windows.jsonl": jsonl(uneven),
        "out_of_range_id.jsonl": jsonl(rows[:1] + [{"domain": "code", "tokens": [1, -3, 2, 5, 6, 7, 8, 9]}]),
        "not_json.jsonl": jsonl(rows[:1]) + '{"domain": "code", "tokens": [1, 2\n',
    }
    for name, text in texts.items():
        (out / name).write_text(text)
    empty_tokens = torch.zeros((0, 8), dtype=torch.int32)
    _canary_file(
        out / "empty.safetensors",
        empty_tokens,
        torch.zeros(0, dtype=torch.int32),
        ["code"],
        digest="0" * 64,
    )
    oov = tokens.clone()
    oov[1, 5] = VOCAB + 7
    _canary_file(out / "out_of_vocabulary.safetensors", oov, ids, list(probe.domains))
    changed = tokens.clone()
    changed[0, 0] = (changed[0, 0] + 1) % VOCAB
    _canary_file(out / "wrong_digest.safetensors", changed, ids, list(probe.domains), digest=probe.digest)
    (out / "truncated.safetensors").write_bytes((good / "canary.safetensors").read_bytes()[:-9])
    return {f"canary_{p.stem}" if p.suffix == ".jsonl" else f"canary_{p.stem}_file": p for p in sorted(out.iterdir())}


# ----- metrics.jsonl ----------------------------------------------------------------------------


def metrics_lines(steps: int = 6) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(2)
    lines = []
    for s in range(steps):
        norms = (0.5 + torch.rand(LAYERS, EXPERTS, generator=gen)).tolist()
        lines.append(
            {
                "step": 10 * (s + 1),
                "loss": round(3.0 - 0.1 * s, 3),
                "expert_grad_norms": {str(i): [round(g, 5) for g in norms[i]] for i in range(LAYERS)},
            }
        )
    return lines


def write_metrics(good: Path, out: Path) -> dict[str, Path]:
    lines = [json.dumps(x) for x in metrics_lines()]
    (good / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    bad = {
        "not_json": lines[:2] + ['{"step": 30, "loss": 2.8, "expert_grad'] + lines[3:],
        "nan_literal": lines[:2] + [lines[2].replace('"loss": 2.8', '"loss": NaN')] + lines[3:],
        "not_object": lines[:2] + ["[30, 2.8]"] + lines[3:],
        "step_missing": lines[:2] + [lines[2].replace('"step": 30, ', "")] + lines[3:],
        "step_repeated": lines[:3] + [lines[2]] + lines[3:],
        "negative_norm": lines[:2] + [lines[2].replace('"0": [', '"0": [-')] + lines[3:],
        "expert_count_changes": lines[:2] + [lines[2].replace('"0": [', '"0": [0.5, ')] + lines[3:],
        "deep_nesting": lines[:2] + ["[" * 100_000] + lines[3:],  # RecursionError in json
        "empty": [],
    }
    paths = {}
    for name, body in bad.items():
        directory = out / name  # the file keeps its real name, so messages say metrics.jsonl:N
        directory.mkdir()
        (directory / "metrics.jsonl").write_text("".join(line + "\n" for line in body))
        paths[f"metrics_{name}"] = directory / "metrics.jsonl"
    return paths


# ----- policies ---------------------------------------------------------------------------------

POLICIES = {
    "unknown_key": "[envelope]\ndelta = 0.05\ndleta = 0.1\n",
    "unknown_section": "[gate]\ntol_c2 = 0.02\n",
    "policy_table": '[policy]\nstage = "post-training"\n',  # looks meaningful, was ignored
    "wrong_type": '[envelope]\ndelta = "0.05"\n',
    "int_wanted": "[envelope]\nwindow = 10.5\n",
    "section_not_table": "receipts = 3\n",
    "out_of_range": "[envelope]\ndelta = 1.5\n",
    "negative_bootstrap": "[receipts]\nbootstrap = -1\n",
    "huge_bootstrap": "[receipts]\nbootstrap = 1000000000\n",  # 10⁹ resamples: out of memory
    "nan_value": "[margins]\nbeta_h = nan\n",
    "never_fires": "[envelope]\nalert_a = 1e-4\nalert_b = 0.02\n",
    "not_toml": "[envelope\ndelta = 0.05\n",
}


def write_policies(out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in POLICIES.items():
        (out / f"{name}.toml").write_text(text)
        paths[f"policy_{name}"] = out / f"{name}.toml"
    return paths


# ----- certificates -----------------------------------------------------------------------------


def signing_key(seed: bytes) -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519.Ed25519PrivateKey.from_private_bytes(hashlib.sha256(seed).digest())


def _pem(key: Any, private: bool) -> bytes:
    from cryptography.hazmat.primitives import serialization as ser

    if private:
        return key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())
    return key.public_key().public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)


def certificate(key: Any, ckpt_digest: str) -> dict[str, Any]:
    from moeaudit.attest.certificate import sign_statement, statement

    predicate = {"verdict": "PASS", "gates": [], "run": {"name": "run", "path": "run"}}
    stmt = statement([{"name": "checkpoint-100", "digest": {"sha256": ckpt_digest}}], predicate)
    return sign_statement(stmt, key, issued_at=ISSUED_AT)


def _shadowed_verdict(key: Any, ckpt_digest: str) -> dict[str, Any]:
    """Correctly signed, but the statement names "verdict" twice (FAIL, then PASS)."""
    from moeaudit.attest.certificate import canonical_json, statement
    from moeaudit.attest.signing import sign_envelope

    predicate = {"verdict": "FAIL", "gates": [], "run": {"name": "run", "path": "run"}}
    stmt = statement([{"name": "checkpoint-100", "digest": {"sha256": ckpt_digest}}], predicate)
    body = canonical_json(stmt).replace(b'"verdict":"FAIL"', b'"verdict":"FAIL","verdict":"PASS"')
    return sign_envelope(key, body)


def _flip_b64(value: str, index: int) -> str:
    raw = bytearray(base64.b64decode(value))
    raw[index % len(raw)] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


def _flip_payload(env: dict[str, Any]) -> None:
    env["payload"] = _flip_b64(env["payload"], 40)


def _flip_signature(env: dict[str, Any]) -> None:
    env["signatures"][0]["sig"] = _flip_b64(env["signatures"][0]["sig"], 7)


def _wrong_keyid(env: dict[str, Any]) -> None:
    env["signatures"][0]["keyid"] = hashlib.sha256(b"somebody else").hexdigest()


def _swapped_type(env: dict[str, Any]) -> None:
    env["payloadType"] = "application/json"


def _two_signatures(env: dict[str, Any]) -> None:
    env["signatures"].append(dict(env["signatures"][0]))


CERT_DEFECTS: dict[str, Callable[[dict[str, Any]], None]] = {
    "flipped_payload": _flip_payload,
    "flipped_signature": _flip_signature,
    "wrong_keyid": _wrong_keyid,
    "swapped_payload_type": _swapped_type,
    "two_signatures": _two_signatures,
}


def write_certificates(good: Path, out: Path, ckpt_digest: str) -> dict[str, Path]:
    key, other = signing_key(b"moeaudit corpus key"), signing_key(b"someone else's key")
    (good / "key.pem").write_bytes(_pem(key, private=True))
    os.chmod(good / "key.pem", 0o600)
    (good / "key.pub").write_bytes(_pem(key, private=False))
    env = certificate(key, ckpt_digest)
    (good / "certificate.json").write_text(json.dumps(env, indent=2) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, mutate in CERT_DEFECTS.items():
        bad = json.loads(json.dumps(env))
        mutate(bad)
        (out / f"{name}.json").write_text(json.dumps(bad, indent=2) + "\n")
        paths[f"cert_{name}"] = out / f"{name}.json"
    (out / "truncated.json").write_text(json.dumps(env)[:-20])
    paths["cert_truncated"] = out / "truncated.json"
    # a second payloadType before the real one: json.loads keeps the last, other parsers the first
    (out / "duplicate_key.json").write_text('{"payloadType": "text/plain", ' + json.dumps(env)[1:])
    paths["cert_duplicate_key"] = out / "duplicate_key.json"
    (out / "payload_duplicate_key.json").write_text(json.dumps(_shadowed_verdict(key, ckpt_digest)))
    paths["cert_payload_duplicate_key"] = out / "payload_duplicate_key.json"
    (out / "garbage.pub").write_text("-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n")
    paths["pubkey_garbage"] = out / "garbage.pub"
    (out / "wrong.pub").write_bytes(_pem(other, private=False))
    paths["pubkey_wrong"] = out / "wrong.pub"
    return paths


# ----- a run with a checkpoint still being written ----------------------------------------------


def write_runs(good: Path, nonfinite_ckpt: Path, out: Path) -> dict[str, Path]:
    """``writing``: checkpoint-100 complete, checkpoint-300 a link to itself, checkpoint-500
    still being written (config.json there, weights a third written), and the training log.
    ``nonfinite``: one checkpoint with NaN/Inf weights."""
    run = out / "writing"
    shutil.copytree(good / "ckpt", run / "checkpoint-100")
    partial = run / "checkpoint-500"
    partial.mkdir(parents=True)
    shutil.copy(good / "ckpt" / "config.json", partial / "config.json")
    blob = (good / "ckpt" / "model.safetensors").read_bytes()
    (partial / "model.safetensors").write_bytes(blob[: len(blob) // 3])
    shutil.copy(good / "metrics.jsonl", run / "metrics.jsonl")
    os.symlink("checkpoint-300", run / "checkpoint-300")
    shutil.copytree(nonfinite_ckpt, out / "nonfinite" / "checkpoint-100")
    for name, dirs in (
        ("duplicate_step", ("checkpoint-100", "checkpoint-0100")),
        ("non_ascii_step", ("checkpoint-100", "checkpoint-\u0663\u0660\u0660")),
    ):
        for d in dirs:  # checkpoint-٣٠٠: Arabic-Indic digits, which int() reads as 300
            shutil.copytree(good / "ckpt", out / name / d)
    return {
        "run_writing": run,
        "run_nonfinite": out / "nonfinite",
        "run_duplicate_step": out / "duplicate_step",
        "run_non_ascii_step": out / "non_ascii_step",
    }


# ----- everything -------------------------------------------------------------------------------


def build(out: str | Path) -> dict[str, Path]:
    """Write the corpus into ``out`` (created; must be empty or absent); ``{name: path}``."""
    from moeaudit.checkpoint.digest import root_digest

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    good = out / "good"
    ckpt = save_checkpoint(good / "ckpt", tensors())
    paths: dict[str, Path] = {"good_ckpt": ckpt}
    for name, mutate in CHECKPOINT_DEFECTS.items():
        copy = out / "checkpoints" / name
        shutil.copytree(ckpt, copy)
        mutate(copy)
        paths[f"ckpt_{name}"] = copy
    paths |= write_canaries(good, out / "canaries")
    paths |= write_metrics(good, out / "metrics")
    paths |= write_policies(out / "policies")
    (good / "fast.toml").write_text("# for tests: no window bootstrap\n[receipts]\nbootstrap = 0\n")
    paths |= write_certificates(good, out / "certificates", root_digest(ckpt)[0])
    paths |= write_runs(good, paths["ckpt_nonfinite_weights"], out / "runs")
    for name in (
        "fast.toml",
        "canary.safetensors",
        "canary.jsonl",
        "metrics.jsonl",
        "key.pem",
        "key.pub",
        "certificate.json",
    ):
        paths[f"good_{Path(name).stem}_{Path(name).suffix[1:]}"] = good / name
    return paths


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for name, path in sorted(build(argv[0]).items()):
        print(f"{name}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
