"""Data-parallel attention's host side (host/ranks.py), without jax: requests are placed on
the least loaded rank, every rank schedules its own requests on its own slots and pages, and
a step's bucket is the one the busiest rank's tokens fit."""

from __future__ import annotations

from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.host.ranks import RankedScheduler
from deepinfer_jax.host.request import Request, RequestStatus, SamplingParams
from tests.host.test_scheduler import MODEL, make, output, request


def ranked(ranks=2, **kwargs) -> RankedScheduler:
    return make(scheduler=lambda step_cfg, eos: RankedScheduler(step_cfg, eos, ranks), **kwargs)


def ranks_of(sched: RankedScheduler) -> dict[str, int]:
    return {req.request_id: rank for rank, s in enumerate(sched.ranks)
            for req in list(s.waiting) + s.running}


def test_requests_go_to_the_rank_with_fewest_then_most_free_pages():
    sched = ranked(ranks=3, pages=64)
    for i in range(7):
        sched.add(request(i, 20))
    # fewest requests first, ties to the lowest rank: round robin while loads are equal
    assert ranks_of(sched) == {"0": 0, "1": 1, "2": 2, "3": 0, "4": 1, "5": 2, "6": 0}
    sched.abort("4")              # rank 1 now has the fewest
    sched.add(request(7, 20))
    assert ranks_of(sched)["7"] == 1
    # equal counts: the rank with more free pages wins
    sched = ranked(ranks=2, pages=64)
    sched.add(request(0, 100))
    sched.add(request(1, 10))
    sched.schedule()              # rank 0's first chunk takes 2 pages, rank 1's prompt 1
    sched.add(request(2, 20))
    assert ranks_of(sched)["2"] == 1


def test_each_rank_schedules_its_own_slots_and_pages():
    sched = ranked(ranks=2, seqs=2, budget=128, pages=8, page_size=16)
    for i, n in enumerate((40, 10, 30)):
        sched.add(request(i, n, max_tokens=4))
    decision = sched.schedule()
    assert [[s.request.request_id for s in d.seqs] for d in decision.ranks] == [["0", "2"], ["1"]]
    # slots and pages count from 0 on every rank: each rank has its own state and pool
    assert sorted(s.slot for s in decision.ranks[0].seqs) == [0, 1]
    assert [s.slot for s in decision.ranks[1].seqs] == [0]
    assert decision.ranks[1].seqs[0].pages == [0]
    assert 0 in decision.ranks[0].seqs[0].pages + decision.ranks[0].seqs[1].pages
    assert decision.num_tokens == 70 and decision.ranks[1].num_tokens == 10
    assert [s.request.request_id for s in decision.seqs] == ["0", "2", "1"]
    touched = sched.postprocess(decision, [output([5, 6]), output([9])])
    assert sorted(r.request_id for r in touched) == ["0", "1", "2"]
    assert [r.generated for r in sched.ranks[1].running] == [[9]]
    for _ in range(3):
        decision = sched.schedule()
        sched.postprocess(decision, [output([5] * len(d.seqs)) for d in decision.ranks])
    assert not sched.has_work()
    assert all(s.kv_cache.num_free_pages == 8 for s in sched.ranks)


def test_a_rank_with_nothing_to_do_still_takes_part():
    sched = ranked(ranks=2)
    sched.add(request(0, 12, max_tokens=2))
    decision = sched.schedule()
    assert [len(d.seqs) for d in decision.ranks] == [1, 0]
    sched.postprocess(decision, [output([3]), output([])])
    assert sched.ranks[0].running[0].status is RequestStatus.RUNNING


def test_a_request_follows_its_cached_prefix_within_the_slack():
    """With prefix caching a request goes to the rank caching most of its prompt's leading
    blocks while that rank holds at most `affinity_slack` (an eighth of its slots) more
    requests than the least loaded one; past that, load decides."""
    step_cfg = EngineConfig(max_num_seqs=16, max_model_len=128, page_size=16, num_pages=64,
                            max_num_batched_tokens=64, enable_prefix_caching=True,
                            compilation_cache_dir=None).resolve(MODEL)
    sched = RankedScheduler(step_cfg, MODEL.eos_token_ids, 2)
    assert sched.affinity_slack == 2
    prefix = list(range(100, 148))                  # three 16-token blocks

    def asking(name, last):
        return Request(name, prefix + [last], SamplingParams(max_tokens=1), 0)

    sched.add(request("filler", 20, max_tokens=1))  # rank 0
    sched.add(asking("first", 1))                   # rank 1, which caches the prefix
    assert ranks_of(sched) == {"filler": 0, "first": 1}
    while sched.has_work():
        decision = sched.schedule()
        sched.postprocess(decision, [output([5] * len(d.seqs)) for d in decision.ranks])
    assert [s.kv_cache.cached_prefix_blocks(asking("probe", 2)) for s in sched.ranks] == [0, 3]
    # both ranks idle: the prefix's rank, where load alone sends it to rank 0
    for i in range(3):          # rank 1 then holds 0, 1, 2 more than rank 0: within the slack
        sched.add(asking(f"again{i}", 2 + i))
    assert [ranks_of(sched)[f"again{i}"] for i in range(3)] == [1, 1, 1]
    sched.add(asking("past the slack", 9))            # 3 more: the least loaded rank
    assert ranks_of(sched)["past the slack"] == 0
    sched.add(request("no prefix", 20))             # nothing cached anywhere: load decides
    assert ranks_of(sched)["no prefix"] == 0
