"""Train deepinfer-tiny-v4: a byte-level BPE tokenizer and a small DeepSeek-V4 on the Python
standard library, with the project's own model functions (JAX + optax).

    python tools/train_tiny.py --out models/deepinfer-tiny-v4 [--steps 3000]

Writes the checkpoint in the official layout (config.json, model.safetensors in bf16,
tokenizer.json, generation_config.json) and train_log.json (file list and hashes, seeds,
steps, losses, held-out metrics). The model card is written by tools/model_card.py.

The architecture is V4's, scaled down: mHC (4 streams), sliding / CSA (with the lightning
indexer) / HCA layers with the window and compress rates shrunk for 512-token contexts, hash
and routed MoE with a shared expert, and the MTP block trained on the next-next token.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_corpus import corpus_files, manifest, read_text, stdlib_root  # noqa: E402

from deepinfer_jax.config import AttentionKind, MlpKind, ModelConfig  # noqa: E402
from deepinfer_jax.model import forward  # noqa: E402
from deepinfer_jax.model.mtp import mtp_input  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from deepinfer_jax.weights.export import save_checkpoint  # noqa: E402

SPECIALS = ["<|bos|>", "<|eos|>", "<|pad|>"]
BOS, EOS = 0, 1

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


# ---- data ---------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A",
                                                       special_tokens=[("<|bos|>", BOS)])
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Every document as <|bos|> text <|eos|>, concatenated (uint16)."""
    encoded = tok.encode_batch(texts)
    return np.concatenate([np.array(e.ids + [EOS], np.uint16) for e in encoded])


def bigram_cross_entropy(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray, vocab: int) -> float:
    """A bigram model with a unigram Dirichlet prior (k = 1), fit on the train stream, scored on
    the (prev -> next) pairs given."""
    pairs = train[:-1].astype(np.int64) * vocab + train[1:]
    counts = np.bincount(pairs, minlength=vocab * vocab).reshape(vocab, vocab).astype(np.float64)
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    prev, nxt = prev.astype(np.int64).ravel(), nxt.astype(np.int64).ravel()
    p = (counts[prev, nxt] + unigram[nxt]) / (counts[prev].sum(axis=1) + 1.0)
    return float(-np.mean(np.log(p)))


# ---- model --------------------------------------------------------------------------------
def compute_dtype_mask(cfg: ModelConfig):
    """True for the leaves that run in the compute dtype (projections, embeddings)."""
    shapes = jax.eval_shape(lambda: random_params(cfg, 0, jnp.bfloat16))
    return jax.tree.map(lambda s: s.dtype == jnp.bfloat16, shapes)


def split_trainable(params):
    """Integer leaves (the hash table) are constants, not trained."""
    leaves, treedef = jax.tree.flatten(params)
    is_float = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
    return [x for x, f in zip(leaves, is_float) if f], (leaves, treedef, is_float)


def merge_trainable(floats, meta):
    leaves, treedef, is_float = meta
    it = iter(floats)
    return jax.tree.unflatten(treedef, [next(it) if f else x for x, f in zip(leaves, is_float)])


def losses(params, tokens, cfg: ModelConfig, mask):
    """tokens i32[B, S] -> (next-token CE, next-next-token CE of the MTP block)."""
    params = jax.tree.map(lambda p, m: p.astype(jnp.bfloat16) if m else p, params, mask)
    streams = forward.forward_streams(params, tokens, cfg)                 # [B, S, hc, D]
    logits = forward.project_logits(streams, params.hc_head, params.norm, params.head, cfg)
    main = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()
    p = params.mtp[0]
    z = mtp_input(p, params.embed, streams[:, :-2], tokens[:, 1:-1], cfg)   # H_t with x_{t+1}
    positions = jnp.arange(z.shape[1], dtype=jnp.int32)
    z = forward.layer(p.layer, z, positions, tokens[:, 1:-1], AttentionKind.SLIDING, MlpKind.MOE, cfg)
    mtp_logits = forward.project_logits(z, p.hc_head, p.norm, params.head, cfg)
    mtp = optax.softmax_cross_entropy_with_integer_labels(mtp_logits, tokens[:, 2:]).mean()
    return main, mtp, logits, mtp_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-files", type=int, default=0, help="corpus subset (smoke tests)")
    ap.add_argument("--time-limit", type=float, default=0, help="stop training after N seconds")
    args = ap.parse_args()
    t_start = time.time()
    log = {"args": vars(args) | {"out": str(args.out)}, "python": sys.version.split()[0],
           "jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}

    root = stdlib_root()
    train_files, held_files = corpus_files(root)
    if args.max_files:
        train_files, held_files = train_files[: args.max_files], held_files[: args.max_files // 4 + 1]
    train_texts = [read_text(root, p) for p in train_files]
    held_texts = [read_text(root, p) for p in held_files]
    log["corpus"] = {"stdlib": str(root), "train_files": manifest(root, train_files),
                     "held_out_files": manifest(root, held_files)}
    cfg = ModelConfig.from_hf_dict(TINY_V4)
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train, held = token_stream(tok, train_texts), token_stream(tok, held_texts)
    log["tokens"] = {"train": int(len(train)), "held_out": int(len(held))}
    print(f"corpus: {len(train_files)} train files ({len(train)} tokens), {len(held_files)} "
          f"held-out ({len(held)} tokens); tokenizer {time.time() - t_start:.0f}s", flush=True)

    mask = compute_dtype_mask(cfg)
    params = random_params(cfg, args.seed, jnp.float32)
    floats, meta = split_trainable(params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    log["parameters"] = int(n_params)
    decay_mask = [x.ndim >= 2 for x in floats]
    # The learning rate is fed each step, so the cosine can follow a step count fixed only once
    # the step time is known (--time-limit).
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
        main_loss, mtp_loss, _, _ = losses(merge_trainable(floats, meta), tokens, cfg, mask)
        return main_loss + args.mtp_weight * mtp_loss, (main_loss, mtp_loss)

    @jax.jit
    def train_step(floats, opt_state, tokens, lr):
        opt_state[1].hyperparams["learning_rate"] = lr
        (_, (main_loss, mtp_loss)), grads = jax.value_and_grad(loss_fn, has_aux=True)(floats, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, floats)
        return optax.apply_updates(floats, updates), opt_state, main_loss, mtp_loss

    rng = np.random.default_rng(args.seed)
    history = []
    print(f"model: {n_params / 1e6:.2f}M parameters; training {args.steps} steps of "
          f"{args.batch}x{args.seq_len} tokens", flush=True)
    t_train = time.time()
    total, step, probe = args.steps, 0, None
    while step < total:
        starts = rng.integers(0, len(train) - args.seq_len - 1, size=args.batch)
        batch = np.stack([train[s: s + args.seq_len] for s in starts]).astype(np.int32)
        floats, opt_state, main_loss, mtp_loss = train_step(floats, opt_state, batch,
                                                           learning_rate(step, total))
        step += 1
        if step == 10:
            main_loss.block_until_ready()
            probe = time.time()
        if step == 60 and args.time_limit:   # fit the schedule to the time left
            main_loss.block_until_ready()
            per_step = (time.time() - probe) / 50
            left = args.time_limit - (time.time() - t_start) - 60   # keep a minute to save
            total = max(step + 1, min(args.steps, step + int(left / per_step)))
            log["step_seconds"] = per_step
            print(f"{per_step * 1000:.0f} ms/step: training {total} steps", flush=True)
        if step % 100 == 0 or step == 1 or step == total:
            entry = {"step": step, "loss": round(float(main_loss), 4),
                     "mtp_loss": round(float(mtp_loss), 4), "lr": learning_rate(step - 1, total),
                     "seconds": round(time.time() - t_train, 1)}
            history.append(entry)
            print(entry, flush=True)
    log["steps_done"], log["history"] = step, history
    params = merge_trainable(floats, meta)

    log["eval"] = evaluate(params, held, train, cfg, mask, args.seq_len)
    print(log["eval"], flush=True)
    out = args.out
    bf16 = jax.tree.map(lambda p, m: p.astype(jnp.bfloat16) if m else p, params, mask)
    save_checkpoint(bf16, cfg, out)
    tok.save(str(out / "tokenizer.json"))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS, "eos_token_id": EOS, "do_sample": False}, indent=2))
    log["seconds"] = round(time.time() - t_start, 1)
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(f"wrote {out} in {log['seconds']}s", flush=True)


def evaluate(params, held: np.ndarray, train: np.ndarray, cfg: ModelConfig, mask, seq_len: int) -> dict:
    """Held-out next-token CE vs a bigram baseline on the same tokens; MTP draft accuracy
    (the MTP top-1 equals the main model's greedy next-next token)."""
    n = (len(held) - 1) // seq_len
    windows = held[: n * seq_len].reshape(n, seq_len).astype(np.int32)

    @jax.jit
    def metrics(tokens):
        main_loss, _, logits, mtp_logits = losses(params, tokens, cfg, mask)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        agree = jnp.argmax(mtp_logits, -1) == jnp.argmax(logits[:, 1:-1], -1)
        return nll.sum(), agree.sum(), agree.size, nll.size

    totals = np.zeros(4)
    for i in range(0, n, 16):
        totals += np.array([float(v) for v in metrics(windows[i: i + 16])])
    model_ce = totals[0] / totals[3]
    # the bigram scores exactly the tokens the model predicts: positions 1.. of each window
    bigram_ce = bigram_cross_entropy(train, windows[:, :-1], windows[:, 1:], cfg.vocab_size)
    return {"held_out_ce": model_ce, "bigram_ce": bigram_ce,
            "reduction_vs_bigram": 1 - model_ce / bigram_ce,
            "mtp_draft_accuracy": totals[1] / totals[2], "held_out_tokens_scored": int(totals[3])}


if __name__ == "__main__":
    main()
