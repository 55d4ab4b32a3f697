"""A draft token map for MTP speculation: a corpus's most frequent tokens under a model's
tokenizer, as a JSON list of ids (speculative_config={"draft_token_map": PATH}).

    python tools/draft_token_map.py MODEL_DIR --size N --out map.json [--corpus FILE ...]

Without --corpus the corpus is the running interpreter's stdlib training split, the text the
shipped tiny model was trained on (tiny_corpus.py). Ids are listed most frequent first; ties
go to the lower id.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def corpus_tokens(model_dir: Path, files: list[Path]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if not files:
        from tiny_corpus import encode_splits
        return encode_splits(tok)[0]
    return np.concatenate([np.asarray(tok.encode(f.read_text()).ids, np.int64) for f in files])


def most_frequent(tokens: np.ndarray, vocab_size: int, size: int) -> list[int]:
    counts = np.bincount(tokens, minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))     # by count, then by id
    return [int(i) for i in order[:size]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--size", type=int, required=True, help="ids in the map")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--corpus", type=Path, nargs="*", default=[])
    args = ap.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ids = most_frequent(corpus_tokens(args.model, args.corpus), vocab, args.size)
    args.out.write_text(json.dumps(ids) + "\n")
    print(f"{len(ids)} of {vocab} ids -> {args.out}")


if __name__ == "__main__":
    main()
