"""The model families moeaudit replays, one module each, discovered at import.

Adding a family is adding ``moeaudit/families/<model_type>.py`` with ``FAMILY = Family(...)``
(see :mod:`moeaudit.families.base` and ``docs/families.md``). ``REFUSED`` names the MoE
architectures we know and cannot replay faithfully, each with its reason; a family file for a
model type listed there takes precedence (the entry is then stale and ignored).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from typing import Any

from moeaudit.errors import CheckpointError
from moeaudit.families.base import Family, build_spec
from moeaudit.spec.config import LAYOUTS, ModelSpec

_NOT_FAMILIES = {"base"}
# the families that predate the registry keep their order (hints, hooks' layout search); new
# ones follow alphabetically
_FIRST = ("mixtral", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v3", "deepseek_v2")


def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        fam = getattr(module, "FAMILY", None)
        if not isinstance(fam, Family):
            raise TypeError(f"{module.__name__} defines no FAMILY = Family(...)")
        if fam.name != info.name or fam.layout.family != info.name:
            raise TypeError(f"{module.__name__}: FAMILY name {fam.name!r} differs from its file name")
        found[fam.name] = fam
    order = sorted(found, key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n))
    return {n: found[n] for n in order}


FAMILIES: dict[str, Family] = _discover()
LAYOUTS.update({n: f.layout for n, f in FAMILIES.items()})  # ModelSpec.layout reads these
# family → the config keys transformers accepts for its expert count
EXPERT_COUNT_KEYS: dict[str, tuple[str, ...]] = {n: f.expert_count_keys for n, f in FAMILIES.items()}

# model_type → why it cannot be replayed (one line), for every MoE model type transformers 5.24
# ships that has no family file (tests/test_family_inventory.py walks transformers' registry and
# holds this list to it). A family file for a listed type takes precedence: the entry is then
# stale and ignored. Each reason names what the replay lacks, concretely.
_SUBCONFIG = "a sub-configuration of {0}: checkpoints carry model_type {0!r}"
_GEMMA4 = (
    "its experts run beside a dense MLP on separately normed inputs, under a router with its own weightless "
    "RMS norm and learned per-channel and per-expert scales; its full-attention layers have their own head "
    "size, KV heads and partial RoPE, and it can share KV across layers and add per-layer input embeddings; "
    "the replay has one attention geometry and none of these"
)
_QWEN4_EXP = (
    "it keeps hc_count residual streams mixed by gated hyper-connections, adds hashed n-gram embeddings (PLE) "
    "in chosen layers, and can restrict its full-attention layers to the keys a block-compressed indexer (QSA) "
    "selects; the replay has none of these (its gated DeltaNet and MoE block it has)"
)
_REFUSED_ALL: dict[str, str] = {
    # --- state-space hybrids
    "zaya": "its attention is compressed convolutional attention (q and k mixed by causal convolutions, half "
    "of each value head taken from the previous token, L2-normalised q and k with a learned key scale) and its "
    "router is an MLP over a down-projected state carried over from the previous layer's router, with a skip "
    "expert and learned scales and biases on both residual branches; the replay has none of these",
    # --- routed designs whose pieces the replay lacks
    "deepseek_v4": "its pieces agree with transformers, composed as a whole model too (Sinkhorn "
    "hyper-connections, sliding-window attention with HCA/CSA compressed branches and their indexer, YaRN on "
    "the compressed RoPE, the sqrt-softplus and hash routers, clamped experts and shared expert), but the "
    "replay's engine does not run them: no spec fields or tensor names for V4's attention, the checkpoint "
    "reader does not read the hash layers' integer token-id table (tid2eid), and the MoE block, its backward "
    "recompute and the receipts are not given the token ids hash layers route by",
    # --- vision-language / omni models whose text decoder is not a replayed family
    "ernie4_5_vl_moe_text": _SUBCONFIG.format("ernie4_5_vl_moe"),
    "hy_v4_vl_text": _SUBCONFIG.format("hy_v4_vl"),
    "glm5_next": "a vision-language model: its text decoder mixes hc_mult residual streams by Sinkhorn "
    "hyper-connections (DeepSeek-V4's), and its NoPE MLA layers, between KDA layers, attend to the pooled key "
    "blocks a DSA indexer selects (later layers may reuse the selection); the replay has neither the "
    "hyper-connections nor the pooled key selection",
    "glm5_next_text": _SUBCONFIG.format("glm5_next"),
    "dots3_note": "a multimodal model: its text decoder gives its sliding-window MLA layers their own geometry "
    "and RoPE (head counts, LoRA ranks and head sizes per layer type, θ 50000 against 80000000 on the DSA "
    "layers), RMS-normalises the RoPE key and gates each head's output by a sigmoid; the replay has one "
    "attention geometry and one RoPE table, and neither of the other two",
    "dots3_note_text": _SUBCONFIG.format("dots3_note"),
    "dots3_note_vision_encoder": "a MoE vision encoder (image patches, not tokens): moeaudit audits "
    "language-model decoders",
    "mistral_large4": "a vision-language model: its text decoder (MLA without a query LoRA, DeepSeek sparse "
    "attention) scales each head's queries by a learned a·log(pos + 1) + b, lets layers reuse an earlier "
    "layer's latent KV and DSA key selection, and soft-caps its logits; the replay has none of these",
    "mistral_large4_text": _SUBCONFIG.format("mistral_large4"),
    "minimax_m3_vl": "a vision-language model: its text decoder (MiniMax-M2's attention with zero-centred "
    "norms) runs gpt-oss's clamped GLU in its shared expert and dense MLPs too, and its sparse layers attend "
    "only to the key blocks a max-pooling block indexer selects; the replay has the clamped GLU for routed "
    "experts only, and no block indexer",
    "minimax_m3_vl_text": _SUBCONFIG.format("minimax_m3_vl"),
    "muse_spark": "a multimodal model: its text decoder's experts work in a smaller space (they read a normed "
    "projection of the block input, each expert's output is RMS-normalised, the sum is projected back) and "
    "each block joins the residual stream through learned gates (α·x + β·f(x)); the replay has neither",
    "muse_spark_text": _SUBCONFIG.format("muse_spark"),
    "inkling_mm_model": "a multimodal model: its text decoder has no RoPE but a token-conditioned relative "
    "position bias, short convolutions on keys, values and every block's output, sliding-window layers with "
    "their own head counts, and shared experts scored with the routed ones in one normalisation (sinks); the "
    "replay has none of these",
    "inkling_text": _SUBCONFIG.format("inkling_mm_model"),
    "inkling2": "a vision-language model: its text decoder feeds each block a learned attention over earlier "
    "blocks' outputs (block attention residuals) instead of one residual stream, keeps Inkling's relative "
    "position bias and short convolutions, and soft-caps its experts' SwiGLU; the replay has none of these",
    "inkling2_text": _SUBCONFIG.format("inkling2"),
    "inkling2_loop": "a vision-language model: Inkling2's text decoder (block attention residuals, relative "
    "position bias, short convolutions) with a core of layers run loop_num_passes times, the passes joined by "
    "gated messages; the replay has none of these and runs each layer once",
    "inkling2_loop_text": _SUBCONFIG.format("inkling2_loop"),
    "deepseek_ocr2_text": _SUBCONFIG.format("deepseek_ocr2"),
    "unlimited_ocr_text": _SUBCONFIG.format("unlimited_ocr"),
    "qwen4_exp": "a vision-language model whose text decoder is qwen4_exp_text's: " + _QWEN4_EXP,
    "qwen4_exp_text": _QWEN4_EXP,
    "qwen3_omni_moe_talker_text": "the talker (speech-code generator) of qwen3_omni_moe: moeaudit "
    "audits the thinker's text decoder",
    # --- not causal decoders
    "switch_transformers": "an encoder-decoder model (T5 layout); moeaudit replays decoders",
    "nllb-moe": "an encoder-decoder translation model; moeaudit replays decoders",
    "openai_privacy_filter": "a bidirectional token-classification encoder (gpt-oss blocks without "
    "a causal mask or an LM head); moeaudit replays causal decoders",
    "diffusion_gemma": "a diffusion (non-autoregressive) encoder-decoder: there is no next-token loss to replay",
    "diffusion_gemma_text": _SUBCONFIG.format("diffusion_gemma"),
    "vitpose": "a pose-estimation vision model: its experts are chosen by dataset index, not routed "
    "per token, and there is no language model",
    "vitpose_backbone": "a pose-estimation vision backbone: its experts are chosen by dataset "
    "index, not routed per token",
    "doge": "its attention adds a learned per-key bias to the logits and keeps only the keep_window_size best "
    "keys (dynamic mask attention), its residual adds have learned per-channel gains, and its MoE block "
    "retrieves single-neuron experts stored as embedding rows by product keys, beside a dense MLP; the replay "
    "has none of these",
    # --- other designs
    "gemma4": "a multimodal model whose text decoder is gemma4_text's: " + _GEMMA4,
    "gemma4_text": _GEMMA4,
    "gemma4_assistant": "a Gemma 4 speculative-decoding drafter: it reads the target model's hidden states and "
    "stored keys and values instead of tokens, so a checkpoint alone has no next-token loss to replay",
    "axk2": "its block norms before attention and before each MoE block are gated (RMSNorm(h) times a low-rank "
    "sigmoid gate of itself), and its MLA query comes from one fused q/gate projection of the normed and raw "
    "query latents, with a sigmoid gate on the attention output; the replay has neither (its DeepSeek-V3.2 "
    "sparse attention and routing it has)",
    "beam": "its residual adds are depth-scaled (x·√((i−1)/i) + f(x)/√i), its logits soft-capped, its NoPE "
    "full-attention layers scale queries by (1 + (pos + 1)/2048)^0.1 and its attention output gate has a "
    "per-head bias; the replay has none of these (its DeepSeek-V3 router, Qwen3 attention and sandwich norms "
    "it has)",
    "kolibri1": "its router picks experts by logit plus the correction bias and weights them by the sigmoid of "
    "the chosen logits (DeepSeek-V3 adds the bias to the sigmoid scores), which the replay's routing does not "
    "have; its EXAONE-4 attention (NoPE on full-attention layers), sandwich norms and shared expert the replay "
    "has",
    "qwen3_vl_moe_text": _SUBCONFIG.format("qwen3_vl_moe"),
    "glm4v_moe_text": _SUBCONFIG.format("glm4v_moe"),
    "qwen3_omni_moe_thinker": _SUBCONFIG.format("qwen3_omni_moe"),
    "qwen3_omni_moe_text": _SUBCONFIG.format("qwen3_omni_moe"),
}
# MoE model types that transformers does not ship (hub checkpoints with their own modeling code),
# refused by name so that they are not "unknown"
HUB_ONLY: dict[str, str] = {
    "bailing_moe": "Ling / Ring 1.0 (remote code, not in transformers): its decoder (fused query_key_value, "
    "softmax top-k, ungated shared experts, dense first layers) is made of pieces the replay has, but no family "
    "file reads it, and its norm_head option (the LM head's columns L2-normalised) is not replayed",
    "bailing_moe_v2": "Ling 2.0 (remote code, not in transformers): its decoder is the one replayed as "
    "sarvam_moe (fused query_key_value, per-head q/k norms, partial RoPE, sigmoid group-limited routing with "
    "expert_bias), but no family file reads its config, tensor names and MTP layers yet",
    "deepseek_vl_v2": "a vision-language model (remote code, not in transformers): its vision tower is not replayed",
    "kimi_vl": "a vision-language model (remote code, not in transformers): its vision tower is not replayed",
}
_REFUSED_ALL.update({k: v for k, v in HUB_ONLY.items() if k not in _REFUSED_ALL})
REFUSED: dict[str, str] = {k: v for k, v in _REFUSED_ALL.items() if k not in FAMILIES}


def family_of(model_type: object, path: Path | str = "config.json") -> Family:
    """The registered family of a ``model_type``; a refused one or an unknown one is a
    CheckpointError saying which."""
    if isinstance(model_type, str) and model_type in FAMILIES:
        return FAMILIES[model_type]
    if isinstance(model_type, str) and model_type in REFUSED:
        raise CheckpointError(
            f"model family {model_type!r} cannot be replayed: {REFUSED[model_type]}",
            path=path,
            hint=f"supported: {', '.join(FAMILIES)}",
        )
    raise CheckpointError(f"unknown model family {model_type!r}", path=path, hint=f"supported: {', '.join(FAMILIES)}")


def spec_from_config(cfg: dict[str, Any], path: Path | str = "config.json") -> ModelSpec:
    """The family's rules (``moeaudit/families/<model_type>.py``) applied to ``cfg``."""
    return build_spec(family_of(cfg.get("model_type"), path), cfg, path)


__all__ = ["EXPERT_COUNT_KEYS", "FAMILIES", "HUB_ONLY", "REFUSED", "Family", "family_of", "spec_from_config"]
