"""Token selection in torch (deepinfer_jax/device/sampling.py): penalties, the grammar
bitmask, greedy or seeded sampling with temperature / top-k / top-p / min-p, and the raw
logprobs (before penalties, masks and temperature) of the chosen and the top tokens.

Greedy rows (temperature 0) take the same token as the JAX step. Seeded rows draw from the
same filtered distribution with a torch generator seeded by (seed, position), so a row's draw
does not depend on its batch; the JAX step's threefry stream is not reproduced, so sampled
(temperature > 0) tokens differ between the backends."""

from __future__ import annotations

import torch

_SEED_STRIDE = 1 << 32


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32[N, W] -> bool[N, vocab]: bit j of word w allows token 32 w + j."""
    words = bits.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(32, device=bits.device)
    return ((words[:, :, None] >> shifts) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab]


def process_logits(logits: torch.Tensor, rows, prompt_mask: torch.Tensor,
                   output_counts: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties, then the token bitmask: the logits greedy rows take the argmax of."""
    seen = prompt_mask | (output_counts > 0)
    rep = rows.repetition_penalty[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - rows.frequency_penalty[:, None] * output_counts
    logits = logits - rows.presence_penalty[:, None] * (output_counts > 0)
    return logits.masked_fill(~unpack_bitmask(rows.allowed, logits.shape[-1]), float("-inf"))


def filter_logits(logits: torch.Tensor, rows) -> torch.Tensor:
    """Temperature, then top-k, top-p (over what top-k left) and min-p as -inf masks."""
    scaled = logits / torch.where(rows.temperature > 0, rows.temperature, 1.0)[:, None]
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    probs = torch.softmax(torch.gather(scaled, -1, order), dim=-1)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    keep = torch.where(rows.top_k[:, None] > 0, rank < rows.top_k[:, None], True)
    in_top_k = torch.where(keep, probs, 0.0)
    in_top_k = in_top_k / in_top_k.sum(-1, keepdim=True)
    keep &= (torch.cumsum(in_top_k, -1) - in_top_k) < rows.top_p[:, None]
    keep &= probs >= rows.min_p[:, None] * probs[:, :1]
    keep[:, 0] = True
    kept = torch.zeros_like(keep).scatter(-1, order, keep)
    return scaled.masked_fill(~kept, float("-inf"))


def draw(logits: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One token per row from softmax(logits), each row's generator seeded by (seed,
    position) (the Gumbel-max trick over the row's own noise)."""
    tokens = []
    for row in range(logits.shape[0]):
        gen = torch.Generator(device="cpu").manual_seed(
            int(seed[row]) * _SEED_STRIDE + int(position[row]) % _SEED_STRIDE)
        u = torch.rand(logits.shape[-1], generator=gen).clamp_min(1e-20).to(logits.device)
        tokens.append(torch.argmax(logits[row] - torch.log(-torch.log(u))))
    return torch.stack(tokens) if tokens else torch.zeros(0, dtype=torch.int64)


def sample(logits: torch.Tensor, rows, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
           num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits f32[N, V] -> (tokens int[N], their raw logprob f32[N], top ids int[N, L],
    top logprobs f32[N, L])."""
    processed = process_logits(logits, rows, prompt_mask, output_counts)
    tokens = torch.argmax(processed, dim=-1)
    hot = rows.temperature > 0
    if bool(hot.any()):
        drawn = draw(filter_logits(processed, rows), rows.seed, rows.position)
        tokens = torch.where(hot, drawn, tokens)
    raw = torch.log_softmax(logits, dim=-1)
    top = torch.sort(raw, dim=-1, descending=True, stable=True)
    chosen = torch.gather(raw, -1, tokens[:, None])[:, 0]
    return tokens, chosen, top.indices[:, :num_logprobs], top.values[:, :num_logprobs]
