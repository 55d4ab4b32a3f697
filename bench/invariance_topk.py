"""The one prompt of test_batch_invariance that test_sync_loop_on_fewer_slots' 8-slot engine
moves on an H100 (prompt 22; `invariance_probe.py loops`, session 53): its CSA selections in
both engines. JSON lines on stdout:

  python bench/invariance_topk.py            # the prompt alone on 32 slots and among the
                                             # first 30 on 8: whether the indexer's scores
                                             # (bit for bit) or its selected rows differ,
                                             # where first; with the reference indexer's
                                             # heads summed in a fixed order (15cc997) and
                                             # by a contraction (before it)
  python bench/invariance_topk.py sorted     # the prompt's logprobs with the chosen rows
                                             # in score order (as the engine has them) and
                                             # sorted by row

Each engine runs in a process of its own (`engine ORDER SLOTS [HEADS]`): the engine's
compiled-step memo would otherwise share steps across the patches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


TOPK_PROMPT = 22        # the prompt `invariance_probe.py loops` found moved on 8 slots (H100, session 53)


def topk_engine(order: str, slots: int, heads: str = "ordered") -> None:
    """One engine of `invariance_probe.py loops`' options: prompt TOPK_PROMPT's logprobs, alone on 32 slots
    or among the first 30 prompts on 8 (the synchronous loop; its steps up to the prompt's
    last are those of all 34). order "sorted": each token's selected CSA rows sorted by row
    index instead of by score, so that the attention sums them in an order that does not
    depend on their scores' ranking; "capture": the selections recorded. heads "einsum": the
    reference indexer sums its heads by a contraction, as before 15cc997 (a JSON line)."""
    import deepinfer_jax.model.paged_forward as paged_forward
    import pallas_kernels.indexer.reference as indexer_reference

    if heads == "einsum":
        scores = indexer_reference.indexer_scores

        def einsum_heads(*args, ordered_heads=False):
            return scores(*args, ordered_heads=False)
        indexer_reference.indexer_scores = einsum_heads
    records, context = [], {}
    if order in ("sorted", "capture"):
        select_rows = paged_forward.select_rows

        def spied_select_rows(t_q, t_w, ls, ctx, *args, **kwargs):
            context["ctx"] = ctx              # (tracing is sequential: top_k below reads it)
            return select_rows(t_q, t_w, ls, ctx, *args, **kwargs)

        def record(slot, start, end, positions, valid, scores, index):
            records.append((slot, start, end, positions, valid, scores, index))

        class Lax:                        # select_rows' only use of jax.lax: its top_k
            def __getattr__(self, name):
                if name != "top_k":
                    return getattr(jax.lax, name)

                def top_k(x, k):
                    values, index = jax.lax.top_k(x, k)
                    if order == "sorted":
                        return values, jnp.sort(index, axis=-1)
                    ctx = context["ctx"]
                    jax.debug.callback(record, ctx.slot, ctx.start, ctx.end, ctx.positions,
                                       ctx.valid, x, index)
                    return values, index
                return top_k

        class Jax:
            lax = Lax()

            def __getattr__(self, name):
                return getattr(jax, name)
        paged_forward.jax = Jax()
        paged_forward.select_rows = spied_select_rows
    out = moved_prompt_run(slots)
    line = {"order": order, "slots": slots, "logprobs": [lp.logprob for lp in out.logprobs]}
    if order == "capture":
        line["selections"] = prompt_selections(records, alone=slots == 32)
    print(json.dumps(line), flush=True)


def moved_prompt_run(slots: int, **options):
    """test_sync_loop_on_fewer_slots' engine and prompts (tiny-mixed, batch-invariant, the
    synchronous loop): prompt TOPK_PROMPT alone on 32 slots, or among the first 30 prompts
    on 8 (its steps up to the prompt's last are those of all 34) -> its RequestOutput.
    options: more `LLM` arguments."""
    import deepinfer_jax
    from deepinfer_jax import SamplingParams
    from deepinfer_jax.config.hf import read_model_config

    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))
    llm = deepinfer_jax.LLM(model, max_num_seqs=slots, max_model_len=640,
                            max_num_batched_tokens=128, token_buckets=(16, 32, 64, 128),
                            page_size=64, show_progress=False, batch_invariant=True,
                            async_scheduling=False, **options)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(5, 300, size=34)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    batch = [prompts[TOPK_PROMPT]] if slots == 32 else prompts[:30]
    outs = llm.generate(batch, params, use_tqdm=False)
    return outs[0] if slots == 32 else outs[TOPK_PROMPT]


def prompt_selections(records: list, alone: bool) -> list:
    """TOPK_PROMPT's tokens' CSA selections, in execution order: [position, the masked scores'
    bits (as ints), the selected rows]. Alone, every real token is the prompt's; among the
    first 30 on 8 slots, its slot is the one whose step holds its first chunk, positions 0-25
    (no other of those prompts starts with 26 tokens: the schedule of the loops probe's run)."""
    out, slot = [], None
    for step_slot, start, end, positions, valid, scores, index in records:
        for t in np.flatnonzero(np.asarray(valid)):
            if not alone and start[t] == 0 and end[t] == 26:
                slot = int(step_slot[t])
            mine = alone or (slot is not None and step_slot[t] == slot)
            if not alone and slot is not None and step_slot[t] == slot and start[t] == 0 \
                    and end[t] != 26:
                slot = None              # the slot's next occupant
                mine = False
            if mine:
                out.append([int(positions[t]), np.asarray(scores[t]).view(np.int32).tolist(),
                            np.asarray(index[t]).tolist()])
    return out


def topk_sorted_probe() -> None:
    """Prompt TOPK_PROMPT alone (32 slots) against among others (8 slots), with the CSA rows
    in score order and sorted by row, each engine in a process of its own (the compiled-step
    memo would otherwise share steps across the patch)."""
    import subprocess

    runs = {}
    for order in ("ranked", "sorted"):
        for slots in (32, 8):
            done = subprocess.run([sys.executable, __file__, "engine", order, str(slots)],
                                  capture_output=True, text=True, cwd=REPO, check=False)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            runs[order, slots] = np.array(
                json.loads(done.stdout.strip().splitlines()[-1])["logprobs"])
        diff = np.abs(runs[order, 8] - runs[order, 32])
        print(json.dumps({"probe": "topk", "order": order, "bitwise": bool((diff == 0).all()),
                          "max_diff": float(diff.max()),
                          "differing": np.flatnonzero(diff).tolist()}), flush=True)
    moved = np.abs(runs["sorted", 32] - runs["ranked", 32])
    print(json.dumps({"probe": "topk", "sorting_moved_alone_by": float(moved.max())}), flush=True)


def topk_probe() -> None:
    """Prompt TOPK_PROMPT's CSA selections alone (32 slots) and among others (8 slots), each
    engine in a process of its own: whether the indexer's scores or the rows it selects
    differ between the two engines, and where first; with the reference indexer's heads
    summed in the tree's fixed order, then by a contraction (the form before 15cc997)."""
    import subprocess

    def keyed(selections):
        # a position comes once per CSA layer, in layer order
        seen, out = {}, {}
        for position, scores, index in selections:
            layer = seen[position] = seen.get(position, -1) + 1
            out[position, layer] = (np.array(scores, np.int32).view(np.float32), index)
        return out

    for heads in ("ordered", "einsum"):
        lines = {}
        for slots in (32, 8):
            done = subprocess.run([sys.executable, __file__, "engine", "capture",
                                   str(slots), heads],
                                  capture_output=True, text=True, cwd=REPO, check=False)
            if done.returncode:           # (an XLA crash's message comes before its stack)
                raise SystemExit("\n".join(line for line in done.stderr.splitlines()
                                           if not line.lstrip().startswith("@"))[-3000:])
            lines[slots] = json.loads(done.stdout.strip().splitlines()[-1])
        alone, among = keyed(lines[32]["selections"]), keyed(lines[8]["selections"])
        both = [k for k in alone if k in among]
        scores_differ = [k for k in both if not np.array_equal(alone[k][0].view(np.int32),
                                                               among[k][0].view(np.int32))]
        sets_differ = [k for k in both if set(alone[k][1]) != set(among[k][1])]
        order_differ = [k for k in both if alone[k][1] != among[k][1]]
        finite = [np.isfinite(alone[k][0]) & np.isfinite(among[k][0]) for k in scores_differ]
        rel = [float(np.max(np.abs(alone[k][0][f] - among[k][0][f])
                            / np.maximum(np.abs(alone[k][0][f]), 1e-30), initial=0.0))
               for k, f in zip(scores_differ, finite)]
        diff = np.abs(np.array(lines[8]["logprobs"]) - np.array(lines[32]["logprobs"]))
        print(json.dumps({"probe": "topk-capture", "heads": heads,
                          "tokens": [len(alone), len(among)],
                          "logprobs_bitwise": bool((diff == 0).all()),
                          "max_diff": float(diff.max()), "scores_differ": len(scores_differ),
                          "max_rel_score_diff": max(rel, default=0),
                          "first_scores_differ": sorted(scores_differ)[:8],
                          "sets_differ": sorted(sets_differ)[:16],
                          "order_differs": len(order_differ)}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "engine":
        topk_engine(sys.argv[2], int(sys.argv[3]), *sys.argv[4:5])
    elif len(sys.argv) > 1 and sys.argv[1] == "sorted":
        topk_sorted_probe()
    else:
        topk_probe()
