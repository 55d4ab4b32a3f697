"""A checkpoint's tensors (official names, [out, in]) in the engine's parameter layout
(deepinfer_jax/model/params.py), as the flat {dotted path: array} that params.py turns into
the torch tree: projections transposed to [in, out], wo_a split per output group
[G, H*hd/G, L], each expert's w1 | w3 joined and the experts stacked, mHC matrices
transposed. The same conversions as deepinfer_jax/weights/builder.py, for plain (not
quantized) tensors; tests/ascend compares the two trees leaf by leaf."""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig


class _Layout:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, np.ndarray]):
        self.cfg, self.t, self.out = cfg, tensors, {}

    def put(self, path: str, array: np.ndarray) -> None:
        self.out[path] = np.ascontiguousarray(array)

    def linear(self, path: str, name: str) -> None:
        self.put(path, self.t[name + ".weight"].T)

    def hc(self, path: str, prefix: str) -> None:
        for field in ("fn", "base", "scale"):
            array = self.t[f"{prefix}_{field}"]
            self.put(f"{path}.{field}", array.T if field == "fn" else array)

    def model(self) -> dict[str, np.ndarray]:
        c = self.cfg
        embed = self.t["embed.weight"]
        self.put("embed", embed)
        self.put("head", embed.T if c.tie_word_embeddings else self.t["head.weight"].T)
        self.put("norm", self.t["norm.weight"])
        self.hc("hc_head", "hc_head")
        for i in range(c.num_layers):
            self.layer(f"layers.{i}", f"layers.{i}.", c.layer_types[i], c.mlp_types[i])
        for j in range(c.num_mtp_layers):
            prefix = f"mtp.{j}."
            if not any(name.startswith(prefix) for name in self.t):
                continue
            for name in ("e_proj", "h_proj"):
                self.linear(f"mtp.{j}.{name}", prefix + name)
            for name in ("enorm", "hnorm", "norm"):
                self.put(f"mtp.{j}.{name}", self.t[prefix + name + ".weight"])
            self.hc(f"mtp.{j}.hc_head", prefix + "hc_head")
            self.layer(f"mtp.{j}.layer", prefix, AttentionKind.SLIDING, MlpKind.MOE)
        return self.out

    def layer(self, path: str, prefix: str, kind: AttentionKind, mlp_kind: MlpKind) -> None:
        self.put(f"{path}.attn_norm", self.t[prefix + "attn_norm.weight"])
        self.put(f"{path}.ffn_norm", self.t[prefix + "ffn_norm.weight"])
        self.hc(f"{path}.attn_hc", prefix + "hc_attn")
        self.hc(f"{path}.ffn_hc", prefix + "hc_ffn")
        self.attention(f"{path}.attn", prefix + "attn.", kind)
        self.moe(f"{path}.moe", prefix + "ffn.", mlp_kind)

    def attention(self, path: str, prefix: str, kind: AttentionKind) -> None:
        c = self.cfg
        for name in ("wq_a", "wq_b", "wkv", "wo_b"):
            self.linear(f"{path}.{name}", prefix + name)
        for name in ("q_norm", "kv_norm"):
            self.put(f"{path}.{name}", self.t[prefix + name + ".weight"])
        wo_a = self.t[prefix + "wo_a.weight"].T                      # [H*hd/G, G*L]
        self.put(f"{path}.wo_a", wo_a.reshape(wo_a.shape[0], c.o_groups, -1).transpose(1, 0, 2))
        self.put(f"{path}.sinks", self.t[prefix + "attn_sink"])
        if kind is not AttentionKind.SLIDING:
            self.compressor(f"{path}.compressor", prefix + "compressor.")
        if kind is AttentionKind.CSA:
            for name in ("wq_b", "weights_proj"):
                self.linear(f"{path}.indexer.{name}", prefix + "indexer." + name)
            self.compressor(f"{path}.indexer.compressor", prefix + "indexer.compressor.")

    def compressor(self, path: str, prefix: str) -> None:
        self.linear(f"{path}.wkv", prefix + "wkv")
        self.linear(f"{path}.wgate", prefix + "wgate")
        self.put(f"{path}.ape", self.t[prefix + "ape"])
        self.put(f"{path}.norm", self.t[prefix + "norm.weight"])

    def moe(self, path: str, prefix: str, kind: MlpKind) -> None:
        c = self.cfg
        expert = lambda e, w: self.t[f"{prefix}experts.{e}.{w}.weight"].T  # noqa: E731
        experts = range(c.n_routed_experts)
        self.put(f"{path}.experts.w13", np.stack(
            [np.concatenate([expert(e, "w1"), expert(e, "w3")], axis=1) for e in experts]))
        self.put(f"{path}.experts.w2", np.stack([expert(e, "w2") for e in experts]))
        if c.n_shared_experts:
            shared = lambda w: self.t[f"{prefix}shared_experts.{w}.weight"].T  # noqa: E731
            self.put(f"{path}.shared.w13", np.concatenate([shared("w1"), shared("w3")], axis=1))
            self.put(f"{path}.shared.w2", shared("w2"))
        self.linear(f"{path}.gate", prefix + "gate")
        if kind is MlpKind.MOE:
            self.put(f"{path}.bias", self.t[prefix + "gate.bias"])
        else:
            self.put(f"{path}.tid2eid", self.t[prefix + "gate.tid2eid"])


def flat_params(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Official-name tensors -> {dotted path of the parameter tree: array}."""
    return _Layout(cfg, tensors).model()
