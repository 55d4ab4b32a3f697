"""The engine loop on a thread of the server's own process (`deepinfer serve
--engine-in-process`, and the tests that reach into the engine while it serves).

Commands go to the thread through a queue; each step's message reaches the event loop in one
`call_soon_threadsafe` (one wake-up of the loop a step, not one per request: at batch 64 that
is one system call instead of 64 in a decode step of a few milliseconds). The thread and the
event loop share the GIL: the engine process (engine_process.py) is the default for that."""

from __future__ import annotations

import asyncio
import queue
import threading

from deepinfer_jax.api.llm import LLM
from deepinfer_jax.api.server.engine_client import EngineClient
from deepinfer_jax.api.server.engine_loop import _IDLE_WAIT_S, EngineLoop, drive
from deepinfer_jax.api.server.messages import StepMessage, Stop


class EngineThread(EngineClient):
    def __init__(self, llm: LLM):
        super().__init__(llm.tokenizer, llm.chat_template, llm.step_config.max_model_len,
                         llm.step_config.num_pages)
        self.llm, self.engine = llm, llm.engine
        if self.engine.tiers is not None:      # read at scrape time, under the tiers' locks
            self.metrics.engine.kv_tiers = self.engine.tiers.stats
        self._loop = EngineLoop(llm)
        self.metrics.engine.snapshot = self._loop.snapshot()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._events: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._events = loop
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stop(self, timeout: float = 30.0) -> None:
        self._commands.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            drive(self._loop, self._receive, self._publish)
        except BaseException as e:      # published to every job by drive; /health says so
            self.error = e

    def _receive(self, block: bool) -> list:
        commands = []
        try:
            commands.append(self._commands.get(timeout=_IDLE_WAIT_S) if block
                            else self._commands.get_nowait())
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _publish(self, message: StepMessage) -> None:
        try:
            self._events.call_soon_threadsafe(self.deliver, message)
        except RuntimeError:            # the server's loop is gone (shutting down)
            pass
