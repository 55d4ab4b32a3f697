"""DeepSeek-V4.1 tensor names: the released checkpoint's DeepSeek-native names onto the
reference's (`DeepseekV41ForCausalLM` state-dict keys, what `save_pretrained` writes), as the
reference's conversion rules map them (the oracle README's "Tensor names").

Routed experts are the one non-rename: native `experts.{e}.w1 / w3 / w2` stay per expert here
(`mlp.experts.{e}.w1.weight`, ...) and the loader stacks them into the reference's
`gate_up_proj` / `down_proj`.
"""

from __future__ import annotations

import re

# Native tensors the text model does not use: the DSpark drafter and the vision side.
_IGNORED = re.compile(r"^(mtp|vision|aligner)\.|^image_(start|end|newline)\b")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight"}

# On the part after `layers.{i}.`; the first match wins, so specific rules come first.
_LAYER_RULES = [(re.compile(a), b) for a, b in [
    (r"^attn_norm\.", "input_layernorm."),
    (r"^ffn_norm\.", "post_attention_layernorm."),
    (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
    (r"^attn\.attn_sink$", "self_attn.sinks"),
    (r"^attn\.compressor\.wkv\.", "self_attn.compressor.kv_proj."),
    (r"^attn\.compressor\.wgate\.", "self_attn.compressor.gate_proj."),
    (r"^attn\.compressor\.norm\.", "self_attn.compressor.kv_norm."),
    (r"^attn\.indexer\.wq_b\.", "self_attn.indexer.q_b_proj."),
    (r"^attn\.indexer\.wk\.", "self_attn.indexer.k_proj."),
    (r"^attn\.wq_a\.", "self_attn.q_a_proj."),
    (r"^attn\.q_norm\.", "self_attn.q_a_norm."),
    (r"^attn\.wq_b\.", "self_attn.q_b_proj."),
    (r"^attn\.wkv\.", "self_attn.kv_proj."),
    (r"^attn\.wo_a\.", "self_attn.o_a_proj."),
    (r"^attn\.wo_b\.", "self_attn.o_b_proj."),
    (r"^attn\.", "self_attn."),
    (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
    (r"^ffn\.gate\.bias_vl$", "mlp.gate.e_score_correction_bias_vl"),
    (r"^ffn\.shared_experts\.w1\.", "mlp.shared_experts.gate_proj."),
    (r"^ffn\.shared_experts\.w3\.", "mlp.shared_experts.up_proj."),
    (r"^ffn\.shared_experts\.w2\.", "mlp.shared_experts.down_proj."),
    (r"^ffn\.", "mlp."),
]]


def is_native(key: str) -> bool:
    return not (key.startswith("model.") or key.startswith("lm_head."))


def reference_name(key: str) -> str | None:
    """The reference name of checkpoint key `key` (either naming); None: not a text-model
    tensor. A native `X.scale` (the scale of a quantized `X.weight`) becomes
    `X'.weight_scale_inv`."""
    if not is_native(key):
        return key
    if _IGNORED.search(key):
        return None
    if key.endswith(".scale"):
        base = reference_name(key[: -len("scale")] + "weight")
        return None if base is None else base + "_scale_inv"
    if key in _TOP:
        return _TOP[key]
    m = _LAYER.match(key)
    if m is None:
        return key                   # unknown: reported as unexpected by the loader
    layer, rest = m.groups()
    if rest.startswith("engram.embed."):
        return f"model.engram_tables.{layer}.{rest[len('engram.embed.'):]}"
    for pattern, replacement in _LAYER_RULES:
        if pattern.search(rest):
            rest = pattern.sub(replacement, rest, count=1)
            break
    return f"model.layers.{layer}.{rest}"
