"""tests/tiers.py: CI's tier keeps every value of every axis; the full tier keeps the product."""

from __future__ import annotations

import itertools

import pytest

from tests.tiers import covering


def _kept_and_slow(params):
    kept = [p for p in params if not any(m.name == "slow" for m in p.marks)]
    slow = [p for p in params if any(m.name == "slow" for m in p.marks)]
    return kept, slow


def test_the_full_tier_runs_the_cross_product_once_each():
    axes = {"case": {"a": 1, "b": 2, "c": 3}, "limit": [None, 7.0], "config": ["x", "y"]}
    params = covering(axes)
    assert [p.values for p in params] == list(itertools.product([1, 2, 3], [None, 7.0], ["x", "y"]))
    assert len({p.id for p in params}) == 12
    assert params[0].id == "a-None-x"


def test_ci_keeps_every_value_of_every_axis_and_no_more_than_the_longest_axis():
    axes = {"case": list("abcde"), "limit": [None, 7.0], "config": ["x", "y", "z"]}
    kept, slow = _kept_and_slow(covering(axes))
    assert len(kept) == 5 and len(slow) == 5 * 2 * 3 - 5
    for position, values in enumerate(axes.values()):
        assert {p.values[position] for p in kept} == set(values)


def test_a_combination_named_in_always_stays_in_ci():
    axes = {"case": ["a", "b"], "limit": [None, 7.0]}
    kept, _ = _kept_and_slow(covering(axes))
    assert "a-7.0" not in {p.id for p in kept}
    kept, _ = _kept_and_slow(covering(axes, always=[("a", 7.0)]))
    assert "a-7.0" in {p.id for p in kept} and len(kept) == 3


@pytest.mark.parametrize("size", [1, 2])
def test_a_single_axis_stays_whole(size):
    kept, slow = _kept_and_slow(covering({"only": list(range(size))}))
    assert len(kept) == size and not slow
