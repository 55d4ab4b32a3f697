"""Structured output (host side): grammars compiled by llguidance into token masks.

A request may carry one of `json_schema`, `regex` or `grammar` (Lark, or llama.cpp GBNF). Each
grammar text is compiled and validated once (cached by text) in a worker thread with a time
limit; a grammar that fails or times out fails that request alone. Per request an `LLMatcher`
follows the generated tokens; before each step that samples for the request, its row of the
step's token bitmask is filled (EOS is allowed only where the grammar may end), and the device
applies it to the logits before sampling.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from deepinfer_jax.host.request import InvalidRequestError, SamplingParams

# Compact JSON: with flexible whitespace a sampler at temperature 1 could pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(InvalidRequestError):
    """A json_schema / regex / grammar that does not compile (or not in time)."""


def grammar_spec(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's constraint, if any."""
    if params.json_schema is not None:
        schema = params.json_schema
        return "json", schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    if params.regex is not None:
        return "regex", params.regex
    if params.grammar is not None:
        return "grammar", params.grammar
    return None


class StructuredOutputs:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float = 10.0):
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self.timeout = compile_timeout_s
        self._grammars: dict[tuple[str, str], str | GrammarError] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._executor = llguidance.LLExecutor()

    def matcher(self, params: SamplingParams) -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's constraint (None if unconstrained)."""
        spec = grammar_spec(params)
        if spec is None:
            return None
        grammar = self._grammars.get(spec)
        if grammar is None:
            future = self._pool.submit(self._compile, *spec)
            try:
                grammar = future.result(timeout=self.timeout)
            except concurrent.futures.TimeoutError:
                return self._fail(spec, GrammarError(
                    f"{spec[0]} did not compile within {self.timeout:.1f} s"))
            self._grammars[spec] = grammar
        if isinstance(grammar, GrammarError):
            raise grammar
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def _fail(self, spec, error: GrammarError):
        self._grammars[spec] = error
        raise error

    def _compile(self, kind: str, text: str) -> str | GrammarError:
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llguidance.grammar_from("grammar", text)
        except ValueError as e:
            return GrammarError(f"{kind}: {e}")
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        return GrammarError(f"{kind}: {error}") if error else grammar

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed-token mask into its row of bitmask (i32[N, W])."""
        if rows:
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
