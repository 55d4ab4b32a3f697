"""Where batch-invariant mode's logprobs follow an engine's shape on a GPU: first speculative
decoding against plain decoding (tests/engine/test_speculative_shipped.py's bitwise test
failed on the H100, not on the CPU), then one slot count against another
(test_batch_invariance.py's 8-slot engine, session 50). Probes, JSON lines on stdout:

  python bench/invariance_probe.py softmax          # the sampler's log-softmax, [8, V] vs [48, V]
  python bench/invariance_probe.py engines          # the test's engines: where and how much
                                                    # (and the speculative engine's state
                                                    # under plain steps only)

  python bench/invariance_probe.py states           # plain engines whose states differ in
                                                    # shape only (more slots, more pages)
  python bench/invariance_probe.py rows             # log-softmax and RMS norm rows at 1-16
                                                    # rows against the same rows among 48
  python bench/invariance_probe.py slots [DIR]      # tiny-mixed engines of 8 and 32 slots
                                                    # (test_batch_invariance's), each in a
                                                    # process of its own, optimized HLO of
                                                    # their steps under DIR/slots{8,32};
                                                    # again with row sums over lanes of 32
                                                    # (default: $BENCH_RESULTS_DIR/
                                                    # invariance-slots-hlo)
  python bench/invariance_probe.py slots-test [DIR] # the same at test_sync_loop_on_fewer_slots'
                                                    # sizes of session 52 (buckets 16, 32, 64,
                                                    # 128; 34 prompts), no lane sums
  python bench/invariance_probe.py loops [N]        # test_batch_invariance's prompts (the
                                                    # first N) alone on its 32-slot engine,
                                                    # then all at once on 32 and 8 slots, each
                                                    # with the asynchronous and the
                                                    # synchronous loop: which engine differs

The loops probe's one moved prompt is followed up in invariance_topk.py.

`engines` runs under the caller's XLA_FLAGS, so that one run per flag set (autotuning off,
cuBLAS instead of Triton GEMMs) tells which compiler choice moves the bits. On the H100
(2026-12-06): every one of the 16 logprobs differed, from the first token on, up to 0.02,
whatever the flags, with optimization barriers around the head or without; and the
speculative engine running plain steps only differed as much (docs/performance-log.md).
`states` asks whether the state's shapes alone move the bits. On the H100 (session 49) 16
slots moved them as much as speculation did, through XLA's Triton normalization fusions;
batch-invariant mode compiles without them since 5c8bb0e, and both probes are bitwise there.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def softmax_probe() -> None:
    from deepinfer_jax.device.sampling import token_logprobs

    for vocab in (6144, 129280):
        logits = jax.random.normal(jax.random.key(0), (48, vocab), jnp.float32) * 4
        tokens = jnp.arange(48, dtype=jnp.int32)
        fn = jax.jit(token_logprobs, static_argnums=2)
        few = fn(logits[:8], tokens[:8], 1)
        many = fn(logits, tokens, 1)
        diff = np.abs(np.asarray(few.logprob) - np.asarray(many.logprob[:8]))
        print(json.dumps({"probe": "softmax", "vocab": vocab, "rows": [8, 48],
                          "bitwise": bool((diff == 0).all()), "max_diff": float(diff.max())}),
              flush=True)


def rows_probe() -> None:
    """Which row counts give a row other bits than it gets among 48 rows: the sampler's
    log-softmax over V and the RMS norm over D, at the tiny configs' widths and V4-Flash's.
    (test_batch_invariance's engine of 8 slots samples 8 rows a step where the 32-slot one
    samples 16 or 32; on the CPU, XLA's log-softmax at V = 512 rounded 1-7 rows apart from 8
    or more: 70f3a61.)"""
    from deepinfer_jax.device.sampling import token_logprobs
    from deepinfer_jax.engine.compile import BATCH_INVARIANT_COMPILER_OPTIONS
    from deepinfer_jax.model.norms import rms_norm

    cases = [("log_softmax", v) for v in (256, 512, 600, 1000, 6144, 129280)]
    cases += [("rms_norm", d) for d in (64, 256, 1024, 4096)]
    for op, width in cases:
        x = jax.random.normal(jax.random.key(width), (48, width), jnp.float32) * 4
        if op == "log_softmax":
            fn = jax.jit(lambda a: token_logprobs(a, jnp.zeros(a.shape[0], jnp.int32), 1).logprob)
        else:
            x = x.astype(jnp.bfloat16)
            fn = jax.jit(lambda a: rms_norm(a, jnp.ones(a.shape[1], jnp.float32), 1e-6))
        for options in ("default", "batch-invariant"):
            def run(a, fn=fn, options=options):
                opts = BATCH_INVARIANT_COMPILER_OPTIONS if options == "batch-invariant" else {}
                compiled = fn.lower(a).compile(compiler_options=opts or None)
                return np.asarray(compiled(a).astype(jnp.float32))

            many = run(x)
            apart = [r for r in range(1, 17) if not np.array_equal(run(x[:r]), many[:r])]
            print(json.dumps({"probe": "rows", "op": op, "width": width, "options": options,
                              "row_counts_differing_from_48": apart}), flush=True)


def engines_probe() -> None:
    import deepinfer_jax
    from deepinfer_jax import SamplingParams

    tiny = REPO / "models" / "deepinfer-tiny-v4"
    engine = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=128,
                  token_buckets=(128,), page_size=64, show_progress=False, batch_invariant=True,
                  enable_prefix_caching=False)
    plain = deepinfer_jax.LLM(tiny, **engine)
    source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    prompt = plain.tokenizer.encode(source)[:310]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {"plain": plain}
    for k in (3,):
        runs[f"spec{k}"] = deepinfer_jax.LLM(
            tiny, speculative_config={"num_speculative_tokens": k, "varlen": False}, **engine)
    outs = {name: llm.generate([prompt], params, use_tqdm=False)[0] for name, llm in runs.items()}
    # The speculative engine's state (its rings hold spare rows for drafts) under plain steps
    # only: equal to plain decoding, the state's shapes are not what moves the bits
    from deepinfer_jax.host.scheduler import Scheduler
    draft_cap = Scheduler.draft_cap
    Scheduler.draft_cap = lambda self: 0
    try:
        outs["spec3 state, plain steps"] = runs["spec3"].generate([prompt], params,
                                                                  use_tqdm=False)[0]
    finally:
        Scheduler.draft_cap = draft_cap
    ref = np.array([lp.logprob for lp in outs["plain"].logprobs])
    for name, out in outs.items():
        got = np.array([lp.logprob for lp in out.logprobs])
        diff = np.abs(got - ref)
        row = {"probe": "engines", "run": name,
               "tokens_equal": out.token_ids ==
               outs["plain"].token_ids, "differing": np.flatnonzero(diff).tolist(),
               "max_diff": float(diff.max()), "logprobs": got.tolist()}
        if name in runs and name != "plain":
            m = runs[name].spec_metrics
            row |= {"drafted": m.drafted, "accepted": m.accepted}
        print(json.dumps(row), flush=True)


def states_probe() -> None:
    """Plain engines alike but for their states' shapes: a request's logprobs in each."""
    import deepinfer_jax
    from deepinfer_jax import SamplingParams

    tiny = REPO / "models" / "deepinfer-tiny-v4"
    engine = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=128,
                  token_buckets=(128,), page_size=64, show_progress=False, batch_invariant=True,
                  enable_prefix_caching=False)
    variants = {"plain": {}, "16 slots": {"max_num_seqs": 16}, "more pages": {"num_pages": 192}}
    outs = {}
    for name, change in variants.items():
        llm = deepinfer_jax.LLM(tiny, **{**engine, **change})
        source = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
        prompt = llm.tokenizer.encode(source)[:310]
        outs[name] = llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True,
                                                           logprobs=1), use_tqdm=False)[0]
        del llm
    ref = np.array([lp.logprob for lp in outs["plain"].logprobs])
    for name, out in outs.items():
        got = np.array([lp.logprob for lp in out.logprobs])
        diff = np.abs(got - ref)
        print(json.dumps({"probe": "states", "run": name,
                          "tokens_equal": out.token_ids == outs["plain"].token_ids,
                          "differing": np.flatnonzero(diff).tolist(),
                          "max_diff": float(diff.max())}), flush=True)


def lane_sums() -> None:
    """Patch jnp.mean over a last axis of a multiple of 32, and jax.nn.log_softmax's sum, into
    sums over lanes of 32 (one element a thread in XLA's GPU row reduction, whatever the
    fusion: no vector width to follow the fusion's narrowest dtype) whose partials are then
    added in a fixed pairwise order (ordered_sum). A probe of that hypothesis only, before
    any model code changes."""
    from deepinfer_jax.model.invariant import ordered_sum

    def sum_lanes(x: jax.Array) -> jax.Array:
        parts = jnp.sum(x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32), axis=-1)
        return ordered_sum(parts, -1)

    def takes(a, axis) -> bool:
        return (axis in (-1, jnp.ndim(a) - 1) and jnp.ndim(a) > 0 and jnp.shape(a)[-1] % 32 == 0
                and jnp.issubdtype(jnp.result_type(a), jnp.floating))

    mean = jnp.mean

    def lane_mean(a, axis=None, dtype=None, out=None, keepdims=False, **kwargs):
        if takes(a, axis) and dtype is None and not kwargs:
            total = sum_lanes(jnp.asarray(a)) / jnp.shape(a)[-1]
            return total[..., None] if keepdims else total
        return mean(a, axis=axis, dtype=dtype, out=out, keepdims=keepdims, **kwargs)

    log_softmax = jax.nn.log_softmax

    def lane_log_softmax(x, axis=-1, **kwargs):
        if not takes(x, axis) or kwargs:
            return log_softmax(x, axis=axis, **kwargs)
        shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
        return shifted - jnp.log(sum_lanes(jnp.exp(shifted)))[..., None]

    jnp.mean, jax.nn.log_softmax = lane_mean, lane_log_softmax


def slots_engine(slots: int, lanes: bool, sizes: str = "small") -> None:
    """One engine of test_batch_invariance's model, `slots` slots, the synchronous loop, with
    lane_sums' patch or without: a JSON line of the prompts' logprobs. `sizes` "small": one
    decode bucket of 16 (32 slots sample 16 rows a decode step, 8 slots 8), 32-token chunks,
    six prompts; "test": test_sync_loop_on_fewer_slots' buckets of 16-128, 128-token chunks
    and 34 prompts."""
    if lanes:
        lane_sums()
    import deepinfer_jax
    from deepinfer_jax import SamplingParams
    from deepinfer_jax.config.hf import read_model_config

    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))
    budget, buckets, count = (32, (16, 32), 6) if sizes == "small" else (128, (16, 32, 64, 128), 34)
    llm = deepinfer_jax.LLM(model, batch_invariant=True, max_num_seqs=slots, max_model_len=640,
                            max_num_batched_tokens=budget, token_buckets=buckets, page_size=64,
                            show_progress=False, async_scheduling=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=int(n)).tolist()
               for n in rng.integers(5, 300, size=count)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    print(json.dumps([[lp.logprob for lp in o.logprobs] for o in outs]), flush=True)


def slots_probe(dump: Path, sizes: str = "small") -> None:
    """test_batch_invariance's 8-slot engine gave other logprobs than its 32-slot one on an
    H100 (session 50; the small-chunk engine, sampling 1 and 4 rows a step, did not): the two
    engines' logprobs, and their steps' optimized HLO to compare; then the same two with
    lane_sums' patch (whether a fixed reduction shape removes the difference)."""
    import subprocess

    runs = {}
    patches = (False, True) if sizes == "small" else (False,)
    for lanes in patches:
        for slots in (8, 32):
            name = f"slots{slots}" + ("-lanes" if lanes else "")
            flags = (f"--xla_dump_to={dump / name} --xla_dump_hlo_as_text "
                     "--xla_dump_hlo_module_re=.*step.*")
            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
            done = subprocess.run([sys.executable, __file__, "slots-engine", str(slots),
                                   str(int(lanes)), sizes], env=env, capture_output=True, text=True,
                                  cwd=REPO, check=False)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            runs[slots, lanes] = np.array(json.loads(done.stdout.strip().splitlines()[-1]))
        diff = np.abs(runs[8, lanes] - runs[32, lanes])
        print(json.dumps({"probe": "slots", "lane_sums": lanes, "bitwise": bool((diff == 0).all()),
                          "max_diff": float(diff.max()),
                          "differing": [np.flatnonzero(row).tolist() for row in diff],
                          "hlo": str(dump)}), flush=True)
    if not patches[-1]:
        return
    # the patch is in use: the lane sums' rounding differs from the plain reductions'
    moved = np.abs(runs[32, True] - runs[32, False])
    print(json.dumps({"probe": "slots", "lane_sums_moved_logprobs": int((moved > 0).sum()),
                      "of": moved.size, "max_diff": float(moved.max())}), flush=True)


def loops_probe(count: int) -> None:
    """test_sync_loop_on_fewer_slots failed on the H100 (session 52) where 8 and 32 slots
    agreed in slots_probe's smaller steps: whether the slot count or the synchronous loop
    moves the logprobs, at the test's engine options of then (buckets 16, 32, 64 and 128;
    the test compiles 16 and 128 since ec1a3a8)."""
    import deepinfer_jax
    from deepinfer_jax import SamplingParams
    from deepinfer_jax.config.hf import read_model_config

    cfg = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
    model = deepinfer_jax.Model(cfg, deepinfer_jax.random_params(cfg, 3, jnp.bfloat16))
    options = dict(max_model_len=640, max_num_batched_tokens=128, token_buckets=(16, 32, 64, 128),
                   page_size=64, show_progress=False, batch_invariant=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, 512, size=int(n)).tolist() for n in rng.integers(5, 300, size=34)]
    prompts = prompts[:count]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)

    def logprobs(outputs) -> np.ndarray:
        return np.array([[lp.logprob for lp in o.logprobs] for o in outputs], np.float32)

    reference = deepinfer_jax.LLM(model, max_num_seqs=32, **options)
    alone = np.concatenate([logprobs(reference.generate([p], params, use_tqdm=False))
                            for p in prompts])
    # the failing engine first: a run stopped at its limit still says the most
    for slots, loop in ((8, "sync"), (8, "async"), (32, "sync"), (32, "async")):
        llm = reference if (slots, loop) == (32, "async") else deepinfer_jax.LLM(
            model, max_num_seqs=slots, async_scheduling=loop == "async", **options)
        diff = np.abs(logprobs(llm.generate(prompts, params, use_tqdm=False)) - alone)
        print(json.dumps({"probe": "loops", "slots": slots, "loop": loop,
                          "bitwise": bool((diff == 0).all()), "max_diff": float(diff.max()),
                          "differing": {i: np.flatnonzero(row).tolist()
                                        for i, row in enumerate(diff) if row.any()},
                          "prompt_lengths": [len(p) for p in prompts]}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "slots-engine":
        slots_engine(int(sys.argv[2]), bool(int(sys.argv[3])), *sys.argv[4:5])
        raise SystemExit
    if sys.argv[1] in ("slots", "slots-test"):
        results = os.environ.get("BENCH_RESULTS_DIR", "/tmp")     # (gpu_suite.py sets it)
        default = f"{results}/invariance-{sys.argv[1]}-hlo"
        slots_probe(Path(sys.argv[2] if len(sys.argv) > 2 else default),
                    "test" if sys.argv[1] == "slots-test" else "small")
        raise SystemExit
    if sys.argv[1] == "loops":
        loops_probe(int(sys.argv[2]) if len(sys.argv) > 2 else 34)
        raise SystemExit
    {"softmax": softmax_probe, "engines": engines_probe, "states": states_probe,
     "rows": rows_probe}[sys.argv[1]]()
