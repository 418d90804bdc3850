"""The geometry of a draft tree that drafters and the verifier share: who sees whom.

A tree of ``N`` drafted nodes is a list of parent indices (``-1`` for the root's children, parents before
children). Block position 0 is the root (the last committed token), position ``i + 1`` is node ``i``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ancestor_matrix(parents: list[int]) -> Tensor:
    """``[N+1, N+1]`` bool: row b sees column c iff c is b itself or one of its ancestors.
    Block position 0 is the root, position i + 1 is node i (parents before children)."""
    n = len(parents)
    anc = torch.eye(n + 1, dtype=torch.bool)  # [N+1, N+1]
    anc[1:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i + 1] |= anc[p + 1]
    return anc


def tree_attention_mask(anc: Tensor, past_len: int, dtype: torch.dtype, device=None) -> Tensor:
    """The additive 4-D mask ``[1, 1, q, past_len + k]`` for ``q`` queries whose visibility over the ``k``
    newest keys is ``anc [q, k]``: every query sees the whole past and the keys ``anc`` allows.
    transformers passes a 4-D mask through as-is."""
    q, k = anc.shape
    mask = torch.zeros(1, 1, q, past_len + k, dtype=dtype, device=device)  # [1, 1, q, kv]
    mask[0, 0, :, past_len:].masked_fill_(~anc.to(device), torch.finfo(dtype).min)
    return mask
