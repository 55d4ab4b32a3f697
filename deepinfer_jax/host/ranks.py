"""Data-parallel attention on the host (no jax): a scheduler per rank, one step for all.

Each rank has its own requests, state slots and page pool (its `Scheduler`, unchanged), and
the device runs every rank's plan in one program (parallel/mesh.py `over_ranks`), so a step
takes one decision from each rank, and the step's token bucket is the one the largest
rank's tokens fit. With prefix caching each rank has its own prefix cache and snapshots;
the KV tiers below the device are shared.

Placement: a request joins the rank with the fewest requests (running and waiting), then the
most free pages, then the lowest index, and stays there: its pages and slot live on that
rank's devices. With prefix caching a request follows its cached prefix: among the ranks
holding at most `affinity_slack` more requests than the least loaded one, the rank whose
cache holds the most leading blocks of its prompt takes it (load decides among equals). The
slack is an eighth of a rank's slots: a cached prefix is worth that much imbalance, and no
more, so a prefix every request shares (a system prompt) cannot pile them on one rank. A
rank's scheduler admits, preempts and finishes its own requests as on one device, so balance
comes from placement.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.contract import SpecStepOutput, StepOutput
from deepinfer_jax.host.decision import (
    Restore,
    ScheduleDecision,
    ScheduledSeq,
    SnapshotSave,
    TierLoad,
    TierSpill,
)
from deepinfer_jax.host.kv_tiers.prefetch import TierWorker
from deepinfer_jax.host.prefix_cache import PrefixCacheStats
from deepinfer_jax.host.request import Request
from deepinfer_jax.host.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class RankedDecision:
    """One step's decisions, a rank's each (rank order), all plain or all speculative."""

    ranks: tuple[ScheduleDecision, ...]

    @property
    def speculative(self) -> bool:
        return self.ranks[0].speculative

    @property
    def restores(self) -> tuple[tuple[Restore, ...], ...]:
        """The prefix cache's snapshot restores before the step, a tuple per rank (empty when
        no rank has one)."""
        return self._per_rank("restores")

    @property
    def saves(self) -> tuple[tuple[SnapshotSave, ...], ...]:
        """The snapshot saves after the step, a tuple per rank (empty when none has one)."""
        return self._per_rank("saves")

    @property
    def tier_ops(self) -> tuple[tuple[TierSpill | TierLoad, ...], ...]:
        """The KV tiers' copies before the step, a tuple per rank (empty when no rank has
        one)."""
        return self._per_rank("tier_ops")

    def _per_rank(self, name: str) -> tuple:
        copies = tuple(getattr(decision, name) for decision in self.ranks)
        return copies if any(copies) else ()

    @property
    def seqs(self) -> tuple[ScheduledSeq, ...]:
        return tuple(seq for decision in self.ranks for seq in decision.seqs)

    @property
    def num_tokens(self) -> int:
        """The most tokens a rank feeds: every rank's plan has the bucket this fits."""
        return max(decision.num_tokens for decision in self.ranks)

    @property
    def truncating_sampler(self) -> bool:
        return any(decision.truncating_sampler for decision in self.ranks)


class RankedScheduler:
    """The scheduler's two verbs (`schedule`, `postprocess`) over data-parallel ranks."""

    def __init__(self, step_cfg: StepConfig, eos_token_ids: tuple[int, ...], ranks: int,
                 tiers: TierWorker | None = None):
        """tiers: the KV tiers' one worker and store, which every rank's prefix cache spills
        to and loads from: a block set is the same bytes on any rank, so a prefix one rank
        evicted can come back on another."""
        self.ranks = [Scheduler(step_cfg, eos_token_ids, tiers) for _ in range(ranks)]
        self.affinity_slack = step_cfg.max_num_seqs // 8

    # ---- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        loads = [(len(s.running) + len(s.waiting), -s.kv_cache.num_free_pages, rank)
                 for rank, s in enumerate(self.ranks)]
        fewest = min(load[0] for load in loads)

        def placement(rank: int) -> tuple:
            if loads[rank][0] > fewest + self.affinity_slack:
                return (1, 0, loads[rank])
            return (0, -self.ranks[rank].kv_cache.cached_prefix_blocks(request), loads[rank])
        self.ranks[min(range(len(self.ranks)), key=placement)].add(request)

    def has_work(self) -> bool:
        return any(scheduler.has_work() for scheduler in self.ranks)

    def abort(self, request_id: str) -> Request | None:
        for scheduler in self.ranks:
            found = scheduler.abort(request_id)
            if found is not None:
                return found
        return None

    @property
    def running(self) -> list[Request]:
        return [req for scheduler in self.ranks for req in scheduler.running]

    @property
    def waiting(self) -> list[Request]:
        return [req for scheduler in self.ranks for req in scheduler.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(scheduler.num_preemptions for scheduler in self.ranks)

    def page_counts(self) -> tuple[int, int]:
        """(pages, free pages) over every rank's pool."""
        counts = [rank.page_counts() for rank in self.ranks]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def prefix_stats(self) -> PrefixCacheStats | None:
        """The ranks' prefix-cache counters summed, or None without prefix caching."""
        stats = [scheduler.kv_cache.prefix_stats() for scheduler in self.ranks]
        if stats[0] is None:
            return None
        return PrefixCacheStats(*(sum(values) for values in
                                  zip(*(dataclasses.astuple(s) for s in stats), strict=True)))

    # ---- the two verbs --------------------------------------------------------------------
    def schedule(self) -> RankedDecision:
        """Every rank's decision for one step. The ranks run one program, so the step is
        speculative only where every rank with requests would speculate (its batch leaves
        room in its verify budget); otherwise all run the plain step."""
        busy = [scheduler for scheduler in self.ranks if scheduler.has_work()]
        speculate = all(scheduler.draft_cap() > 0 for scheduler in busy)
        return RankedDecision(tuple(scheduler.schedule(speculate) for scheduler in self.ranks))

    def postprocess(self, decision: RankedDecision, outputs: list[StepOutput | SpecStepOutput]
                    ) -> list[Request]:
        """`outputs`: the step's output per rank, in rank order."""
        return [req for scheduler, rank_decision, output in
                zip(self.ranks, decision.ranks, outputs, strict=True)
                for req in scheduler.postprocess(rank_decision, output)]
