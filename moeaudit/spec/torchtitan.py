"""torchtitan's state-dict names → Hugging Face names: the rules, as data (no I/O, no torch).
Read by :mod:`moeaudit.checkpoint.dcp`; families add their own (``Family.torchtitan``)."""

from __future__ import annotations

# ----- torchtitan names → Hugging Face names (data) ----------------------------------------------
#
# From torchtitan's state-dict adapters (``from_hf_map``), pytorch/torchtitan
# torchtitan/models/qwen3/state_dict_adapter.py and torchtitan/models/deepseek_v3/
# state_dict_adapter.py; ``attention.wq`` without ``qkv_linear.`` and ``output.weight`` are the
# older llama3/llama4-style names. A ``None`` template drops the tensor (RoPE buffers). The
# stacked routed experts ``layers.{i}.moe.experts.w1/w3/w2`` are fused by ``_fuse_experts``.

_L = HF_LAYER = "model.layers.{layer}."
_T = TT_LAYER = r"layers\.(?P<layer>\d+)\."
Rules = tuple[tuple[str, str | None], ...]  # (torchtitan name regex, HF key template or None)

# common rules; a family's own (``Family.torchtitan``, e.g. MLA names) are tried before these
TORCHTITAN_COMMON: Rules = (
    (r"tok_embeddings\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"output\.weight", "lm_head.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"freqs_cis|rope\.cache", None),
    (_T + r"attention_norm\.weight", _L + "input_layernorm.weight"),
    (_T + r"ffn_norm\.weight", _L + "post_attention_layernorm.weight"),
    (_T + r"attention\.(?:qkv_linear\.)?wq\.(?P<p>weight|bias)", _L + "self_attn.q_proj.{p}"),
    (_T + r"attention\.(?:qkv_linear\.)?wk\.(?P<p>weight|bias)", _L + "self_attn.k_proj.{p}"),
    (_T + r"attention\.(?:qkv_linear\.)?wv\.(?P<p>weight|bias)", _L + "self_attn.v_proj.{p}"),
    (_T + r"attention\.wo\.(?P<p>weight|bias)", _L + "self_attn.o_proj.{p}"),
    (_T + r"attention\.q_norm\.weight", _L + "self_attn.q_norm.weight"),
    (_T + r"attention\.k_norm\.weight", _L + "self_attn.k_norm.weight"),
    (_T + r"moe\.router\.gate\.weight", _L + "mlp.gate.weight"),
    (_T + r"moe\.experts\.w[123]", None),  # fused by _fuse_experts
    (_T + r"moe\.expert_bias(?:_E)?", _L + "mlp.gate.e_score_correction_bias"),
    (_T + r"moe\.tokens_per_expert", None),  # a load-balancing counter buffer
    (_T + r"moe\.shared_experts?\.w1\.weight", _L + "mlp.shared_expert.gate_proj.weight"),
    (_T + r"moe\.shared_experts?\.w3\.weight", _L + "mlp.shared_expert.up_proj.weight"),
    (_T + r"moe\.shared_experts?\.w2\.weight", _L + "mlp.shared_expert.down_proj.weight"),
    (_T + r"feed_forward\.w1\.weight", _L + "mlp.gate_proj.weight"),
    (_T + r"feed_forward\.w3\.weight", _L + "mlp.up_proj.weight"),
    (_T + r"feed_forward\.w2\.weight", _L + "mlp.down_proj.weight"),
)
