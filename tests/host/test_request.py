"""Request.token_slice (the plan builder's per-step read) against slicing the whole list."""

import itertools

from deepinfer_jax.host.request import Request, SamplingParams


def test_token_slice_equals_slicing_the_concatenation():
    req = Request("r", [10, 11, 12, 13, 14], SamplingParams(), 0, seed=0)
    req.generated = [20, 21, 22]
    req.drafts = [30, 31, 32]
    for drafts in range(4):
        whole = req.prompt + req.generated + req.drafts[:drafts]
        for start, stop in itertools.combinations_with_replacement(range(len(whole) + 2), 2):
            assert req.token_slice(start, stop, drafts) == whole[start:stop], (start, stop)
