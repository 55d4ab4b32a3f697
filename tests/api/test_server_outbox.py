"""The engine thread's Outbox: a step's events for many jobs reach their asyncio queues in
order, in one thread-safe call per event loop (api/server/engine_thread.py)."""

import asyncio
import threading

from deepinfer_jax.api.server.engine_thread import Job, Outbox
from deepinfer_jax.host.request import SamplingParams


def test_a_steps_events_arrive_in_order_in_one_wakeup():
    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job([[1, 2]], SamplingParams(), True, loop, asyncio.Queue()) for _ in range(3)]
        calls = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            calls.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        outbox = Outbox()

        def engine_thread():            # a step touching every job, one finishing
            for step in range(2):
                for i, job in enumerate(jobs):
                    outbox.push(job, "delta", 0, 0, f"step{step}-job{i}", None)
                if step == 1:
                    outbox.push(jobs[1], "done")
                outbox.flush()

        thread = threading.Thread(target=engine_thread)
        thread.start()
        thread.join()
        await asyncio.sleep(0)          # the two deliveries run on this loop
        await asyncio.sleep(0)
        got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
        return calls, got

    calls, got = asyncio.run(main())
    assert len(calls) == 2                       # one wake-up per step, not one per event
    for i, events in enumerate(got):
        assert [e[3] for e in events[:2]] == [f"step0-job{i}", f"step1-job{i}"]
    assert got[1][-1] == ("done",) and len(got[1]) == 3 and len(got[0]) == len(got[2]) == 2


def test_a_flush_to_a_closed_loop_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    job = Job([[1]], SamplingParams(), True, loop, asyncio.Queue())
    loop.close()
    outbox = Outbox()
    outbox.push(job, "done")
    outbox.flush()                               # the server is shutting down: no error
    outbox.flush()                               # and the outbox was emptied
