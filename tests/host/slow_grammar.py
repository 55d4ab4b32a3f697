"""A grammar compiler that takes its time on texts containing "slow" (a stand-in for a
pathological schema). The grammar worker's child process imports it by name (spawn)."""

import time

from deepinfer_jax.host.grammar_worker import compile_grammar


def slow_compile(llguidance, tokenizer, kind: str, text: str):
    if "slow" in text:
        time.sleep(60)                      # until the time limit kills the process
    return compile_grammar(llguidance, tokenizer, kind, text)
