"""Prefix caching: time to first token with a long cached prefix vs cold, the tokens actually
computed, and what the cache holds per token vs a full per-layer KV cache; the same prefix
served from each KV tier below the device (host memory, disk).

    python bench/prefix_cache.py                                   # CPU: 2k cached tokens
    python bench/prefix_cache.py --prefix 16384 --chunk 2048 --name prefix-cache-16k-cpu
    python bench/prefix_cache.py --v4-flash-layers 4 --prefix 16384 --chunk 2048   # GPU

Cold: a prompt of `prefix + suffix` tokens that shares nothing with the cache. Warm: the same
length, after a request made of the prefix alone (untimed) left it in the cache. Both run in
one engine with prefix caching on; an engine with caching off runs the cold prompt too, to
show what the bookkeeping costs (runs interleaved). Host tier / disk tier: an engine with only
that tier below its device cache; after the prefix is cached, every cached block is evicted
from the device (untimed: copied out, written, and for the disk tier dropped from the OS page
cache with posix_fadvise), so the timed request reads it back from that tier (prefetched,
checksummed, copied to the device). Each row's source is asserted from the counters: the
prefix's blocks were hits of that tier, and its tokens were not computed. Bytes per token: the cached pages
(compressed rows and indexer keys) plus the slot snapshots the cache keeps for the prefix, vs
a cache that keeps every layer's K=V row of every token; also computed for the full
DeepSeek-V4-Flash config (shapes only).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.models import SMALL_CPU, V4_FLASH, model_config, model_label  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.config.engine import EngineConfig, StepConfig  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.config.model import AttentionKind, ModelConfig  # noqa: E402
from deepinfer_jax.device.snapshots import init_pool  # noqa: E402
from deepinfer_jax.model.state import init_state  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402

FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


def bytes_per_page(cfg: ModelConfig, step_cfg: StepConfig, itemsize: int) -> int:
    total = 0
    for kind in cfg.layer_types:
        if kind is AttentionKind.SLIDING:
            continue
        width = cfg.head_dim + (cfg.index_head_dim if kind is AttentionKind.CSA else 0)
        total += step_cfg.rows_per_page(cfg.compress_rate(kind)) * width * itemsize
    return total


def bytes_per_snapshot(cfg: ModelConfig, step_cfg: StepConfig, dtype) -> int:
    state = jax.eval_shape(lambda: init_state(cfg, step_cfg, dtype))
    pool = jax.eval_shape(lambda: init_pool(state, 1, spare=step_cfg.spec_tokens))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))


def footprint(cfg: ModelConfig, step_cfg: StepConfig, prefix: int, snapshots: int,
              dtype=jnp.bfloat16) -> dict:
    """Bytes per cached token: pages + snapshots vs every layer's K=V row of every token."""
    itemsize = jnp.dtype(dtype).itemsize
    pages = -(-prefix // step_cfg.page_size)
    cached = pages * bytes_per_page(cfg, step_cfg, itemsize) + snapshots * bytes_per_snapshot(
        cfg, step_cfg, dtype)
    full = cfg.num_layers * cfg.head_dim * itemsize      # one K=V head per layer (MQA)
    return {"prefix_tokens": prefix, "snapshots": snapshots,
            "cached_bytes_per_token": cached / prefix, "full_kv_bytes_per_token": full,
            "ratio": cached / prefix / full}


def first_token(llm: LLM, prompt: list[int]) -> dict:
    engine = llm.engine
    fed, stats = engine.stats.tokens, llm.prefix_cache_stats
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST_TOKEN, use_tqdm=False)[0]
    ttft = time.perf_counter() - start
    after = llm.prefix_cache_stats
    row = {"ttft_s": ttft, "metrics_ttft_s": out.metrics.time_to_first_token,
           "tokens_computed": engine.stats.tokens - fed}
    if stats is not None:
        row.update(hit_tokens=after.hit_tokens - stats.hit_tokens,
                   replayed_tokens=after.replayed_tokens - stats.replayed_tokens)
    return row


def evict_to_tier(llm: LLM, new) -> None:
    """Every cached block out of the device cache and into the engine's tier: evicted, copied
    out by the next step (a short request's), and put by the tiers' worker."""
    cache = llm.engine.scheduler.kv_cache.prefix_cache
    cache.evict(cache.pages.num_free + cache.num_idle_blocks())
    llm.generate([new(8)], FIRST_TOKEN, use_tqdm=False)
    llm.engine.tiers.drain()
    assert cache.current_stats().cached_blocks == 0


def drop_page_cache(directory: str) -> None:
    """The tier files out of the OS page cache (they are clean: written and fsynced), so the
    disk row reads the device, not memory, where the file system honours the advice."""
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tier_first_token(llm: LLM, prompt: list[int], prefix: int, tier: str) -> dict:
    """First token of `prompt`, whose `prefix` tokens are in `tier` only; checked from the
    counters to have come from there."""
    before = llm.kv_tier_stats[tier].counters.hits
    row = first_token(llm, prompt)
    llm.engine.tiers.drain()
    report = llm.kv_tier_stats[tier]
    blocks = prefix // llm.step_config.page_size
    row.update(served_from=f"{tier} tier", tier_hits=report.counters.hits - before,
               prefetch_p50_s=report.prefetch_latency.p50_s,
               prefetch_p99_s=report.prefetch_latency.p99_s)
    assert row["tier_hits"] >= blocks, (tier, row)
    assert row["hit_tokens"] >= blocks * llm.step_config.page_size, (tier, row)
    return row


def tier_round(llm: LLM, new, args, tier: str, directory: str | None) -> dict:
    prefix = new(args.prefix)
    llm.generate([prefix], FIRST_TOKEN, use_tqdm=False)                     # caches it
    evict_to_tier(llm, new)
    if directory is not None:
        drop_page_cache(directory)
    return tier_first_token(llm, prefix + new(args.suffix), args.prefix, tier)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--buckets", type=int, nargs="+", default=None,
                    help="token buckets to compile (default: powers of two up to --chunk)")
    ap.add_argument("--tiers", nargs="*", default=["host", "disk"], choices=["host", "disk"],
                    help="KV tiers to serve the prefix from too (none: device cache only)")
    ap.add_argument("--name", default=None,
                    help="the result files' name (default: prefix-cache-<platform>)")
    ap.add_argument("--tier-dir", default=None, help="the disk tier's directory (default: a "
                    "temporary one; the disk under test is the one it lies on)")
    args = ap.parse_args()
    cfg = model_config(args)
    longest = args.prefix + args.suffix + 64
    stretched = longest > cfg.max_position_embeddings
    if stretched:     # random weights: a context past the config's cap costs what it costs
        cfg = cfg.replace(max_position_embeddings=longest)
    model = Model(cfg, random_params(cfg, 0, jnp.bfloat16))
    rng = np.random.default_rng(0)
    new = lambda n: rng.integers(2, cfg.vocab_size, n).tolist()  # noqa: E731
    options = dict(max_num_seqs=4, max_model_len=args.prefix + args.suffix + 64,
                   max_num_batched_tokens=args.chunk, show_progress=False,
                   token_buckets=args.buckets and tuple(args.buckets),
                   compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    runs = {"cold": [], "warm": [], "caching off": []}
    llm = LLM(model, enable_prefix_caching=True, **options)
    plain = LLM(model, **options)
    scratch = tempfile.TemporaryDirectory(prefix="kv-tier-bench-", dir=args.tier_dir)
    tier_options = {"host": dict(kv_host_tier_bytes=1 << 34),
                    "disk": dict(kv_disk_tier_dir=scratch.name, kv_disk_tier_bytes=1 << 40)}
    tiers = {tier: LLM(model, enable_prefix_caching=True, **tier_options[tier], **options)
             for tier in args.tiers}
    for engine in (llm, plain, *tiers.values()):
        engine.generate([new(args.chunk + 8)], FIRST_TOKEN, use_tqdm=False)      # warm-up
    for tier, engine in tiers.items():      # and a first trip through the tier, untimed
        tier_round(engine, new, args, tier, scratch.name if tier == "disk" else None)
        runs[f"{tier} tier"] = []
    for _ in range(args.repeats):          # interleaved, so that drifts hit every run alike
        runs["caching off"].append(first_token(plain, new(args.prefix + args.suffix)))
        runs["cold"].append(first_token(llm, new(args.prefix + args.suffix)))
        assert runs["cold"][-1]["hit_tokens"] == 0
        prefix = new(args.prefix)
        llm.generate([prefix], FIRST_TOKEN, use_tqdm=False)                     # caches it
        runs["warm"].append(first_token(llm, prefix + new(args.suffix)))
        assert runs["warm"][-1]["hit_tokens"] >= args.prefix - llm.step_config.page_size
        for tier, engine in tiers.items():
            runs[f"{tier} tier"].append(tier_round(
                engine, new, args, tier, scratch.name if tier == "disk" else None))
    del llm, plain, tiers
    scratch.cleanup()

    summary = {}
    for name, rows in runs.items():
        times = [r["ttft_s"] for r in rows]
        summary[name] = {**rows[-1], "ttft_s": float(np.median(times)),
                         "ttft_min_s": min(times), "ttft_max_s": max(times)}
    step_cfg = EngineConfig(**options).resolve(cfg)
    # a snapshot at every chunk end (the most the cache keeps for a prefix prefilled alone)
    measured = footprint(cfg, step_cfg, args.prefix, -(-args.prefix // args.chunk))
    flash = read_model_config(V4_FLASH).replace(
        num_mtp_layers=0, quantization=None)
    flash_prefix = 16384
    flash_ecfg = EngineConfig(max_num_seqs=1, max_model_len=flash_prefix + 1024,
                              max_num_batched_tokens=8192).resolve(flash)
    flash_fp = footprint(flash, flash_ecfg, flash_prefix, -(-flash_prefix // 8192))
    device = jax.devices()[0].platform
    label = model_label(args, cfg)
    payload = {"model": label, "prefix": args.prefix, "suffix": args.suffix, "chunk": args.chunk,
               "runs": runs, "median": summary, "footprint": measured,
               "footprint_v4_flash_16k": flash_fp}
    cold, warm = summary["cold"]["ttft_s"], summary["warm"]["ttft_s"]
    table = (f"Prompt of {args.prefix} + {args.suffix} tokens, first token only "
             f"(median of {args.repeats}, min-max beside).\n\n"
             "| run | served from | TTFT (s) | min-max (s) | tokens computed | "
             "prefix tokens reused | replayed | tier hits (blocks) | prefetch p50 (ms) |\n"
             "|---|---|---:|---:|---:|---:|---:|---:|---:|\n")
    source = {"cold": "computed", "warm": "device cache", "caching off": "computed"}
    for name, row in summary.items():
        p50 = row.get("prefetch_p50_s")
        table += (f"| {name} | {row.get('served_from', source.get(name))} | "
                  f"{row['ttft_s']:.3f} | {row['ttft_min_s']:.3f}-{row['ttft_max_s']:.3f} | "
                  f"{row['tokens_computed']} | {row.get('hit_tokens', '-')} | "
                  f"{row.get('replayed_tokens', '-')} | {row.get('tier_hits', '-')} | "
                  f"{'-' if p50 is None else f'{p50 * 1e3:.3f}'} |\n")
    table += f"\nTTFT speed-up with the prefix cached: {cold / warm:.1f}x"
    table += "".join(f"; from the {name}: {cold / summary[name]['ttft_s']:.1f}x"
                     for name in summary if name.endswith(" tier")) + ".\n\n"
    table += ("| model | cached prefix | snapshots | cached bytes/token | full KV bytes/token | "
              "ratio |\n|---|---:|---:|---:|---:|---:|\n")
    for name, fp in ((label, measured), ("DeepSeek-V4-Flash (shapes)", flash_fp)):
        table += (f"| {name} | {fp['prefix_tokens']} | {fp['snapshots']} | "
                  f"{fp['cached_bytes_per_token']:.0f} | {fp['full_kv_bytes_per_token']:.0f} | "
                  f"{fp['ratio']:.2f} |\n")
    table += (f"\nFull KV: one bf16 K=V row of head_dim per layer and token. Cached: the pages "
              f"(compressed rows, indexer keys) plus a slot snapshot at each chunk end "
              f"(chunks of {args.chunk}; V4-Flash: 8192). Random bf16 weights"
              + (f", the config's context cap raised to {longest} tokens for this run"
                 if stretched else "") + ".")
    write_results(args.name or f"prefix-cache-{device}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
