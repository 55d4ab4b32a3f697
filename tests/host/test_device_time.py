"""bench/lib/device_time.py: a trace's kernel events summed by name, and the GPU's busy time
against its span (overlapping kernels counted once, gaps not at all), each call's share, and
the idle gaps between kernels."""

from __future__ import annotations

import pytest

from bench.lib.device_time import (
    busy_and_span_of,
    host_events,
    host_totals,
    idle_gaps,
    kernel_totals,
    launching_thread,
    per_call_ms,
)


def event(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "pid": 1, "name": name, "ts": ts, "dur": dur}


def test_busy_counts_overlaps_once_and_gaps_not_at_all():
    # Two calls: [0, 10) and [5, 20) overlap (busy 20), a gap to 30, then [30, 40) holding
    # [32, 35) (busy 10), a gap, [50, 60). Busy 40 us, span 60 us, over 2 calls (in ms).
    events = [event("b", 5, 15), event("a", 0, 10), event("c", 30, 10), event("d", 32, 3),
              event("e", 50, 10)]
    busy, span = busy_and_span_of(events, calls=2)
    assert busy == pytest.approx(40 / 1e3 / 2)
    assert span == pytest.approx(60 / 1e3 / 2)


def test_kernel_totals_per_call_by_name():
    events = [event("gemm", 0, 100), event("gemm", 200, 300), event("copy", 150, 50),
              event("copy", 600, 30)]
    totals = kernel_totals(events, calls=2)
    assert totals["gemm"] == (pytest.approx(0.2), 1)      # 400 us over 2 calls, 1 launch each
    assert totals["copy"] == (pytest.approx(0.04), 1)


def test_per_call_splits_launch_ordered_events_into_calls():
    # Two calls of two kernels each, given out of order: call 0 = 10 + 20 us, call 1 = 15 + 5.
    events = [event("b", 20, 20), event("a", 0, 10), event("c", 50, 15), event("d", 70, 5)]
    assert per_call_ms(events, calls=2) == [pytest.approx(0.03), pytest.approx(0.02)]
    assert per_call_ms(events[:3], calls=2) is None       # a kernel not every call launched


def test_idle_gaps_are_the_holes_between_the_kernels_union():
    # [0, 10) and [5, 20) overlap: no gap; 20 -> 25 (5 us, short), [25, 40) holding [30, 35);
    # 40 -> 90 (50 us, medium) after "c" (the kernel that ended last, not "d"); [90, 100);
    # 100 -> 400 (300 us, long); [400, 410). Idle 355 us over 2 calls.
    events = [event("b", 5, 15), event("a", 0, 10), event("c", 25, 15), event("d", 30, 5),
              event("e", 90, 10), event("f", 400, 10)]
    idle = idle_gaps(events, calls=2, top=2)
    assert idle["idle_ms_per_call"] == pytest.approx(355 / 1e3 / 2)
    assert idle["gaps_per_call"] == 1.5
    assert idle["idle_ms_under_10us"] == pytest.approx(5 / 1e3 / 2)
    assert idle["idle_ms_10_to_100us"] == pytest.approx(50 / 1e3 / 2)
    assert idle["idle_ms_over_100us"] == pytest.approx(300 / 1e3 / 2)
    assert idle["longest"] == [{"us": 300, "after": "e", "before": "f"},
                               {"us": 50, "after": "c", "before": "e"}]


def test_host_totals_are_the_launching_threads_events_not_the_gpus():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]

    def host(tid, name, dur):
        return {"ph": "X", "pid": 2, "tid": tid, "name": name, "ts": 0, "dur": dur}

    # thread 7 launched (the longest in jitted calls), thread 8 planned and made one short call
    events = meta + [event("gemm", 0, 10), host(7, "PjitFunction(jit(step))", 400),
                     host(7, "cuGraphLaunch", 300), host(7, "PjitFunction(jit(step))", 400),
                     host(8, "plan", 900), host(8, "PjitFunction(jit(copy))", 50)]
    assert launching_thread(events) == (2, 7)
    assert host_events(events, (2, 8)) == events[-2:]
    totals = host_totals(events, calls=2, thread=(2, 7))
    assert totals == [{"name": "PjitFunction(jit(step))", "ms_per_call": pytest.approx(0.4),
                       "count_per_call": 1.0},
                      {"name": "cuGraphLaunch", "ms_per_call": pytest.approx(0.15),
                       "count_per_call": 0.5}]
