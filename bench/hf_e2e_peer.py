"""The Hugging Face peer for bench/e2e.py: DeepseekV4ForCausalLM on the same slice and prompts.

Usage: python bench/hf_e2e_peer.py SPEC.json OUT.json   (run by bench/e2e.py, own process)
SPEC.json: {"config": the slice's HF config dict (ModelConfig.to_hf_dict), "prefill":
[lengths], "decode": [[batch, context]], "new_tokens": n, "seed": s}. Random bf16 weights
(HF's init), on the GPU when there is one.
Prefill: one prompt's forward pass, timed (= its time to first token). Decode: `generate`
of n greedy tokens for a batch of prompts of the given context, minus the prefill of that
batch, per token.
"""

import json
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
            ids = prompts(batch, context)
            mask = torch.ones_like(ids)

            def generate(new):
                return model.generate(ids, attention_mask=mask, do_sample=False,
                                      max_new_tokens=new, min_new_tokens=new,
                                      eos_token_id=None, pad_token_id=0)

            row = {"case": f"decode b{batch} ctx {context}", "batch": batch, "context": context}
            try:
                first, total = timed(lambda: generate(1), 2), timed(lambda: generate(n + 1), 2)
            except torch.OutOfMemoryError as error:        # eager attention at long contexts
                rows.append(row | {"error": str(error).splitlines()[0][:160]})
                torch.cuda.empty_cache()
                continue
            per_token = (total - first) / n
            rows.append(row | {"itl_s": per_token, "tokens_per_s": batch / per_token,
                               "ttft_s": first})
            print(rows[-1], flush=True)
    json.dump({"rows": rows, "torch": torch.__version__, "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"},
              open(out_file, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
