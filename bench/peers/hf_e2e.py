"""The Hugging Face peer for bench/e2e.py: DeepseekV4ForCausalLM on the same slice and prompts.

Usage: python bench/peers/hf_e2e.py SPEC.json OUT.json   (run by bench/e2e.py, own process)
SPEC.json: {"config": the slice's HF config dict (config/hf.py to_hf_dict), "prefill":
[lengths], "decode": [[batch, context]], "new_tokens": n, "seed": s}. Random bf16 weights
(HF's init), on the GPU when there is one.
Prefill: one prompt's forward pass, timed (= its time to first token). Decode: the batch's
prompts prefilled in chunks through HF's cache (its eager attention would otherwise hold
scores for the whole batch's prompts at once: out of memory at 16 x 4k), then n greedy steps
of the model with its cache, timed per step (the same arithmetic as `generate`, without its
per-step logits processing).
"""

import json
import math
import statistics
import sys
import time

import torch
import transformers
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats=3):
    fn()                                                         # warm-up
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


SCORE_BYTES = 4 << 30     # what one prefill chunk's attention scores may take


def decode_step_seconds(model, ids: torch.Tensor, steps: int) -> float:
    """ids [B, S]: prefill them in chunks, then `steps` greedy decode steps -> seconds a step."""
    batch, context = ids.shape
    heads = model.config.num_attention_heads
    chunk = 2 ** max(0, int(math.log2(SCORE_BYTES / (batch * heads * context * 4))))
    cache = None
    for start in range(0, context, chunk):
        out = model(ids[:, start: start + chunk], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        cache = out.past_key_values
    out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)  # warm-up
    sync()
    begin = time.perf_counter()
    for _ in range(steps):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                    use_cache=True)
    sync()
    return (time.perf_counter() - begin) / steps


def main(spec_file: str, out_file: str) -> None:
    spec = json.loads(open(spec_file).read())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(spec["seed"])
    config = DeepseekV4Config(**spec["config"])
    config._attn_implementation = "eager"
    # Built in bf16 directly: a 4-layer V4-Flash slice has ~27 B parameters, which in float32
    # (the default) would not fit beside its bf16 copy.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    vocab = config.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(spec["seed"])
    prompts = lambda b, n: torch.randint(2, vocab, (b, n), generator=gen).to(device)  # noqa: E731
    rows = []
    with torch.no_grad():
        for length in spec["prefill"]:
            ids = prompts(1, length)
            seconds = timed(lambda: model(ids))
            rows.append({"case": f"prefill {length}", "tokens": length, "seconds": seconds,
                         "tokens_per_s": length / seconds, "ttft_s": seconds})
            print(rows[-1], flush=True)
        n = spec["new_tokens"]
        for batch, context in spec["decode"]:
            row = {"case": f"decode b{batch} ctx {context}", "batch": batch, "context": context}
            try:
                step_s = decode_step_seconds(model, prompts(batch, context), n)
            except torch.OutOfMemoryError as error:
                rows.append(row | {"error": str(error).splitlines()[0][:160]})
                torch.cuda.empty_cache()
                continue
            rows.append(row | {"itl_s": step_s, "tokens_per_s": batch / step_s})
            print(rows[-1], flush=True)
    json.dump({"rows": rows, "torch": torch.__version__, "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"},
              open(out_file, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
