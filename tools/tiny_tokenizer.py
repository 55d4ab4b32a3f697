"""The byte-level BPE tokenizer of deepinfer-tiny-v4 (`tokenizers`), with BOS/EOS."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS = 0, 1


def train_tokenizer(texts: list[str], vocab_size: int, specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{specials[BOS]} $A",
                                                       special_tokens=[(specials[BOS], BOS)])
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Every document as <|bos|> text <|eos|>, concatenated (uint16)."""
    encoded = tok.encode_batch(texts)
    return np.concatenate([np.array(e.ids + [EOS], np.uint16) for e in encoded])
