"""Runs in .venv-ascend (no jax): greedy generation with `deepinfer_jax.LLM(...,
backend="ascend")` (the one LLM and its host loop over the Ascend engine: its own checkpoint
reading, the shared scheduler driving the torch step) on the prompts a JAX-side test wrote.

    python tests/ascend/torch_generate.py DIR

DIR holds case.json (the checkpoint, the engine's shapes and options, rounds of prompts, each
one `generate` call, and max_tokens); this writes result.json: each prompt's generated tokens,
the speculative counters summed over the requests (verify steps, drafts verified, drafts
accepted), the prefix cache's hits and hit tokens, and whether jax was imported (never)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from deepinfer_jax import LLM, SamplingParams  # noqa: E402


def main(directory: Path) -> None:
    case = json.loads((directory / "case.json").read_text())
    llm = LLM(case["checkpoint"], backend="ascend", show_progress=False,
              **{**case["engine"], "token_buckets": tuple(case["engine"]["token_buckets"])})
    default = SamplingParams(max_tokens=case["max_tokens"], ignore_eos=True)
    each = case.get("sampling")       # per prompt of the one round, or the default for all
    done = [o for prompts in case["rounds"] for o in llm.generate(
        prompts, [SamplingParams(**kw) for kw in each] if each else default, use_tqdm=False)]
    stats, spec = llm.prefix_cache_stats, llm.spec_metrics
    (directory / "result.json").write_text(json.dumps({
        "tokens": [list(o.outputs[0].token_ids) for o in done],
        "errors": [None if o.error is None else str(o.error) for o in done],
        "spec": [spec.steps, spec.drafted, spec.accepted],
        "prefix": None if stats is None else [stats.hits, stats.hit_tokens],
        "jax_imported": "jax" in sys.modules}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
