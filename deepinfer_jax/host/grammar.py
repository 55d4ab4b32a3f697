"""Structured output (host side): grammars compiled by llguidance into token masks.

A request may carry one of `json_schema`, `regex` or `grammar` (Lark, or llama.cpp GBNF). Its
size and nesting are checked before any work (a 1,000-deep schema or one whose shared
sub-objects expand without bound fails at once, that request alone). Each grammar text is
then compiled and validated once, in a child process that a time limit really stops and a
memory limit bounds (grammar_worker.py); the engine polls for it and runs other requests'
steps meanwhile. A grammar that does not compile fails its request, and later ones with the
same text at once; a time-out or a memory overrun fails its request only, and the next
request with that text tries again. Per request an `LLMatcher` follows the generated tokens;
before each step that samples for the request, its row of the step's token bitmask is filled
(EOS is allowed only where the grammar may end), and the device applies it to the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from deepinfer_jax.host.grammar_worker import Compiled, GrammarWorker, Rejected
from deepinfer_jax.host.request import InvalidRequestError, SamplingParams

MAX_GRAMMAR_CHARS = 1 << 18     # a grammar text's size
MAX_SCHEMA_DEPTH = 64           # nesting of a JSON schema's objects and arrays
MAX_SCHEMA_NODES = 100_000      # its values, a shared sub-object counted where it appears

Spec = tuple[str, str]          # (kind, text): "json" | "regex" | "grammar"


class GrammarError(InvalidRequestError):
    """A json_schema / regex / grammar that does not compile, or not within the limits."""


def grammar_spec(params: SamplingParams) -> Spec | None:
    """(kind, text) of the request's constraint, if any, within the size limits."""
    if params.json_schema is not None:
        schema = params.json_schema
        if isinstance(schema, str):
            _check_size("json_schema", schema)
            try:
                parsed = json.loads(schema)
            except RecursionError:
                raise GrammarError(f"json_schema nested deeper than {MAX_SCHEMA_DEPTH}") from None
            except ValueError as e:
                raise GrammarError(f"json_schema is not JSON: {e}") from None
            _check_schema(parsed)
            return "json", schema
        _check_schema(schema)
        text = json.dumps(schema, sort_keys=True)
        _check_size("json_schema", text)
        return "json", text
    for kind, text in (("regex", params.regex), ("grammar", params.grammar)):
        if text is not None:
            _check_size(kind, text)
            return kind, text
    return None


def _check_size(kind: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{kind} of {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")


def _check_schema(schema) -> None:
    """Depth and size of a schema as it would be written out, walked without recursion."""
    stack, nodes = [(schema, 1)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"json_schema has more than {MAX_SCHEMA_NODES} values (shared "
                               "sub-objects count where they appear)")
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"json_schema nested deeper than {MAX_SCHEMA_DEPTH}")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)


class StructuredOutputs:
    """Grammars by text: compiled ones, failed ones, and those the worker has yet to finish."""

    PENDING = object()      # `lookup`'s answer while a grammar compiles

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...],
                 compile_timeout_s: float = 10.0):
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids))
        self._worker = GrammarWorker(str(tokenizer_json), vocab_size, eos_token_ids,
                                     compile_timeout_s)
        self._grammars: dict[Spec, str | GrammarError] = {}
        self._executor = llguidance.LLExecutor()

    def lookup(self, spec: Spec):
        """A fresh matcher for a compiled grammar, PENDING while it compiles (the compile is
        started), or the GrammarError of one that does not compile."""
        grammar = self._grammars.get(spec, self.PENDING)
        if isinstance(grammar, GrammarError):
            raise grammar
        if grammar is self.PENDING:
            if spec not in self._grammars:
                self._grammars[spec] = self.PENDING
                self._worker.submit(spec)
            return self.PENDING
        return self.matcher(spec)

    def matcher(self, spec: Spec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammars[spec], log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def poll(self, wait_s: float = 0.0) -> list[tuple[Spec, GrammarError | None]]:
        """Grammars the worker finished since the last call: (spec, None) if it compiled, else
        (spec, its error). Waits up to wait_s for one."""
        finished = []
        for spec, result in self._worker.poll(wait_s):
            if isinstance(result, Compiled):
                self._grammars[spec] = result.grammar
                finished.append((spec, None))
                continue
            assert isinstance(result, Rejected)
            error = GrammarError(result.message)
            if result.cacheable:
                self._grammars[spec] = error
            else:                          # time and memory limits: a later try may pass
                del self._grammars[spec]
            finished.append((spec, error))
        return finished

    def close(self) -> None:
        self._worker.close()

    def fill_masks(self, rows: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed-token mask into its row of bitmask (i32[N, W])."""
        if rows:
            llg_numpy.fill_next_token_bitmask_par(self._executor, rows, bitmask)
