"""Write the Hugging Face oracle's fixtures: tiny random checkpoints and reference outputs.

Runs in the oracle environment (Python 3.11, CPU torch 2.13.0, transformers 5.23.0), never in
the engine's. For each case it builds a `DeepseekV4ForCausalLM` from a tiny config, randomises
every parameter and buffer (HF initialises sinks, biases, hc bases and scales, tid2eid, ... to
constants, which would hide bugs), saves it with `save_pretrained` (official tensor names),
adds an MTP block, and records:
  * `logits`: full-sequence float32 logits for a batch of long prompts;
  * `greedy`: `generate(do_sample=False)` continuations (HF's own cached decode path), with
    `greedy_logits`: the float32 logits each of its steps took the argmax of;
  * `mtp_logits`: the MTP block's drafts, computed with HF's decoder-layer code.
Outputs go to <out>/<case>-<hash>/, where the hash covers the config, the case, this file and
the library versions, so an unchanged case is never rebuilt.

Usage: python tests/oracle/build.py [--out DIR] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".cache" / "oracle"

# name, config file, seed, batch x length of the logits prompts, greedy prompt length.
# Every generate() call passes an explicit attention mask: given only pad_token_id, generate
# would treat any prompt token equal to it (a BOS of id 0) as padding.
CASES = [
    dict(name="tiny-mixed", config="configs/tiny/tiny-mixed.json", seed=1,
         logits_shape=[2, 320], greedy_prompt=300, greedy_new=32,
         batch_requests=32, batch_max_prompt=600, batch_max_new=24),
    dict(name="tiny-sigmoid", config="configs/tiny/tiny-sigmoid.json", seed=2,
         logits_shape=[2, 330], greedy_prompt=310, greedy_new=32),
    dict(name="tiny-legacy", config="configs/tiny/tiny-legacy.json", seed=3,
         logits_shape=[1, 600], greedy_prompt=520, greedy_new=32),
    # The project's trained checkpoint, as shipped (not randomised): its text is a held-out
    # module of the oracle's own Python 3.11 stdlib.
    dict(name="deepinfer-tiny-v4", checkpoint="models/deepinfer-tiny-v4", text_module="textwrap.py",
         logits_len=400, greedy_prompt=300, greedy_new=32),
]


def case_source(case: dict) -> str:
    """What the case is built from: its config file, or the shipped checkpoint's bytes."""
    if "checkpoint" in case:
        d = REPO / case["checkpoint"]
        return "".join(hashlib.sha256((d / f).read_bytes()).hexdigest()
                       for f in ("config.json", "model.safetensors", "tokenizer.json"))
    return (REPO / case["config"]).read_text()


def case_hash(case: dict, config_text: str) -> str:
    h = hashlib.sha256()
    for part in (json.dumps(case, sort_keys=True), config_text, Path(__file__).read_text(),
                 torch.__version__, transformers.__version__):
        h.update(part.encode())
    return h.hexdigest()[:16]


# ---- top-k ties -----------------------------------------------------------------------------
def _stable_topk(input, k, dim=-1, largest=True, sorted=True, *, out=None):
    """torch.topk, but equal values keep their order (the lower index first), as jax.lax.top_k
    does. torch leaves ties unspecified; the indexer's scores tie exactly whenever the ReLU
    zeroes every head, and a tie at the top-k boundary makes two selections equally right."""
    values, indices = torch.sort(input, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


torch.topk = _stable_topk
torch.Tensor.topk = lambda self, k, dim=-1, largest=True, sorted=True: _stable_topk(
    self, k, dim, largest, sorted)


# ---- randomisation ------------------------------------------------------------------------
def randomize_(module: torch.nn.Module, gen: torch.Generator, n_experts: int) -> None:
    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "tid2eid":
                noise = torch.rand((p.shape[0], n_experts), generator=gen)
                p.copy_(noise.argsort(dim=-1)[:, : p.shape[1]])
            elif leaf == "e_score_correction_bias":
                p.copy_(normal(p.shape, 0.3))
            elif leaf == "sinks":
                p.copy_(normal(p.shape, 1.0))
            elif leaf == "position_bias":
                p.copy_(normal(p.shape, 0.5))
            elif leaf in ("fn", "hc_fn"):
                p.copy_(normal(p.shape, p.shape[-1] ** -0.5))
            elif leaf in ("base", "hc_base"):
                p.copy_(normal(p.shape, 0.5))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + normal(p.shape, 0.1))
            elif "embed_tokens" in name:
                p.copy_(normal(p.shape, 1.0))
            else:  # projections [out, in] and stacked experts [E, out, in]
                p.copy_(normal(p.shape, p.shape[-1] ** -0.5))


# ---- the MTP block, computed with HF's own layer code -------------------------------------
class MtpOracle(torch.nn.Module):
    """e_proj/h_proj/enorm/hnorm/norm/hc_head around one HF decoder layer (window-only, MoE)."""

    def __init__(self, carrier: DeepseekV4ForCausalLM):
        super().__init__()
        cfg = carrier.config
        d = cfg.hidden_size
        self.cfg = cfg
        self.layer = carrier.model.layers[cfg.num_hidden_layers - 1]
        self.rotary = carrier.model.rotary_emb
        self.e_proj = torch.nn.Linear(d, d, bias=False)
        self.h_proj = torch.nn.Linear(d, d, bias=False)
        self.enorm = hf_v4.DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = hf_v4.DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
        self.norm = hf_v4.DeepseekV4RMSNorm(d, cfg.rms_norm_eps)
        self.hc_head = hf_v4.DeepseekV4HyperHead(cfg)

    def official_tensors(self) -> dict[str, np.ndarray]:
        t = {
            "mtp.0.e_proj.weight": self.e_proj.weight, "mtp.0.h_proj.weight": self.h_proj.weight,
            "mtp.0.enorm.weight": self.enorm.weight, "mtp.0.hnorm.weight": self.hnorm.weight,
            "mtp.0.norm.weight": self.norm.weight, "mtp.0.hc_head_fn": self.hc_head.hc_fn,
            "mtp.0.hc_head_base": self.hc_head.hc_base, "mtp.0.hc_head_scale": self.hc_head.hc_scale,
        }
        return {k: v.detach().numpy().copy() for k, v in t.items()}

    @torch.no_grad()
    def logits(self, model: DeepseekV4ForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
        streams = {}
        hook = model.model.layers[-1].register_forward_hook(
            lambda mod, args, out: streams.__setitem__("h", out))
        model(input_ids)
        hook.remove()
        h = streams["h"][:, :-1]                                    # H_t, t = 0..S-2
        next_tokens = input_ids[:, 1:]                              # x_{t+1}
        e = self.enorm(model.model.embed_tokens(next_tokens))
        z = self.e_proj(e).unsqueeze(2) + self.h_proj(self.hnorm(h))
        positions = torch.arange(next_tokens.shape[1]).unsqueeze(0)
        mask = create_sliding_window_causal_mask(config=self.cfg, inputs_embeds=e, attention_mask=None,
                                                 past_key_values=None, position_ids=positions)
        pos_emb = {kind: self.rotary(e, position_ids=positions, layer_type=kind)
                   for kind in ("main", "compress")}
        z = self.layer(z, input_ids=next_tokens, position_embeddings=pos_emb,
                       position_ids=positions, attention_mask=mask, past_key_values=None)
        return model.lm_head(self.norm(self.hc_head(z))).float()


def greedy(model, prompt: torch.Tensor, new: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's greedy continuation of a [1, S] prompt, exactly `new` tokens, and the raw logits
    [new, V] of each step (`output_logits`: before any logits processor)."""
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                             eos_token_id=None, pad_token_id=0,
                             attention_mask=torch.ones_like(prompt),
                             return_dict_in_generate=True, output_logits=True)
    tokens = out.sequences[0, prompt.shape[1]:].numpy()
    if len(tokens) != new:
        raise RuntimeError(f"generate stopped after {len(tokens)} tokens")
    return tokens, torch.cat(out.logits).float().numpy()


def greedy_batch(model, case: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Prompts of lengths spread over 1..batch_max_prompt, each generated greedily *alone*
    with its own max_new_tokens; stored ragged (concatenated, with lengths)."""
    n = case["batch_requests"]
    lengths = rng.permutation(np.linspace(1, case["batch_max_prompt"], n).round().astype(int))
    max_new = rng.integers(1, case["batch_max_new"] + 1, size=n)
    prompts, outputs = [], []
    for length, new in zip(lengths, max_new):
        prompt = torch.from_numpy(rng.integers(2, model.config.vocab_size, size=(1, length)))
        with torch.no_grad():
            out = model.generate(prompt, do_sample=False, max_new_tokens=int(new),
                                 min_new_tokens=int(new), eos_token_id=None, pad_token_id=0,
                                 attention_mask=torch.ones_like(prompt))
        prompts.append(prompt[0].numpy())
        outputs.append(out[0, length:].numpy())
    return dict(batch_prompt_lens=lengths, batch_prompts=np.concatenate(prompts),
                batch_max_new=max_new, batch_outputs=np.concatenate(outputs))


# ---- one case -----------------------------------------------------------------------------
def build_case(case: dict, out_dir: Path) -> None:
    raw = json.loads((REPO / case["config"]).read_text())
    raw.pop("_comment", None)
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    base = DeepseekV4Config(**raw)
    n = base.num_hidden_layers

    # A carrier model with one extra window-only MoE layer: that layer becomes the MTP block.
    carrier_cfg = DeepseekV4Config(**{
        **{k: v for k, v in raw.items() if k not in ("compress_ratios", "num_hash_layers")},
        "num_hidden_layers": n + 1,
        "layer_types": list(base.layer_types) + ["sliding_attention"],
        "mlp_layer_types": list(base.mlp_layer_types) + ["moe"],
        "compress_rates": dict(base.compress_rates),
        "rope_parameters": base.rope_parameters,
    })
    carrier_cfg._attn_implementation = "eager"
    carrier = DeepseekV4ForCausalLM(carrier_cfg).float().eval()
    randomize_(carrier, gen, base.n_routed_experts)
    mtp = MtpOracle(carrier).float().eval()
    randomize_(mtp.e_proj, gen, 0), randomize_(mtp.h_proj, gen, 0)
    for m in (mtp.enorm, mtp.hnorm, mtp.norm, mtp.hc_head):
        randomize_(m, gen, 0)

    ckpt = out_dir / "checkpoint"
    with tempfile.TemporaryDirectory() as tmp:
        carrier.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
    last = f"model.layers.{n}."
    renamed = {("mtp.0." + k[len(last):] if k.startswith(last) else k): v for k, v in tensors.items()}
    renamed.update(mtp.official_tensors())
    ckpt.mkdir(parents=True)
    save_file(renamed, str(ckpt / "model.safetensors"))
    # The checkpoint's config.json is the case's own file: legacy cases keep legacy fields.
    (ckpt / "config.json").write_text(json.dumps({**raw, "dtype": "float32"}, indent=2))

    model, info = DeepseekV4ForCausalLM.from_pretrained(ckpt, output_loading_info=True,
                                                        attn_implementation="eager")
    model = model.float().eval()
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"HF could not load its own checkpoint: {info}")
    for key, value in model.state_dict().items():  # the reload equals the carrier's first n layers
        if "inv_freq" not in key:
            torch.testing.assert_close(value, carrier.state_dict()[key], rtol=0, atol=0)

    rng = np.random.default_rng(case["seed"])
    vocab = base.vocab_size
    input_ids = torch.from_numpy(rng.integers(2, vocab, size=case["logits_shape"]))
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
    prompt = torch.from_numpy(rng.integers(2, vocab, size=(1, case["greedy_prompt"])))
    generated, greedy_logits = greedy(model, prompt, case["greedy_new"])
    mtp_logits = mtp.logits(model, input_ids[:1]).numpy()
    batch = greedy_batch(model, case, rng) if case.get("batch_requests") else {}

    np.savez(out_dir / "reference.npz", input_ids=input_ids.numpy(), logits=logits,
             greedy_prompt=prompt[0].numpy(), greedy_tokens=generated,
             greedy_logits=greedy_logits, mtp_logits=mtp_logits, **batch)
    (out_dir / "meta.json").write_text(json.dumps({
        "case": case, "torch": torch.__version__, "transformers": transformers.__version__,
        "layer_types": base.layer_types, "mlp_layer_types": base.mlp_layer_types}, indent=2))


def build_shipped(case: dict, out_dir: Path) -> None:
    """Reference outputs of the shipped checkpoint on held-out text."""
    import sysconfig

    from tokenizers import Tokenizer

    ckpt = REPO / case["checkpoint"]
    model, info = DeepseekV4ForCausalLM.from_pretrained(ckpt, output_loading_info=True,
                                                        attn_implementation="eager")
    if info["missing_keys"] or info["mismatched_keys"]:
        raise RuntimeError(f"HF could not load {ckpt}: {info}")
    model = model.float().eval()
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    text = (Path(sysconfig.get_paths()["stdlib"]) / case["text_module"]).read_text()
    ids = torch.tensor([tok.encode(text).ids[: case["logits_len"]]])
    with torch.no_grad():
        logits = model(ids).logits.float().numpy()
    prompt = ids[:, : case["greedy_prompt"]]
    generated, greedy_logits = greedy(model, prompt, case["greedy_new"])
    np.savez(out_dir / "reference.npz", input_ids=ids.numpy(), logits=logits,
             greedy_prompt=prompt[0].numpy(), greedy_tokens=generated,
             greedy_logits=greedy_logits)
    (out_dir / "meta.json").write_text(json.dumps({
        "case": case, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": sys.version.split()[0]}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if args.only and case["name"] not in args.only:
            continue
        key = case_hash(case, case_source(case))
        final = args.out / f"{case['name']}-{key}"
        if (final / "meta.json").exists():
            print(f"oracle: {case['name']} up to date ({final.name})")
            continue
        for stale in args.out.glob(f"{case['name']}-*"):
            shutil.rmtree(stale)
        work = args.out / f".{case['name']}-{key}.partial"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        print(f"oracle: building {case['name']} ...", flush=True)
        (build_shipped if "checkpoint" in case else build_case)(case, work)
        work.rename(final)
        print(f"oracle: wrote {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
