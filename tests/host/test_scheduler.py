"""Scheduler and page allocator on the host alone (no model, no jax)."""

from __future__ import annotations

import numpy as np
import pytest

from bench.lib.admission import FirstChunkAdmission
from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.contract import SpecStepOutput, StepOutput
from deepinfer_jax.host.pages import OutOfPagesError, PageAllocator
from deepinfer_jax.host.request import PLACEHOLDER, FinishReason, Request, RequestStatus, SamplingParams
from deepinfer_jax.host.scheduler import Scheduler
from deepinfer_jax.host.stop_strings import StopStrings
from tests.conftest import REPO
from tests.host.test_detokenizer import TOKENIZER

MODEL = read_model_config(REPO / "configs" / "tiny" / "tiny-mixed.json")
EOS = MODEL.eos_token_ids[0]


def make(budget=32, seqs=4, pages=None, page_size=16, max_len=256, scheduler=Scheduler):
    step_cfg = EngineConfig(max_num_seqs=seqs, max_model_len=max_len, page_size=page_size,
                            num_pages=pages, max_num_batched_tokens=budget,
                            compilation_cache_dir=None).resolve(MODEL)
    return scheduler(step_cfg, MODEL.eos_token_ids)


def request(i, prompt_len, **params):
    return Request(str(i), list(range(10, 10 + prompt_len)), SamplingParams(**params), i)


def output(tokens) -> StepOutput:
    """A plain step's output as the engine reads it back (no logprobs asked for)."""
    n = len(tokens)
    return StepOutput(np.asarray(tokens, np.int32), np.zeros(n, np.float32),
                      np.zeros((n, 1), np.int32), np.zeros((n, 1), np.float32))


def run_step(sched, token=7):
    """One synchronous step: schedule (booked as launched), then its tokens (postprocess)."""
    decision = sched.schedule()
    sched.postprocess(decision, output([token] * len(decision.seqs)))
    return decision


def test_page_allocator_counts_and_refuses():
    pages = PageAllocator(3)
    a = pages.allocate(2)
    assert pages.num_free == 1 and not pages.can_allocate(2)
    with pytest.raises(OutOfPagesError):
        pages.allocate(2)
    pages.share(a[0])
    pages.free(a)
    assert pages.num_free == 2          # a[0] still referenced once
    pages.free([a[0]])
    assert pages.num_free == 3
    with pytest.raises(ValueError):
        pages.free([a[0]])


def test_chunked_prefill_respects_the_budget_and_decodes_go_first():
    sched = make(budget=32)
    sched.add(request(0, 10, max_tokens=5))
    sched.add(request(1, 70, max_tokens=5))
    d = run_step(sched)
    assert [(s.request.request_id, s.start, s.num_tokens, s.samples) for s in d.seqs] == [
        ("0", 0, 10, True), ("1", 0, 22, False)]
    d = run_step(sched)
    # request 0 now decodes (one token, scheduled first), request 1 continues its prompt
    assert [(s.request.request_id, s.start, s.num_tokens) for s in d.seqs] == [
        ("0", 10, 1), ("1", 22, 31)]
    d = run_step(sched)
    assert [(s.request.request_id, s.num_tokens, s.samples) for s in d.seqs] == [
        ("0", 1, True), ("1", 17, True)]


def test_stop_conditions():
    sched = make()
    sched.add(eos := request(0, 4, max_tokens=10))
    sched.add(ignore := request(1, 4, max_tokens=3, ignore_eos=True))
    sched.add(stop := request(2, 4, max_tokens=10, stop_token_ids=[9]))
    run_step(sched, token=EOS)
    assert eos.finish_reason is FinishReason.STOP and eos.generated == [EOS]
    assert ignore.status is RequestStatus.RUNNING
    run_step(sched, token=9)
    assert stop.finish_reason is FinishReason.STOP
    run_step(sched, token=EOS)
    assert ignore.finish_reason is FinishReason.LENGTH and ignore.generated == [EOS, 9, EOS]
    assert sched.kv_cache.num_free_pages == sched.step_cfg.num_pages and not sched.has_work()


def test_max_model_len_stops_generation():
    sched = make(max_len=64)
    sched.add(req := request(0, 60, max_tokens=100))
    while sched.has_work():
        run_step(sched)
    assert req.finish_reason is FinishReason.LENGTH and req.num_tokens == 64


def test_admission_waits_for_slots_and_pages():
    sched = make(seqs=2, pages=4, page_size=16, budget=64)
    for i in range(3):
        sched.add(request(i, 20, max_tokens=4))       # 20 tokens -> 2 pages each
    d = sched.schedule()
    assert [s.request.request_id for s in d.seqs] == ["0", "1"]
    assert [r.request_id for r in sched.waiting] == ["2"]    # no slot (and no page) left


def test_preemption_requeues_the_newest_request_with_its_tokens():
    # the old admission overcommits the cache; preemption is the safety net it relies on
    sched = make(seqs=2, pages=4, page_size=16, budget=64, scheduler=FirstChunkAdmission)
    old, new = request(0, 16, max_tokens=40), request(1, 30, max_tokens=40)
    sched.add(old), sched.add(new)
    run_step(sched)        # old holds 1 page, new 2 pages, 1 page free
    # old's 17th token takes the last page; new's 33rd token then finds none: the newest
    # running request (new) is preempted, keeping its generated tokens.
    for _ in range(8):
        run_step(sched)
        if new.status is RequestStatus.WAITING:
            break
    assert new.status is RequestStatus.WAITING and sched.num_preemptions == 1
    assert new.num_computed == 0 and new.pages == [] and new.slot is None
    assert sched.waiting[0] is new and new.num_tokens == 33 and len(new.generated) == 3
    assert old.status is RequestStatus.RUNNING and len(old.pages) == 2
    # once old finishes, new is readmitted and recomputes its 33 tokens before decoding on
    while old.status is RequestStatus.RUNNING:
        run_step(sched)
    d = sched.schedule()
    assert [(s.request, s.start, s.num_tokens, s.samples) for s in d.seqs] == [(new, 0, 33, True)]


# ---- admission under cache pressure -----------------------------------------------------------
def fake_token(seq) -> int:
    """A sampled token that depends only on the request and its position, as greedy decoding's
    does, so that outputs can be compared across schedules."""
    return 100 + (int(seq.request.request_id) * 31 + seq.token_index) % 50


def drive(sched, requests, asynchronous=False) -> int:
    """Run `requests` to the end (synchronous or one step late); returns the steps taken."""
    for req in requests:
        sched.add(req)
    in_flight, steps = None, 0
    while sched.has_work() or in_flight:
        decision = sched.schedule() if sched.has_work() else None
        done = decision if not asynchronous else in_flight
        if done is not None:
            sched.postprocess(done, output([fake_token(s) if s.token_index is not None else 0
                                            for s in done.seqs]))
        in_flight = decision if asynchronous else None
        steps += 1
        assert steps < 10_000
    return steps


def pressure_workload():
    """8 requests of 20 + 60 tokens (5 pages of 16 each) in a pool of 12 pages: two at a time
    fit to their ends, yet every first chunk (2 pages) fits while they are young."""
    return [request(i, 20, max_tokens=60, ignore_eos=True) for i in range(8)]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_admission_reserves_to_the_end_and_never_preempts(asynchronous):
    sched = make(seqs=8, pages=12, page_size=16, budget=64)
    requests = pressure_workload()
    drive(sched, requests, asynchronous)
    assert sched.num_preemptions == 0
    for req in requests:
        assert req.finish_reason is FinishReason.LENGTH and len(req.generated) == 60
        assert req.generated == [100 + (int(req.request_id) * 31 + i) % 50 for i in range(60)]
    assert sched.kv_cache.num_free_pages == 12


@pytest.mark.parametrize("asynchronous", [False, True])
def test_first_chunk_admission_preempts_the_same_workload(asynchronous):
    """The workload above is under pressure: the old admission preempts (the test above fails
    with it), and the recomputed requests still produce the same tokens."""
    new, old = pressure_workload(), pressure_workload()
    drive(make(seqs=8, pages=12, page_size=16, budget=64), new, asynchronous)
    sched = make(seqs=8, pages=12, page_size=16, budget=64, scheduler=FirstChunkAdmission)
    drive(sched, old, asynchronous)
    assert sched.num_preemptions > 0
    assert [r.generated for r in old] == [r.generated for r in new]


def test_admission_fills_the_pool_with_short_requests():
    # 8 requests of 10 + 6 tokens need one page each: all 8 run at once in 8 pages
    sched = make(seqs=8, pages=8, page_size=16, budget=128)
    for i in range(8):
        sched.add(request(i, 10, max_tokens=6))
    assert len(sched.schedule().seqs) == 8 and not sched.waiting
    assert sched.kv_cache.num_free_pages == 0


def test_admission_waits_until_the_whole_need_fits():
    # 3 requests of 20 + 8..12 tokens need 2 pages each to their ends; 5 pages hold two. The
    # third waits though its first chunk's 2 pages are free, and runs once the first finishes.
    sched = make(seqs=4, pages=5, page_size=16, budget=128)
    for i, max_tokens in enumerate((8, 12, 12)):
        sched.add(request(i, 20, max_tokens=max_tokens, ignore_eos=True))
    assert [s.request.request_id for s in run_step(sched).seqs] == ["0", "1"]
    assert sched.kv_cache.num_free_pages == 1 and [r.request_id for r in sched.waiting] == ["2"]
    while sched.waiting:
        run_step(sched)
    assert [r.request_id for r in sched.running] == ["1", "2"] and sched.num_preemptions == 0


def test_abort_frees_everything():
    sched = make(budget=64)
    sched.add(a := request(0, 40))
    sched.add(b := request(1, 5))
    run_step(sched)
    assert sched.abort("0") is a and a.finish_reason is FinishReason.ABORT
    assert sched.abort("nope") is None
    assert a.pages == [] and sched.running == [b]


# ---- asynchronous use: booked at schedule(), postprocessed one step later ---------------------
def test_placeholders_feed_the_next_step_before_the_host_sees_the_token():
    sched = make()
    sched.add(req := request(0, 5, max_tokens=10))
    d0 = sched.schedule()
    assert req.generated == [PLACEHOLDER] and req.num_pending == 1
    assert [s.token_index for s in d0.seqs] == [0]
    d1 = sched.schedule()                      # planned while step 0 runs
    assert [(s.start, s.num_tokens, s.samples, s.token_index) for s in d1.seqs] == [
        (5, 1, True, 1)]
    sched.postprocess(d0, output([11]))
    assert req.generated == [11, PLACEHOLDER] and req.resolved_tokens == [11]
    sched.postprocess(d1, output([12]))
    assert req.generated == [11, 12] and not req.has_placeholders


def test_a_stop_token_is_seen_one_step_late_and_the_extra_token_dropped():
    sched = make()
    sched.add(req := request(0, 5, max_tokens=10))
    d0 = sched.schedule()
    d1 = sched.schedule()                      # one extra token is computed ...
    sched.postprocess(d0, output([EOS]))
    assert req.finish_reason is FinishReason.STOP and req.generated == [EOS] and req.is_complete
    assert sched.postprocess(d1, output([99])) == []   # ... and discarded
    assert req.generated == [EOS] and sched.kv_cache.num_free_pages == sched.step_cfg.num_pages


def test_length_limits_are_known_at_launch():
    sched = make()
    sched.add(req := request(0, 5, max_tokens=2))
    d0 = sched.schedule()
    d1 = sched.schedule()
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert not req.is_complete                 # its last token is still on the device
    assert sched.schedule().seqs == ()         # no extra token for it
    sched.postprocess(d0, output([3]))
    sched.postprocess(d1, output([4]))
    assert req.is_complete and req.generated == [3, 4]


def test_a_preempted_request_waits_for_its_token_before_recomputing():
    sched = make(seqs=2, pages=4, page_size=16, budget=64, scheduler=FirstChunkAdmission)
    sched.add(request(0, 16, max_tokens=40))
    sched.add(new := request(1, 30, max_tokens=40))
    in_flight = None
    for _ in range(12):              # asynchronous: plan step k+1, then postprocess step k
        d = sched.schedule()
        if new.status is RequestStatus.WAITING:
            break
        if in_flight:
            sched.postprocess(in_flight, output([7] * len(in_flight.seqs)))
        in_flight = d
    # preempted while its last token is still on the device: not readmitted in this plan
    assert new.num_preemptions == 1 and new.has_placeholders
    assert all(seq.request is not new for seq in d.seqs)
    sched.postprocess(in_flight, output([7] * len(in_flight.seqs)))
    assert not new.has_placeholders and new.generated[-1] == 7


def test_a_row_keeps_the_slot_and_pages_it_was_scheduled_with():
    """schedule() books the step as launched: a request that reaches max_tokens then releases
    its slot and pages, but the decision (and the plan built from it) still has them."""
    sched = make(page_size=16)
    sched.add(req := request(0, 20, max_tokens=1))
    decision = sched.schedule()
    assert req.finish_reason is FinishReason.LENGTH and req.slot is None and req.pages == []
    [seq] = decision.seqs
    assert seq.slot == 0 and seq.pages == [0, 1] and seq.token_index == 0
    assert sched.kv_cache.num_free_pages == sched.step_cfg.num_pages     # released at launch
    sched.postprocess(decision, output([5]))
    assert req.is_complete and req.generated == [5]


def test_postprocess_takes_the_output_of_the_step_it_was_given():
    sched = make()
    sched.add(request(0, 5))
    decision = sched.schedule()
    n = len(decision.seqs)
    spec = SpecStepOutput(np.zeros((n, 2), np.int32), np.ones(n, np.int32),
                          np.zeros((n, 1), np.int32), np.zeros(n, np.int32),
                          np.zeros((n, 2), np.float32), np.zeros((n, 2, 1), np.int32),
                          np.zeros((n, 2, 1), np.float32))
    with pytest.raises(TypeError, match="plain"):
        sched.postprocess(decision, spec)


def test_a_stop_string_ends_the_request_when_its_token_arrives():
    """postprocess runs the stop-string search: the request ends after the token that
    completes the string, tokens computed after it are dropped, and the text is cut."""
    ids = TOKENIZER.encode(" hello world again")[1:]
    sched = make()
    sched.add(req := request(0, 4, max_tokens=20))
    req.stop_strings = StopStrings(TOKENIZER, ("o w",))
    in_flight = sched.schedule()
    for token in ids:
        decision = sched.schedule()            # asynchronous: the next step is launched first
        sched.postprocess(in_flight, output([token] * len(in_flight.seqs)))
        in_flight = decision
        if req.status is RequestStatus.FINISHED:
            break
    end = next(i for i in range(len(ids)) if "o w" in TOKENIZER.decode(ids[: i + 1]))
    assert req.finish_reason is FinishReason.STOP and req.generated == ids[: end + 1]
    assert req.stop_text_at == len(" hell")
    assert req.output(TOKENIZER.decode(req.generated)).text == " hell"
    assert sched.postprocess(in_flight, output([7] * len(in_flight.seqs))) == []
    assert req.is_complete and sched.kv_cache.num_free_pages == sched.step_cfg.num_pages
