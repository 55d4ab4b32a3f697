"""The Engram n-gram hash, exactly as the reference computes it: plain numpy int64 on the host
(wrapping products, like torch's int64), since every input is a token id and the tables of
the release are too large for the device anyway (section 6 of the architecture notes).

* `compressed_token_map`: token id -> compressed id, from the tokenizer's decoded text
  normalised (NFKC, NFD, accents stripped, lower-cased, whitespace runs collapsed, trimmed; a
  lone space kept), numbered in first-appearance order; partial UTF-8 tokens keyed raw.
* `hash_tables`: the config-derived primes, offsets and multipliers.
* `hash_ids`: [B, S] tokens (+ a live mask) -> [B, S, L, C] row ids into each layer's table.
* `product_words`: every token's products with the multipliers as 32-bit words, from which the
  step hashes on the device (engram_device.py) where the tables are device weights.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deepinfer_jax.config.v41 import EngramConfig

_SEED_STRIDE = 10007          # layer l's multipliers come from default_rng(10007 * l)
_DEAD = -1                    # a look-back slot that may not be used (start, pad, image)
DEAD = _DEAD                  # the same, for callers that build `history`


@dataclasses.dataclass(frozen=True)
class HashTables:
    primes: np.ndarray        # i64[L, max_ngram-1, heads]  bucket sizes, never reused
    offsets: np.ndarray       # i64[L, C]   start of each (n-gram, head) range in its layer's table
    multipliers: np.ndarray   # i64[L, max_ngram]  odd, bounded so one product cannot overflow


def _is_prime(n: int) -> bool:
    if n < 2 or n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def hash_tables(cfg: EngramConfig) -> HashTables:
    seen: set[int] = set()
    primes = []
    for _ in cfg.layer_ids:
        per_layer = []
        for _ in range(cfg.max_ngram_size - 1):
            current, sizes = cfg.vocab_size - 1, []
            for _ in range(cfg.n_heads):      # the next unused prime above the last one
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_layer.append(sizes)
        primes.append(per_layer)
    primes = np.array(primes, np.int64)
    flat = primes.reshape(len(cfg.layer_ids), -1)
    offsets = np.cumsum(flat, axis=1) - flat
    bound = max(1, (np.iinfo(np.int64).max // cfg.compressed_vocab_size) // 2)
    multipliers = np.stack([
        np.random.default_rng(_SEED_STRIDE * layer).integers(0, bound, cfg.max_ngram_size,
                                                             dtype=np.int64) * 2 + 1
        for layer in cfg.layer_ids])
    return HashTables(primes=primes, offsets=offsets, multipliers=multipliers)


def compressed_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """A `tokenizers.Tokenizer` -> (i64[V] compressed ids, number of distinct ids)."""
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"       # keeps a lone space from being stripped to the empty key
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), sentinel), normalizers.Strip(),
        normalizers.Replace(sentinel, " ")])
    keys: dict[str, int] = {}
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    out = np.zeros(size, np.int64)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = (tokenizer.id_to_token(token_id) if "\ufffd" in text
               else normalizer.normalize_str(text) or text)
        out[token_id] = keys.setdefault(key, len(keys))
    return out, len(keys)


def hash_ids(tokens: np.ndarray, live: np.ndarray, token_map: np.ndarray, cfg: EngramConfig,
             tables: HashTables, history: np.ndarray | None = None) -> np.ndarray:
    """Row ids i64[B, S, L, C] for tokens i64[B, S] (live: bool[B, S], False = DEAD).

    history: i64[B, max_ngram-1] compressed ids before this call (DEAD where none), the
    look-back across calls; None = every row starts here."""
    back = cfg.max_ngram_size - 1
    # int64 whatever the caller's dtypes: the products wrap as the reference's int64 do.
    compressed = np.where(live, np.asarray(token_map, np.int64)[tokens], _DEAD)
    if history is None:
        history = np.full((tokens.shape[0], back), _DEAD, np.int64)
    full = np.concatenate([history, compressed], axis=1)
    pad = compressed.dtype.type(token_map[cfg.pad_id])
    seq = tokens.shape[1]
    blocked = np.zeros(compressed.shape, bool)
    slots = []
    for shift in range(cfg.max_ngram_size):  # once a look-back hits DEAD, longer ones are too
        source = full[:, back - shift: back - shift + seq]
        blocked |= source == _DEAD
        slots.append(np.where(blocked, pad, source))
    products = np.stack(slots, -1)[:, :, None, :] * tables.multipliers   # [B, S, L, n]
    rolling, columns = products[..., 0], []
    for i in range(1, cfg.max_ngram_size):
        rolling = rolling ^ products[..., i]
        columns.append(rolling[..., None] % tables.primes[:, i - 1])       # [B, S, L, heads]
    return np.concatenate(columns, -1) + tables.offsets


def product_words(token_map: np.ndarray, tables: HashTables) -> np.ndarray:
    """u32[V, L, max_ngram, 2]: the (high, low) words of `token_map[v] * multipliers[l, k]`,
    the int64 product `hash_ids` XORs for token v in look-back slot k of layer l (wrapped as
    numpy wraps it), for every token id v."""
    products = np.asarray(token_map, np.int64)[:, None, None] * tables.multipliers
    words = products.view(np.uint64)
    return np.stack([(words >> np.uint64(32)).astype(np.uint32),
                     (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)], axis=-1)
