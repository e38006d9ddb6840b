"""Sarvam-105B (``sarvam_mla``): transformers builds it as DeepSeek-V3 (``DeepseekV3ForCausalLM``)
from its own configuration class, so the replay is :mod:`deepseek_v3`'s with Sarvam's defaults:
one group (``n_group`` = ``topk_group`` = 1: top-k over all experts), one dense first layer, a
plain query projection (``q_lora_rank`` null), 128 experts, no MTP module. The original
config's format is read as ``SarvamMLAConfig`` converts it: ``num_experts`` /
``num_shared_experts`` are the DeepSeek names, a ``deepseek_yarn`` RoPE is YaRN, and ``head_dim``
(written there as ``kv_lora_rank + qk_rope_head_dim`` for vLLM) is derived, not read."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from moeaudit.families import deepseek_v3
from moeaudit.families.base import Ctx, Family, first_k_dense, mtp_count, parse_mla, renamed, v3_gate

# SarvamMLAConfig.attribute_map: the original sarvamai/sarvam-105b names → DeepSeek-V3's
ALIASES = {
    "num_experts": "n_routed_experts",
    "num_shared_experts": "n_shared_experts",
    "num_mtp_layers": "num_nextn_predict_layers",
}


def _canonical(cfg: dict[str, Any], path: Path | str) -> dict[str, Any]:
    """``SarvamMLAConfig.__post_init__``'s translation of the original format (aliases, the
    ``deepseek_yarn`` RoPE, the derived ``head_dim``); an alias and its name with different
    values are refused."""
    out = renamed(cfg, path, ALIASES)
    out.pop("head_dim", None)
    out.pop("q_head_dim", None)
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
        del out["rope_scaling"]
        out["rope_parameters"] = {**{k: v for k, v in scaling.items() if k != "type"}, "rope_type": "yarn"}
    return out


def _fields(c: Ctx) -> dict[str, Any]:
    return {
        **deepseek_v3.FAMILY.fields(c),
        "routed_layers": first_k_dense(c, 1),
        "gate": v3_gate(c, n_group=1, topk_group=1, scaling=2.5),
        "mtp_layers": mtp_count(c, 0),
    }


FAMILY = Family(
    name="sarvam_mla",
    layout=dataclasses.replace(deepseek_v3.LAYOUT, family="sarvam_mla"),
    fields=_fields,
    expert_count_keys=("n_routed_experts", "num_local_experts"),
    mla=parse_mla,
    torchtitan=deepseek_v3.FAMILY.torchtitan,
    refuse=deepseek_v3.REFUSE,
    decoder_config=_canonical,
)
