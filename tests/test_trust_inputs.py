"""Input side: the bytes certified are the bytes read, names and steps come from the
run, config sizes that would crash later are refused up front, and a large canary is linear.

The checkpoint is the bad-input corpus's tiny Mixtral (``make_bad_inputs``), written into a
temp directory per test; every test that replays uses the policy without window bootstrap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import make_bad_inputs as corpus
import numpy as np
import pytest
from click.testing import CliRunner

from moeaudit import canary as canary_mod
from moeaudit.cache import ReceiptsCache
from moeaudit.checkpoint import Checkpoint
from moeaudit.checkpoint import digest as digest_mod
from moeaudit.cli import cli
from moeaudit.errors import CheckpointError, InputError
from moeaudit.families import spec_from_config
from moeaudit.policy import load_policy
from moeaudit.run import discover

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """good/ckpt (seed 0), good/other.safetensors (same shapes, seed 1), canary, fast policy."""
    root = tmp_path_factory.mktemp("good")
    corpus.save_checkpoint(root / "ckpt", corpus.tensors())
    (root / "other.safetensors").write_bytes(corpus.pack(corpus.tensors(seed=1), {"format": "pt"}))
    corpus.write_canaries(root, root / "canaries")
    (root / "fast.toml").write_text("[receipts]\nbootstrap = 0\n")
    return root


def _copy(good: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    return Path(shutil.copytree(good / "ckpt", tmp_path / name))


def _cli(*args: Any) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stderr


def _one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [x for x in stderr.splitlines() if x.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0]
    return lines[0]


# ----- item 2: hash exactly the bytes that are read --------------------------------------------


def _swap_in(other: Path) -> Any:
    def swap(target: Path) -> None:  # rename over: a new inode under the old name
        shutil.copy(other, target.with_name(".incoming"))
        os.replace(target.with_name(".incoming"), target)

    return swap


def _rewrite_in_place(other: Path) -> Any:
    def rewrite(target: Path) -> None:  # same inode, same size, mtime put back
        st = target.stat()
        with open(target, "r+b") as f:
            f.write(other.read_bytes())
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))

    return rewrite


def _after_hashing(monkeypatch: pytest.MonkeyPatch, target: Path, change: Any) -> list[bool]:
    """Run ``change(target)`` between the digest (taken first) and the replay's reads."""
    import moeaudit.receipts.state as state

    real, done = state.replay, []

    def replay(ckpt: Any, *args: Any, **kwargs: Any) -> Any:
        assert "digest" in vars(ckpt)  # hashed already
        change(target)
        done.append(True)
        return real(ckpt, *args, **kwargs)

    monkeypatch.setattr(state, "replay", replay)
    return done


@pytest.mark.parametrize("how", ["renamed over", "rewritten in place"])
def test_weights_changed_between_hashing_and_reading(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A swap after hashing used to give receipts of file B under file A's digest."""
    ckpt = _copy(good, tmp_path)
    change = (_swap_in if how == "renamed over" else _rewrite_in_place)(good / "other.safetensors")
    done = _after_hashing(monkeypatch, ckpt / WEIGHTS, change)
    out = tmp_path / "out.json"
    code, stderr = _cli(
        "receipts", ckpt, "--canary", good / "canary.safetensors", "--policy", good / "fast.toml", "--json", out
    )
    line = _one_error(stderr)
    assert done and code == 4, line
    assert f"{ckpt / WEIGHTS}: " in line and "changed while it was being audited" in line
    why = "it was replaced by another file" if how == "renamed over" else "it was modified"
    assert why in line and "leave it alone until the audit ends" in line
    assert not out.exists()


def test_change_invisible_to_stat_is_caught_by_rehashing(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Timestamps have the clock's granularity: a rewrite within one tick of the file's last
    change can leave (size, mtime, ctime) as they were. Such "racy" files are hashed again."""
    ckpt = _copy(good, tmp_path)
    frozen = time.time_ns() + 60 * 10**9  # every file looks just written: racy
    real_of = digest_mod.FileId.of.__func__  # type: ignore[attr-defined]

    def coarse(cls: type, st: os.stat_result) -> digest_mod.FileId:
        fid = real_of(cls, st)
        return digest_mod.FileId(fid.dev, fid.ino, fid.size, frozen, frozen, fid.seen_ns)

    monkeypatch.setattr(digest_mod.FileId, "of", classmethod(coarse))
    _after_hashing(monkeypatch, ckpt / WEIGHTS, _rewrite_in_place(good / "other.safetensors"))
    code, stderr = _cli("receipts", ckpt, "--canary", good / "canary.safetensors", "--policy", good / "fast.toml")
    line = _one_error(stderr)
    assert code == 4 and f"{ckpt / WEIGHTS}: changed while" in line
    assert "its bytes no longer hash to the digest" in line


def test_reads_are_pinned_to_the_file_the_header_came_from(good: Path, tmp_path: Path) -> None:
    ckpt = Checkpoint(_copy(good, tmp_path))
    key = corpus.ROUTER
    before = ckpt.read(key).clone()
    _swap_in(good / "other.safetensors")(ckpt.path / WEIGHTS)
    with pytest.raises(CheckpointError, match="replaced by another file") as info:
        ckpt.read(key)
    assert str(ckpt.path / WEIGHTS) in info.value.diagnostics()
    with pytest.raises(CheckpointError, match="replaced by another file"):
        _ = ckpt.digest  # nor can it be hashed as if it were the file the header came from
    assert not before.equal(Checkpoint(ckpt.path).read(key))  # the files really differ


def test_a_file_added_or_config_changed_after_hashing_is_an_error(good: Path, tmp_path: Path) -> None:
    ckpt = Checkpoint(_copy(good, tmp_path))
    _ = ckpt.digest
    ckpt.verify_unchanged()  # nothing changed: quiet
    (ckpt.path / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="it appeared after hashing"):
        ckpt.verify_unchanged()
    (ckpt.path / "trainer_state.json").unlink()
    cfg = ckpt.path / "config.json"
    cfg.write_text(cfg.read_text().replace('"rope_theta": 1000000.0', '"rope_theta": 10000.0'))
    with pytest.raises(CheckpointError, match="config.json: changed while"):
        ckpt.verify_unchanged()


def test_certify_with_a_swap_fails_and_caches_nothing(
    good: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moeaudit.certify import audit_run

    run = tmp_path / "run"
    _copy(good, run, "checkpoint-1")
    swap = _swap_in(good / "other.safetensors")
    _after_hashing(monkeypatch, run / "checkpoint-1" / WEIGHTS, swap)
    cache = ReceiptsCache(tmp_path / "cache")
    probe = canary_mod.load(good / "canary.safetensors")
    with pytest.raises(CheckpointError, match="changed while it was being audited"):
        audit_run(run, probe, load_policy(good / "fast.toml"), cache=cache)
    assert list((tmp_path / "cache").rglob("*.json")) == []  # nothing poisoned


# ----- item 8: steps come from ASCII directory names, one directory per step ------------------


def test_steps(good: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    _copy(good, run, "checkpoint-0100")
    (run / "checkpoint-best").mkdir()  # not a step: ignored as before
    found = discover(run)
    assert found.steps == [100] and found.checkpoints[0][1].path.name == "checkpoint-0100"
    _copy(good, run, "checkpoint-100")
    with pytest.raises(InputError, match="checkpoint-0100 and checkpoint-100 are both step 100"):
        discover(run)
    shutil.rmtree(run / "checkpoint-100")
    _copy(good, run, "checkpoint-\uff15\uff10")  # fullwidth "50"
    with pytest.raises(InputError, match="is not written in ASCII digits 0-9"):
        discover(run)


# ----- item 10: sizes the replay divides by --------------------------------------------------

EVEN = "head size must be even and ≥ 2 (RoPE rotates pairs)"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"hidden_size": 2}, f"{EVEN}; hidden_size 2 // 2 heads = 1"),
        ({"head_dim": 0}, "head_dim must be ≥ 1, got 0"),  # explicit 0: refused, not read as absent
        ({"head_dim": 5}, f"{EVEN}; head_dim 5"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be ≥ 1, got 0"),
        ({"vocab_size": 0}, "vocab_size must be ≥ 1, got 0"),
        ({"intermediate_size": 0}, "the expert intermediate size must be ≥ 1, got 0"),
        ({"rms_norm_eps": -1e-6}, "rms_norm_eps must be ≥ 0"),
    ],
)
def test_config_sizes(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        spec_from_config({**corpus.config(), **changes}, "ckpt/config.json")
    assert info.value.diagnostics().startswith("ckpt/config.json: ")


def test_config_without_a_routed_layer() -> None:
    cfg = {
        "model_type": "qwen2_moe",
        "vocab_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 8,
        "intermediate_size": 8,
        "decoder_sparse_step": 3,
    }
    with pytest.raises(CheckpointError, match="none of the 2 decoder layers is a routed MoE layer"):
        spec_from_config(cfg)
    assert spec_from_config({**cfg, "decoder_sparse_step": 1}).routed_layers == (0, 1)


# ----- item 9: a canary with many domains is linear -----------------------------------------------


def _build_seconds(tmp_path: Path, domains: int) -> float:
    rows = ({"domain": f"d{i}", "tokens": [1, 2]} for i in range(domains))
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    src = tmp_path / f"{domains}.jsonl"
    src.write_text(lines)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        built = canary_mod.build_from_jsonl(src)
        canary_mod.save(built, tmp_path / f"{domains}.safetensors")
        loaded = canary_mod.load(tmp_path / f"{domains}.safetensors")
        best = min(best, time.perf_counter() - start)
    assert len(loaded.domains) == domains and loaded.summary()["domains"][f"d{domains - 1}"] == 1
    return best


def test_many_domains_scale_linearly(tmp_path: Path) -> None:
    """20k domains took 7.4 s (a quadratic name check); 10× the domains must cost ≪ 100×."""
    small, large = _build_seconds(tmp_path, 2_000), _build_seconds(tmp_path, 20_000)
    assert large < 30 * small, (small, large)
    assert large < 2.0, large


def test_canary_tensors_are_views_of_its_arrays() -> None:
    import torch

    probe = canary_mod.Canary(np.array([[1, 2], [3, 4]], dtype=np.int32), np.array([0, 1], dtype=np.int32), ("a", "b"))
    assert probe.tokens.dtype == torch.int32 and probe.tokens.tolist() == [[1, 2], [3, 4]]
    assert probe.windows_of("b").tolist() == [1]
    assert probe == canary_mod.Canary(probe.tokens, probe.domain_ids, probe.domains)
    with pytest.raises(AttributeError):
        probe.domains = ("c", "d")  # type: ignore[misc]
