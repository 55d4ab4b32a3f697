"""The JSON bodies of the OpenAI API: completions and chat completions, whole or as streamed
chunks, with their logprobs and usage."""

from __future__ import annotations

import time
import uuid

from deepinfer_jax.host.request import FinishReason, Logprob, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(reason: FinishReason | None) -> str | None:
    return None if reason is None else reason.value


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def output_usage(outputs: list[RequestOutput]) -> dict:
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs))


# ---- logprobs ---------------------------------------------------------------------------------
def completion_logprobs(entries: list[dict[int, Logprob]], offset: int = 0) -> dict:
    """The completions API's logprobs: each token's text and logprob, the top alternatives
    (the chosen token included, as vLLM's), and each token's offset into the text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        (token, chosen), *_ = entry.items()
        text = chosen.decoded_token or ""
        out["tokens"].append(text)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({(lp.decoded_token or ""): lp.logprob for lp in entry.values()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _token_entry(text: str | None, logprob: float) -> dict:
    text = text or ""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[dict[int, Logprob]], top: int) -> dict:
    """The chat API's logprobs: per token its entry and the `top` most likely, best first."""
    content = []
    for entry in entries:
        (token, chosen), *_ = entry.items()
        ranked = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda lp: lp.rank)
        item = _token_entry(chosen.decoded_token, chosen.logprob)
        item["top_logprobs"] = [_token_entry(lp.decoded_token, lp.logprob) for lp in ranked[:top]]
        content.append(item)
    return {"content": content}


# ---- whole responses --------------------------------------------------------------------------
def completion_response(rid: str, model: str, outputs: list[RequestOutput], n: int,
                        with_logprobs: bool) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        for c in out.outputs:
            choices.append({
                "index": i * n + c.index, "text": c.text or "",
                "logprobs": completion_logprobs(c.logprobs or []) if with_logprobs else None,
                "finish_reason": finish_reason(c.finish_reason),
                "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": output_usage(outputs)}


def chat_response(rid: str, model: str, output: RequestOutput, top_logprobs: int | None) -> dict:
    choices = [{
        "index": c.index, "message": {"role": "assistant", "content": c.text or ""},
        "logprobs": (chat_logprobs(c.logprobs or [], top_logprobs)
                     if top_logprobs is not None else None),
        "finish_reason": finish_reason(c.finish_reason), "stop_reason": c.stop_reason}
        for c in output.outputs]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": output_usage([output])}


# ---- streamed chunks --------------------------------------------------------------------------
def completion_chunk(rid: str, model: str, created: int, index: int, text: str,
                     logprobs: dict | None, reason: str | None, with_usage: bool) -> dict:
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(rid: str, model: str, created: int, index: int, delta: dict,
               logprobs: dict | None, reason: str | None, with_usage: bool) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                          "finish_reason": reason}]}
    if with_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, model: str, created: int, obj: str, totals: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": totals}
