"""The model's parameters as torch tensors, in the JAX engine's layout (model/params.py:
projections stored [in, out], routed experts stacked [E, ...], wo_a per group).

They arrive as a flat mapping from dotted paths ("layers.0.attn.wq_a") to numpy arrays, the
JAX parameter tree's leaves by path, and become a tree of `Node`s read by attribute:
`params.layers[0].attn.wq_a`. A field the tree leaves out (None in the JAX tree: no
compressor in a sliding layer, no hash table in a routed one) reads None.
"""

from __future__ import annotations

import numpy as np
import torch


class Node:
    """One level of the parameter tree: attributes are sub-trees or tensors."""

    def __init__(self, fields: dict):
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        # only called for a missing field: a None leaf of the JAX tree
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _as_tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # a copy: the arrays may be read-only views of a checkpoint file
    if np.issubdtype(array.dtype, np.integer):
        return torch.as_tensor(np.array(array, np.int64), device=device)
    return torch.as_tensor(np.array(array, np.float32), device=device).to(dtype)


def _build(tree):
    if isinstance(tree, dict):
        if tree and all(k.isdigit() for k in tree):
            return [_build(tree[str(i)]) for i in range(len(tree))]
        return Node({k: _build(v) for k, v in tree.items()})
    return tree


def params_from_flat(flat: dict[str, np.ndarray], device: torch.device,
                     dtype: torch.dtype = torch.float32) -> Node:
    """{dotted path: array} -> the parameter tree (floats in `dtype`, integers int64)."""
    root: dict = {}
    for path, array in flat.items():
        *parents, leaf = path.split(".")
        node = root
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = _as_tensor(array, device, dtype)
    return _build(root)
