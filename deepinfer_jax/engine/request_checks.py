"""Checks of a request before it is queued (engine/core.py `add_request`): each problem
becomes a line of its InvalidRequestError."""

from __future__ import annotations

from deepinfer_jax.host.pages import pages_needed
from deepinfer_jax.host.request import SamplingParams


def request_problems(engine, prompt: list[int], params: SamplingParams) -> list[str]:
    """What stops a request from running on the engine `engine` (core.py), one line each;
    empty if it can run."""
    problems = list(params.problems(engine.cfg.vocab_size, engine.step_cfg.max_logprobs,
                                    engine.tokenizer is not None))
    if params.constrained and engine.mesh is not None and engine.mesh.is_multi_process:
        # grammars compile on a worker thread and join the batch when done: at another
        # step in each process, whose plans must all be the same
        problems.append("structured outputs are not supported by an engine spanning "
                        "processes yet")
    if params.constrained and engine.tokenizer is not None and engine.structured is None:
        problems.append("structured outputs need the model to name an end-of-sequence "
                        "token (eos_token_id); this one names none")
    if not prompt:
        problems.append("empty prompt")
    elif len(prompt) >= engine.step_cfg.max_model_len:
        problems.append(f"prompt of {len(prompt)} tokens leaves no room under "
                        f"max_model_len={engine.step_cfg.max_model_len}")
    else:
        bad = [t for t in prompt if not 0 <= t < engine.cfg.vocab_size]
        if bad:
            problems.append(f"token ids outside the vocabulary [0, {engine.cfg.vocab_size}): "
                            f"{bad[:8]}")
        longest = len(prompt) + max(params.max_tokens, 0)
        if longest > engine.step_cfg.max_model_len:
            # an error, as vLLM's server gives, rather than a silent cut: the caller
            # asked for more than any sequence here can hold
            problems.append(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} "
                            f"exceeds max_model_len={engine.step_cfg.max_model_len}: ask for "
                            f"at most {engine.step_cfg.max_model_len - len(prompt)} tokens")
        elif pages_needed(longest, engine.step_cfg.page_size) > engine.step_cfg.num_pages:
            problems.append(f"a sequence of {longest} tokens needs more pages than the "
                            f"pool holds ({engine.step_cfg.num_pages})")
    return problems
