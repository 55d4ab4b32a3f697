"""Write the release's quantized formats with torch, independently of the engine's own code.

Runs in the oracle environment after build.py. From the tiny-mixed oracle checkpoint it writes
  * `quantized/`: the dense projections the release stores in FP8 (attention wq_a, wq_b, wkv,
    wo_a, wo_b, the indexer's wq_b, the shared experts, MTP e_proj/h_proj) as E4M3 codes with
    one E8M0 scale per 128 x 128 block, and the routed experts as FP4 E2M1 packed two per
    int8 (low nibble = even input) with one E8M0 scale per 32 inputs; the rest as it was.
    Encoded here from the format's documentation (deepseek_v4_architecture.md, "FP8 weights"
    and "FP4 experts") with torch's float8 dtypes, saved by `safetensors.torch`;
  * `dequantized/`: the same checkpoint with every quantized tensor decoded back to float32
    by torch (the twin the engine's loader must agree with);
  * `reference.npz`: Hugging Face's logits and a 64-token greedy continuation of the model
    with the decoded weights.
Output: <out>/quantized-tiny-mixed-<hash>/ (hash: this file, the source checkpoint, versions).

Usage: python tests/oracle/build_quantized.py [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from build import DEFAULT_OUT, greedy  # noqa: E402

FP8_WEIGHT = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|\.shared_experts\.w[123]"
                        r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
FP4_WEIGHT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def power_of_two_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp_min(2.0 ** -120))))


def encode_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (E4M3 codes [out, in], E8M0 scales [ceil(out/128), ceil(in/128)])."""
    out_dim, in_dim = w.shape
    rows, cols = -(-out_dim // 128), -(-in_dim // 128)
    padded = torch.zeros(rows * 128, cols * 128)
    padded[:out_dim, :in_dim] = w
    amax = padded.abs().reshape(rows, 128, cols, 128).amax(dim=(1, 3))
    scale = power_of_two_at_least(amax / E4M3_MAX)
    per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_dim, :in_dim]
    return (w / per_element).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def decode_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = codes.shape
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)[:out_dim, :in_dim]
    return codes.float() * s


def encode_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in/2]: code(2j) | code(2j+1) << 4, E8M0 scales [out, in/32])."""
    out_dim, in_dim = w.shape
    groups = w.reshape(out_dim, in_dim // 32, 32)
    scale = power_of_two_at_least(groups.abs().amax(-1) / E2M1_MAX)
    scaled = (groups / scale[..., None]).reshape(out_dim, in_dim)
    # nearest magnitude: bucketize against the midpoints between neighbouring values
    midpoints = (E2M1[1:] + E2M1[:-1]) / 2
    magnitude = torch.bucketize(scaled.abs(), midpoints)
    code = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    raw = packed.view(torch.uint8).long()
    codes = torch.stack([raw & 0xF, raw >> 4], dim=-1).reshape(raw.shape[0], -1)
    values = E2M1[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    return values * scale.float().repeat_interleave(32, 1)


def build(source: Path, out_dir: Path) -> None:
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, value in tensors.items():
        scale_name = name[: -len("weight")] + "scale"
        if FP8_WEIGHT.search(name):
            codes, scale = encode_fp8(value.float())
            quantized[name], quantized[scale_name] = codes, scale
            dequantized[name] = decode_fp8(codes, scale)
        elif FP4_WEIGHT.search(name):
            packed, scale = encode_fp4(value.float())
            quantized[name], quantized[scale_name] = packed, scale
            dequantized[name] = decode_fp4(packed, scale)
        else:
            quantized[name] = dequantized[name] = value
    config = json.loads((source / "config.json").read_text())
    for sub, contents, extra in (
            ("quantized", quantized, {"quantization_config": {
                "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}}),
            ("dequantized", dequantized, {})):
        (out_dir / sub).mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in contents.items()},
                  str(out_dir / sub / "model.safetensors"))
        (out_dir / sub / "config.json").write_text(json.dumps({**config, **extra}, indent=2))

    model = DeepseekV4ForCausalLM.from_pretrained(out_dir / "dequantized",
                                                  attn_implementation="eager").float().eval()
    rng = np.random.default_rng(11)
    vocab = config["vocab_size"]
    input_ids = torch.from_numpy(rng.integers(2, vocab, size=(1, 200)))
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()
    prompt = torch.from_numpy(rng.integers(2, vocab, size=(1, 100)))
    generated, greedy_logits = greedy(model, prompt, 64)
    np.savez(out_dir / "reference.npz", input_ids=input_ids.numpy(), logits=logits,
             greedy_prompt=prompt[0].numpy(), greedy_tokens=generated,
             greedy_logits=greedy_logits)
    (out_dir / "meta.json").write_text(json.dumps({
        "source": str(source), "torch": torch.__version__,
        "transformers": transformers.__version__}, indent=2))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    sources = sorted(args.out.glob("tiny-mixed-*/checkpoint"))
    sources = [s for s in sources if "quantized" not in s.parent.name]
    if len(sources) != 1:
        raise SystemExit(f"expected one tiny-mixed oracle checkpoint in {args.out}, found "
                         f"{[str(s) for s in sources]} (run build.py first)")
    source = sources[0]
    digest = hashlib.sha256(Path(__file__).read_bytes() + source.parent.name.encode()
                            + torch.__version__.encode() + transformers.__version__.encode())
    out_dir = args.out / f"quantized-tiny-mixed-{digest.hexdigest()[:16]}"
    if (out_dir / "meta.json").exists():
        print(f"{out_dir.name}: up to date")
        return 0
    for stale in args.out.glob("quantized-tiny-mixed-*"):
        shutil.rmtree(stale)
    work = args.out / f".{out_dir.name}.partial"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    build(source, work)
    work.rename(out_dir)
    print(f"oracle: wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
