"""Train deepinfer-tiny-v4: a small DeepSeek-V4 on the Python standard library, with the
project's own model functions (JAX + optax).

    python tools/train_tiny.py prepare --data DATA            # tokenizer + token streams (CPU)
    python tools/train_tiny.py train --data DATA --out MODEL  # the model (H200 or CPU)
    python tools/eval_tiny.py MODEL --data DATA               # held-out metrics

`prepare` trains a byte-level BPE tokenizer on the train split of the running interpreter's
stdlib and writes the token streams with a manifest (file list and hashes). `train` writes
the checkpoint in the official layout (config.json, model.safetensors in bf16,
tokenizer.json, generation_config.json) plus train_log.json, and re-saves it periodically so
that a run cut short still leaves a model.

The architecture is V4's, scaled down: mHC (4 streams), sliding / CSA (with the lightning
indexer) / HCA layers with the window and compress rates shrunk for 512-token contexts, hash
and routed MoE with a shared expert, and the MTP block trained on the next-next token.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_corpus import prepare  # noqa: E402
from tiny_tokenizer import BOS, EOS  # noqa: E402

from deepinfer_jax.config.compute import ComputeConfig  # noqa: E402
from deepinfer_jax.config.hf import parse_hf_config  # noqa: E402
from deepinfer_jax.config.model import AttentionKind, MlpKind, ModelConfig  # noqa: E402
from deepinfer_jax.model import reference_forward  # noqa: E402
from deepinfer_jax.model.mtp import mtp_input  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from deepinfer_jax.weights.export import save_checkpoint  # noqa: E402

JNP = ComputeConfig()     # training computes with the jnp references, not in invariant mode

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]

TINY_V4 = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 6144, "hidden_size": 256, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "partial_rotary_factor": 0.5, "q_lora_rank": 128, "o_groups": 2, "o_lora_rank": 128,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
    "rope_theta": 10000.0, "compress_rope_theta": 40000.0,
    "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0},
                        "compress": {"rope_type": "yarn", "rope_theta": 40000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 1024, "beta_fast": 32,
                                     "beta_slow": 1, "attention_factor": 1.0}},
    "index_n_heads": 8, "index_head_dim": 32, "index_topk": 32,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "moe_intermediate_size": 192, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096, "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False, "bos_token_id": BOS, "eos_token_id": EOS,
}


# ---- model and losses ---------------------------------------------------------------------
def compute_dtype_mask(cfg: ModelConfig):
    """True for the leaves that run in the compute dtype (projections, embeddings)."""
    shapes = jax.eval_shape(lambda: random_params(cfg, 0, jnp.bfloat16))
    return jax.tree.map(lambda s: s.dtype == jnp.bfloat16, shapes)


def as_compute(params, mask, dtype=jnp.bfloat16):
    return jax.tree.map(lambda p, m: p.astype(dtype) if m else p, params, mask)


def split_trainable(params):
    """Integer leaves (the hash table) are constants, not trained."""
    leaves, treedef = jax.tree.flatten(params)
    is_float = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    return [x for x, f in zip(leaves, is_float) if f], (leaves, treedef, is_float)


def merge_trainable(floats, meta):
    leaves, treedef, is_float = meta
    it = iter(floats)
    return jax.tree.unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, is_float)])


def forward_with_mtp(params, tokens, cfg: ModelConfig):
    """tokens i32[B, S] -> (logits [B, S, V], MTP logits [B, S-2, V]; row t drafts x_{t+2})."""
    streams = reference_forward.forward_streams(params, tokens, cfg, JNP)            # [B, S, hc, D]
    logits = reference_forward.project_logits(streams, params.hc_head, params.norm, params.head,
                                              cfg, JNP)
    p = params.mtp[0]
    z = mtp_input(p, params.embed, streams[:, :-2], tokens[:, 1:-1], cfg, JNP)   # H_t with x_{t+1}
    positions = jnp.arange(z.shape[1], dtype=jnp.int32)
    z = reference_forward.layer(p.layer, z, positions, tokens[:, 1:-1], AttentionKind.SLIDING,
                                MlpKind.MOE, cfg, JNP)
    return logits, reference_forward.project_logits(z, p.hc_head, p.norm, params.head, cfg, JNP)


def losses(params, tokens, cfg: ModelConfig):
    logits, mtp_logits = forward_with_mtp(params, tokens, cfg)
    main = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, tokens[:, 2:]).mean()
    return main, mtp


# ---- training -----------------------------------------------------------------------------
def save(params, mask, cfg: ModelConfig, data: Path, out: Path, log: dict) -> None:
    save_checkpoint(as_compute(params, mask), cfg, out)
    shutil.copy(data / "tokenizer.json", out / "tokenizer.json")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, indent=2))
    (out / "train_log.json").write_text(json.dumps(log, indent=1))


def train(args) -> None:
    t_start = time.time()
    data = args.data
    manifest = json.loads((data / "manifest.json").read_text())
    train_tokens = np.load(data / "train.npy")
    cfg = parse_hf_config(TINY_V4)
    log = {"args": {k: str(v) for k, v in vars(args).items() if k != "func"},
           "jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
           "corpus": {k: manifest[k] for k in ("python", "tokens", "held_out_modules")}}

    mask = compute_dtype_mask(cfg)
    params = random_params(cfg, args.seed, jnp.float32)
    floats, meta = split_trainable(params)
    log["parameters"] = int(sum(x.size for x in jax.tree.leaves(params)))
    decay_mask = [x.ndim >= 2 for x in floats]
    # The learning rate is an input of each step, so the cosine can follow a step count that
    # is fixed only once the step time is known (--time-limit).
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(
        learning_rate=args.lr, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt_state = optimizer.init(floats)
    warmup = min(150, args.steps // 10)

    def learning_rate(step: int, total: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def loss_fn(floats, tokens):
        params = as_compute(merge_trainable(floats, meta), mask)
        main_loss, mtp_loss = losses(params, tokens, cfg)
        return main_loss + args.mtp_weight * mtp_loss, (main_loss, mtp_loss)

    @jax.jit
    def train_step(floats, opt_state, tokens, lr):
        opt_state[1].hyperparams["learning_rate"] = lr
        (_, (main_loss, mtp_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(floats, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, floats)
        return optax.apply_updates(floats, updates), opt_state, main_loss, mtp_loss

    rng = np.random.default_rng(args.seed)
    print(f"model: {log['parameters'] / 1e6:.2f}M parameters; {len(train_tokens)} train tokens; "
          f"up to {args.steps} steps of {args.batch}x{args.seq_len}", flush=True)
    history, total, step, probe, last_save = [], args.steps, 0, None, time.time()
    while step < total:
        starts = rng.integers(0, len(train_tokens) - args.seq_len - 1, size=args.batch)
        batch = np.stack([train_tokens[s: s + args.seq_len] for s in starts]).astype(np.int32)
        floats, opt_state, main_loss, mtp_loss = train_step(floats, opt_state, batch,
                                                           learning_rate(step, total))
        step += 1
        if step == 1:
            main_loss.block_until_ready()
            log["compile_seconds"] = round(time.time() - t_start, 1)
            print(f"first step (compile) after {log['compile_seconds']}s", flush=True)
        if step == 10:
            main_loss.block_until_ready()
            probe = time.time()
        if step == 60 and args.time_limit:   # fit the schedule to the time left
            main_loss.block_until_ready()
            per_step = (time.time() - probe) / 50
            left = args.time_limit - (time.time() - t_start) - 45   # keep time to save
            total = max(step + 1, min(args.steps, step + int(left / per_step)))
            log["step_seconds"] = round(per_step, 4)
            print(f"{per_step * 1000:.0f} ms/step: training {total} steps", flush=True)
        if step % 100 == 0 or step == 1 or step == total:
            entry = {"step": step, "loss": round(float(main_loss), 4),
                     "mtp_loss": round(float(mtp_loss), 4),
                     "lr": round(learning_rate(step - 1, total), 6),
                     "seconds": round(time.time() - t_start, 1)}
            history.append(entry)
            print(entry, flush=True)
        if step >= 200 and time.time() - last_save > args.save_every:
            log.update(steps_done=step, history=history, finished=False)
            save(merge_trainable(floats, meta), mask, cfg, data, args.out, log)
            last_save = time.time()
    log.update(steps_done=step, history=history, finished=True,
               seconds=round(time.time() - t_start, 1))
    save(merge_trainable(floats, meta), mask, cfg, data, args.out, log)
    print(f"wrote {args.out} after {log['seconds']}s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenizer and token streams")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--max-files", type=int, default=0, help="corpus subset (smoke tests)")
    p.set_defaults(func=lambda a: print(json.dumps(
        {k: v for k, v in prepare(a.data, TINY_V4["vocab_size"], SPECIALS, a.max_files).items()
         if not k.endswith("files")})))
    t = sub.add_parser("train", help="train the model")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--steps", type=int, default=3000)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--mtp-weight", type=float, default=0.3)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--time-limit", type=float, default=0, help="fit the run into N seconds")
    t.add_argument("--save-every", type=float, default=90, help="seconds between saves")
    t.set_defaults(func=train)
    args = ap.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
