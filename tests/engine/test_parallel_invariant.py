"""The engine over a device mesh, continued (a file of its own so that `make test`'s two
workers share the mesh runs): context parallelism on a long prompt, and batch-invariant mode
bitwise alone vs batched on every mesh shape (8 CPU devices, in a process of their own)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.test_parallel import CFG, run_meshes

CP_MESHES = ("1,1,1,2", "1,1,1,4", "1,2,1,2")     # (dp, ep, tp, cp)


def test_context_parallel_long_prompt_matches_one_device():
    """A 440-token prompt (seven 64-token chunks) beside two short ones, each step's tokens
    split over 2 and 4 cp devices (and cp 2 with ep 2): the single device's greedy tokens,
    logprobs within 1e-5, the experts split over cp and ep too."""
    runs = run_meshes("configs/tiny/tiny-mixed.json:long", CP_MESHES)
    single = runs["single"]
    for mesh in CP_MESHES:
        dp, ep, tp, cp = map(int, mesh.split(","))
        sharded = runs[mesh]
        assert sharded["mesh_devices"] == dp * ep * tp * cp
        assert sharded["tokens"] == single["tokens"], mesh
        for ours, ref in zip(sharded["logprobs"], single["logprobs"], strict=True):
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5)
        assert sharded["expert_shard_rows"] == CFG.n_routed_experts // (cp * ep)



INVARIANT_MESHES = ("1,8,1", "2,4,1", "2,2,2", "8,1,1", "1,2,1,2")   # the last: ep 2, cp 2


@pytest.mark.slow
def test_batch_invariant_mode_on_a_mesh_is_bitwise_alone_or_batched():
    """On every mesh in batch-invariant mode each request's logprobs are bitwise those of the
    request alone (the ranks' partial sums are added in one order whatever the batch, and a
    data-parallel rank's tokens reach the experts beside any other rank's)."""
    runs = run_meshes("configs/tiny/tiny-mixed.json:invariant", INVARIANT_MESHES)
    for name in ("single", *INVARIANT_MESHES):
        assert runs[name]["logprobs"] == runs[name]["alone_logprobs"], name
        assert runs[name]["tokens"] == runs["single"]["tokens"], name
