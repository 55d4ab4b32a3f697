"""Bounded prefix replay against exact snapshots (EngineConfig.prefix_replay): what rebuilding
the sliding windows by replaying the last R cached tokens changes in the output of the shipped
trained model, and what it saves per cached token.

    python bench/prefix_replay.py                 # CPU: 1536-token shared prefix, 4 prompts
    python bench/prefix_replay.py --footprint-only  # the byte table again, the stored rows kept

Each prompt is a shared prefix (the start of a standard-library module, cached first by a
request made of it alone) followed by its own suffix (the start of another module); each
engine generates 256 greedy tokens for every prompt in one batch, batch-invariant mode. The
exact engine's output is the cold run's (tests/engine/test_prefix_cache.py). Against it, for
each replay length R: greedy agreement (tokens equal up to the first difference, of 256), and
the per-token logprob difference of the chosen tokens over the tokens before that point (after
it the contexts differ). Bytes per cached token: pages (compressed rows and indexer keys) and
the slot snapshots kept, one at each chunk end, for the shipped model and DeepSeek-V4-Flash
(shapes only).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.models import V4_FLASH  # noqa: E402
from bench.lib.results import RESULTS, command, commit, write_results  # noqa: E402
from bench.prefix_cache import bytes_per_page  # noqa: E402
from deepinfer_jax import LLM, SamplingParams  # noqa: E402
from deepinfer_jax.config.engine import EngineConfig, StepConfig  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.config.model import ModelConfig  # noqa: E402
from deepinfer_jax.device.snapshots import init_pool  # noqa: E402
from deepinfer_jax.model.state import init_state  # noqa: E402

TINY = REPO / "models" / "deepinfer-tiny-v4"
SUFFIX_MODULES = ("textwrap.py", "shlex.py", "fractions.py", "heapq.py")


def snapshot_bytes(cfg: ModelConfig, step_cfg: StepConfig, windows: bool) -> int:
    state = jax.eval_shape(lambda: init_state(cfg, step_cfg, jnp.bfloat16))
    pool = jax.eval_shape(lambda: init_pool(state, 1, windows, spare=step_cfg.spec_tokens))
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(pool))


def per_token(cfg: ModelConfig, step_cfg: StepConfig, prefix: int, chunk: int) -> dict:
    pages = -(-prefix // step_cfg.page_size) * bytes_per_page(cfg, step_cfg, 2)
    snapshots = -(-prefix // chunk)       # one at each chunk end of a prefix prefilled alone
    out = {"prefix_tokens": prefix, "snapshots": snapshots, "pages_bytes_per_token": pages / prefix}
    for mode, windows in (("exact", True), ("bounded", False)):
        snap = snapshot_bytes(cfg, step_cfg, windows)
        out[mode] = {"snapshot_bytes": snap,
                     "bytes_per_token": (pages + snapshots * snap) / prefix}
    return out


def exactness_bound(cfg: ModelConfig) -> int:
    """The shortest replay that is exact: a token's layer-l output reads the layer-l inputs of
    the W-1 tokens before it (its window; the compressed rows are cached, exact), so after a
    replay of R tokens layer l's inputs are exact from R - l*(W-1) tokens before the prefix's
    end, and the first new token needs every layer's last W-1: R >= L*(W-1)."""
    return cfg.num_layers * (cfg.sliding_window - 1)


def prompts_of(llm: LLM, prefix_len: int, suffix_len: int) -> tuple[list[int], list[list[int]]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prefix = llm.tokenizer.encode((stdlib / "argparse.py").read_text())[:prefix_len]
    suffixes = [llm.tokenizer.encode((stdlib / m).read_text())[:suffix_len]
                for m in SUFFIX_MODULES]
    return prefix, [prefix + s for s in suffixes]


def run(llm: LLM, prefix: list[int], prompts: list[list[int]], tokens: int) -> dict:
    llm.generate([prefix], SamplingParams(max_tokens=1), use_tqdm=False)   # fills the cache
    hit = llm.prefix_cache_stats.hit_tokens
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=1),
                        use_tqdm=False)
    return {"seconds": time.perf_counter() - start,
            "hit_tokens": llm.prefix_cache_stats.hit_tokens - hit,
            "tokens": [o.token_ids for o in outs],
            "logprobs": [[lp.logprob for lp in o.logprobs] for o in outs]}


def compare(got: dict, want: dict) -> dict:
    agree, diffs = [], []
    for toks, lps, ref_toks, ref_lps in zip(got["tokens"], got["logprobs"], want["tokens"],
                                            want["logprobs"], strict=True):
        same = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), len(toks))
        agree.append(same)
        # the chosen token's logprob, up to and including the first differing position
        upto = min(same + 1, len(toks))
        diffs.extend(np.abs(np.subtract(lps[:upto], ref_lps[:upto])).tolist())
    return {"greedy_agree_tokens": agree, "all_agree": all(a == len(t) for a, t in
                                                           zip(agree, got["tokens"])),
            "logprob_abs_diff_max": float(np.max(diffs)),
            "logprob_abs_diff_mean": float(np.mean(diffs))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--suffix", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--replay", type=int, nargs="+", default=[128, 140, 256, 512, 1024],
                    help="replay lengths; the exactness bound L*(W-1) and one less are added")
    ap.add_argument("--footprint-only", action="store_true",
                    help="keep the stored run's rows (its prefix, chunk, measurements and "
                         "stamp) and recompute only the bytes per token (a new snapshot layout "
                         "changes what is stored, not what a hit computes)")
    args = ap.parse_args()
    if args.footprint_only:
        return footprint_only()
    engine = engine_options(args.chunk)
    exact = LLM(TINY, **engine)
    prefix, prompts = prompts_of(exact, args.prefix, args.suffix)
    want = run(exact, prefix, prompts, args.tokens)
    rows = {"exact": {"hit_tokens": want["hit_tokens"], "generate_wall_s_one_run": want["seconds"]}}
    bound = exactness_bound(exact.model.config)
    for replay in sorted({*args.replay, bound - 1, bound}):
        llm = LLM(TINY, prefix_replay="bounded", swa_replay_tokens=replay, **engine)
        got = run(llm, prefix, prompts, args.tokens)
        rows[f"bounded_{replay}"] = {"replay": replay, "hit_tokens": got["hit_tokens"],
                                     "generate_wall_s_one_run": got["seconds"],
                                     **compare(got, want)}
        print(replay, rows[f"bounded_{replay}"], flush=True)
        del llm
    tiny_fp, flash_fp = footprints(args.prefix, args.chunk)
    flash = read_model_config(V4_FLASH)
    payload = {"model": "deepinfer-tiny-v4 (shipped)", "prefix": args.prefix,
               "exactness_bound": bound, "exactness_bound_v4_flash": exactness_bound(flash),
               "suffix": args.suffix, "tokens": args.tokens, "chunk": args.chunk,
               "prompts": len(prompts), "rows": rows, "footprint_tiny": tiny_fp,
               "footprint_v4_flash_16k": flash_fp}
    write_results("prefix-replay-cpu", payload,
                  table(args, len(prompts), rows, tiny_fp, flash_fp, bound, exactness_bound(flash)))


def engine_options(chunk: int) -> dict:
    return dict(max_num_seqs=4, max_model_len=2048 + 256, max_num_batched_tokens=chunk,
                page_size=64, show_progress=False, batch_invariant=True,
                enable_prefix_caching=True)


def footprints(prefix: int, chunk: int) -> tuple[dict, dict]:
    """Bytes per cached token: the shipped model as run, V4-Flash with a 16k prefix."""
    tiny_cfg = read_model_config(TINY)
    tiny_fp = per_token(tiny_cfg, EngineConfig(**engine_options(chunk)).resolve(tiny_cfg),
                        prefix, chunk)
    flash = read_model_config(V4_FLASH).replace(num_mtp_layers=0, quantization=None)
    flash_step = EngineConfig(max_num_seqs=1, max_model_len=16384 + 1024,
                              max_num_batched_tokens=8192).resolve(flash)
    return tiny_fp, per_token(flash, flash_step, 16384, 8192)


def footprint_only() -> None:
    """Rewrite bench/results/prefix-replay-cpu with its stored rows and fresh byte figures."""
    payload = json.loads((RESULTS / "prefix-replay-cpu.json").read_text())
    payload["footprint_tiny"], payload["footprint_v4_flash_16k"] = footprints(
        payload["prefix"], payload["chunk"])
    payload["footprint_recomputed"] = {"commit": commit(), "command": command()}
    args = argparse.Namespace(**{k: payload[k] for k in ("prefix", "suffix", "tokens")})
    text = table(args, payload["prompts"], payload["rows"], payload["footprint_tiny"],
                 payload["footprint_v4_flash_16k"], payload["exactness_bound"],
                 payload["exactness_bound_v4_flash"])
    text += (f"\nThe byte table recomputed at commit {commit()} (`{command()}`); the rows "
             f"above are the stamped run's.\n")
    write_results("prefix-replay-cpu", payload, text)


def table(args, n: int, rows: dict, tiny_fp: dict, flash_fp: dict, bound: int,
          flash_bound: int) -> str:
    text = (f"Shipped tiny model (window 64), {n} prompts sharing a {args.prefix}-token prefix "
            f"(+{args.suffix} own tokens), {args.tokens} greedy tokens each, one batch, "
            f"batch-invariant; bounded replay against exact snapshots (= the cold run). "
            f"Agreement: tokens equal before the first difference, per prompt; logprob "
            f"difference of the chosen tokens up to that point (a close call that flips one "
            f"token shows as its difference there). A replay of L*(W-1) = {bound} tokens or "
            f"more is exact by construction ({flash_bound} for DeepSeek-V4-Flash). No timing "
            f"here (bench/prefix_cache.py times hits).\n\n"
            "| mode | replayed | hit tokens | greedy agreement (of 256, per prompt) | "
            "max abs logprob diff | mean abs logprob diff |\n|---|---|---|---|---|---|\n")
    for name, row in rows.items():
        if name == "exact":
            text += f"| exact | 0 | {row['hit_tokens']} | reference | 0 | 0 |\n"
            continue
        text += (f"| bounded | {row['replay']} | {row['hit_tokens']} | "
                 f"{', '.join(map(str, row['greedy_agree_tokens']))} | "
                 f"{row['logprob_abs_diff_max']:.2e} | {row['logprob_abs_diff_mean']:.2e} |\n")
    text += ("\nBytes per cached token (pages + one snapshot per chunk end; bf16 pages and "
             "windows, the CSA compressors' closed-block halves in f32, "
             "device/snapshot_layout.py):\n\n| model | prefix | snapshots | pages B/token | "
             "exact: snapshot B | exact B/token | bounded: snapshot B | bounded B/token |\n"
             "|---|---|---|---|---|---|---|---|\n")
    for name, fp in (("tiny (shipped)", tiny_fp), ("DeepSeek-V4-Flash", flash_fp)):
        text += (f"| {name} | {fp['prefix_tokens']} | {fp['snapshots']} | "
                 f"{fp['pages_bytes_per_token']:.0f} | {fp['exact']['snapshot_bytes']:,} | "
                 f"{fp['exact']['bytes_per_token']:.0f} | {fp['bounded']['snapshot_bytes']:,} | "
                 f"{fp['bounded']['bytes_per_token']:.0f} |\n")
    return text


if __name__ == "__main__":
    main()
