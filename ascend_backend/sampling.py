"""Token selection in torch (deepinfer_jax/device/sampling.py): penalties, the grammar
bitmask, greedy or seeded sampling with temperature / top-k / top-p / min-p, and the raw
logprobs (before penalties, masks and temperature) of the chosen and the top tokens.

Greedy rows (temperature 0) take the same token as the JAX step. Seeded rows draw from the
same filtered distribution with a torch generator seeded by (seed, position), so a row's draw
does not depend on its batch; the JAX step's threefry stream is not reproduced, so sampled
(temperature > 0) tokens differ between the backends."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling controls (device/sampling.SamplingRows)."""

    temperature: torch.Tensor         # f32[N]   0 = greedy
    top_k: torch.Tensor               # int[N]   <= 0: off
    top_p: torch.Tensor               # f32[N]   1: off
    min_p: torch.Tensor               # f32[N]   0: off
    repetition_penalty: torch.Tensor  # f32[N]
    presence_penalty: torch.Tensor    # f32[N]
    frequency_penalty: torch.Tensor   # f32[N]
    seed: torch.Tensor                # int[N]
    position: torch.Tensor            # int[N]   position of the token whose logits are sampled
    allowed: torch.Tensor             # int32[N, ceil(V/32)] token bitmask


def sampling_rows(plan, positions: torch.Tensor) -> SamplingRows:
    """The plan's controls (torch tensors) for positions int[N, S]: each row's fields repeated
    for its S sampled positions (S = 1: the plain step)."""
    s = positions.shape[1]
    rep = lambda a: a.repeat_interleave(s, dim=0)  # noqa: E731
    return SamplingRows(rep(plan.temperature), rep(plan.top_k), rep(plan.top_p),
                        rep(plan.min_p), rep(plan.repetition_penalty),
                        rep(plan.presence_penalty), rep(plan.frequency_penalty),
                        rep(plan.seed), positions.reshape(-1), rep(plan.allowed))

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


def row_uniforms(seed: torch.Tensor, position: torch.Tensor, size: int, purpose: int = 0
                 ) -> torch.Tensor:
    """f32[N, size] uniforms in (0, 1), row i's from a generator seeded by (seed, position,
    purpose) alone: purpose 0 samples a token; the speculative verifier uses 1 (accept or
    not) and 2 (resample after a rejection), as device/sampling.row_keys."""
    out = torch.empty((seed.shape[0], size))
    for row in range(seed.shape[0]):
        # the hash of a tuple of ints is the same in every process (no hash randomisation)
        gen = torch.Generator(device="cpu").manual_seed(
            hash((int(seed[row]), int(position[row]), purpose)))
        out[row] = torch.rand(size, generator=gen)
    return out.clamp(1e-20, 1.0 - 1e-7).to(seed.device)


def draw(logits: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
         purpose: int = 0) -> torch.Tensor:
    """One token per row from softmax(logits) (the Gumbel-max trick over the row's own
    uniforms)."""
    u = row_uniforms(seed, position, logits.shape[-1], purpose)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_logprobs: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs: (of the chosen tokens f32[N], top ids int[N, L], top logprobs f32[N, L])."""
    raw = torch.log_softmax(logits, dim=-1)
    top = torch.sort(raw, dim=-1, descending=True, stable=True)
    chosen = torch.gather(raw, -1, tokens[:, None])[:, 0]
    return chosen, top.indices[:, :num_logprobs], top.values[:, :num_logprobs]


def sample(logits: torch.Tensor, rows: SamplingRows, prompt_mask: torch.Tensor,
           output_counts: torch.Tensor, num_logprobs: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits f32[N, V] -> (tokens int[N], their raw logprob f32[N], top ids int[N, L],
    top logprobs f32[N, L])."""
    processed = process_logits(logits, rows, prompt_mask, output_counts)
    tokens = torch.argmax(processed, dim=-1)
    hot = rows.temperature > 0
    if bool(hot.any()):
        drawn = draw(filter_logits(processed, rows), rows.seed, rows.position)
        tokens = torch.where(hot, drawn, tokens)
    return (tokens, *token_logprobs(logits, tokens, num_logprobs))
