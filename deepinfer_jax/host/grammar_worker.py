"""The child process that compiles grammars, and its handle in the engine's process.

llguidance compiles a grammar holding the interpreter lock, and a pathological schema can run
for tens of seconds or grow the process by gigabytes. So compiles run here, in a process of
their own: its address space is capped (RLIMIT_AS), and a compile still running at the time
limit is stopped by killing the process (a thread could not be stopped). The engine's loop
only ever polls (`GrammarWorker.poll`), so a compile never delays anyone else's step.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from collections import deque

# A grammar compile's address-space cap in the child: far above any real schema's needs
# (tens of MB), far below the host's memory.
MEMORY_LIMIT_BYTES = 4 << 30


@dataclasses.dataclass(frozen=True)
class Compiled:
    grammar: str                # llguidance's grammar, ready for LLMatcher


@dataclasses.dataclass(frozen=True)
class Rejected:
    message: str                # the grammar does not compile: the same text always fails
    cacheable: bool = True      # False: a resource limit, which a later try may pass


def _serve(conn, compile_fn, tokenizer_json: str, vocab_size: int, eos: list[int],
           memory: int) -> None:
    """The child: compile (kind, text) jobs one at a time until the pipe closes."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    import llguidance

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    conn.send("ready")              # a job's time limit counts from here, not from the spawn
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:
            return
        conn.send(compile_fn(llguidance, tokenizer, kind, text))


def compile_grammar(llguidance, tokenizer, kind: str, text: str) -> Compiled | Rejected:
    """Compile and validate one grammar (in the child)."""
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(text)
        else:
            grammar = llguidance.grammar_from("grammar", text)
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    except ValueError as e:
        return Rejected(f"{kind}: {e}")
    except MemoryError:
        return Rejected(f"{kind}: needs more than {MEMORY_LIMIT_BYTES >> 30} GiB to compile",
                        cacheable=False)
    return Rejected(f"{kind}: {error}") if error else Compiled(grammar)


class GrammarWorker:
    """Submit (kind, text) jobs; poll for their results. One job runs at a time in the child;
    a job past `timeout_s` (counted from when the child is ready for it) kills the child (its
    result: a non-cacheable Rejected) and the next job starts a fresh one."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: tuple[int, ...],
                 timeout_s: float, memory_bytes: int = MEMORY_LIMIT_BYTES):
        # the child imports compile_grammar by name (spawn): a module-level function
        self._args = (compile_grammar, tokenizer_json, vocab_size, list(eos), memory_bytes)
        self.timeout_s = timeout_s
        self._queue: deque[tuple[str, str]] = deque()
        self._running: tuple[str, str] | None = None
        self._started = 0.0              # when the child began the running job
        self._ready = False              # the child has loaded its tokenizer
        self._process = self._conn = None

    def submit(self, job: tuple[str, str]) -> None:
        self._queue.append(job)
        self._start_next()

    def poll(self, wait_s: float = 0.0) -> list[tuple[tuple[str, str], Compiled | Rejected]]:
        """Results that are ready (waiting up to wait_s for the running job's)."""
        done = []
        job = self._running
        if job is not None:
            deadline = time.monotonic() + wait_s
            try:
                while self._conn.poll(max(0.0, deadline - time.monotonic())):
                    message = self._conn.recv()
                    if message == "ready":
                        self._ready, self._started = True, time.monotonic()
                        continue
                    done.append((job, message))
                    self._running = None
                    break
            except (EOFError, OSError):     # the child died (its memory limit, a crash)
                done.append((job, Rejected(f"{job[0]}: the grammar compiler failed on it",
                                           cacheable=False)))
                self._stop()
            if (self._running is not None and self._ready
                    and time.monotonic() - self._started > self.timeout_s):
                self._stop()
                done.append((job, Rejected(f"{job[0]} did not compile within "
                                           f"{self.timeout_s:.1f} s", cacheable=False)))
        self._start_next()
        return done

    @property
    def busy(self) -> bool:
        return self._running is not None or bool(self._queue)

    def close(self) -> None:
        self._queue.clear()
        self._running = None
        self._stop()

    def _start_next(self) -> None:
        if self._running is not None or not self._queue:
            return
        if self._process is None:
            context = multiprocessing.get_context("spawn")
            parent, child = context.Pipe()
            self._process = context.Process(target=_serve, args=(child, *self._args),
                                            daemon=True, name="grammar-compiler")
            self._process.start()
            child.close()
            self._conn, self._ready = parent, False
        self._running = self._queue.popleft()
        self._conn.send(self._running)
        self._started = time.monotonic()

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=5)
        self._process = self._conn = None
        self._running = None
