"""Published per-GPU figures of peers serving DeepSeek-V4-Flash on H200s, with their sources
(gathered in the project's research notes, peer_numbers.md), for e2e_parallel's tables to
state beside the engine's own. They are other workloads (a serving benchmark of 8192-token
prompts and 1024-token outputs, concurrency-limited), so they sit beside the rows, not in
them."""

from __future__ import annotations

SGLANG_COOKBOOK = ("SGLang cookbook benchmark table, sgl-project/sglang "
                   "docs_new/src/snippets/configs/deepseek-ai/deepseek-v4-benchmarks.jsx @ "
                   "08587007c81585756076d965a3af856ac620f1b9 (SGLang v0.5.15; random dataset, "
                   "8192 in / 1024 out; TTFT and TPOT are means)")

# (model and weights, GPUs and layout, concurrency, TPOT ms, total (input + output) tok/s/GPU);
# output tok/s/GPU = total x 1024 / 9216 for that workload
V4_FLASH_H200 = (
    ("V4-Flash, FP4 experts + FP8 (as released)", "4xH200 TP4, Marlin W4A16 MoE, MTP 3-1-4", 1,
     3.37, 607),
    ("V4-Flash, FP4 experts + FP8 (as released)", "4xH200 TP4, flashinfer_mxfp4 MoE, MTP 1-1-2",
     256, 127.26, 4207),
    ("V4-Flash, FP4 experts + FP8 (as released)", "4xH200 TP4, Marlin W4A16 MoE, no MTP", 1024,
     126.81, 4473),
    ("V4-Flash-FP8 (experts FP8)", "4xH200 TP4 + DP4 attention, DeepEP, no MTP", 1024, 147.51,
     3958),
)


def table() -> list[str]:
    lines = [f"Published peers serving V4-Flash on H200s ({SGLANG_COOKBOOK}):", "",
             "| model | GPUs, layout | concurrency | TPOT ms | total tok/s/GPU | output tok/s/GPU |",
             "|---|---|---:|---:|---:|---:|"]
    for model, layout, concurrency, tpot, total in V4_FLASH_H200:
        lines.append(f"| {model} | {layout} | {concurrency} | {tpot:.2f} | {total:,} | "
                     f"{total * 1024 / 9216:,.0f} |")
    return lines
