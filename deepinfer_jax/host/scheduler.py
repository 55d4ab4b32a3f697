"""The scheduler: which requests run in the next step, and how many tokens each (no jax).

Two verbs, as in nano-vllm and vLLM v1: `schedule()` returns the whole decision for the next
step (decision.py), `postprocess(decision, output)` applies the step's results.

Policy per step, under a token budget (`max_num_batched_tokens`):
1. decodes of running requests (one token each), oldest first;
2. continued prefill chunks of running requests;
3. admission of waiting requests, first come first served, while a state slot is free and
   the cache can hold the newcomer to its end: the pages the running requests will still
   need, each up to its own end (min(prompt + max_tokens, max_model_len)), plus the
   newcomer's, must fit in the free pages (and idle cached blocks, which can be evicted).
   Reserving the whole need rather than estimating it (SGLang's new-token ratio) makes a
   batch without shared prefix pages or drafts never preempt, so it is never slower than its
   requests one by one; a request that stops early only gives its reservation back early.
   A request whose prefix continues in blocks the disk KV tier is still reading is passed
   over, keeping its place, until they are in (host/kv_tiers/prefetch.py).
A running request that needs a page when none is free preempts the newest running request
(possibly itself): its slot and pages are freed and it goes back to the front of the queue,
keeping its generated tokens, to be recomputed later. Nothing is lost. With admission as
above this is a safety net for what the reservation cannot see (pages shared with the prefix
cache, pages held for speculative drafts).

Pages, the prefix index and its snapshots belong to the KV cache manager (kv_cache.py). With
prefix caching, admission first looks the request's tokens up: the matched blocks' pages are
shared and their snapshot restored (`ScheduleDecision.restores`), so computing starts after
them; cached blocks no sequence uses are evicted before anything is preempted, and a
preempted request resumes from its own cached blocks. Prefill chunks are cut at block
boundaries so that each chunk's end can be snapshotted (`ScheduleDecision.saves`); the blocks
a step completes enter the cache once their tokens are known on the host.

The engine launches every decision as soon as it has it, and reads a step's tokens one step
later (or at once, in the synchronous loop), so `schedule()` books the step as launched before
returning: counts advance, each sampled token is a PLACEHOLDER that the next step reads on the
device, and a request that reaches max_tokens or max_model_len finishes. `postprocess` fills
the placeholders; EOS, stop tokens, stop strings and finished grammars end requests there. A
stop is thus seen one step late, so a stopped request may have one extra token computed,
which is discarded. A speculative step books its rows as if no draft were accepted (the
asynchronous loop), or nothing at all (the synchronous one): how far each row gets is known only
from its output (host/spec_booking.py).
"""

from __future__ import annotations

import collections

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import SpecStepOutput, StepOutput
from deepinfer_jax.host.decision import Restore, ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.kv_cache import PREFETCHING, KVCacheManager
from deepinfer_jax.host.kv_tiers.prefetch import TierWorker
from deepinfer_jax.host.output_checks import end_of_output
from deepinfer_jax.host.pages import pages_needed
from deepinfer_jax.host.request import PLACEHOLDER, FinishReason, Request, RequestStatus
from deepinfer_jax.host.spec_booking import SpecBooking, apply_speculative, token_logprobs


class Scheduler:
    defers_masks = False    # constrained requests may run with a token in flight (core.py)
    # speculative steps booked at launch (the asynchronous loop; None: read first, host/spec_booking.py)
    spec_booking: SpecBooking | None = None

    def __init__(self, step_cfg: StepConfig, eos_token_ids: tuple[int, ...],
                 tiers: TierWorker | None = None):
        self.step_cfg = step_cfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.kv_cache = KVCacheManager(step_cfg.num_pages, step_cfg.page_size, step_cfg.enable_prefix_caching,
                                       step_cfg.num_snapshots,
                                       snapshots_need_next_token=step_cfg.speculative is not None,
                                       tiers=tiers, replay_tokens=step_cfg.bounded_replay)
        self._free_slots = list(range(step_cfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def prefix_stats(self):
        """The prefix cache's counters (PrefixCacheStats), or None without prefix caching."""
        return self.kv_cache.prefix_stats()

    def page_counts(self) -> tuple[int, int]:
        """(pages in the pool, pages free): what the server's metrics report."""
        return self.step_cfg.num_pages, self.kv_cache.num_free_pages

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self._finish(req, FinishReason.ABORT)
                self.kv_cache.forget_prefetch(req)
                return req
        return None

    # ---- the two verbs --------------------------------------------------------------------
    def schedule(self, speculate: bool = True) -> ScheduleDecision:
        """The next step, booked as launched (see the module docstring): the caller launches
        it before the next `schedule()` and hands its output to `postprocess`. speculate
        False: a plain step even where the batch would speculate (data-parallel ranks share
        one step, host/ranks.py)."""
        self.kv_cache.cache_completed()
        cap = self.draft_cap() if speculate else 0
        speculative = cap > 0
        scheduled, budget = self._schedule_running(cap, speculative)
        restores = self._admit(cap, speculative, budget, scheduled)
        seqs = tuple(scheduled)
        # before the counts advance; a carried row's once its start is known (spec_booking.py)
        saves = self.kv_cache.snapshot_saves(s for s in seqs if not s.carried)
        if not speculative:
            self._book_launch(seqs)
        elif self.spec_booking is not None:
            self.spec_booking.book(self, seqs)
        # tier copies wait for a step that launches (one without rows launches nothing)
        tier_ops = self.kv_cache.take_tier_ops() if seqs else ()
        if not seqs and not self.running:      # only prefetches to wait for: no busy loop
            self.kv_cache.wait_prefetch(0.05)
        return ScheduleDecision(seqs, speculative, tuple(restores), saves, tier_ops=tier_ops,
                                truncating_sampler=any(s.request.params.truncates for s in seqs))

    def postprocess(self, decision: ScheduleDecision, output: StepOutput | SpecStepOutput
                    ) -> list[Request]:
        """Apply a launched step's results (numpy, read back from the device): fill its tokens
        in, end requests on EOS, stop tokens, stop strings or a finished grammar, and cache the
        blocks whose tokens are now known. Returns the requests that received tokens."""
        if isinstance(output, SpecStepOutput) != decision.speculative:
            raise TypeError(f"a {'speculative' if decision.speculative else 'plain'} step's "
                            f"decision with a {type(output).__name__}")
        if decision.speculative:
            touched = (self.spec_booking.apply(self, decision, output) if self.spec_booking
                       else apply_speculative(self, decision, output))
        else:
            touched = self._apply_tokens(decision, output)
        for req in touched:
            index = end_of_output(req)     # grammar, stop strings
            if index is not None:
                self._stop_at(req, index)
        return touched

    # ---- schedule() -----------------------------------------------------------------------
    def _schedule_running(self, cap: int, speculative: bool) -> tuple[list[ScheduledSeq], int]:
        budget = self.step_cfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        # A constrained request needs its last token on the host (its grammar mask depends on
        # it): with a token in flight it sits this step out, unless the engine applies its
        # mask once the token is in (`defers_masks`, engine/deferred_masks.py).
        ready = [r for r in self.running if self.defers_masks
                 or not (r.matcher is not None and r.has_placeholders)]
        decodes = [r for r in ready if r.num_pending == 1]
        prefills = [r for r in ready if r.num_pending > 1]
        if not speculative:           # a plain step: drafts made for it would be misaligned
            for req in decodes:
                req.drafts = []
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            carried = self.spec_booking is not None and self.spec_booking.carried(req)
            wanted = self.spec_booking.num_drafts(req) if carried else len(req.drafts)
            n = self._chunk(req, req.num_pending + wanted, budget)
            drafts = max(0, n - req.num_pending)             # drafts ride after the last token
            shift = self.spec_booking.max_shift(req) if carried else 0   # pages: all accepted
            if not self._make_room(req, req.num_computed + shift + n, scheduled):
                continue
            samples = req.num_computed + n - drafts == req.num_tokens
            scheduled.append(self._row(req, n, samples, drafts, cap, speculative, carried))
            budget -= n
        return scheduled, budget

    def _admit(self, cap: int, speculative: bool, budget: int,
               scheduled: list[ScheduledSeq]) -> list[Restore]:
        restores = []
        if not (self.waiting and budget > 0 and self._free_slots):
            return restores      # the common decode step: no sum over the running requests
        reserved = sum(self._pages_to_come(r) for r in self.running)
        skipped: list[Request] = []     # their prefix is being read from disk: they wait
        try:
            self._admit_waiting(cap, speculative, budget, scheduled, reserved, restores, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))
        return restores

    def _admit_waiting(self, cap: int, speculative: bool, budget: int,
                       scheduled: list[ScheduledSeq], reserved: int, restores: list[Restore],
                       skipped: list[Request]) -> None:
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            if req.has_placeholders:   # preempted with a token in flight: recompute needs it
                break
            match = self.kv_cache.match_prefix(req)
            if match is PREFETCHING:
                skipped.append(self.waiting.popleft())
                continue
            n = self._chunk(req, req.num_pending, budget)
            if (not self._fits(req, reserved)
                    or not self.kv_cache.grow(req, req.num_computed + n)):
                self.kv_cache.release(req)
                req.num_computed = 0
                break
            reserved += self._pages_to_come(req)
            self.waiting.popleft()
            req.status, req.slot = RequestStatus.RUNNING, self._free_slots.pop()
            self.running.append(req)
            if match is not None:
                self.kv_cache.count_lookup(req, match)
                if match.snapshot is not None:
                    restores.append(Restore(req.slot, match.snapshot, match.snapshot_end,
                                            tuple(req.tokens[: match.num_tokens]), len(req.prompt)))
            scheduled.append(self._row(req, n, n == req.num_pending, 0, cap, speculative))
            budget -= n

    def _pages_to_come(self, req: Request) -> int:
        """Pages `req` does not hold yet and will need to reach its end."""
        end = min(len(req.prompt) + req.params.max_tokens, self.step_cfg.max_model_len)
        return max(0, pages_needed(end, self.step_cfg.page_size) - len(req.pages))

    def _fits(self, req: Request, reserved: int) -> bool:
        """Whether `req` (holding its matched prefix pages) can run to its end next to the
        running requests, which still need `reserved` pages. Alone it always may (as far as
        its first chunk's pages go): the engine rejects a request that cannot fit the pool,
        and nothing else is held up by one that waits for pages still pending."""
        return not self.running or self.kv_cache.can_provide(reserved + self._pages_to_come(req))

    def _row(self, req: Request, n: int, samples: bool, num_drafts: int, cap: int,
             speculative: bool, carried: bool = False) -> ScheduledSeq:
        return ScheduledSeq(
            req, req.num_computed, n, samples, req.slot, req.pages, num_drafts,
            draft_cap=cap if samples and self._may_draft(req) else 0,
            token_index=len(req.generated) if samples and not speculative else None,
            mask_stops=samples and len(req.generated) < req.params.min_tokens, carried=carried)

    def _book_launch(self, seqs: tuple[ScheduledSeq, ...]) -> None:
        """A plain step as launched: advance the computed counts and append a placeholder for
        each sampled token (at its row's `token_index`); length limits end requests now."""
        for seq in seqs:
            req = seq.request
            req.num_computed = seq.start + seq.num_tokens
            self.kv_cache.count_replayed(req, seq.start)
            if seq.token_index is None:
                continue
            req.generated.append(PLACEHOLDER)
            req.logprobs.append(None)
            if (len(req.generated) >= req.params.max_tokens
                    or req.num_tokens >= self.step_cfg.max_model_len):
                self._finish(req, FinishReason.LENGTH)

    def _chunk(self, req: Request, wanted: int, budget: int) -> int:
        """Tokens to feed `req` this step. With prefix caching a prefill chunk that stops
        short of the last token ends on a block boundary, where its state can be snapshotted."""
        n = min(wanted, budget)
        if self.kv_cache.caching and n < req.num_pending:
            end = req.num_computed + n
            aligned = end - end % self.step_cfg.page_size
            if aligned > req.num_computed:
                n = aligned - req.num_computed
        return n

    def draft_cap(self) -> int:
        """Drafts per row for the next step (0: a plain step), from the requests that would
        run in it."""
        return self._draft_cap(len(self.running) + min(len(self.waiting), len(self._free_slots)))

    def _draft_cap(self, batch: int) -> int:
        """Drafts per row for the next step: the verify-token budget shared by the batch's
        requests (0 once the batch is large: the step is compute-bound)."""
        spec = self.step_cfg.speculative
        if spec is None:
            return 0
        return min(spec.num_speculative_tokens, spec.verify_token_budget // max(batch, 1))

    @staticmethod
    def _may_draft(req: Request) -> bool:
        """Rows whose next tokens depend on host state per token do not speculate: grammar
        masks, penalties, and min_tokens still holding back stops."""
        p = req.params
        return not (p.constrained or p.repetition_penalty != 1 or p.presence_penalty
                    or p.frequency_penalty or len(req.generated) < p.min_tokens)

    def _make_room(self, req: Request, end: int, scheduled: list[ScheduledSeq]) -> bool:
        """Give `req` the pages for positions < end, preempting the newest running requests
        not yet scheduled in this step (or `req` itself). False if `req` was preempted."""
        while not self.kv_cache.grow(req, end):
            taken = {s.request for s in scheduled}
            victims = [r for r in self.running if r is not req and r not in taken]
            victim = max(victims, key=lambda r: r.arrival_index) if victims else req
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        if self.spec_booking is not None and self.spec_booking.carried(req):
            raise RuntimeError(f"request {req.request_id}: preempted with a speculative step "
                               "in flight (SpecBooking.must_read_first should have prevented it)")
        self._release(req)
        self.running.remove(req)
        req.status, req.num_computed = RequestStatus.WAITING, 0
        req.drafts = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- postprocess() --------------------------------------------------------------------
    def _apply_tokens(self, decision: ScheduleDecision, out: StepOutput) -> list[Request]:
        """A plain step: each sampled token fills its placeholder."""
        touched = []
        for row, seq in enumerate(decision.seqs):
            req, index = seq.request, seq.token_index
            if index is None or index >= len(req.generated):   # dropped: stopped or aborted
                continue
            token = int(out.next_tokens[row])
            req.generated[index] = token
            if req.params.logprobs is not None:
                req.logprobs[index] = token_logprobs(token, out.logprob[row], out.top_ids[row],
                                                      out.top_logprobs[row], req.params.logprobs)
            touched.append(req)
            if self._is_stop(req, token):
                self._stop_at(req, index, token)    # drops tokens computed after the stop
        self.kv_cache.cache_completed()
        return touched

    def _is_stop(self, req: Request, token: int) -> bool:
        p = req.params
        return (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids

    # ---- ending requests ------------------------------------------------------------------
    def _stop_at(self, req: Request, index: int, stop_token: int | None = None) -> None:
        """End `req` after its generated token `index` (stop token or string, grammar done;
        with `req.error` set, a grammar's dead end: an error). A stop token is recorded as
        vLLM reports it: its id is the stop reason, EOS's none."""
        req.truncate(index + 1)
        if stop_token is not None:
            req.ended_on_stop_token = True
            req.stop_reason = stop_token if stop_token in req.params.stop_token_ids else None
        reason = FinishReason.STOP if req.error is None else FinishReason.ERROR
        if req.status is RequestStatus.FINISHED:
            req.finish_reason = reason
        else:
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if reason is FinishReason.ABORT:   # tokens still in flight are dropped
            req.truncate(len(req.resolved_tokens))

    def _release(self, req: Request) -> None:
        self.kv_cache.release(req)
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None

