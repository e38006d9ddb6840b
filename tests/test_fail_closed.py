"""Fail closed on anything not replayed.

* A tensor the family's replay does not read is an input error (exit 4) naming it — a few names,
  then a count — unless it is on the family's documented ignore list (rotary ``inv_freq``
  buffers, multi-token-prediction modules, a VL checkpoint's vision tower); what is ignored is
  listed in the receipts and changes no number.
* A ``config.json`` setting that changes the math and is not implemented is refused by name,
  and the message says moeaudit lacks the feature, not that the checkpoint is wrong.
* An explicit 0 is never read as "absent, take the default" (``rope_theta: 0``, ``head_dim: 0``…).

DeepSeek-V2 with ``mlp_bias: true`` used to exit 0 with "9 unexpected tensor(s) ignored" and
receipts 44 % off; it is the first case below.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from hfmodels import DEEPSEEK, FAMILIES, NEW_FAMILIES, random_tokens, save_tiny, tiny_config  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moeaudit.checkpoint import Checkpoint  # noqa: E402
from moeaudit.cli import cli  # noqa: E402
from moeaudit.errors import EXIT_INPUT, CheckpointError  # noqa: E402
from moeaudit.families import spec_from_config  # noqa: E402
from moeaudit.replay import replay  # noqa: E402

ALL = (*FAMILIES, *DEEPSEEK, "deepseek_v32", *NEW_FAMILIES, "qwen3_next", "qwen3_5_moe_text")
SAMPLES = Path(__file__).resolve().parents[1] / "sample_checkpoints"
LIMIT = "a limit of moeaudit, not a fault of the checkpoint"

Tensors = dict[str, torch.Tensor]


def edited(
    src: Path,
    dst: Path,
    tensors: Callable[[Tensors], Tensors] | None = None,
    config: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Path:
    """A copy of the single-file checkpoint ``src`` with its tensors and/or config rewritten."""
    shutil.copytree(src, dst)
    if tensors is not None:
        t = tensors(load_file(str(src / "model.safetensors")))
        save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def invoke(*args: str | Path) -> tuple[int, str]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    return result.exit_code, result.stderr


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOEAUDIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))


def one_error(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("moeaudit: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


# ----- tensors the replay does not read -----------------------------------------------------------


EXTRA = (
    "model.layers.0.mlp.extra_proj.weight",
    "model.layers.1.self_attn.lora_A.weight",
    "model.layers.1.self_attn.lora_B.weight",
    "optimizer.state.step",
)


@pytest.mark.parametrize("family", ALL)
def test_a_tensor_the_family_does_not_read_is_refused_by_name(family: str, hf_checkpoint, tmp_path: Path) -> None:
    def add(t: Tensors) -> Tensors:
        return {**t, **{k: torch.zeros(2, 2) for k in EXTRA}}

    ckpt = edited(hf_checkpoint(family), tmp_path / "ckpt", add)
    code, stderr = invoke("inspect", ckpt)
    line = one_error(stderr)
    assert code == EXIT_INPUT, line
    assert (
        f"{ckpt}: 4 tensor(s) that moeaudit's {family} replay does not use: model.layers.0.mlp.extra_proj.weight, "
        "model.layers.1.self_attn.lora_A.weight, model.layers.1.self_attn.lora_B.weight and 1 more"
    ) in line
    assert "moeaudit does not replay them yet" in line and len(line) < 600


def test_deepseek_v2_mlp_bias_is_refused_by_its_config_key_and_by_its_tensors(tmp_path: Path) -> None:
    """The issue's case: with ``mlp_bias: true`` the config is refused by name; with the key
    removed, the nine bias tensors (dense MLP and shared experts: 3 × 3) are."""
    save_tiny(tmp_path / "v2", "deepseek_v2", mlp_bias=True)
    code, stderr = invoke("inspect", tmp_path / "v2")
    line = one_error(stderr)
    assert code == EXIT_INPUT
    assert "moeaudit does not replay mlp_bias=true for deepseek_v2 yet" in line and LIMIT in line

    def drop(cfg: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in cfg.items() if k != "mlp_bias"}

    stripped = edited(tmp_path / "v2", tmp_path / "stripped", config=drop)
    with pytest.raises(
        CheckpointError,
        match=r"(\d+) tensor\(s\) that moeaudit's deepseek_v2 replay does not use: "
        r"model\.layers\.0\.mlp\.down_proj\.bias",
    ) as err:
        Checkpoint(stripped)
    assert int(str(err.value).split(": ", 2)[1].split(" ")[0]) == len(
        [k for k in load_file(str(stripped / "model.safetensors")) if k.endswith(".bias")]
    )


def test_a_huge_tensor_name_keeps_the_error_one_short_line(hf_checkpoint, tmp_path: Path) -> None:
    ckpt = edited(hf_checkpoint("mixtral"), tmp_path / "ckpt", lambda t: {**t, "x" * 5000: torch.zeros(1)})
    code, stderr = invoke("inspect", ckpt)
    line = one_error(stderr)
    assert code == EXIT_INPUT and "x" * 119 + "…" in line and len(line) < 600


def test_receipts_refuse_it_too_and_write_nothing(hf_checkpoint, tmp_path: Path) -> None:
    ckpt = edited(hf_checkpoint("mixtral"), tmp_path / "ckpt", lambda t: {**t, "model.extra": torch.zeros(1)})
    out = tmp_path / "receipts.json"
    code, stderr = invoke("receipts", ckpt, "--canary", SAMPLES / "canary.safetensors", "--json", out)
    assert code == EXIT_INPUT and "model.extra" in one_error(stderr)
    assert not out.exists()


# ----- the ignore list -----------------------------------------------------------------------------


def _inv_freq(t: Tensors) -> Tensors:
    """What older transformers versions saved: a RoPE buffer per layer, and one at the model."""
    extra = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(3)}
    return {**t, **extra, "model.rotary_emb.inv_freq": torch.ones(4)}


def _mtp_layer(n: int) -> Callable[[Tensors], Tensors]:
    def add(t: Tensors) -> Tensors:  # DeepSeek-V3's layer 61 (here n): a copy of the last layer and its fusion
        out = {
            **t,
            **{
                k.replace(f"layers.{n - 1}.", f"layers.{n}."): v.clone()
                for k, v in t.items()
                if k.startswith(f"model.layers.{n - 1}.")
            },
        }
        return {
            **out,
            f"model.layers.{n}.eh_proj.weight": torch.zeros(32, 64),
            f"model.layers.{n}.enorm.weight": torch.ones(32),
        }

    return add


def _ernie_mtp(t: Tensors) -> Tensors:
    """ERNIE 4.5's released MTP module (transformers ignores every key containing "mtp")."""
    return {
        **t,
        "model.mtp_block.0.self_attn.q_proj.weight": torch.zeros(32, 32),
        "model.mtp_emb_norm.0.weight": torch.ones(32),
        "model.mtp_hidden_norm.0.weight": torch.ones(32),
        "model.mtp_linear_proj.0.weight": torch.zeros(32, 64),
    }


def _with_mtp(count: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda cfg: {**cfg, "num_nextn_predict_layers": count}


IGNORED: dict[str, tuple[str, Callable[[Tensors], Tensors], Any, str, int]] = {
    # case: family, tensors added, config edit, what the receipts call them, how many
    "rotary-buffers": ("mixtral", _inv_freq, None, "rotary inv_freq buffers", 4),
    "deepseek_v3-mtp": ("deepseek_v3", _mtp_layer(3), _with_mtp(1), "multi-token-prediction layer(s) 3", 0),
    "glm4_moe-mtp": ("glm4_moe", _mtp_layer(3), _with_mtp(1), "multi-token-prediction layer(s) 3", 0),
    "ernie-mtp": ("ernie4_5_moe", _ernie_mtp, None, "multi-token-prediction module model.mtp_*", 4),
    "qwen3_next-mtp": (
        "qwen3_next",
        lambda t: {**t, "mtp.fc.weight": torch.zeros(32, 64), "mtp.norm.weight": torch.ones(32)},
        None,
        "multi-token-prediction module mtp.*",
        2,
    ),
}


@pytest.mark.parametrize("case", IGNORED)
def test_the_ignore_list_is_honoured_and_listed_in_the_receipts(case: str, hf_checkpoint, tmp_path: Path) -> None:
    family, add, config, what, count = IGNORED[case]
    src = hf_checkpoint(family)
    with_extra = edited(src, tmp_path / "ckpt", add, config)
    added = len(load_file(str(with_extra / "model.safetensors"))) - len(load_file(str(src / "model.safetensors")))
    ckpt = Checkpoint(with_extra)
    assert [x.what for x in ckpt.left_out] == [what]
    assert len(ckpt.left_out[0].keys) == (count or added)
    tokens = random_tokens()
    assert replay(ckpt, tokens).nll == replay(Checkpoint(src), tokens).nll  # nothing left out was needed
    out = tmp_path / "receipts.json"
    policy = tmp_path / "fast.toml"
    policy.write_text("[receipts]\nbootstrap = 0\n")
    code, stderr = invoke(
        "receipts", with_extra, "--canary", SAMPLES / "canary.safetensors", "--policy", policy, "--json", out
    )
    assert code == 0, stderr
    assert f"note: {with_extra}: {what} ({count or added} tensors) left out" in stderr
    listed = json.loads(out.read_text())["checkpoint"]["left_out"]
    assert listed == [
        {
            "what": what,
            "reason": ckpt.left_out[0].reason,
            "tensors": count or added,
            "names": sorted(ckpt.left_out[0].keys)[:5],
        }
    ]


def test_receipts_of_a_checkpoint_without_ignored_tensors_have_no_left_out_field(tmp_path: Path) -> None:
    """The field appears only when something was left out: older receipts keep their bytes."""
    out = tmp_path / "receipts.json"
    policy = tmp_path / "fast.toml"
    policy.write_text("[receipts]\nbootstrap = 0\n")
    code, _ = invoke("receipts", SAMPLES / "healthy" / "checkpoint-250", "--policy", policy, "--json", out)
    assert code == 0 and "left_out" not in json.loads(out.read_text())["checkpoint"]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_layers_beyond_the_declared_mtp_modules_are_refused(family: str, hf_checkpoint, tmp_path: Path) -> None:
    """Only layers N … N + num_nextn_predict_layers − 1 are MTP modules; a layer past them (or
    any when the config declares none) is a tensor the replay does not read."""
    src = hf_checkpoint(family)
    cases = {"none-declared": (_mtp_layer(3), 0, 3), "one-too-many": (lambda t: _mtp_layer(4)(_mtp_layer(3)(t)), 1, 4)}
    for name, (add, declared, refused) in cases.items():
        ckpt = edited(src, tmp_path / name, add, _with_mtp(declared))
        with pytest.raises(CheckpointError, match=f"replay does not use: model.layers.{refused}."):
            Checkpoint(ckpt)


# ----- config settings that change the math --------------------------------------------------------


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=true for deepseek_v2"),
    ("deepseek_v32", {"mlp_bias": True}, "mlp_bias=true for deepseek_v32"),
    ("mixtral", {"mlp_bias": True}, "mlp_bias=true for mixtral"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=true for deepseek_v2"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, 'scoring_func="sigmoid" for deepseek_v2'),
    ("deepseek_v3", {"scoring_func": "softmax"}, 'scoring_func="softmax" for deepseek_v3'),
    ("deepseek_v3", {"topk_method": "greedy"}, 'topk_method="greedy" for deepseek_v3'),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2 for deepseek_v3"),
    (
        "deepseek_v32",
        {"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]},
        "layer_types ['full_attention'] for deepseek_v32",
    ),
    ("ernie4_5_moe", {"use_bias": True}, "use_bias=true for ernie4_5_moe"),
    ("minimax_m2", {"scoring_func": "softmax"}, 'scoring_func="softmax" for minimax_m2'),
    ("minimax_m2", {"use_routing_bias": False}, "use_routing_bias=false for minimax_m2"),
    ("minimax_m2", {"qk_norm_type": "per_head"}, 'qk_norm_type="per_head" for minimax_m2'),
    ("minimax_m2", {"attn_type_list": [1, 0, 1]}, "attn_type_list values other than 1 for minimax_m2"),
    ("hunyuan_v1_moe", {"use_cla": True}, "use_cla=true for hunyuan_v1_moe"),
    *(
        (
            family,
            {"quantization_config": {"quant_method": method, "bits": 4}},
            f'{family} weights quantised with quantization_config quant_method="{method}"',
        )
        for family, method in (
            ("mixtral", "gptq"),
            ("qwen3_moe", "awq"),
            ("olmoe", "bitsandbytes"),
            ("deepseek_v3", "compressed-tensors"),
        )
    ),
    ("mixtral", {"quantization_config": {"load_in_4bit": True}}, "quantization_config an unrecognised format"),
]


@pytest.mark.parametrize("family, change, message", REFUSED, ids=[f"{f}-{next(iter(c))}" for f, c, _ in REFUSED])
def test_a_setting_that_changes_the_math_and_is_not_replayed_is_refused_by_name(
    family: str, change: dict[str, Any], message: str
) -> None:
    cfg = tiny_config(family).to_dict()
    with pytest.raises(CheckpointError) as err:
        spec_from_config({**cfg, **change}, "ckpt/config.json")
    line = err.value.diagnostics()
    assert line.startswith("ckpt/config.json: moeaudit does not ") and message in line and "yet" in line
    assert "limit of moeaudit" in line or "audit the unquantised checkpoint" in line
    for blame in ("invalid", "corrupt", "malformed", "must be"):
        assert blame not in line


ACCEPTED: list[tuple[str, dict[str, Any]]] = [  # the released configs' values of those keys
    ("deepseek_v2", {"mlp_bias": False, "norm_topk_prob": False, "scoring_func": "softmax", "moe_layer_freq": 1}),
    (
        "deepseek_v3",
        {
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "moe_layer_freq": 1,
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "weight_block_size": [128, 128],
                "activation_scheme": "dynamic",
            },
        },
    ),
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}),
    (
        "minimax_m2",
        {
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "qk_norm_type": "per_layer",
            "attn_type_list": [1, 1, 1],
            "use_qk_norm": True,
        },
    ),
    ("hunyuan_v1_moe", {"use_cla": False, "use_mixed_mlp_moe": True, "use_qk_norm": True}),
    ("ernie4_5_moe", {"use_bias": False, "moe_norm_min": 1e-12}),
    ("deepseek_v32", {"layer_types": ["indexed_attention"] * 3}),
]


@pytest.mark.parametrize("family, change", ACCEPTED, ids=[f for f, _ in ACCEPTED])
def test_the_released_values_of_those_settings_are_accepted(family: str, change: dict[str, Any]) -> None:
    spec_from_config({**tiny_config(family).to_dict(), **change})


def test_a_refused_setting_exits_4_from_the_cli(hf_checkpoint, tmp_path: Path) -> None:
    ckpt = edited(
        hf_checkpoint("qwen3_moe"),
        tmp_path / "gptq",
        config=lambda cfg: {**cfg, "quantization_config": {"quant_method": "gptq", "bits": 4}},
    )
    code, stderr = invoke("inspect", ckpt)
    assert code == EXIT_INPUT
    assert (
        'moeaudit does not read qwen3_moe weights quantised with quantization_config quant_method="gptq" yet'
        in one_error(stderr)
    )


# ----- an explicit 0 is not "absent" ---------------------------------------------------------------


ZEROS: list[tuple[str, dict[str, Any], str]] = [
    ("mixtral", {"rope_theta": 0}, "rope_theta must be a positive number, got 0"),
    (
        "mixtral",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
        "rope_theta must be a positive number, got 0.0",
    ),
    ("qwen3_moe", {"head_dim": 0}, "head_dim must be ≥ 1, got 0"),
    ("olmoe", {"num_key_value_heads": 0}, "'num_key_value_heads' must be ≥ 1, got 0"),
    ("mixtral", {"sliding_window": 0}, "sliding_window must be a positive integer or null, got 0"),
    (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "beta_fast": 0,
                "original_max_position_embeddings": 16,
            }
        },
        "YaRN beta_fast and beta_slow must be positive",
    ),
    (
        "deepseek_v3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "mscale": 0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 16,
            }
        },
        "YaRN mscale=0 is ambiguous",
    ),
    (
        "phimoe",
        {
            "original_max_position_embeddings": 0,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * 4,
                "long_factor": [1.0] * 4,
                "short_mscale": 1.0,
                "long_mscale": 1.0,
                "original_max_position_embeddings": 64,
            },
        },
        "longrope needs original_max_position_embeddings, got 0",
    ),
]


@pytest.mark.parametrize("family, change, message", ZEROS, ids=[f"{f}-{next(iter(c))}" for f, c, _ in ZEROS])
def test_an_explicit_zero_is_refused_not_replaced_by_a_default(
    family: str, change: dict[str, Any], message: str
) -> None:
    rope = {"rope_theta", "rope_parameters"} & change.keys()  # the change alone says the RoPE
    cfg = {
        k: v
        for k, v in tiny_config(family).to_dict().items()
        if not (rope and k in ("rope_parameters", "rope_scaling"))
    }
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_config({**cfg, **change})


@pytest.mark.parametrize("family, default", [("mixtral", 1e6), ("olmoe", 1e4), ("minimax_m2", 5e6)])
def test_only_an_absent_or_null_rope_theta_takes_the_family_default(family: str, default: float) -> None:
    cfg = {k: v for k, v in tiny_config(family).to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    assert spec_from_config(cfg).rope.theta == default
    assert spec_from_config({**cfg, "rope_theta": None}).rope.theta == default
    assert spec_from_config({**cfg, "rope_theta": 123.0}).rope.theta == 123.0
    # a v5 rope_parameters without a θ falls back to the top-level key, then to the default
    assert spec_from_config({**cfg, "rope_parameters": {"rope_type": "default"}, "rope_theta": 7.0}).rope.theta == 7.0


# ----- settings implemented rather than refused (checked against transformers) ---------------------


def test_deepseek_v32_mlp_layer_types_are_replayed(tmp_path: Path) -> None:
    """save_pretrained always writes ``mlp_layer_types``; any dense/sparse pattern is replayed,
    not only the first-k-dense one it defaults to."""
    from hfmodels import load
    from support.oracle import transformers_observed
    from support.oracle_deepseek import assert_agree_deepseek, observed

    save_tiny(tmp_path, "deepseek_v32", mlp_layer_types=["sparse", "dense", "sparse"])
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.routed_layers == (0, 2)
    tokens = random_tokens()
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), observed(ckpt, tokens), ckpt)
    bad = {**tiny_config("deepseek_v32").to_dict(), "mlp_layer_types": ["sparse", "moe", "sparse"]}
    with pytest.raises(CheckpointError, match="mlp_layer_types must list 3 layers, each 'dense' or 'sparse'"):
        spec_from_config(bad)


def test_ernie_moe_norm_min_is_replayed(tmp_path: Path) -> None:
    """ERNIE divides the chosen probabilities by max(Σ, moe_norm_min); with a floor above most
    tokens' sums the clamp acts, and the replay still agrees with transformers."""
    from hfmodels import load
    from support.oracle import transformers_observed
    from support.oracle_deepseek import assert_agree_deepseek, observed

    save_tiny(tmp_path, "ernie4_5_moe", moe_norm_min=0.5)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.spec.settings.renorm_min == 0.5
    tokens = random_tokens()
    ours = observed(ckpt, tokens)
    clamped = [float((c.sum(-1) < 0.999).float().mean()) for c in ours.combine.values()]
    assert max(clamped) > 0.2, clamped  # the floor binds for a share of the tokens
    assert_agree_deepseek(transformers_observed(load(tmp_path), tokens), ours, ckpt)
