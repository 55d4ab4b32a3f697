"""Incremental detokenization and the stop-string search against decoding the whole output
after every token, over random token sequences of the shipped tokenizer, multi-byte
characters split across tokens included (no model, no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_jax.host.detokenizer import IncrementalDetokenizer
from deepinfer_jax.host.stop_strings import StopStrings
from deepinfer_jax.host.tokenizer import TextTokenizer
from tests.conftest import REPO

TOKENIZER = TextTokenizer.from_model_dir(REPO / "models" / "deepinfer-tiny-v4")
# characters of 1 to 4 UTF-8 bytes, which the byte-level BPE splits into byte tokens
ALPHABET = list("abcdef xyz_(){}:\n\t.,0123") + list("éöñßçøÅ€—“”’✓→日本語中文") + ["🙂", "🚀", "𝔘"]


def sequences(seed: int, count: int = 120) -> list[list[int]]:
    """Encodings of random mixed-script text, runs of random ids (special tokens included),
    and byte tokens shuffled into invalid or unfinished UTF-8."""
    rng = np.random.default_rng(seed)
    vocab = TOKENIZER.vocab_size
    bytes_only = [i for i in range(vocab) if "\ufffd" in TOKENIZER.decode([i])]
    out = []
    for k in range(count):
        length = int(rng.integers(1, 48))
        if k % 3 == 0:
            text = "".join(rng.choice(ALPHABET, size=length))
            out.append(TOKENIZER.encode(text)[1:])        # without the BOS
        elif k % 3 == 1:
            out.append(rng.integers(0, vocab, length).tolist())
        else:
            ids = rng.choice(bytes_only + list(range(3, 200)), size=length)
            out.append([int(i) for i in ids])
    return out


def test_incremental_text_is_the_whole_decode_after_every_token():
    split_characters = 0
    for ids in sequences(0):
        detokenizer = IncrementalDetokenizer(TOKENIZER)
        text = ""
        for i, token in enumerate(ids):
            text += detokenizer.add([token])
            full = TOKENIZER.decode(ids[: i + 1])
            assert text + detokenizer.pending == full, (ids[: i + 1], text, detokenizer.pending)
            assert detokenizer.pending == "" or detokenizer.pending.endswith("\ufffd")
        split_characters += "".join(TOKENIZER.decode([t]) for t in ids) != TOKENIZER.decode(ids)
    # the sequences do split characters across tokens (decoding token by token would be wrong)
    assert split_characters > 40


def reference_stop(ids: list[int], stops: tuple[str, ...], min_tokens: int):
    """The engine's former check: after every token from the min_tokens-th on, decode the
    whole output and look for the stop strings. (token index, text position) or None."""
    for index in range(len(ids)):
        if index + 1 >= min_tokens:
            text = TOKENIZER.decode(ids[: index + 1])
            hits = [i for i in (text.find(s) for s in stops) if i >= 0]
            if hits:
                return index, min(hits)
    return None


def incremental_stop(ids: list[int], stops: tuple[str, ...], min_tokens: int):
    search = StopStrings(TOKENIZER, stops)
    for index, token in enumerate(ids):
        at = search.add(token, search=index + 1 >= min_tokens)
        if at is not None:
            return index, at
    return None


@pytest.mark.parametrize("seed", [1, 2])
def test_stop_strings_found_where_decoding_everything_finds_them(seed):
    rng = np.random.default_rng(seed)
    hits = early = 0
    for ids in sequences(seed):
        text = TOKENIZER.decode(ids)
        stops = []
        for _ in range(int(rng.integers(1, 4))):
            if text and rng.random() < 0.8:               # a piece of the output
                start = int(rng.integers(0, len(text)))
                stops.append(text[start: start + int(rng.integers(1, 7))])
            else:
                stops.append("".join(rng.choice(ALPHABET, size=int(rng.integers(1, 4)))))
        min_tokens = int(rng.integers(0, len(ids) + 1)) if rng.random() < 0.3 else 0
        expected = reference_stop(ids, tuple(stops), min_tokens)
        assert incremental_stop(ids, tuple(stops), min_tokens) == expected, (ids, stops, min_tokens)
        hits += expected is not None
        early += expected is not None and 0 < min_tokens == expected[0] + 1
    assert hits > 60 and early > 0    # most sequences stop; some as soon as min_tokens allows


def test_a_stop_string_across_a_split_character_and_before_min_tokens():
    ids = TOKENIZER.encode("ab日本cd")[1:]
    assert TOKENIZER.decode(ids[:3]).endswith("\ufffd")      # 日 spans several tokens
    for stops, min_tokens in [(("b日",), 0), (("日本c",), 0), (("ab",), len(ids)), (("\ufffd",), 0)]:
        assert incremental_stop(ids, stops, min_tokens) == reference_stop(ids, stops, min_tokens)
    assert incremental_stop(ids, ("zz",), 0) is None
