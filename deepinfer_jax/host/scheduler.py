"""The scheduler: which requests run in the next step, and how many tokens each (no jax).

Policy per step, under a token budget (`max_num_batched_tokens`):
1. decodes of running requests (one token each), oldest first;
2. continued prefill chunks of running requests;
3. admission of waiting requests, first come first served, while a state slot and the pages
   for their first chunk are free.
A running request that needs a page when none is free preempts the newest running request
(possibly itself): its slot and pages are freed and it goes back to the front of the queue,
keeping its generated tokens, to be recomputed later. Nothing is lost.

Pages, the prefix index and its snapshots belong to the KV cache manager (kv_cache.py). With
prefix caching, admission first looks the request's tokens up: the matched blocks' pages are
shared and their snapshot restored (`ScheduleDecision.restores`), so computing starts after
them; cached blocks no sequence uses are evicted before anything is preempted, and a
preempted request resumes from its own cached blocks. Prefill chunks are cut at block
boundaries so that each chunk's end can be snapshotted (`snapshot_saves`); the blocks a step
completes enter the cache once their tokens are known on the host.

A step's effects arrive in two parts, so that the runner can plan step N+1 while step N runs:
`commit` when the step is launched (counts advance; each sampled token is a PLACEHOLDER that
the next step reads on the device) and `resolve` when its tokens reach the host (placeholders
get their values; EOS and stop tokens end requests). Length limits are known at commit; a stop
token is seen one step late, so a stopped request may have one extra token computed, which is
discarded. The synchronous loop calls both back to back.
"""

from __future__ import annotations

import collections
import dataclasses

from deepinfer_jax.config.engine import ResolvedEngineConfig
from deepinfer_jax.host.kv_cache import KVCacheManager
from deepinfer_jax.host.request import PLACEHOLDER, FinishReason, Request, RequestStatus, TokenLogprobs


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    start: int          # tokens already in the device state (position of the first new token)
    num_tokens: int     # tokens fed this step (including drafts)
    samples: bool       # the chunk reaches the last known token: sample the next one
    num_drafts: int = 0 # the last num_drafts fed tokens are MTP drafts to verify
    draft_cap: int = 0  # the most drafts the row may propose for the next step


@dataclasses.dataclass(frozen=True)
class Restore:
    """Before the step: load a cached snapshot into an admitted request's slot."""

    slot: int
    snapshot: int
    tokens: tuple[int, ...]       # the tokens the snapshot covers (penalty counters)
    prompt_len: int


@dataclasses.dataclass(frozen=True)
class ScheduleDecision:
    seqs: tuple[ScheduledSeq, ...]
    speculative: bool = False     # run the speculative step (verify drafts, draft with MTP)
    restores: tuple[Restore, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler:
    def __init__(self, ecfg: ResolvedEngineConfig, eos_token_ids: tuple[int, ...]):
        self.ecfg = ecfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.kv_cache = KVCacheManager(ecfg.num_pages, ecfg.page_size, ecfg.enable_prefix_caching,
                                       ecfg.num_snapshots,
                                       snapshots_need_next_token=ecfg.speculative is not None)
        self._free_slots = list(range(ecfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    # ---- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Request | None:
        for req in list(self.waiting) + self.running:
            if req.request_id == request_id:
                self.finish(req, FinishReason.ABORT)
                return req
        return None

    def finish(self, req: Request, reason: FinishReason) -> None:
        if req in self.running:
            self._release(req)
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        if reason is FinishReason.ABORT:   # tokens still in flight are dropped
            req.truncate(len(req.resolved_tokens))

    def stop_at(self, req: Request, index: int) -> None:
        """End `req` after its generated token `index` (stop string, grammar complete)."""
        req.truncate(index + 1)
        if req.status is RequestStatus.FINISHED:
            req.finish_reason = FinishReason.STOP
        else:
            self.finish(req, FinishReason.STOP)

    # ---- one step -------------------------------------------------------------------------
    def schedule(self) -> ScheduleDecision:
        self.kv_cache.cache_completed()
        budget = self.ecfg.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        # A constrained request needs its last token on the host (its grammar mask depends on
        # it), so with a token in flight it sits this step out.
        ready = [r for r in self.running if not (r.matcher is not None and r.has_placeholders)]
        decodes = [r for r in ready if r.num_pending == 1]
        prefills = [r for r in ready if r.num_pending > 1]
        cap = self._draft_cap(len(self.running) + min(len(self.waiting), len(self._free_slots)))
        if cap == 0:                  # a plain step: drafts made for it would be misaligned
            for req in decodes:
                req.drafts = []
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:   # preempted earlier in this loop
                continue
            n = self._chunk(req, req.num_pending + len(req.drafts), budget)
            drafts = max(0, n - req.num_pending)             # drafts ride after the last token
            if not self._make_room(req, req.num_computed + n, scheduled):
                continue
            samples = req.num_computed + n - drafts == req.num_tokens
            scheduled.append(ScheduledSeq(req, req.num_computed, n, samples, drafts,
                                          cap if samples and self._may_draft(req) else 0))
            budget -= n
        restores = []
        while self.waiting and budget > 0 and self._free_slots:
            req = self.waiting[0]
            if req.has_placeholders:   # preempted with a token in flight: recompute needs it
                break
            match = self.kv_cache.match_prefix(req)
            n = self._chunk(req, req.num_pending, budget)
            if not self.kv_cache.grow(req, req.num_computed + n):
                self.kv_cache.release(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            req.status, req.slot = RequestStatus.RUNNING, self._free_slots.pop()
            self.running.append(req)
            if match is not None:
                self.kv_cache.count_lookup(req, match)
                if match.snapshot is not None:
                    restores.append(Restore(req.slot, match.snapshot,
                                            tuple(req.tokens[: match.num_tokens]), len(req.prompt)))
            samples = n == req.num_pending
            scheduled.append(ScheduledSeq(req, req.num_computed, n, samples, 0,
                                          cap if samples and self._may_draft(req) else 0))
            budget -= n
        return ScheduleDecision(tuple(scheduled), speculative=cap > 0, restores=tuple(restores))

    def commit(self, decision: ScheduleDecision) -> tuple[int | None, ...]:
        """The step was launched: advance the computed counts and give each sampled token a
        placeholder. Returns, per row, the index in `generated` its token will fill."""
        token_index: list[int | None] = []
        for seq in decision.seqs:
            req = seq.request
            req.num_computed = seq.start + seq.num_tokens
            self.kv_cache.count_replayed(max(0, min(req.num_computed, req.replay_until) - seq.start))
            req.replay_until = max(req.replay_until, req.num_computed)
            if not seq.samples:
                token_index.append(None)
                continue
            token_index.append(len(req.generated))
            req.generated.append(PLACEHOLDER)
            req.logprobs.append(None)
            if (len(req.generated) >= req.params.max_tokens
                    or req.num_tokens >= self.ecfg.max_model_len):
                self.finish(req, FinishReason.LENGTH)
        return tuple(token_index)

    def resolve(self, decision: ScheduleDecision, token_index: tuple[int | None, ...],
                next_tokens, logprobs=None) -> list[Request]:
        """The step's sampled tokens reached the host: fill the placeholders and stop requests
        on EOS or stop tokens. `logprobs`: (chosen f32[N], top ids i32[N, L], top f32[N, L]).
        Returns the requests that received a token."""
        touched = []
        for row, (seq, index) in enumerate(zip(decision.seqs, token_index)):
            req = seq.request
            if index is None or index >= len(req.generated):   # dropped: stopped or aborted
                continue
            token = int(next_tokens[row])
            req.generated[index] = token
            if logprobs is not None and req.params.logprobs is not None:
                chosen, top_ids, top = logprobs
                n = req.params.logprobs
                req.logprobs[index] = TokenLogprobs(token, float(chosen[row]), tuple(
                    (int(t), float(lp)) for t, lp in zip(top_ids[row][:n], top[row][:n])))
            touched.append(req)
            if self._is_stop(req, token):
                self.stop_at(req, index)    # drops tokens computed after the stop
        self.kv_cache.cache_completed()
        return touched

    # ---- prefix caching (kv_cache.py) -----------------------------------------------------
    def snapshot_saves(self, decision: ScheduleDecision) -> list[tuple[int, int]]:
        """Call when the step is launched (before `commit`); see KVCacheManager.snapshot_saves."""
        return self.kv_cache.snapshot_saves(decision.seqs)

    def _chunk(self, req: Request, wanted: int, budget: int) -> int:
        """Tokens to feed `req` this step. With prefix caching a prefill chunk that stops
        short of the last token ends on a block boundary, where its state can be snapshotted."""
        n = min(wanted, budget)
        if self.kv_cache.caching and n < req.num_pending:
            end = req.num_computed + n
            aligned = end - end % self.ecfg.page_size
            if aligned > req.num_computed:
                n = aligned - req.num_computed
        return n

    # ---- internals ------------------------------------------------------------------------
    def resolve_spec(self, decision: ScheduleDecision, out) -> list[Request]:
        """A speculative step's results (read synchronously): each row committed its last
        token plus `a` accepted drafts and produced a + 1 new tokens; its next drafts wait in
        `req.drafts`. Stops inside the new tokens drop the tokens after them."""
        touched = []
        for row, seq in enumerate(decision.seqs):
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue
            new = int(out.num_new[row])
            accepted = max(new - 1, 0)
            req.num_computed = seq.start + seq.num_tokens - seq.num_drafts + accepted
            req.drafts = []
            if not seq.samples:
                continue
            req.spec.steps += 1
            req.spec.drafted += seq.num_drafts
            req.spec.accepted += accepted
            touched.append(req)
            for j in range(new):
                token = int(out.new_tokens[row, j])
                req.generated.append(token)
                if req.params.logprobs is not None:
                    n = req.params.logprobs
                    req.logprobs.append(TokenLogprobs(token, float(out.logprob[row, j]), tuple(
                        (int(t), float(lp)) for t, lp in zip(out.top_ids[row, j][:n],
                                                           out.top_logprobs[row, j][:n]))))
                else:
                    req.logprobs.append(None)
                if self._is_stop(req, token):
                    self.stop_at(req, len(req.generated) - 1)
                    break
                if (len(req.generated) >= req.params.max_tokens
                        or req.num_tokens >= self.ecfg.max_model_len):
                    self.finish(req, FinishReason.LENGTH)
                    break
            if req.status is RequestStatus.RUNNING:
                req.drafts = [int(t) for t in out.drafts[row, : int(out.num_drafts[row])]]
        return touched

    def _draft_cap(self, batch: int) -> int:
        """Drafts per row for the next step: the verify-token budget shared by the batch's
        requests (0 once the batch is large: the step is compute-bound)."""
        spec = self.ecfg.speculative
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

    def _is_stop(self, req: Request, token: int) -> bool:
        p = req.params
        return (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids

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
        self._release(req)
        self.running.remove(req)
        req.status, req.num_computed = RequestStatus.WAITING, 0
        req.drafts = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.kv_cache.release(req)
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
