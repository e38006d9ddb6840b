"""Receipts cache (docs/decisions.md, "Receipts cache"): re-certifying an unchanged run replays nothing, adding one
checkpoint replays only that checkpoint, and cached results equal freshly computed ones.
An entry is trusted only with a valid MAC under the local key; anything else is a
miss and is recomputed; the certificate says what came from the cache; names are the run's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moeaudit import canary as canary_mod
from moeaudit.cache import ReceiptsCache
from moeaudit.certify import audit_run
from moeaudit.policy import Policy
from moeaudit.samples.build import build_samples


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    build_samples(out, "tiny", runs=("healthy",))
    return out


def _certify(run: Path, canary: canary_mod.Canary, cache: ReceiptsCache) -> tuple[dict, list[str]]:
    said: list[str] = []
    audit = audit_run(run, canary, Policy(), say=said.append, cache=cache)
    replayed = [m.removeprefix("replaying ") for m in said if m.startswith("replaying ")]
    return audit.statement["predicate"], replayed


def _stable(pred: dict) -> dict:
    """Less what says how this audit obtained its numbers: what the cache served, and which
    replays carried another's FLOP count rather than being metered (receipts.flop_reuse)."""
    out = {k: v for k, v in pred.items() if k not in ("issued_at", "environment", "from_cache")}
    if "compute" in out:
        replays = [{k: v for k, v in r.items() if k != "flops_from"} for r in out["compute"]["replays"]]
        out["compute"] = {**out["compute"], "replays": replays}
    return out


def test_adding_a_checkpoint_replays_only_it(tiny: Path, tmp_path: Path) -> None:
    canary = canary_mod.load(tiny / "canary.safetensors")
    full = sorted((tiny / "healthy").glob("checkpoint-*"), key=lambda p: int(p.name[11:]))
    assert len(full) == 2
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(tiny / "healthy" / "metrics.jsonl", run / "metrics.jsonl")
    shutil.copytree(full[0], run / full[0].name)
    cache = ReceiptsCache(tmp_path / "cache")

    _, replayed = _certify(run, canary, cache)
    assert replayed == [full[0].name]
    _, replayed = _certify(run, canary, cache)
    assert replayed == []  # unchanged run: nothing replayed

    shutil.copytree(full[1], run / full[1].name)  # the trainer saved one more checkpoint
    incremental, replayed = _certify(run, canary, cache)
    assert replayed == [full[1].name]  # the baseline's states came from the cache

    fresh, replayed = _certify(run, canary, ReceiptsCache(tmp_path / "other", enabled=False))
    assert replayed == [p.name for p in full]
    assert _stable(incremental) == _stable(fresh)  # cached states give the same certificate
    # the same FLOPs; fresh, the second replay carries the first's count, which this audit metered
    assert [r.get("flops_from") for r in fresh["compute"]["replays"]] == [None, f"{full[0].name}.json"]
    assert [r.get("flops_from") for r in incremental["compute"]["replays"]] == [None, None]
    assert incremental["from_cache"] == [  # and the certificate says what was not recomputed
        {"kind": "receipts", "checkpoints": [full[0].name]},
        {"kind": "anchor_states", "checkpoints": [full[0].name]},
    ]
    assert "from_cache" not in fresh


# ----- the cache decides no signed number ---------------------------------------------------


def _one_checkpoint_run(tiny: Path, tmp_path: Path, copies: tuple[str, ...] = ("checkpoint-1",)) -> Path:
    first = sorted((tiny / "healthy").glob("checkpoint-*"), key=lambda p: int(p.name[11:]))[0]
    run = tmp_path / "run"
    run.mkdir()
    for name in copies:
        shutil.copytree(first, run / name)
    return run


def _entries(cache: Path, schema: str) -> list[Path]:
    return [p for p in cache.rglob("*.json") if json.loads(p.read_text()).get("document", {}).get("schema") == schema]


def test_tampered_nll_in_the_cache_is_recomputed(tiny: Path, tmp_path: Path) -> None:
    """Editing a cached receipt (nll → 1.2345) must not reach a certificate."""
    canary = canary_mod.load(tiny / "canary.safetensors")
    run = _one_checkpoint_run(tiny, tmp_path)
    cache = ReceiptsCache(tmp_path / "cache")
    first = audit_run(run, canary, Policy(), cache=cache)
    true_nll = first.receipts["checkpoint-1.json"]["nll"]
    [entry] = _entries(tmp_path / "cache", "moeaudit.receipts/v1")
    doc = json.loads(entry.read_text())
    doc["document"]["nll"] = 1.2345  # the MAC is left as it was
    entry.write_text(json.dumps(doc))

    again = ReceiptsCache(tmp_path / "cache")
    pred, replayed = _certify(run, canary, again)
    assert replayed == ["checkpoint-1"]  # not served: recomputed
    assert again.served == [] and again.misses >= 1
    audit = audit_run(run, canary, Policy(), cache=ReceiptsCache(tmp_path / "cache"))
    assert audit.receipts["checkpoint-1.json"]["nll"] == true_nll != 1.2345
    assert json.loads(entry.read_text())["document"]["nll"] == true_nll  # the entry was rewritten
    assert "from_cache" not in pred


def test_an_entry_signed_with_another_key_is_a_miss(tmp_path: Path) -> None:
    ours, theirs = ReceiptsCache(tmp_path / "a"), ReceiptsCache(tmp_path / "b")
    key = ours.key("receipts", "x")
    theirs.put(key, {"nll": 1.2345})
    forged = tmp_path / "b" / key[:2] / f"{key}.json"
    (tmp_path / "a" / key[:2]).mkdir(parents=True)
    shutil.copy(forged, tmp_path / "a" / key[:2] / f"{key}.json")
    assert ours.get(key) is None and ours.misses == 1
    ours.put(key, {"nll": 2.5})
    assert ours.get(key) == {"nll": 2.5} and ours.served == [key]


BAD_ENTRIES = {
    "not json": lambda key, e: "{not json",
    "not utf-8": lambda key, e: b"\xff\xfe",
    "a list": lambda key, e: "[]",
    "no mac": lambda key, e: json.dumps({"key": key, "document": e["document"]}),
    "mac not a string": lambda key, e: json.dumps({**e, "mac": 7}),
    "document a list": lambda key, e: json.dumps({**e, "document": [1, 2]}),
    "other key": lambda key, e: json.dumps({**e, "key": "0" * 64}),
    "truncated": lambda key, e: json.dumps(e)[:40],
    "value edited": lambda key, e: json.dumps({**e, "document": {**e["document"], "nll": 0.1}}),
    "key added": lambda key, e: json.dumps({**e, "document": {**e["document"], "x": 1}}),
}


@pytest.mark.parametrize("damage", BAD_ENTRIES, ids=list(BAD_ENTRIES))
def test_damaged_json_entries_are_misses(tmp_path: Path, damage: str) -> None:
    cache = ReceiptsCache(tmp_path)
    key = cache.key("receipts", damage)
    cache.put(key, {"nll": 3.0, "layers": [{"layer": 0}]})
    path = tmp_path / key[:2] / f"{key}.json"
    bad = BAD_ENTRIES[damage](key, json.loads(path.read_text()))
    path.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    assert cache.get(key) is None
    assert (cache.hits, cache.misses, cache.served) == (0, 1, [])


def test_a_wrong_shaped_entry_is_a_miss(tmp_path: Path) -> None:
    """A caller's shape check that fails (or raises) makes a miss, never an internal error."""
    cache = ReceiptsCache(tmp_path)
    key = cache.key("receipts", "shape")
    cache.put(key, {"schema": "moeaudit.receipts/v1", "layers": "not a list"})
    assert cache.get(key, check=lambda d: [e["layer"] for e in d["layers"]] == [0]) is None
    assert cache.get(key, check=lambda d: d["no such field"]) is None
    assert cache.get(key, check=lambda d: d["schema"] == "moeaudit.receipts/v1") is not None
    assert cache.misses == 2 and cache.hits == 1


def test_damaged_tensor_entries_are_misses(tmp_path: Path) -> None:
    import torch

    from moeaudit.checkpoint.safetensors import SafetensorsFile, write_safetensors

    cache = ReceiptsCache(tmp_path)
    key = cache.key("states", "x")
    states = {"0.z": torch.arange(6.0).reshape(2, 3), "0.y": torch.ones(2, 3)}
    assert cache.put_tensors(key, states)
    got = cache.get_tensors(key)
    assert got is not None and all(torch.equal(got[k], v) for k, v in states.items())
    path = tmp_path / key[:2] / f"{key}.safetensors"
    meta = SafetensorsFile(path).metadata
    write_safetensors(path, {**states, "0.z": states["0.z"] + 1}, metadata=meta)  # values edited
    assert cache.get_tensors(key) is None
    write_safetensors(path, states, metadata={"key": key})  # MAC removed
    assert cache.get_tensors(key) is None
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # truncated / not ours
    assert cache.get_tensors(key) is None
    assert (cache.hits, cache.misses) == (1, 3)


def test_cache_key_is_created_once_private_and_race_free(tmp_path: Path) -> None:
    import threading

    from moeaudit.cache import load_or_create_secret

    root, barrier, got = tmp_path / "cache", threading.Barrier(12), []

    def create() -> None:
        barrier.wait()
        got.append(load_or_create_secret(root))

    threads = [threading.Thread(target=create) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 12 and len(set(got)) == 1 and len(got[0]) == 32
    assert [p.name for p in root.iterdir()] == ["hmac.key"]  # no temp file left
    assert (root / "hmac.key").stat().st_mode & 0o777 == 0o600
    assert load_or_create_secret(root) == got[0]  # created once, then read


def test_a_key_others_can_read_turns_the_cache_off(tmp_path: Path) -> None:
    cache = ReceiptsCache(tmp_path)
    key = cache.key("receipts", "k")
    cache.put(key, {"nll": 1.0})
    (tmp_path / "hmac.key").chmod(0o644)
    other = ReceiptsCache(tmp_path)
    assert other.get(key) is None
    assert other.problem is not None and "readable or writable by others" in other.problem
    assert "hmac.key" in other.problem and "delete it" in other.problem


def test_identical_checkpoints_keep_their_own_names(tiny: Path, tmp_path: Path) -> None:
    """Byte-identical checkpoints share cache entries (same digest), but the
    names and steps in receipts, gates and pairs are the run's, not the first one cached."""
    canary = canary_mod.load(tiny / "canary.safetensors")
    run = _one_checkpoint_run(tiny, tmp_path, ("checkpoint-1", "checkpoint-2", "checkpoint-3"))
    audit = audit_run(run, canary, Policy(), cache=ReceiptsCache(tmp_path / "cache"))
    for step in (1, 2, 3):
        name = audit.receipts[f"checkpoint-{step}.json"]["checkpoint"]["name"]
        assert name == f"checkpoint-{step}"
    gates = audit.statement["predicate"]["gates"]
    assert [(g["step"], g["receipts"]["checkpoint"]) for g in gates] == [
        (1, "checkpoint-1"),
        (2, "checkpoint-2"),
        (3, "checkpoint-3"),
    ]
    pair = audit.receipts["pair-3-vs-1.json"]
    assert (pair["base_step"], pair["step"]) == (1, 3)
    served = audit.statement["predicate"]["from_cache"]
    assert {"kind": "receipts", "checkpoints": ["checkpoint-2"]} in served


def test_the_nll_interval_is_cached_and_a_tampered_one_recomputed(tiny: Path, tmp_path: Path) -> None:
    """The NLL change's bootstrap interval (numpy) is kept in the cache, so a
    fully cached certify loads no numpy; a forged interval is a miss and is recomputed."""
    canary = canary_mod.load(tiny / "canary.safetensors")
    run = tmp_path / "run"
    for ckpt in (tiny / "healthy").glob("checkpoint-*"):  # two checkpoints with different NLLs
        shutil.copytree(ckpt, run / ckpt.name)
    cold, _ = _certify(run, canary, ReceiptsCache(tmp_path / "cache"))
    warm, replayed = _certify(run, canary, ReceiptsCache(tmp_path / "cache"))
    assert replayed == [] and {"kind": "nll_interval"} in warm["from_cache"]
    ci = cold["gates"][1]["nll_change"]["ci95"]
    assert ci is not None and ci[0] < ci[1] and warm["gates"][1]["nll_change"]["ci95"] == ci

    [entry] = [
        p for p in (tmp_path / "cache").rglob("*.json") if set(json.loads(p.read_text())["document"]) == {"ci95"}
    ]
    doc = json.loads(entry.read_text())
    doc["document"]["ci95"] = [-9.0, -8.0]  # "clearly improving"; the MAC is left as it was
    entry.write_text(json.dumps(doc))
    again, _ = _certify(run, canary, ReceiptsCache(tmp_path / "cache"))
    assert again["gates"][1]["nll_change"]["ci95"] == ci
    assert {"kind": "nll_interval"} not in again["from_cache"]
