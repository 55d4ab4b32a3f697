"""Sequential Hugging Face greedy generation, timed (runs in the oracle environment).

Usage: python bench/peers/hf_generate.py CHECKPOINT PROMPTS.json OUT.json
PROMPTS.json: {"prompts": [[ids...], ...], "max_tokens": n}. Writes the outputs and timings.
"""

import json
import sys
import time

import torch
import transformers
from transformers import DeepseekV4ForCausalLM


def main(checkpoint: str, prompts_file: str, out_file: str) -> None:
    spec = json.loads(open(prompts_file).read())
    torch.set_num_threads(torch.get_num_threads())
    model = DeepseekV4ForCausalLM.from_pretrained(checkpoint, attn_implementation="eager")
    model = model.float().eval()
    outputs, seconds = [], []
    def generate(prompt, max_tokens):
        # An explicit attention mask: with only pad_token_id, generate would mask every
        # token equal to it (e.g. a BOS of id 0) as padding.
        ids = torch.tensor([prompt])
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        generate(spec["prompts"][0][:8], 2)                                 # warm-up
        for prompt in spec["prompts"]:
            start = time.perf_counter()
            out = generate(prompt, spec["max_tokens"])
            seconds.append(time.perf_counter() - start)
            outputs.append(out[0, len(prompt):].tolist())
    json.dump({"outputs": outputs, "seconds": seconds, "torch": torch.__version__,
               "transformers": transformers.__version__, "threads": torch.get_num_threads()},
              open(out_file, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:4])
