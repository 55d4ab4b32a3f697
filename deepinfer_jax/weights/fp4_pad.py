"""Zero-padding FP4 routed-expert stacks to the FP4 grouped-GEMM kernel's K granule.

The kernel (pallas_kernels/grouped_gemm/mosaic_gpu_fp4.py) needs the contraction size K to
be a multiple of K_GRANULE (512). The down projection's K is the expert intermediate size I
(2304 in V4.1-Flash): without padding the whole expert MLP falls back to XLA over bf16
copies of the stacks. So where the engine runs that kernel (ComputeConfig.fp4_expert_granule,
resolved once with the step's kernel table) the loader holds the stacks at I' = the next
multiple of the granule; elsewhere (the CPU's jnp references) at I, as stored:

* w13 [E, D, 2I] (packed [E, 2I, D/2], scales [E, D/32, 2I]): I' - I zero columns after
  EACH half, gate | up, so that the split of the 2I' columns in two is still gate | up;
* w2 [E, I, D] (packed [E, D, I/2], scales [E, I/32, D]): I' - I zero rows.

The padded codes are 0 (+0.0 in E2M1) and their scales 2**0 (byte 127, in every dequant
formulation's range), so every padded weight is exactly +0.0: a padded hidden column is
silu(0) * 0 = 0 (the clamp of SwiGLU keeps 0), and it meets zero rows of w2. The model reads
I from the stacks' shapes (w13's columns / 2, w2's rows), never from the config.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.params import ExpertParams
from deepinfer_jax.model.v41.params import V41ModelParams
from pallas_kernels.quantized import FP4_GROUP, Fp4Blocks

PAD_SCALE = 127                  # E8M0 2**0: with code 0, exactly +0.0


def padded_intermediate(inter: int, granule: int) -> int:
    """The intermediate size FP4 stacks are held at: the next multiple of `granule`."""
    return -(-inter // granule) * granule


def _pad(a, axis: int, splits: int, extra: int, value: int):
    """a with `extra` entries of `value` appended along `axis` to each of its `splits` equal
    parts (numpy stays numpy: the loader pads on the host; jax arrays stay on the device)."""
    xp = np if isinstance(a, np.ndarray) else jnp
    shape = list(a.shape)
    shape[axis] = extra
    fill = xp.full(shape, value, a.dtype)
    parts = xp.split(a, splits, axis=axis)
    return xp.concatenate([x for part in parts for x in (part, fill)], axis=axis)


def pad_fp4_experts(experts: ExpertParams, granule: int) -> ExpertParams:
    """FP4 stacks (both Fp4Blocks) padded to I' = padded_intermediate(I, granule); anything
    else (float stacks, FP8, granule 1, an I already a multiple) returned as given."""
    w13, w2 = experts.w13, experts.w2
    if granule == 1 or not (isinstance(w13, Fp4Blocks) and isinstance(w2, Fp4Blocks)):
        return experts
    if granule < 1 or granule % FP4_GROUP:      # whole scale groups only
        raise ValueError(f"an FP4 padding granule must be 1 or a positive multiple of "
                         f"{FP4_GROUP}, got {granule}")
    inter = w2.shape[-2]                                     # w2 [E, I, D]
    if w13.shape[-1] != 2 * inter:
        raise ValueError(f"FP4 expert stacks disagree on I: w13 {w13.shape}, w2 {w2.shape}")
    extra = padded_intermediate(inter, granule) - inter
    if extra == 0:
        return experts
    w13 = Fp4Blocks(_pad(w13.packed, -2, 2, extra, 0),                 # [E, 2I', D/2]
                    _pad(w13.scale, -1, 2, extra, PAD_SCALE))          # [E, D/32, 2I']
    w2 = Fp4Blocks(_pad(w2.packed, -1, 1, extra // 2, 0),              # [E, D, I'/2]
                   _pad(w2.scale, -2, 1, extra // FP4_GROUP, PAD_SCALE))  # [E, I'/32, D]
    return experts.replace(w13=w13, w2=w2)


def pad_v41_params(params: V41ModelParams, granule: int) -> V41ModelParams:
    """Every layer's routed experts through pad_fp4_experts (an engine given a V4.1 model
    loaded without its kernels' granule; on the device, so briefly both widths). `params`
    itself where no stack changes."""
    experts = [pad_fp4_experts(layer.moe.experts, granule) for layer in params.layers]
    if all(new is layer.moe.experts for new, layer in zip(experts, params.layers, strict=True)):
        return params
    return params.replace(layers=tuple(
        layer.replace(moe=layer.moe.replace(experts=new))
        for new, layer in zip(experts, params.layers, strict=True)))
