"""Shared fixtures: the oracle's reference cases, loaded once per session."""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# Compiling is most of an engine test's time on the CPU, and the tests run what they compile
# for a few steps: without LLVM's optimisations of the generated code the tiny-mixed engine's
# two buckets build in 6.3 s instead of 8.5, though 32 prompts then take 0.7 s instead of 0.4
# (the suite's test time -16%: docs/performance-log.md). The programs XLA builds are the same
# (its HLO passes all run); only the machine code is less tuned. A user's setting of the flag
# wins.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",)


def xla_flags(*extra: str) -> str:
    """XLA_FLAGS for a test process (this one, or a subprocess with `extra` flags)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    own = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in {g.split("=")[0] for g in flags}]
    return " ".join([*flags, *own, *extra])


def subprocess_pythonpath() -> str:
    """PYTHONPATH for a test's subprocess: the repository ahead of this process's own entries
    (the GPU machine's carried wheels are on it: bench/gpu_suite.py)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


os.environ["XLA_FLAGS"] = xla_flags()      # (before the CPU client exists, as below)
# Compiled steps persist across test runs (and are shared by every engine with equal shapes).
os.environ.setdefault("XDG_CACHE_HOME", str(REPO / ".cache" / "xdg"))
# Every CPU computation runs to its end in the call that dispatches it. The kernels' GPU
# interpret mode runs jax computations inside io_callbacks; with async dispatch, a test that
# dispatched its next computation (the reference) while an interpreted kernel still ran left
# the callback's nested computation queued behind it: a deadlock, both threads on a futex
# (a CI run here, in tests/kernels/test_sink_attention.py; an earlier run's hang in a test
# not identified was likely the same).
jax.config.update("jax_cpu_enable_async_dispatch", False)   # (before the CPU client exists)
# jax's persistent compilation cache is off in the tests. An engine points it at its cache
# directory with no minimum compile time (engine/compile.py), so after a worker's first engine
# every small jit the tests compiled was serialized to disk too, and XLA's CPU client crashed
# inside that serialization in CI runs (segfaults in compilation_cache.put_executable_and_time,
# twice, one in a V4.1 test's plain jit).
jax.config.update("jax_enable_compilation_cache", False)
# And the engine's step cache is off in the test processes (test_step_cache.py turns it on in
# its own): the next clean-clone run lost a worker to a segfault inside the step cache's
# serialization (jax.experimental.serialize_executable, on the main thread, every compile
# done). Every crash seen was XLA's CPU client serializing an executable or compiling one.
os.environ["DEEPINFER_STEP_CACHE"] = "0"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a
    container's `cpus` limit leaves os.cpu_count() at the host's count, and a pool a host core
    each would oversubscribe the few it has)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


# The CPU client's intra-op pool has a thread per core, and interpret mode blocks pool threads:
# the kernel's thread_map callback waits on its simulated warpgroups, each a computation of its
# own whose barrier waits can run on the pool too. On a 2-core machine both threads ended up
# blocked (the outer callback and one warpgroup's barrier) while the other warpgroups' thunks
# waited for a free thread: the engine's step on interpreted kernels hung for good (CI's 90 min,
# split-score attention; py-spy showed exactly that). One outer callback and two of a kernel's
# three warpgroups can block at once (all three waiting is a barrier that completes), so 4
# threads always leave the last one room; more cost the other tests time on two cores (two test
# files: 99 s with 2 threads, 106 s with 4, 123 s with 8). Larger machines keep a thread a core.
os.environ.setdefault("PJRT_NPROC", str(max(4, usable_cores())))
ORACLE_DIR = Path(os.environ.get("DEEPINFER_ORACLE_DIR", REPO / ".cache" / "oracle"))
ORACLE_CASES = ("tiny-mixed", "tiny-sigmoid", "tiny-legacy")
# The two tiny DeepSeek-V4.1 checkpoints with transformers-main reference outputs (issue 36),
# kept beside the checkout (read-only), not made by `make oracle`.
V41_ORACLE_DIR = Path(os.environ.get("DEEPINFER_V41_ORACLE_DIR", REPO.parent / "shared" / "oracle"))


class OracleCase:
    def __init__(self, directory: Path):
        self.dir = directory
        self.checkpoint = directory / "checkpoint"
        self.reference = dict(np.load(directory / "reference.npz"))
        self._model = None

    @property
    def model(self):
        """The float32 model, loaded once (its compiled forward is shared by the tests)."""
        if self._model is None:
            import deepinfer_jax

            self._model = deepinfer_jax.load(self.checkpoint, dtype=np.float32)
        return self._model


_cases: dict[str, OracleCase] = {}


def oracle_case(name: str) -> OracleCase:
    if name not in _cases:
        found = sorted(p for p in ORACLE_DIR.glob(f"{name}-*") if (p / "meta.json").exists())
        if not found:
            pytest.fail(f"no oracle fixtures for {name} in {ORACLE_DIR}: run `make oracle` "
                        "(or `make test`, which builds them first)")
        _cases[name] = OracleCase(found[-1])
    return _cases[name]


def pytest_runtest_logreport(report):
    """With DEEPINFER_FAILURES_LOG set, each failure's traceback is appended to that file as
    its report arrives (in xdist's controller, or the one process without it): a GPU run that
    its device call's time limit stops ends before pytest's summary prints any traceback."""
    path = os.environ.get("DEEPINFER_FAILURES_LOG")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as log:
            log.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


# pytest-xdist's `--dist loadfile` work units: a test file each, except in these packages, each
# of which runs as one unit on one worker: their package-scoped fixture (tests/api's compiled,
# served engine and its reference outputs, about a minute on CI's machine) would otherwise be
# built again on every worker that draws one of their files.
ONE_UNIT_PACKAGES = ("tests/api/",)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FilesAndPackageUnits(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((p for p in ONE_UNIT_PACKAGES if path.startswith(p)), path)

    return FilesAndPackageUnits(config, log)


def pytest_sessionstart(session):
    """The machine in the run's log (the controller's; workers print nothing): suite times
    differ between CI machines by a factor of three."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or hasattr(session.config, "workerinput"):
        return
    model = next((line.split(":", 1)[1].strip() for line in _read_lines("/proc/cpuinfo")
                  if line.startswith("model name")), "unknown CPU")
    reporter.write_line(f"machine: {model}; {os.cpu_count()} CPUs, {usable_cores()} usable; "
                        f"PJRT_NPROC={os.environ['PJRT_NPROC']}")


def _read_lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


@pytest.fixture(params=ORACLE_CASES)
def case(request) -> OracleCase:
    return oracle_case(request.param)


@pytest.fixture
def mixed_case() -> OracleCase:
    return oracle_case("tiny-mixed")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test past pyproject's timeout fails with every thread's stack (pytest-timeout), and
    the run stops there: a hang's threads may still hold the CPU client's pool, which would
    starve the tests after it into timeouts of their own."""
    report = yield
    if report.failed and call.excinfo is not None and "from pytest-timeout" in str(call.excinfo.value):
        item.session.shouldstop = f"{item.nodeid} hung (the stacks are in its report)"
    return report


# pytest-timeout's signal method needs the main thread back in Python; a test stuck inside
# XLA (a futex wait) never returns there, and one CI run's worker sat so until CI's 90 min ran
# out. Past this the watchdog thread of faulthandler prints every thread's stack and ends the
# process: xdist reports the test as failed ("node down") and goes on without it. Armed around
# the whole of a test's protocol, so that a module fixture's set-up (an engine compiled for
# the test file) is covered too.
HARD_TIMEOUT_S = 1200


# Engines' compiled steps kept from one test file to the next (engine/compile.py's memo keeps 32).
# Files often build an engine of the same shapes as a file before (the shared tiny configs),
# and a worker compiled such steps again for 270 s of one run's 70 core-minutes; the four most
# recent trace keys would have served about 100 s of that (replayed on that run's compile log).
# With four kept, a later run's workers still compiled three step sets again that five to
# seven other keys had pushed out (34 s); eight keep them (a tiny model's two-bucket set held
# 20-50 MB of the worker's memory).
KEPT_STEP_SETS = 8


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """After each test file, its jit caches and all but the most recent compiled steps are let
    go. A worker kept up to 32 engines' steps and every jit it ever compiled, about 6 GB by the
    end of a run, and three clean-clone runs here each lost a worker inside XLA's CPU client
    (compiling or serializing) in the same late test, test_speculative_shipped.py, which passes
    on its own (serializing was since turned off above). A file's own fixtures still share
    their engines."""
    yield
    from deepinfer_jax.engine import compile as engine_compile

    kept = list(engine_compile._memo.items())[-KEPT_STEP_SETS:]
    engine_compile._memo.clear()
    engine_compile._memo.update(kept)
    jax.clear_caches()
    gc.collect()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(HARD_TIMEOUT_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
