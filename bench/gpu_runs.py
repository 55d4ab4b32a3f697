"""The GPU suite's runs (bench/gpu_suite.py runs them): each a time limit for all of its
commands, a line saying what it is for, and the commands. bench/README.md lists them."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
V4_BATCH_INVARIANT = ["--v4-flash-layers", "2", "--prefill", "8192", "--decode-batches", "64",
                      "--buckets", "64", "256"]
# issue 35's settings: 4k-context decode at batch 16 and 64, the 8k prefill in one chunk
V4_BATCH_INVARIANT_E2E = ["--v4-flash-layers", "2", "--prefill", "8192", "--chunk", "8192",
                          "--context", "4096", "--decode-batches", "16", "64", "--steps", "16",
                          "--buckets", "16", "64", "8192", "--name", "batch-invariant-e2e-gpu"]

# bench/launch_options.py's GPU run: the slope between 2 and 4 layers at batch 1
LAUNCH_OPTIONS = ["--v4-flash-layers", "2", "4", "--batch", "1", "--context", "4096",
                  "--budget", "16"]

# bench/serve_load.py's GPU run (its docstring and bench/README.md say why these shapes)
SERVE_LOAD = ["--requests", "1024", "--concurrency", "64", "--client-processes", "8",
              "--max-tokens", "64", "--prompt-ids",
              "64", "--disconnects", "64", "--offline", "--min-ratio", "0.9",
              "--start-timeout-s", "300", "--max-seconds", "180", "--name", "serve-load-gpu", "--",
              "deepseek-v4-flash", "--load-format", "dummy", "--dummy-layers", "4",
              "--max-num-seqs", "64", "--max-model-len", "256", "--max-num-batched-tokens",
              "1024", "--token-buckets", "64", "128", "256", "1024"]


@dataclasses.dataclass(frozen=True)
class Run:
    limit_s: int                    # for all its commands together; under a 10-minute call
    what: str
    commands: tuple[tuple[str, ...], ...]


def bench(script: str, *args: str) -> tuple[str, ...]:
    return (PY, f"bench/{script}", *args)


RUNS = {
    "kernel-tests": Run(540, "the kernels against their jnp references, compiled for the GPU",
                        ((*PYTEST, "tests/kernels"),)),
    "engine-tests": Run(540, "every kernel forced on in the engine; the model's MoE and mHC on "
                             "the kernels", ((*PYTEST, "tests/engine/test_kernels_in_engine.py",
                                              "tests/model/test_mhc.py"),
                                             (*PYTEST, "tests/model/test_moe.py", "-k", "kernel"))),
    # (the file's lowering tests lower for CUDA on the CPU, in CI: session 51's run with them
    # stopped at its limit with a failure it had no time left to report)
    "invariance-tests": Run(540, "batch invariance: logprobs bitwise equal alone and in batches, "
                                 "on the tiny model and on the kernels",
                            ((*PYTEST, "-rf", "--tb=short", "tests/engine/test_batch_invariance.py",
                              "-k", "not (computes_the_same_model or lowers or no_row_tiles)"),)),
    "invariance-fewer-slots": Run(300, "test_sync_loop_on_fewer_slots alone (the 8-slot "
                                       "synchronous engine against the 32-slot one's runs "
                                       "alone), the check that failed on an H100",
                                  ((*PYTEST, "-rf", "--tb=short",
                                    "tests/engine/test_batch_invariance.py", "-k",
                                    "fewer_slots"),)),
    # Session 59's bf16 top-logprob failure: the values matched HF's sorted ones while two
    # ranks' tokens traded places. The probe reads the engine's top 5 beside the cache-free
    # forward's on the same device (ids misnamed, or logits off), then the test with its
    # traceback. Needs the oracle's deepinfer-tiny-v4 folder.
    "top-logprobs-probe": Run(300, "whether the bf16 engine's top logprobs name the wrong "
                                   "tokens or its logits err, then the HF top-logprob test",
                              (("env", f"DEEPINFER_ORACLE_DIR={REPO / '.cache' / 'oracle'}",
                                *bench("top_logprobs_probe.py")),
                               ("env", f"DEEPINFER_ORACLE_DIR={REPO / '.cache' / 'oracle'}",
                                *PYTEST, "-rf", "--tb=short",
                                "tests/engine/test_engine_vs_hf_cases.py::test_top_logprobs_match_hf"
                                "[deepinfer-tiny-v4]"))),
    # Session 59's three GPU failures in one call, each a few minutes: the top-logprob probe
    # above; V4.1 invariance[b], whose 64-token-chunk engine parted from the 16-token one by
    # 1e-6 in float32. Its per-token segments run in 64-row tiles in both engines, a loop of
    # one trip that XLA removes and fused with the padding (16 rows padded, 64 not): the
    # tiles are now sealed (invariant.sealed_row_tiles), which the test as is checks. Its
    # dense products are XLA's own dots (the invariant GEMM kernel takes 16-bit operands
    # only), whose kernels XLA picks by timing them (xla_gpu_autotune_level, default 4), so
    # the test again without autotuning, and the 8-slot check without it too.
    "diagnose-59": Run(570, "the bf16 top-logprob probe; V4.1 invariance[b] with XLA's GEMM "
                            "autotuning on, then off; the 8-slot invariance check with it off",
                       (("env", f"DEEPINFER_ORACLE_DIR={REPO / '.cache' / 'oracle'}",
                         *bench("top_logprobs_probe.py")),
                        *(("env", *flags, f"DEEPINFER_V41_ORACLE_DIR={REPO / '.cache' / 'v41-oracle'}",
                           *PYTEST, "-rf", "--tb=line",
                           "tests/engine/test_v41_invariance.py::test_v41_rows_do_not_depend_on_the_"
                           "batch_or_the_chunks[b]")
                          for flags in ((), ("XLA_FLAGS=--xla_gpu_autotune_level=0",))),
                        ("env", "XLA_FLAGS=--xla_gpu_autotune_level=0", *PYTEST, "-rf", "--tb=line",
                         "tests/engine/test_batch_invariance.py::test_sync_loop_on_fewer_slots"))),
    # Whether XLA's excess precision is what parts the GPU's bf16 runs: under the default
    # xla_allow_excess_precision the GPU compiler drops float conversion chains (the V4.1
    # fake quantization lost its FP8 rounding so, session 57) and may keep a bf16 value in
    # float32 across ops, where the rounding points can follow how a step was fused, i.e. its
    # shapes. The batch-invariance check across slot counts and the bf16 HF logprob bound,
    # with the flag off for the whole process, then on (the default) for comparison.
    "no-excess-precision": Run(560, "test_sync_loop_on_fewer_slots and the bf16 HF logprobs "
                                    "with xla_allow_excess_precision off, then on",
                               tuple(("env", f"XLA_FLAGS=--xla_allow_excess_precision={flag}",
                                      f"DEEPINFER_ORACLE_DIR={REPO / '.cache' / 'oracle'}",
                                      "XLA_PYTHON_CLIENT_PREALLOCATE=false",
                                      "XLA_PYTHON_CLIENT_MEM_FRACTION=0.4",
                                      *PYTEST, "-n", "2", "--dist", "loadfile", "-rf",
                                      "--tb=line",
                                      "tests/engine/test_batch_invariance.py::"
                                      "test_sync_loop_on_fewer_slots",
                                      "tests/engine/test_engine_vs_hf_cases.py::"
                                      "test_top_logprobs_match_hf[deepinfer-tiny-v4]")
                                     for flag in ("false", "true"))),
    # issue 35's full GPU test run: the CPU suite's files with the kernels compiled, not
    # interpreted. Ten workers share the GPU (eight reached 98% of the suite in 1150 s on the
    # H200, session 56), so each takes 9% of it, and only as it needs it; each test's result
    # is logged as it ends (-vv against PYTEST's -q), so a run cut short still tells. Longer
    # than one device call: run it detached (bench/README.md). The oracle fixtures travel in
    # .cache/oracle (the GPU image has no torch CPU environment to build them) and V4.1's in
    # .cache/v41-oracle (a copy of ../shared/oracle, which stays here).
    "all-tests": Run(1150, "every test file on the GPU (slow tier included), ten workers",
                     (("env", "XLA_PYTHON_CLIENT_PREALLOCATE=false",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION=0.09",
                       f"DEEPINFER_ORACLE_DIR={REPO / '.cache' / 'oracle'}",
                       f"DEEPINFER_V41_ORACLE_DIR={REPO / '.cache' / 'v41-oracle'}",
                       *PYTEST, "-vv", "-n", "10",
                       "--dist", "loadfile", "--max-worker-restart=0",
                       "--continue-on-collection-errors", "-rfEs", "--durations=20",
                       # the engine's files first: a run cut short has run those
                       "tests/engine", "tests/model", "tests/weights", "tests/kernels",
                       "tests/api", "tests/host", "tests/ascend",
                       "tests/test_architecture.py", "tests/test_notebooks.py"),)),
    "e2e": Run(540, "end to end on a 4-layer V4-Flash slice, beside its roofline and HF's "
                    "(needs transformers >= 5.23: .whl)",
               (bench("e2e.py", "--peer-timeout", "150"),)),
    "quantized-tests": Run(540, "the FP4 grouped GEMM and FP8 path compiled; the shipped model "
                                "quantized vs bf16 in the engine; the memory plan on a GPU",
                           ((*PYTEST, "tests/kernels/test_grouped_gemm_fp4.py",
                             "tests/engine/test_quantized_engine.py",
                             "tests/engine/test_memory_plan.py"),
                            (*PYTEST, "tests/kernels/test_grouped_gemm.py", "-k", "fp8"))),
    "load-memory": Run(420, "host memory while loading a 3-layer V4-Flash-sized FP8/FP4 "
                            "checkpoint; the device holds the packed bytes",
                       (bench("load_memory.py", "--layers", "3"),)),
    "e2e-quantized": Run(590, "the deepest V4-Flash slice that fits, in the release's formats "
                              "(prefill 8k, decode 1/16/64 at 4k)",
                         (("env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95", PY, "bench/e2e.py",
                           "--quantized", "--layers", "0", "--prefill", "8192", "--batches", "1",
                           "16", "64", "--steps", "16", "--peer-python", "", "--versus-layers",
                           "0", "--gpu-memory-utilization", "0.95", "--token-buckets", "16",
                           "64", "--name", "e2e-quantized-gpu"),)),
    "e2e-quantized-versus": Run(540, "4 V4-Flash layers quantized vs the same weights in bf16, "
                                     "decode batch 16 at 4k",
                                (bench("e2e.py", "--quantized", "--layers", "4", "--prefill",
                                       "1024", "--batches", "16", "--steps", "16",
                                       "--peer-python", "", "--name",
                                       "e2e-quantized-versus-gpu"),)),
    # issue 32's two decode figures in one call: the bf16 slice's 51 GiB of weights need jax's
    # memory fraction raised on an 80 GB card (e2e.py runs one form of the weights at a time)
    "quantized-versus": Run(420, "decode b16 at 4k on 4 V4-Flash layers, quantized vs the same "
                                 "weights in bf16 (logits compared too)",
                            (("env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95", PY, "bench/e2e.py",
                              "--quantized", "--versus-only", "--steps", "16", "--peer-python",
                              "", "--gpu-memory-utilization", "0.95", "--name",
                              "e2e-versus-gpu"),)),
    "fp4-tiles": Run(200, "the FP4 grouped GEMM on the engine's stored tiles vs the row order, "
                          "decode 16/64 and an 8k prefill",
                     (bench("fp4_probe.py", "--study", "engine-tiles"),)),
    "fp4-persistent": Run(300, "the FP4 grouped GEMM on the stored tiles, one program a pair vs "
                               "persistent programs over the used tiles, decode 1/4 of a "
                               "16-token bucket, 16 and 64",
                          (bench("fp4_probe.py", "--study", "persistent"),)),
    "fp4-persistent-engine": Run(480, "decode at batch 1, 16 and 64 (4k context) on 4 quantized "
                                      "V4-Flash layers, the FP4 expert kernel a program a pair "
                                      "vs 4 persistent programs an SM",
                                 (bench("depth_slope.py", "--quantized", "--layers", "4",
                                        "--batches", "1", "16", "64", "--bucket-sets",
                                        "16,64,1024", "--fp4-programs-per-sm", "0", "4",
                                        "--name", "fp4-persistent-engine-gpu"),)),
    # the bitwise pair first, on its own: pytest -q reports a failure only at the end, which
    # a run stopped at its limit never reaches
    "spec-shipped-tests": Run(560, "MTP speculation on the trained tiny model: outputs and "
                                   "logprobs bitwise plain decoding's, with and without a "
                                   "draft token map",
                              ((*PYTEST, "--tb=short", "tests/engine/test_speculative_shipped.py",
                                "-k", "bitwise or draft_token_map"),
                               (*PYTEST, "tests/engine/test_speculative_shipped.py", "-k",
                                "not (bitwise or draft_token_map)"))),
    "spec-bitwise-tests": Run(300, "spec-shipped-tests' first half alone: speculation's outputs "
                                   "and logprobs bitwise plain decoding's",
                              ((*PYTEST, "--tb=short", "tests/engine/test_speculative_shipped.py",
                                "-k", "bitwise or draft_token_map"),)),
    "invariance-probe": Run(480, "where a speculative step's logprobs part from a plain step's "
                                 "(batch-invariant mode), and whether plain engines whose states "
                                 "differ in shape only agree",
                            (bench("invariance_probe.py", "softmax"),
                             bench("invariance_probe.py", "states"),
                             bench("invariance_probe.py", "engines"))),
    "invariance-slots": Run(480, "which op's bits follow the slot count on the tiny model "
                                 "(test_batch_invariance's 8- vs 32-slot engines failed on an "
                                 "H100): log-softmax and RMS norm rows at 1-16 rows vs 48, and "
                                 "both engines' logprobs and optimized step HLO (under results/), "
                                 "plain and with row sums over lanes of 32",
                            (bench("invariance_probe.py", "rows"),
                             bench("invariance_probe.py", "slots"))),
    "invariance-loops": Run(420, "test_sync_loop_on_fewer_slots' engines apart: the test's 34 "
                                 "prompts alone on 32 slots, then together on 32 and 8 slots, "
                                 "each loop (which engine's logprobs move); then the 8- and "
                                 "32-slot synchronous engines at the test's sizes, each in a "
                                 "process of its own with its optimized HLO under results/",
                            (bench("invariance_probe.py", "loops"),
                             bench("invariance_probe.py", "slots-test"))),
    "invariance-topk": Run(420, "the prompt test_sync_loop_on_fewer_slots' 8-slot engine moved "
                                "(22), alone on 32 slots and among others on 8: its CSA "
                                "selections' scores and rows in both engines, where they part, "
                                "with the reference indexer's heads in a fixed order and by a "
                                "contraction",
                           (bench("invariance_topk.py"),)),
    "invariance-layers": Run(420, "the same prompt's every layer's values (queries, keys, rows, "
                                  "attention, sublayer outputs, experts) in both engines: the "
                                  "first layer, value and position that part; then the same "
                                  "with the closed compressed rows in fixed row tiles",
                             (bench("invariance_layers.py"),
                              bench("invariance_layers.py", "tiled-rows"))),
    "kernels-moe": Run(420, "grouped MoE GEMM vs XLA and tokamax (.whl)",
                       (bench("kernels_moe.py"),)),
    "kernels-attention": Run(480, "sink attention kernels vs the XLA path",
                             (bench("kernels_attention.py"),)),
    "kernels-attention-quick": Run(300, "sink attention at decode batch 64 (4k context) and the 8k "
                                        "prefill only, each decode row's time by kernel",
                                   (bench("kernels_attention.py", "--quick"),)),
    "kernels-indexer": Run(240, "lightning indexer kernel vs the XLA path",
                           (bench("kernels_indexer.py"),)),
    "fp8-probe": Run(300, "the FP8 kernel's configs and ablations at M = 16 (what bounds it)",
                     (bench("fp8_probe.py"),)),
    "e2e-v41": Run(560, "a V4.1-Flash slice (8 layers: the first CSA2 source and its five reusers) "
                        "in the release's formats: prefill 8k, decode 1/16 at 4k",
                   # the allocator's default 75% of the H200 (105 GiB) is less than the slice's
                   # weights, activations and what the random draw leaves held (107 GiB planned)
                   (("env", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95", PY, "bench/e2e.py", "--model",
                     "v4.1", "--prefill", "8192", "--batches", "1", "16", "--context", "4096",
                     "--steps", "16", "--token-buckets", "16", "--peer-python", "",
                     "--name", "e2e-v41-gpu"),)),
    "v41-engram-tests": Run(300, "the step's 32-bit Engram hash against the host's int64 one on "
                                 "the GPU (released sizes; the fixtures' cases where a copy of "
                                 "../shared/oracle is carried, DEEPINFER_V41_ORACLE_DIR)",
                            ((*PYTEST, "tests/model/test_v41_engram_device.py",
                              "tests/engine/test_engram_rows.py"),)),
    "e2e-v41-async": Run(420, "the V4.1 slice's decode with the Engram tables on the device (the "
                              "step hashes; the asynchronous loop) beside host tables (synchronous)",
                         tuple(bench("e2e.py", "--model", "v4.1", "--v41-reusers", "1",
                                     "--prefill", "1024", "--batches", "1", "16", "--context",
                                     "2048", "--steps", "16", "--token-buckets", "16",
                                     "--peer-python", "", "--engram-tables", tables,
                                     "--name", f"e2e-v41-{tables}-gpu")
                               for tables in ("host", "device"))),
    "kernels-fp8": Run(360, "the FP8 projections at decode sizes: the kernel beside XLA's dot on "
                            "the weights dequantized in the call and on bf16 weights",
                       (bench("kernels_fp8.py", "--rows", "1", "16", "64", "--sweep-rows", "0",
                              "--xla", "--name", "kernels-fp8-xla-gpu"),)),
    "kernels-dense": Run(240, "batch-invariant dense GEMM vs XLA's dot",
                         (bench("kernels_dense.py"),)),
    "batch-invariant": Run(420, "the batch-invariant mode's cost, decode and chunked prefill",
                           (bench("batch_invariant.py", *V4_BATCH_INVARIANT),)),
    "batch-invariant-e2e": Run(590, "the batch-invariant mode's cost at the e2e settings: 4k-context "
                                    "decode at batch 16/64, the 8k prefill in one chunk",
                               (bench("batch_invariant.py", *V4_BATCH_INVARIANT_E2E),)),
    "overlap": Run(420, "the device's idle share in the asynchronous loop at batch 1/16/64, 4k "
                        "context, plain and with 3 drafts a step (2 V4-Flash layers + MTP)",
                   (bench("overlap.py", "--v4-flash-layers", "2", "--context", "4096",
                          "--spec-k", "0", "3", "--steps", "10"),)),
    "launch-options": Run(560, "the decode step's launch under XLA's command-buffer update "
                               "modes and PDL, at 2 and 4 V4-Flash layers (batch 1, 4k context), "
                               "with the default and the VMM allocator",
                          (bench("launch_options.py", *LAUNCH_OPTIONS),
                           ("env", "XLA_PYTHON_CLIENT_ALLOCATOR=vmm",
                            *bench("launch_options.py", *LAUNCH_OPTIONS, "--variants", "default",
                                   "skip-temp", "skip-profiled")))),
    "depth-slope": Run(590, "the per-layer cost of a decode step at batch 1 and 16: quantized "
                            "V4-Flash slices of 2, 4 and 8 layers against the roofline's slope",
                       (bench("depth_slope.py", "--quantized"),)),
    "decode-buckets": Run(480, "batch 1, 4 and 8 decode on 4 quantized V4-Flash layers (4k context) "
                               "padded to a 16-token bucket against buckets of 1, 4 and 8 tokens, "
                               "each row's kernels profiled",
                          (bench("depth_slope.py", "--quantized", "--layers", "4", "--batches",
                                 "1", "4", "8", "--bucket-sets", "16,1024", "1,4,8,16,1024",
                                 "--name", "decode-buckets-quantized-gpu", "--trace",
                                 "/tmp/decode-buckets-trace"),)),
    **{f"spec-verify-k{k}": Run(
        1100, f"the verify step's cost for {k} draft{'s' if k > 1 else ''} against a plain step "
              "(4 V4-Flash layers + MTP in the release's formats, 4k context, batch 1/16/64) and "
              "the speed-up the trained tiny model's acceptance implies (as spec-verify-cpu "
              "measured it); one k a run, detached over two calls: the plain engine builds in "
              "about 135 s, each k's speculative one in over 400 s (k = 3, an H100)",
        (bench("spec_verify.py", "--v4-flash-layers", "4", "--quantized", "--batches", "1",
               "16", "64", "--ks", str(k), "--acceptance-from",
               "bench/results/spec-verify-cpu.json",
               "--name", f"spec-verify-k{k}-gpu"),)) for k in (1, 3, 5)},
    "spec-verify-k3-map": Run(
        1100, "spec-verify-k3 with the drafts from a token map of a quarter of the vocabulary "
              "(speculative_config.draft_token_map: the draft reads a quarter of the LM head), "
              "the tiny model's acceptance with its most frequent quarter (as "
              "spec-verify-map0.25-cpu measured it); detached over two calls",
        (bench("spec_verify.py", "--v4-flash-layers", "4", "--quantized", "--batches", "1",
               "16", "64", "--ks", "3", "--draft-vocab-fraction", "0.25", "--acceptance-from",
               "bench/results/spec-verify-map0.25-cpu.json",
               "--name", "spec-verify-k3-map0.25-gpu"),)),
    "speculative": Run(480, "MTP speculative decoding on the tiny model (cold: ~5 min compiling)",
                       (bench("speculative.py", "--buckets", "16", "64", "256"),)),
    "prefix-cache": Run(480, "TTFT with a 16k cached prefix vs cold, from the device cache and "
                             "from the host and disk KV tiers",
                        (bench("prefix_cache.py", "--v4-flash-layers", "2", "--prefix", "16384",
                               "--chunk", "2048", "--buckets", "16", "128", "512", "2048",
                               "--repeats", "5"),)),
    "serve-load": Run(540, "the OpenAI server at 64 concurrent streams on a 4-layer V4-Flash "
                           "slice (random weights) against LLM.generate on the same requests",
                      (bench("serve_load.py", *SERVE_LOAD),)),
    "step-profile": Run(480, "batch-1 decode (4 V4-Flash layers, 4k context) and an 8k prefill "
                             "step (2 layers): host vs device, every kernel with its source line",
                        (bench("step_profile.py", "--v4-flash-layers", "4", "--context", "4096",
                               "--batch", "1", "--steps", "30", "--out", "{scratch}/b1",
                               "--name", "step-profile-gpu"),
                         bench("step_profile.py", "--v4-flash-layers", "2", "--prefill", "8192",
                               "--steps", "5", "--out", "{scratch}/prefill",
                               "--name", "step-profile-prefill-gpu"))),
    "step-profile-quantized": Run(
        420, "batch-1 and batch-16 decode of the 4-layer slice in the release's formats (4k "
             "context): host vs device, every kernel with its source line",
        (bench("step_profile.py", "--v4-flash-layers", "4", "--context", "4096", "--batch", "1",
               "--quantized", "--steps", "30", "--out", "{scratch}/q1",
               "--name", "step-profile-b1-quantized-gpu"),
         bench("step_profile.py", "--v4-flash-layers", "4", "--context", "4096", "--batch", "16",
               "--quantized", "--steps", "30", "--out", "{scratch}/q16",
               "--name", "step-profile-b16-quantized-gpu"))),
    "step-profile-invariant": Run(
        300, "the batch-invariant mode's 8k single-chunk prefill step (2 V4-Flash layers): every "
             "kernel with its source line",
        (bench("step_profile.py", "--v4-flash-layers", "2", "--prefill", "8192", "--steps", "5",
               "--batch-invariant", "--out", "{scratch}/inv",
               "--name", "step-profile-invariant-prefill-gpu"),)),
}
