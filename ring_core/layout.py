"""Sequence layouts: which global tokens each rank holds.

``contiguous``: rank r holds global tokens [r*S, (r+1)*S) where S is ``seq_local``.
``zigzag``: the global sequence is cut into 2*W chunks of S/2 tokens; rank r holds chunk r followed
by chunk 2W-1-r. Under causal masking every rank then does the same amount of work.

The functions take an array namespace ``xp`` (numpy, jax.numpy or torch) so that each frontend can
compute positions with a traced rank while the formula lives once.
"""

from __future__ import annotations

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def global_positions(xp, rank, world_size: int, seq_local: int, layout: str):
    """Global token index of each local position on ``rank``: an int array of length ``seq_local``.

    >>> import numpy as np
    >>> global_positions(np, 1, 2, 4, "zigzag").tolist()
    [2, 3, 4, 5]
    """
    i = xp.arange(seq_local)
    if layout == "contiguous":
        return rank * seq_local + i
    if layout == "zigzag":
        c = seq_local // 2
        return xp.where(i < c, rank * c + i, (2 * world_size - 1 - rank) * c + (i - c))
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def layout_permutation(seq_global: int, world_size: int, layout: str) -> np.ndarray:
    """Indices ``perm`` such that ``x[perm]`` (along the sequence) is in ``layout`` order.

    Sharding ``x[perm]`` contiguously over ``world_size`` ranks gives each rank its chunks.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if layout == "contiguous":
        if seq_global % world_size:
            raise ValueError(
                f"sequence length {seq_global} is not divisible by world_size {world_size}; "
                "pad the sequence to a multiple of world_size")
        return np.arange(seq_global)
    if seq_global % (2 * world_size):
        raise ValueError(
            f"zigzag layout needs the sequence length ({seq_global}) to be a multiple of "
            f"2*world_size ({2 * world_size}); pad the sequence or use layout='contiguous'")
    seq_local = seq_global // world_size
    return np.concatenate([global_positions(np, r, world_size, seq_local, layout) for r in range(world_size)])


def inverse_permutation(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    inv[perm] = np.arange(perm.size)
    return inv
