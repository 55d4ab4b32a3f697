"""The scheduler's speculative steps (no jax): applying a read step's new tokens, and, in the
asynchronous loop, booking a speculative step as launched.

Synchronous loop: a speculative step books nothing at launch; once read, each sampling row
has committed its last token plus `a` accepted drafts and produced a + 1 new tokens, and its
next drafts wait in `req.drafts` (`apply_speculative`).

Asynchronous loop (`SpecBooking`): step N+1 is planned before step N is read. At launch a
speculative step is booked as if no draft were accepted: `num_computed` advances to that
lower bound, a sampling row appends one PLACEHOLDER for its a + 1 new tokens, and its next
drafts stay on the device (model/state.py `SpecCarry`; the plan is built after the booking,
so `req.drafts` keeps the ones a row not carried feeds). A row
that continues a sampling row of the unread step is `carried` (decision.py): its tokens and
its true positions come from the device (device/spec_carry.py), and its pages cover the
unread step's drafts all accepted. When step N is read its placeholder becomes the a + 1
tokens (stops and length limits cut them as in the synchronous loop, dropping the carried
row's placeholder with them), `num_computed` moves up by a, and the carried row of N+1 learns
its true start (`Booked.shift`). The prefix cache's blocks of a carried row are registered
then, from its true positions (never with a snapshot: the slot has moved on).

The engine reads step N before planning step N+1 (the synchronous way, explicitly) where a
carried row could not be planned: `must_read_first`.
"""

from __future__ import annotations

import collections
import dataclasses

from deepinfer_jax.contract import SpecStepOutput
from deepinfer_jax.host.decision import ScheduleDecision, ScheduledSeq
from deepinfer_jax.host.pages import pages_needed
from deepinfer_jax.host.request import (
    PLACEHOLDER,
    FinishReason,
    Request,
    RequestStatus,
    TokenLogprobs,
)

# `sched` below: the Scheduler (host/scheduler.py) whose steps these are; not imported, as it
# imports this module


def apply_speculative(sched, decision: ScheduleDecision, out: SpecStepOutput
                      ) -> list[Request]:
    """The synchronous loop's read: each row committed its last token plus `a` accepted drafts
    and produced a + 1 new tokens; its next drafts wait in `req.drafts`. Stops inside the new
    tokens drop the tokens after them."""
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
        _count(req, seq.num_drafts, accepted)
        touched.append(req)
        _append(sched, req, len(req.generated), row, new, out)
        if req.status is RequestStatus.RUNNING:
            req.drafts = _drafts(out, row)
    return touched


@dataclasses.dataclass
class Booked:
    """A sampling row of a launched speculative step, until it is read."""

    seq: ScheduledSeq
    shift: int = 0                  # drafts accepted by the step before: true start - seq.start
    verified: int | None = None     # drafts it verifies, once known (planned: seq.num_drafts)


class SpecBooking:
    def __init__(self):
        # a request's booked rows not read yet, oldest first (at most one when planning)
        self._unread: dict[Request, collections.deque[Booked]] = {}

    def carried(self, req: Request) -> bool:
        """Whether `req` sampled in the unread speculative step."""
        return bool(self._unread.get(req))

    def max_shift(self, req: Request) -> int:
        """The most drafts the unread step may have accepted for `req` (0 without one)."""
        rows = self._unread.get(req)
        return rows[-1].seq.num_drafts if rows else 0

    def num_drafts(self, req: Request) -> int:
        """The most drafts the unread step may have proposed for `req`, which the device feeds
        a carried row (its draft cap; `req.drafts` are the host's last known ones)."""
        rows = self._unread.get(req)
        return rows[-1].seq.draft_cap if rows else 0

    def must_read_first(self, sched) -> bool:
        """Whether the next step must wait for the unread one (the synchronous loop's way):
        * its draft cap may depend on the unread step (speculative or plain): the cap follows
          the batch's size, and the unread step may end requests (a different cap gives other
          drafts, and sampled rows other draws, than the synchronous loop); a plain step
          (cap 0) cannot continue a row on the device;
        * the running requests' pages for the worst case (every unread draft accepted) may
          not be there: planning could preempt a request whose tokens are still in flight,
          which the synchronous loop would preempt, if at all, knowing them;
        * a carried row's worst case runs past the block table (max_model_len);
        * the decoding rows' drafts may not all fit the step's token budget."""
        # requests with tokens in flight (a speculative or a plain step's placeholders)
        unread = [r for r in sched.running if r.generated[-1:] == [PLACEHOLDER]]
        if not unread:
            return False
        running, waiting, free = len(sched.running), len(sched.waiting), len(sched._free_slots)
        ending = sum(self._may_end(sched, r) for r in unread)
        cap = sched._draft_cap(running + min(waiting, free))
        if cap != sched._draft_cap(running - ending + min(waiting, free + ending)):
            return True
        if not self._unread:        # a plain step's placeholders only: resolved on the device
            return False
        if cap == 0:
            return True
        cfg = sched.step_cfg
        need = decoding = 0
        for req in sched.running:
            drafts = self.num_drafts(req) if self.carried(req) else len(req.drafts)
            end = req.num_computed + self.max_shift(req) + min(
                req.num_pending + drafts, cfg.max_num_batched_tokens)
            if self.carried(req) and end > cfg.max_blocks_per_seq * cfg.page_size:
                return True
            need += max(0, pages_needed(end, cfg.page_size) - len(req.pages))
            decoding += 1 + drafts if req.num_pending == 1 else 0
        # a carried row asks the budget for its cap's drafts, the synchronous loop's row for
        # the drafts made: where the budget cuts drafts, it would cut other ones
        return decoding > cfg.max_num_batched_tokens or not sched.kv_cache.can_provide(need)

    def _may_end(self, sched, req: Request) -> bool:
        """Whether the unread step's tokens may end `req` (a stop, or a length limit within
        its 1 + drafts new tokens; `generated` counts one placeholder for them)."""
        p, extra = req.params, self.max_shift(req)
        return bool((sched.eos_token_ids and not p.ignore_eos) or p.stop_token_ids or p.stop
                    or req.matcher is not None or len(req.generated) + extra >= p.max_tokens
                    or req.num_tokens + extra >= sched.step_cfg.max_model_len)

    def book(self, sched, seqs: tuple[ScheduledSeq, ...]) -> None:
        """A speculative step as launched, no draft accepted (the module docstring)."""
        for seq in seqs:
            req = seq.request
            req.num_computed = seq.start + seq.num_tokens - seq.num_drafts
            sched.kv_cache.count_replayed(req, seq.start)
            if not seq.samples:
                continue
            self._unread.setdefault(req, collections.deque()).append(Booked(seq))
            req.generated.append(PLACEHOLDER)
            req.logprobs.append(None)
            if (len(req.generated) >= req.params.max_tokens
                    or req.num_tokens >= sched.step_cfg.max_model_len):
                sched._finish(req, FinishReason.LENGTH)

    def apply(self, sched, decision: ScheduleDecision, out: SpecStepOutput
              ) -> list[Request]:
        """A booked speculative step read: placeholders become tokens (the module docstring)."""
        touched = []
        for row, seq in enumerate(decision.seqs):
            req = seq.request
            if not seq.samples:
                continue
            rows = self._unread[req]
            booked = rows.popleft()
            if not rows:
                del self._unread[req]
            new = int(out.num_new[row])
            accepted = max(new - 1, 0)
            if rows:          # the carried row of the next step: its true start, its drafts
                rows[0].shift, rows[0].verified = accepted, int(out.num_drafts[row])
            index = _first_placeholder(req.generated)
            if index is None:      # dropped: stopped or aborted since
                continue
            if req.status is RequestStatus.RUNNING:
                if seq.carried:
                    sched.kv_cache.snapshot_saves(
                        [dataclasses.replace(seq, start=seq.start + booked.shift)],
                        snapshots=False)
                req.num_computed += accepted
            # a carried row verifies the drafts made, as many as were planned (device/spec_carry.py)
            _count(req, seq.num_drafts if booked.verified is None
                   else min(seq.num_drafts, booked.verified), accepted)
            touched.append(req)
            del req.generated[index], req.logprobs[index]
            _append(sched, req, index, row, new, out)
            if not rows and req.status is RequestStatus.RUNNING:
                req.drafts = _drafts(out, row)       # the next plan feeds them (none carried)
        return touched


def _first_placeholder(generated: list[int]) -> int | None:
    """Where the oldest unread step's tokens go: placeholders are a suffix of `generated`,
    one per unread step (at most two)."""
    index = len(generated)
    while index and generated[index - 1] == PLACEHOLDER:
        index -= 1
    return index if index < len(generated) else None


def _count(req: Request, drafted: int, accepted: int) -> None:
    req.spec.steps += 1
    req.spec.drafted += drafted
    req.spec.accepted += accepted


def _drafts(out: SpecStepOutput, row: int) -> list[int]:
    return [int(t) for t in out.drafts[row, : int(out.num_drafts[row])]]


def _append(sched, req: Request, index: int, row: int, new: int,
            out: SpecStepOutput) -> None:
    """Insert a row's `new` tokens (and logprobs) at generated[index]; a stop token, or
    reaching max_tokens / max_model_len, ends the request there (dropping what follows)."""
    p = req.params
    for j in range(new):
        token = int(out.new_tokens[row, j])
        at = index + j
        req.generated.insert(at, token)
        req.logprobs.insert(at, None if p.logprobs is None else token_logprobs(
            token, out.logprob[row, j], out.top_ids[row, j], out.top_logprobs[row, j],
            p.logprobs))
        if sched._is_stop(req, token):
            sched._stop_at(req, at, token)
            return
        if at + 1 >= p.max_tokens or len(req.prompt) + at + 1 >= sched.step_cfg.max_model_len:
            req.truncate(at + 1)
            if req.status is not RequestStatus.FINISHED:
                sched._finish(req, FinishReason.LENGTH)
            return


def token_logprobs(token: int, chosen, top_ids, top, n: int) -> TokenLogprobs:
    """A sampled token's logprob and its top n alternatives (numpy rows -> Python values)."""
    return TokenLogprobs(token, float(chosen), tuple(
        (int(t), float(lp)) for t, lp in zip(top_ids[:n], top[:n])))
