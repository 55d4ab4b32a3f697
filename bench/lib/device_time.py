"""Device time from a profiler trace: what the GPU spent in kernels, without the host's
launch cost. Back-to-back calls of a jitted function cost ~40 us each on the host, which
hides any kernel shorter than that (decode attention at batch 16 reads 10 MB: 2.5 us at
copy bandwidth); the trace's kernel durations do not."""

from __future__ import annotations

import collections
import gzip
import json
import tempfile
from pathlib import Path

import jax

from bench.lib.timing import Timing


def trace_events(trace_dir: Path) -> list[dict]:
    files = sorted(trace_dir.rglob("*.trace.json.gz")) or sorted(trace_dir.rglob("*.json.gz"))
    return json.loads(gzip.open(files[-1]).read())["traceEvents"] if files else []


def device_events(events: list[dict]) -> list[dict]:
    """The complete events on the GPUs' timelines (on a CPU backend: every thread's)."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpus = {pid for pid, name in processes.items() if "GPU" in name}
    return [e for e in events if e.get("ph") == "X" and (not gpus or e["pid"] in gpus)]


def host_events(events: list[dict], thread: tuple[int, int] | None = None) -> list[dict]:
    """The complete events on the host's timelines (not a GPU's), only those of one
    (pid, tid) where given: what the host spent in XLA's runtime (launches, copies, waits)."""
    processes = {e["pid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "process_name"}
    return [e for e in events if e.get("ph") == "X" and "GPU" not in processes.get(e["pid"], "")
            and (thread is None or (e["pid"], e.get("tid")) == thread)]


def launching_thread(events: list[dict]) -> tuple[int, int] | None:
    """The (pid, tid) of the host thread that spent longest in jitted calls (jax's
    "PjitFunction(...)" events): the one that launched the steps. The trace names Python's
    threads all alike, so the thread is found by what it did."""
    time = collections.Counter()
    for e in host_events(events):
        if e["name"].startswith("PjitFunction("):
            time[(e["pid"], e.get("tid"))] += e.get("dur", 0)
    return time.most_common(1)[0][0] if time else None


def runtime_trace_options() -> jax.profiler.ProfileOptions:
    """Profiler options that keep XLA's runtime events on the host (CUDA graph updates and
    launches, thunks), which the default level leaves out."""
    options = jax.profiler.ProfileOptions()
    options.host_tracer_level = 3
    return options


def _by_name(events: list[dict]) -> dict[str, list]:
    """name (cut to 90 characters) -> [total us, count] over the events."""
    total = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        t = total[e["name"][:90]]
        t[0] += e.get("dur", 0)
        t[1] += 1
    return total


def host_totals(events: list[dict], calls: int, thread: tuple[int, int] | None = None,
                top: int = 30) -> list[dict]:
    """The `top` host event names of `thread` (host_events) by ms per call, nested events
    counted in each of their parents: where the host's time went."""
    ranked = sorted(_by_name(host_events(events, thread)).items(), key=lambda kv: -kv[1][0])
    return [{"name": name, "ms_per_call": us / 1e3 / calls, "count_per_call": count / calls}
            for name, (us, count) in ranked[:top]]


def kernel_totals(events: list[dict], calls: int) -> dict[str, tuple[float, int]]:
    """name -> (ms per call, launches per call) over the device events."""
    return {name: (us / 1e3 / calls, count // calls)
            for name, (us, count) in _by_name(device_events(events)).items()}


def traced(fn, *args, calls: int = 20) -> list[dict]:
    """The trace events of `calls` back-to-back calls of fn(*args) (after one untraced)."""
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        return trace_events(Path(tmp))


def device_kernels(fn, *args, calls: int = 20) -> dict[str, tuple[float, int]]:
    """fn(*args)'s kernels on the GPU: name -> (ms per call, launches per call)."""
    return kernel_totals(traced(fn, *args, calls=calls), calls)


def busy_and_span(fn, *args, calls: int = 20) -> tuple[float, float]:
    """(ms per call the GPU spent in fn's kernels, ms per call from the first kernel's start
    to the last one's end): where the span is longer, the GPU waited between kernels."""
    return busy_and_span_of(device_events(traced(fn, *args, calls=calls)), calls)


def busy_and_span_of(events: list[dict], calls: int) -> tuple[float, float]:
    """busy_and_span's figures from complete events (ts, dur in us)."""
    events = sorted(events, key=lambda e: e["ts"])
    busy, end = 0.0, None
    for e in events:                     # the union of the kernels' intervals, in us
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is None or start >= end:
            busy += stop - start
        elif stop > end:
            busy += stop - end
        end = stop if end is None else max(end, stop)
    span = (end - events[0]["ts"]) if events else 0.0
    return busy / 1e3 / calls, span / 1e3 / calls


def idle_gaps(events: list[dict], calls: int, top: int = 12) -> dict:
    """Where the GPU waited, from complete events: the idle time per call between kernels,
    split by gap length (many short gaps: the kernels are launched one by one slower than
    they run; a few long ones: the host held the next launch back), and the longest gaps
    with the kernels either side."""
    events = sorted(events, key=lambda e: e["ts"])
    gaps, end, last = [], None, None
    for e in events:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is not None and start > end:
            gaps.append((start - end, last["name"][:60], e["name"][:60]))
        if end is None or stop > end:
            end, last = stop, e
    bins = {"under_10us": (0, 10), "10_to_100us": (10, 100), "over_100us": (100, float("inf"))}
    return {"idle_ms_per_call": sum(g for g, _, _ in gaps) / 1e3 / calls,
            "gaps_per_call": len(gaps) / calls,
            **{f"idle_ms_{label}": sum(g for g, _, _ in gaps if lo <= g < hi) / 1e3 / calls
               for label, (lo, hi) in bins.items()},
            "longest": [{"us": g, "after": a, "before": b}
                        for g, a, b in sorted(gaps, key=lambda t: -t[0])[:top]]}


def device_ms(fn, *args, calls: int = 20) -> float:
    """Kernel time per call of `fn(*args)` on the GPU (the sum of its kernels' durations)."""
    return sum(ms for ms, _ in device_kernels(fn, *args, calls=calls).values())


def per_call_ms(events: list[dict], calls: int) -> list[float] | None:
    """Each call's kernel time (ms), from complete events in launch order: the calls run one
    after another on one stream and launch the same kernels, so the i-th run of
    len(events) / calls events is call i. None where the events do not divide evenly (a
    kernel that not every call launched): then only the total per call can be trusted."""
    if not events or len(events) % calls:
        return None
    events = sorted(events, key=lambda e: e["ts"])
    size = len(events) // calls
    return [sum(e.get("dur", 0) for e in events[i * size:(i + 1) * size]) / 1e3
            for i in range(calls)]


def device_timing(fn, *args, calls: int = 20) -> Timing:
    """fn(*args)'s kernel time on the GPU as a median over the traced calls, with the spread
    between calls (one sample of the mean per call where the calls cannot be told apart)."""
    events = device_events(traced(fn, *args, calls=calls))
    samples = per_call_ms(events, calls)
    if samples is None:
        mean = sum(e.get("dur", 0) for e in events) / 1e3 / calls
        return Timing(mean, mean, mean, 1)
    return Timing.of(samples)
