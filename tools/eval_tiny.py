"""Held-out evaluation of deepinfer-tiny-v4 (runs on CPU in a few minutes).

    python tools/eval_tiny.py models/deepinfer-tiny-v4 [--data DATA] [--out metrics.json]

Without --data the running interpreter's stdlib is tokenized with the model's own
tokenizer.json (the same streams `train_tiny.py prepare` wrote, on the same Python).

* held-out cross-entropy (nats/token) of the model over 512-token windows of the held-out
  modules, and of a bigram baseline (unigram Dirichlet prior, k = 1, fit on the train stream)
  on exactly the same predicted tokens;
* MTP draft accuracy: how often the MTP block's top-1 draft for token t+2 (from the state at t
  and the true token t+1) equals the main model's greedy prediction at t+1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny import forward_with_mtp  # noqa: E402

import deepinfer_jax  # noqa: E402


def bigram_cross_entropy(train: np.ndarray, prev: np.ndarray, nxt: np.ndarray, vocab: int) -> float:
    pairs = train[:-1].astype(np.int64) * vocab + train[1:]
    counts = np.bincount(pairs, minlength=vocab * vocab).reshape(vocab, vocab).astype(np.float64)
    unigram = (np.bincount(train, minlength=vocab) + 1.0) / (len(train) + vocab)
    prev, nxt = prev.astype(np.int64).ravel(), nxt.astype(np.int64).ravel()
    p = (counts[prev, nxt] + unigram[nxt]) / (counts[prev].sum(axis=1) + 1.0)
    return float(-np.mean(np.log(p)))


def token_streams(model_dir: Path, data: Path | None) -> tuple[np.ndarray, np.ndarray]:
    if data is not None:
        return np.load(data / "train.npy"), np.load(data / "held_out.npy")
    from tiny_corpus import encode_splits
    from tokenizers import Tokenizer

    train, held, _ = encode_splits(Tokenizer.from_file(str(model_dir / "tokenizer.json")))
    return train, held


def evaluate(model_dir: Path, data: Path | None = None, seq_len: int = 512, batch: int = 8,
             stride: int = 1) -> dict:
    model = deepinfer_jax.load(model_dir, dtype=jnp.float32)
    cfg = model.config
    train, held = token_streams(model_dir, data)
    n = (len(held) - 1) // seq_len
    windows = held[: n * seq_len].reshape(n, seq_len).astype(np.int32)[::stride]

    @jax.jit
    def metrics(params, tokens):
        logits, mtp_logits = forward_with_mtp(params, tokens, cfg)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
        agree = jnp.argmax(mtp_logits, -1) == jnp.argmax(logits[:, 1:-1], -1)
        return nll.sum(), nll.size, agree.sum(), agree.size

    totals = np.zeros(4)
    for i in range(0, len(windows), batch):
        chunk = windows[i: i + batch]
        if len(chunk) < batch:                     # keep one compiled shape
            chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch - len(chunk), 0)])
            keep = len(windows) - i
        else:
            keep = batch
        nll, count, agree, size = (float(v) for v in metrics(model.params, chunk))
        totals += np.array([nll, count, agree, size]) * keep / batch
    model_ce = totals[0] / totals[1]
    bigram_ce = bigram_cross_entropy(train, windows[:, :-1], windows[:, 1:], cfg.vocab_size)
    return {"held_out_ce": round(model_ce, 4), "bigram_ce": round(bigram_ce, 4),
            "reduction_vs_bigram": round(1 - model_ce / bigram_ce, 4),
            "mtp_draft_accuracy": round(totals[2] / totals[3], 4),
            "held_out_tokens_scored": int(totals[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--data", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--stride", type=int, default=1, help="score every stride-th window only")
    args = ap.parse_args()
    result = evaluate(args.model, args.data, stride=args.stride)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
