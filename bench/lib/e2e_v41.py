"""bench/e2e.py --model v4.1: the engine on a DeepSeek-V4.1-Flash slice at its real dimensions.

The slice (`slice_config`): the config's layers up to its first CSA2 KV source (window-only
layers, the first Engram layer among them) and `reusers` layers after it that attend the
source's compressed KV and reuse its top-k (the release: layers 0-1 window-only, layer 1 with
an Engram, layer 2 the KV + index source, 3-7 reusing it; 8 layers at most). The Engram
tables stay in host memory (`--engram-tables host`, the engine's default: the host hashes and
the loop is synchronous) or on the device (`device`: the step hashes, the loop runs ahead),
their vocabulary cut to `engram_vocab` (the release's 384M-row tables are ~98 GB each even in
FP8; a token gathers the same 24 rows of 256 values whatever the table's size). Random
weights in the release's formats (weights/v41_random.py: FP8 32x32-block projections, FP4
routed experts), bf16 otherwise.

Rooflines as V4's (bench/lib/rooflines.py), with V4.1's cache: a decode step reads the dense
weights, the hit experts and each request's cache rows in their stored formats (model/v41/
kv_format.py, sized by config/memory_v41.py): the window's FP8 rows, the selected compressed
entries (FP4 codes, a byte each while unpacked, and their scales) and, at index sources,
every indexer key. A prefill token: 2 FLOPs per active parameter plus attention's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib.ceilings import DATASHEET_BF16_TFLOPS, DATASHEET_TBPS
from bench.lib.ceilings import measure as measure_ceilings
from bench.lib.models import V4_FLASH, engine_params
from bench.lib.results import environment, write_results
from bench.lib.rooflines import weight_counts
from deepinfer_jax import LLM
from deepinfer_jax.api.v41_model import V41Model
from deepinfer_jax.config import memory_v41, options
from deepinfer_jax.config.family import facts_of
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.hf_v41 import parse_v41_config
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.engine.devices import local_device_facts
from deepinfer_jax.model.v41.engram_hash import hash_tables
from deepinfer_jax.weights.v41_random import random_v41_params

REPO = Path(__file__).resolve().parents[2]
V41_FLASH = REPO / "configs" / "deepseek-v41-flash.json"
ENGRAM_VOCAB = 200_000        # default buckets a head: ~4.8M rows, 2.5 GB of bf16 host table
KV_PAGE = 256                 # tokens a page for the bytes-per-token figures (all rates divide it)


def slice_config(path: Path, reusers: int, engram_vocab: int | None) -> V41Config:
    """The config at `path` cut to its first KV source, the layers before it and `reusers`
    layers reusing it; one Engram layer (the first) with `engram_vocab` hash buckets per
    head (None: the config's, at most ENGRAM_VOCAB)."""
    raw = json.loads(Path(path).read_text())
    source, *later = raw["kv_source_layer_ids"]
    layers = source + 1 + reusers
    if reusers < 0 or (later and layers > later[0]) or layers > raw["num_hidden_layers"]:
        raise SystemExit(f"--v41-reusers {reusers}: layer {source}'s group has "
                         f"{(later[0] if later else raw['num_hidden_layers']) - source - 1} "
                         f"layers after it")
    engram = [i for i in raw.get("engram_layer_ids") or () if i < layers][:1]
    raw.update(num_hidden_layers=layers, compress_ratios=raw["compress_ratios"][:layers],
               layer_types=raw["layer_types"][:layers], kv_source_layer_ids=[source],
               index_source_layer_ids=[source], candidate_source_layer_id=source,
               dspark_target_layer_ids=[layers - 1], engram_layer_ids=engram,
               engram_num_embeddings=[1] * len(engram))
    raw["engram_vocab_size"] = engram_vocab or min(raw["engram_vocab_size"], ENGRAM_VOCAB)
    cfg = parse_v41_config(raw)
    if cfg.engram is not None:      # the table rows: the sum of the layer's bucket primes
        rows = hash_tables(cfg.engram).primes.reshape(len(engram), -1).sum(-1)
        cfg = parse_v41_config(raw | {"engram_num_embeddings": [int(r) for r in rows]})
    return cfg


def cache_bytes_read(cfg: V41Config, context: int) -> int:
    """Cache bytes one request's decode token reads over the slice's layers, each row in its
    stored format (config/memory_v41.py)."""
    total = 0
    for i, ratio in enumerate(cfg.compress_ratios):
        total += min(cfg.sliding_window, context) * memory_v41.window_row_bytes(cfg)
        if ratio:
            entries = context // ratio
            total += min(cfg.index_topk, entries) * memory_v41.entry_bytes(cfg)
            if cfg.is_index_source(i):
                total += entries * memory_v41.index_key_bytes(cfg)
    return total


def decode_roofline(counts: dict, cfg: V41Config, batch: int, context: int,
                    copy_tbps: float) -> dict:
    experts, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = experts * (1 - (1 - k / experts) ** batch)
    weights = counts["dense_bytes"] + cfg.num_layers * hit * counts["per_expert_bytes"]
    total = weights + batch * cache_bytes_read(cfg, context)
    return {"bytes_per_step": total, "tokens_per_s": batch / (total / (copy_tbps * 1e12))}


def prefill_roofline(counts: dict, cfg: V41Config, length: int, matmul_tflops: float) -> dict:
    active = (counts["dense"] - counts["head"]
              + cfg.num_layers * cfg.num_experts_per_tok * counts["per_expert"])
    flops = 2 * active * length + 2 * counts["head"]
    for position in range(0, length, 64):            # attention, sampled every 64 positions
        for i, ratio in enumerate(cfg.compress_ratios):
            rows = min(cfg.sliding_window, position + 1)
            if ratio:
                entries = position // ratio
                rows += min(cfg.index_topk, entries)
                if cfg.is_index_source(i):
                    flops += 64 * 2 * cfg.index_n_heads * cfg.index_head_dim * entries
            flops += 64 * 4 * cfg.num_heads * cfg.head_dim * rows
    return {"flops": flops, "tokens_per_s": length / (flops / (matmul_tflops * 1e12))}


def kv_bytes_per_token(cfg, full_path: Path) -> dict:
    """The paged state's bytes per token (compressed entries and indexer keys, the window
    rings apart): the slice's, and the full model's at `full_path`."""
    def per_token(c):
        return facts_of(c).page_bytes(c, KV_PAGE, 2) / KV_PAGE
    return {"slice": per_token(cfg), "full": per_token(read_model_config(full_path))}


def run(args, engine_shapes: dict, prefill, decode, table) -> None:
    """e2e.py's main for V4.1: its prefill / decode / table functions on the V4.1 slice."""
    path = V41_FLASH if args.config == V4_FLASH else args.config
    cfg = slice_config(path, args.v41_reusers, args.engram_vocab)
    ceilings = measure_ceilings(small=jax.default_backend() != "gpu")
    print(ceilings, flush=True)
    start = time.perf_counter()
    # FP4 experts drawn at the width the engine's kernels want (LLM would pad them on the
    # device, holding both widths for a moment)
    granule = options.resolve_compute(local_device_facts()).fp4_expert_granule
    # and in the kernel's stored tiles (LLM would lay out a copy: weights/fp4_tiles.py)
    params = engine_params(jax.block_until_ready(random_v41_params(
        cfg, 0, jnp.bfloat16, release_formats=True, fp4_k_granule=granule)))
    startup = {"random_weights_s": time.perf_counter() - start}
    counts = weight_counts(params.replace(engram_tables=()), cfg)
    rng = np.random.default_rng(0)
    token_map = (rng.integers(0, cfg.engram.compressed_vocab_size, cfg.vocab_size)
                 if cfg.engram is not None else None)
    start = time.perf_counter()
    llm = LLM(V41Model(config=cfg, params=params, token_map=token_map), **engine_shapes,
              engram_tables=args.engram_tables, compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    startup["engine_s"] = time.perf_counter() - start
    print("start-up:", startup, flush=True)
    rows = []
    for length in args.prefill:
        row = {"case": f"prefill {length}", **prefill(llm, length, rng)}
        roof = prefill_roofline(counts, cfg, length, ceilings["matmul_tflops"])
        row |= {"roofline_tokens_per_s": roof["tokens_per_s"], "flops": roof["flops"],
                "datasheet_roofline_tokens_per_s": roof["tokens_per_s"] * DATASHEET_BF16_TFLOPS
                / ceilings["matmul_tflops"]}
        rows.append(row)
        print(row, flush=True)
    for batch in args.batches:
        row = {"case": f"decode b{batch} ctx {args.context}",
               **decode(llm, batch, args.context, args.steps, rng)}
        roof = decode_roofline(counts, cfg, batch, args.context, ceilings["copy_tbps"])
        row |= {"roofline_tokens_per_s": roof["tokens_per_s"],
                "bytes_per_step": roof["bytes_per_step"],
                "datasheet_roofline_tokens_per_s": roof["tokens_per_s"] * DATASHEET_TBPS
                / ceilings["copy_tbps"]}
        rows.append(row)
        print(row, flush=True)
    kv = {"v4.1": kv_bytes_per_token(cfg, path),
          "v4-flash": kv_bytes_per_token(read_model_config(V4_FLASH), V4_FLASH)}
    layers = ", ".join(f"{i}:{'E+' if cfg.has_engram(i) else ''}"
                       f"{'src' if cfg.is_kv_source(i) else f'r{r}' if r else 'win'}"
                       for i, r in enumerate(cfg.compress_ratios))
    where = ("in host memory (the host hashes; a synchronous loop)" if args.engram_tables == "host"
             else "on the device (the step hashes; the asynchronous loop)")
    note = (f"Model: {path.name} cut to {cfg.num_layers} layers ({layers}; E: Engram, src: the "
            f"CSA2 KV + index source, rN: reusing it at ratio N), random weights in the "
            f"release's formats (FP8 32x32-block projections, FP4 routed experts), Engram "
            f"tables {where} ({cfg.engram.vocab_size if cfg.engram else 0} buckets a "
            f"head, not the release's 16M). Ceilings measured in this run: matmul "
            f"{ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_tbps']:.2f} TB/s. "
            f"No peer. KV bytes per token (paged compressed entries and indexer keys, "
            f"bf16 for V4, stored formats for V4.1; window rings apart): the V4.1 slice "
            f"{kv['v4.1']['slice']:.0f}, {path.name} in full {kv['v4.1']['full']:.0f}, "
            f"{V4_FLASH.name} in full {kv['v4-flash']['full']:.0f}.")
    text = table(rows, note)
    print(text)
    write_results(args.name or f"e2e-v41-{jax.devices()[0].platform}",
                  {"environment": environment(), "ceilings": ceilings, "weights": counts,
                   "startup": startup, "rows": rows, "kv_bytes_per_token": kv,
                   "layers": layers, "engram_tables": args.engram_tables}, text)
