"""A real server on the loopback address (uvicorn on a thread of the test process, its engine
on a thread too, so tests can read the engine's state) serving the shipped tiny model, and
the reference outputs of `LLM.generate` for the requests the tests send, computed on the same
engine before it serves."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
import uvicorn

from deepinfer_jax import SamplingParams
from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server.app import build_app

MODEL = "deepinfer-tiny-v4"
STORY = "Once upon a time"
PROMPTS = ["Once upon a time", "The little dog", "She opened the door and", "In the morning,",
           "The king said", "A cat sat on", "They walked to the", "It was a sunny day"]
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}},
          "required": ["name"], "additionalProperties": False}

# name -> (prompt, SamplingParams): what LLM.generate gives for these is what the server must
REFERENCE_CASES = {
    **{f"greedy{i}": (p, SamplingParams(max_tokens=10)) for i, p in enumerate(PROMPTS)},
    "seeded": (STORY, SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=2)),
    "logprobs": (STORY, SamplingParams(max_tokens=6, logprobs=3)),
    "stop": (STORY, SamplingParams(max_tokens=12, stop=("time, time",))),
    "json": (STORY, SamplingParams(max_tokens=40, json_schema=SCHEMA)),
    "long": (PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True)),
    "best_of": (STORY, SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2, best_of=4)),
}


REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, llm: LLM, app, base_url: str, reference: dict):
        self.llm, self.app, self.base_url, self.reference = llm, app, base_url, reference
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=60)

    @property
    def engine(self):
        return self.app.state.engine.engine


# The served engine's options. Batch-invariant: a request's tokens do not depend on which
# others share its steps, so the outputs of clients that run at once equal LLM.generate's of
# each alone. Two token buckets, decode steps and the default budget's 256-token prefill chunks:
# each bucket is a compiled step, and the default five were most of these files' time.
SERVED_OPTIONS = dict(max_num_seqs=4, batch_invariant=True, token_buckets=(16, 256))


@pytest.fixture(scope="package")
def served():
    llm = LLM(**SERVED_OPTIONS)
    reference = {name: llm.generate([prompt], params, use_tqdm=False)[0]
                 for name, (prompt, params) in REFERENCE_CASES.items()}
    reference["chat"] = llm.chat(CHAT, SamplingParams(max_tokens=10), use_tqdm=False)[0]
    reference["chat_json"] = llm.chat(CHAT, SamplingParams(max_tokens=40, json_schema=SCHEMA),
                                      use_tqdm=False)[0]
    with running_server(llm) as (app, base_url):
        yield Served(llm, app, base_url, reference)


@contextlib.contextmanager
def running_server(engine):
    """An LLM (its engine on a thread) or an engine process (api/server/engine_process.py)
    served by uvicorn on a thread, on a free loopback port: (app, base URL)."""
    app = build_app(engine, MODEL, llm_model_dir())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def llm_model_dir():
    from deepinfer_jax.api.llm import DEFAULT_MODEL

    return DEFAULT_MODEL
