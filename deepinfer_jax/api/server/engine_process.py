"""The engine loop in a process of its own (`deepinfer serve`'s default), as vLLM's V1 runs its
engine core: the server's process keeps HTTP, tokenization and the SSE formatting, the engine
process builds the LLM, schedules and steps, and neither waits for the other's GIL.

Two one-way pipes: commands in (messages.py: Submit, Abort, Stop), and out the engine's
`EngineInfo` once it is ready (or `EngineFailed`), then one `StepMessage` per step. The
server reads that pipe on its event loop (`add_reader`), so a step's message costs it one
wake-up and one unpickling, and no thread of its own.

The process is spawned (never forked: jax in a forked child of an initialized jax is broken),
ignores SIGINT (a Ctrl-C in the terminal reaches the whole process group; the server stops
it), and exits when its command pipe closes, so a server that dies leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable

from deepinfer_jax.api.server.engine_client import EngineClient
from deepinfer_jax.api.server.engine_loop import _IDLE_WAIT_S, EngineLoop, drive
from deepinfer_jax.api.server.messages import EngineFailed, EngineInfo, StepMessage, Stop

log = logging.getLogger("deepinfer.server")

_TIER_REPORTS_EVERY_S = 0.5


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why)."""


class EngineStopped(RuntimeError):
    """The engine process failed or exited while serving."""


class EngineProcess(EngineClient):
    def __init__(self, build_llm: Callable, start_timeout_s: float | None = None):
        """build_llm: a picklable callable (a module-level function or a partial of one) that
        returns the `LLM` to serve; it runs in the engine process. Blocks until the engine is
        ready; raises EngineStartError if it fails or exits first, or after
        `start_timeout_s`."""
        context = multiprocessing.get_context("spawn")
        commands_in, self._commands = context.Pipe(duplex=False)
        self._messages, messages_out = context.Pipe(duplex=False)
        # not a daemon: the engine starts processes of its own (a grammar compile that may
        # time out); it stops with `stop`, which atexit calls too, or on its pipe's EOF
        self.process = context.Process(target=_engine_main, name="deepinfer-engine",
                                       args=(build_llm, commands_in, messages_out))
        self.process.start()
        atexit.register(self.stop)
        # the child's ends live on in the child alone: its exit closes them (EOF here)
        commands_in.close()
        messages_out.close()
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            info = self._wait_ready(start_timeout_s)
        except BaseException:           # (a Ctrl-C too: it reads no Stop while it builds)
            self.stop(timeout=1.0)
            raise
        super().__init__(info.tokenizer, info.chat_template, info.max_model_len, info.num_pages)

    def _wait_ready(self, timeout_s: float | None) -> EngineInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._messages.poll(0.2):
            if not self.process.is_alive():
                raise EngineStartError(f"the engine process exited with code "
                                       f"{self.process.exitcode} before it was ready")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartError(f"the engine process was not ready after {timeout_s} s")
        try:
            message = self._messages.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineStartError(f"the engine process exited with code "
                                   f"{self.process.exitcode} before it was ready") from None
        if isinstance(message, EngineFailed):      # (its traceback is on the engine's stderr)
            raise EngineStartError(f"the engine could not start: {message.error}")
        return message

    # ---- the transport --------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._messages.fileno(), self._read)

    @property
    def alive(self) -> bool:
        return self.error is None and self.process.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine process and wait for it (terminated, then killed, if it hangs)."""
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._messages.fileno())
            except (ValueError, OSError, RuntimeError):    # closed already, or the loop is
                pass
            self._loop = None
        try:
            self._commands.send(Stop())
        except (OSError, ValueError):    # it is gone already
            pass
        # its last messages are read and dropped: a full pipe would keep it from the Stop
        deadline = time.monotonic() + timeout
        while self.process.is_alive() and time.monotonic() < deadline:
            try:
                if self._messages.poll(0.1):
                    self._messages.recv()
            except (EOFError, OSError, ValueError):
                self.process.join(max(deadline - time.monotonic(), 0))
        for end in (self.process.terminate, self.process.kill):
            if self.process.exitcode is not None:
                break
            end()
            self.process.join(5)
        self._commands.close()
        self._messages.close()
        atexit.unregister(self.stop)

    def _send(self, command) -> None:
        try:
            self._commands.send(command)
        except (OSError, ValueError) as e:     # the engine process is gone
            self._gone(e)

    def _read(self) -> None:
        """On the event loop: every message the engine has written so far."""
        try:
            while self._messages.poll():
                message = self._messages.recv()
                if isinstance(message, StepMessage):
                    self.deliver(message)
                elif isinstance(message, EngineFailed):
                    self.fail_all(EngineStopped(f"the engine failed: {message.error}"))
        except (EOFError, OSError) as e:
            self._gone(e)

    def _gone(self, cause: BaseException) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._messages.fileno())
            self._loop = None
        self.process.join(1)
        log.error("the engine process is gone (exit code %s)", self.process.exitcode)
        self.fail_all(EngineStopped(f"the engine process exited (code {self.process.exitcode}): "
                                    f"{type(cause).__name__}"))


# ---- the engine process ------------------------------------------------------------------------
def _engine_main(build_llm: Callable, commands, messages) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        llm = build_llm()
        messages.send(EngineInfo(llm.step_config.max_model_len, llm.step_config.num_pages,
                                 llm.tokenizer, llm.chat_template))
    except BaseException as e:
        _report(messages, e)
        return
    loop = EngineLoop(llm, tier_reports_every_s=_TIER_REPORTS_EVERY_S)

    def receive(block: bool) -> list:
        out = []
        # EOF (the server is gone) reads as a Stop: the engine ends with it
        if commands.poll(_IDLE_WAIT_S if block else 0):
            try:
                out.append(commands.recv())
                while commands.poll(0):
                    out.append(commands.recv())
            except (EOFError, OSError):
                out.append(Stop())
        return out

    def publish(message: StepMessage) -> None:
        try:
            messages.send(message)
        except (pickle.PicklingError, TypeError, AttributeError):
            messages.send(_picklable(message))   # an exception that does not pickle

    try:
        drive(loop, receive, publish)
    except (EOFError, OSError):       # the server is gone: nobody to tell
        return
    except BaseException as e:
        _report(messages, e)


def _report(messages, error: BaseException) -> None:
    """Why the engine stopped: its traceback on this process's stderr (the server's), its
    one line to the server."""
    text = traceback.format_exc()
    print(f"deepinfer engine process:\n{text}", file=sys.stderr, flush=True)
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    try:
        messages.send(EngineFailed(f"{type(error).__name__}: {'; '.join(lines)}", text))
    except (OSError, ValueError):       # the server is gone
        pass


def _picklable(message: StepMessage) -> StepMessage:
    """The message with every error event's exception as a RuntimeError of its text."""
    events = [(e[0], "error", RuntimeError(f"{type(e[2]).__name__}: {e[2]}"))
              if e[1] == "error" else e for e in message.events]
    return StepMessage(events, message.observed, message.snapshot, message.kv_tiers)
