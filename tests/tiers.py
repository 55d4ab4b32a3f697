"""Which parametrized cases CI's tier runs: `covering` keeps every value of every axis in it
and leaves the rest of the cross product to the full tier (`make test-all`, the GPU's
`all-tests`), marked slow.

The interpreted kernel tests multiply their axes (row distributions x epilogue x kernel
config): on CI's two cores the cross product cost minutes of the suite for combinations whose
values each already run in another case. A combination a test needs on its own (a bug seen
only there) is listed in `always`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

import pytest


def _named(values) -> list[tuple[str, object]]:
    """An axis as (id, value) pairs: a mapping's keys are the ids, else str(value)."""
    if isinstance(values, Mapping):
        return [(str(k), v) for k, v in values.items()]
    return [(str(v), v) for v in values]


def covering(axes: Mapping[str, object], always: Iterable[tuple] = ()) -> list:
    """pytest params for the cross product of `axes` (name -> values, or ids -> values), in
    pytest's usual order, each with id "a-b-c". The i-th of the first max(len) combinations
    that round-robin over every axis (value i mod len of each) stays in CI's tier, as do the
    combinations in `always` (tuples of ids); the others are marked slow."""
    named = [_named(values) for values in axes.values()]
    longest = max(map(len, named))
    kept = {tuple(axis[i % len(axis)][0] for axis in named) for i in range(longest)}
    kept |= {tuple(map(str, ids)) for ids in always}
    params = []
    for combo in itertools.product(*named):
        ids = tuple(name for name, _ in combo)
        marks = () if ids in kept else (pytest.mark.slow,)
        params.append(pytest.param(*(value for _, value in combo), id="-".join(ids), marks=marks))
    return params
