"""A prompt's `RequestOutput` from its finished requests, in vLLM's shape (no jax).

One prompt runs as `best_of or n` requests (api/llm.py); each becomes a `CompletionOutput`,
with best_of > n keeping the n of highest cumulative logprob, best first. Text follows vLLM:
a stop token's text (EOS, stop_token_ids) and a stop string are left out of the text unless
`include_stop_str_in_output`; special tokens are left out unless `skip_special_tokens` is
False. Logprob entries are vLLM's `{token id: Logprob(logprob, rank, decoded_token)}`: the
chosen token, then the top k (ranks of chosen tokens outside the top k are not computed by
the step, so None).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from deepinfer_jax.host.request import (
    CompletionOutput,
    FinishReason,
    Logprob,
    Request,
    RequestMetrics,
    RequestOutput,
    RequestStatus,
    TokenLogprobs,
)
from deepinfer_jax.host.tokenizer import TextTokenizer


def text_tokens(req: Request, tokens: list[int] | None = None) -> list[int]:
    """The generated tokens whose text is output: all but a final stop token, unless the
    request includes its stop in the output."""
    tokens = req.generated if tokens is None else tokens
    if req.ended_on_stop_token and not req.params.include_stop_str_in_output and tokens:
        return tokens[:-1]
    return tokens


def cut_at_stop(text: str, req: Request) -> str:
    """The output text ends where its stop string starts (or, included, where it ends)."""
    if req.stop_text_at is None:
        return text
    end = req.stop_text_at
    if req.params.include_stop_str_in_output and isinstance(req.stop_reason, str):
        end += len(req.stop_reason)
    return text[:end]


def output_text(req: Request, tokenizer: TextTokenizer | None) -> str | None:
    if tokenizer is None:
        return None
    return cut_at_stop(tokenizer.decode(text_tokens(req), req.params.skip_special_tokens), req)


def token_text(tokenizer: TextTokenizer | None) -> Callable[[int], str | None]:
    """A token's text alone, special tokens included (vLLM's `decoded_token`)."""
    if tokenizer is None:
        return lambda token: None
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def completion_logprobs(entries: list[TokenLogprobs], text: Callable[[int], str | None]
                        ) -> list[dict[int, Logprob]]:
    out = []
    for entry in entries:
        ranks = {token: rank for rank, (token, _) in enumerate(entry.top, 1)}
        row = {entry.token_id: Logprob(entry.logprob, ranks.get(entry.token_id), text(entry.token_id))}
        for token, logprob in entry.top:
            row.setdefault(token, Logprob(logprob, ranks[token], text(token)))
        out.append(row)
    return out


def completion(req: Request, index: int, tokenizer: TextTokenizer | None,
               with_logprobs: bool) -> CompletionOutput:
    """One request's completion. Its cumulative logprob needs the request's per-token logprobs
    (asked for, or by best_of); `with_logprobs` says whether the caller asked to see them."""
    scored = req.params.logprobs is not None and all(e is not None for e in req.logprobs)
    cumulative = float(sum(e.logprob for e in req.logprobs)) if scored else None
    logprobs = completion_logprobs(req.logprobs, token_text(tokenizer)) if (
        scored and with_logprobs) else None
    return CompletionOutput(index, output_text(req, tokenizer), list(req.generated), cumulative,
                            logprobs, req.finish_reason, req.stop_reason)


def group_output(request_id: str, requests: list[Request], n: int,
                 tokenizer: TextTokenizer | None, with_logprobs: bool,
                 prompt_logprobs: list | None = None) -> RequestOutput:
    """The prompt's output: its requests' completions (best_of > n: the n most likely, best
    first), the top-level fields repeating outputs[0]'s."""
    completions = [completion(r, i, tokenizer, with_logprobs) for i, r in enumerate(requests)]
    order = list(range(len(requests)))
    if len(requests) > n:
        order = sorted(order, key=lambda i: -completions[i].cumulative_logprob)[:n]
        completions = [dataclasses.replace(completions[j], index=i) for i, j in enumerate(order)]
    first = requests[order[0]]
    top = completions[0]
    return RequestOutput(
        request_id, list(first.prompt), top.token_ids, top.text,
        all(r.status is RequestStatus.FINISHED for r in requests), top.finish_reason,
        next((r.error for r in requests if r.error is not None), None), first.metrics,
        list(first.logprobs) if with_logprobs else None,
        outputs=completions, prompt_logprobs=prompt_logprobs)


def prompt_logprobs(prompt: list[int], logits: np.ndarray, k: int,
                    text: Callable[[int], str | None]) -> list[dict[int, Logprob] | None]:
    """vLLM's `RequestOutput.prompt_logprobs` from the logits [S, V] of the prompt's own
    positions: None for the first token, then each token's logprob (with its rank) and the
    top k at its position."""
    rows = logits[:-1].astype(np.float64)
    shifted = rows - rows.max(axis=-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    out: list[dict[int, Logprob] | None] = [None]
    for row, token in zip(logprobs, prompt[1:], strict=True):
        entry = {token: Logprob(float(row[token]), int((row > row[token]).sum()) + 1, text(token))}
        for rank, best in enumerate(np.argsort(-row, kind="stable")[:k], 1):
            entry.setdefault(int(best), Logprob(float(row[best]), rank, text(int(best))))
        out.append(entry)
    return out


def failed_output(request_id: str, prompt, error: Exception,
                  metrics: RequestMetrics | None = None) -> RequestOutput:
    metrics = metrics or RequestMetrics(time.time())
    metrics.finished_time = time.time()
    tokens = list(prompt) if isinstance(prompt, (list, tuple)) and all(
        isinstance(t, int) for t in prompt) else []
    return RequestOutput(request_id, tokens, [], None, True, FinishReason.ERROR, error, metrics)
