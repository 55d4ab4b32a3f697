"""A step's message (api/server/messages.py) through a pipe and onto the server's side
(engine_client.py): it pickles with the host's real types, its events reach their jobs'
queues in order, an aborted job's are dropped, and its observations land in /metrics."""

import asyncio
import pickle
import threading

from deepinfer_jax.api.deltas import Increment
from deepinfer_jax.api.server.engine_client import EngineClient, Job
from deepinfer_jax.api.server.engine_process import _picklable
from deepinfer_jax.api.server.messages import (
    Abort,
    EngineSnapshot,
    Observations,
    StepMessage,
    Submit,
)
from deepinfer_jax.host.request import (
    FinishReason,
    InvalidRequestError,
    RequestOutput,
    SamplingParams,
    TokenLogprobs,
)


class _Recording(EngineClient):
    def __init__(self):
        super().__init__(None, None, 64, 10)
        self.sent = []

    def _send(self, command):
        self.sent.append(command)


def _value(client, name, **labels):
    return client.metrics.registry.get_sample_value(name, labels or None)


def test_a_steps_message_reaches_its_jobs_in_order_and_its_metrics():
    client = _Recording()
    jobs = [Job([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=1), True) for _ in range(3)]
    for job in jobs:
        client.submit(job)
    assert [type(c) for c in client.sent] == [Submit] * 3
    assert client.sent[0].prompts == [[1, 2, 3]] and client.sent[0].arrival == jobs[0].arrival
    client.abort(jobs[2])
    client.abort(jobs[2])                        # once: the engine hears it once
    assert client.sent[3:] == [Abort(jobs[2].id)]
    a, b, gone = (job.id for job in jobs)
    inc = Increment([7], "hi", [TokenLogprobs(7, -0.5, ((7, -0.5),))], True)
    out = RequestOutput("0", [1, 2, 3], [7], "hi", True, FinishReason.LENGTH)
    message = StepMessage(
        events=[(a, "delta", 0, 0, inc, FinishReason.LENGTH), (gone, "delta", 0, 0, inc, None),
                (b, "error", InvalidRequestError("temperature must be >= 0")),
                (a, "final", 0, out), (a, "done")],
        observed=Observations(prompt_tokens=3, generation_tokens=1, ttft=[0.02],
                              e2e=[0.03], finished=["length"], aborted=1),
        snapshot=EngineSnapshot(running=1, pages_total=10, pages_free=7, steps=5))
    client.deliver(pickle.loads(pickle.dumps(message)))   # as the engine process's pipe does
    got_a = [jobs[0].events.get_nowait() for _ in range(jobs[0].events.qsize())]
    assert [e[0] for e in got_a] == ["delta", "final", "done"]
    assert got_a[0][3] == inc and got_a[0][4] is FinishReason.LENGTH
    assert got_a[1][2].outputs[0].token_ids == [7]
    [(kind, error)] = [jobs[1].events.get_nowait()]
    assert kind == "error" and isinstance(error, InvalidRequestError)
    assert jobs[2].events.empty()                # aborted: its events are dropped
    assert not client._jobs                      # done, failed, aborted: none left open
    assert _value(client, "deepinfer_generation_tokens_total") == 1
    assert _value(client, "deepinfer_prompt_tokens_total") == 3
    assert _value(client, "deepinfer_time_to_first_token_seconds_count") == 1
    assert _value(client, "deepinfer_request_success_total", finished_reason="length") == 1
    assert _value(client, "deepinfer_requests_aborted_total") == 1
    assert _value(client, "deepinfer_cache_pages_used") == 3
    assert _value(client, "deepinfer_engine_steps_total") == 5


def test_an_error_that_does_not_pickle_arrives_as_its_text():
    class Unpicklable(Exception):
        def __init__(self):
            super().__init__("held a lock")
            self.lock = threading.Lock()

    message = StepMessage([(4, "error", Unpicklable()), (5, "done")], Observations(),
                          EngineSnapshot())
    back = pickle.loads(pickle.dumps(_picklable(message)))
    assert str(back.events[0][2]) == "Unpicklable: held a lock" and back.events[1] == (5, "done")


def test_an_engine_that_is_gone_ends_every_open_job():
    client = _Recording()
    job = Job([[1]], SamplingParams(), False)
    client.submit(job)
    client.fail_all(RuntimeError("gone"))
    assert asyncio.run(job.events.get())[0] == "error" and client.error is not None
