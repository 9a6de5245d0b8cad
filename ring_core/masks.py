"""Attention masks beyond plain causal: packed sequences (segment ids) and sliding windows.

The mask rule lives here once, in ``allowed``; the numpy reference, the xla ring and the torch ring all
call it (it uses only operators and indexing, so numpy, jax.numpy and torch arrays go through it alike).

The rule, in *global* token order (query token at position i, key token at position j):

* ``is_causal``: j <= i.
* ``window=(left, right)`` (flash-attn's ``window_size``): i - left <= j <= i + right; -1 leaves that side
  unbounded, so (-1, -1) is no window. With ``is_causal`` the keys after the query stay masked whatever
  ``right`` is. Every window contains the diagonal (both sides are >= -1), and so does causal masking.
* ``segment_ids`` (int32 per token): query i attends key j only where both carry the same id (the ids need
  not be contiguous runs: equal ids attend each other wherever they are, as in
  ``jax.nn.dot_product_attention``). A *negative* id marks padding: a padding query attends nothing, and
  since no query with id >= 0 shares its id, no query attends a padding key.

So the only rows that attend nothing are padding rows: a row with id >= 0 always attends at least itself.
Every backend still handles an empty row on its own terms: out 0, lse -inf, zero gradients, no NaN.

``segment_ids_from_cu_seqlens`` turns flash-attn's varlen ``cu_seqlens`` into segment ids.
"""

from __future__ import annotations

import numpy as np

NO_WINDOW = (-1, -1)
UNBOUNDED = (None, None)  # kernel_window's window that masks nothing by position


def is_masked(*, is_causal: bool, window=NO_WINDOW, segmented: bool = False) -> bool:
    """Whether ``allowed`` can mask anything for these settings (False: every query attends every key)."""
    return bool(is_causal) or tuple(window) != NO_WINDOW or bool(segmented)


def kernel_window(is_causal: bool, window, seq_global: int, key_offset: int = 0) -> tuple:
    """The window as the fused kernels apply it, on the call's own positions: the query at position i attends the
    key at position j iff ``i - left <= j <= i + right``; a side that masks nothing is None, so that calls that
    mask alike carry the same window (their call signatures agree) and a window that masks nothing costs nothing.

    ``key_offset``: where the keys sit in the queries' frame (a key at the call's position j is at j + key_offset
    there; 0 for every call a user makes). ``window`` is in that frame, so the sides move by the offset:
    left + key_offset, right - key_offset, and then need not contain the diagonal (either may be negative): the
    two-level ring's calls with another node's K/V (ring_core.nodes). A side that reaches every token of a call of
    ``seq_global`` tokens (at least ``seq_global - 1``) is unbounded; under ``is_causal`` (key_offset 0 only) the
    right side is (causal masking already hides every key after the query). Also keeps ``position + side``
    within int32 in the kernels.

    >>> kernel_window(True, (128, 0), 4096), kernel_window(False, (8000, 3), 4096)
    ((128, None), (None, 3))
    >>> kernel_window(False, (100, 0), 4096, key_offset=-4096)  # keys 4096 tokens before the queries' frame
    (-3996, None)
    """
    if is_causal and key_offset:
        raise ValueError("a causal call takes no key_offset (give the causal side as window right = 0)")
    left, right = (int(w) for w in window)
    left = None if left < 0 or left + key_offset >= seq_global - 1 else left + key_offset
    right = None if is_causal or right < 0 or right - key_offset >= seq_global - 1 else right - key_offset
    return left, right


def allowed(q_pos, k_pos, *, is_causal: bool, window=NO_WINDOW, q_segment_ids=None, k_segment_ids=None,
            head_axes: int = 2):
    """Where query tokens attend key tokens: a boolean array, True = attend; None when nothing is masked.

    ``q_pos`` [sq] and ``k_pos`` [sk] are global token positions (``ring_core.layout.global_positions``),
    ``window`` a checked ``(left, right)`` (``ring_core.validate.check_window``), ``q_segment_ids`` [b, sq]
    and ``k_segment_ids`` [b, sk] the tokens' segment ids (both or neither). Without segment ids the mask is
    [sq, sk]; with them it is [b, 1 x head_axes, sq, sk], so that it broadcasts against scores laid out
    [b, <head_axes head axes>, sq, sk] (the references use [b, hkv, group, sq, sk]: ``head_axes=2``).
    Works on numpy, jax.numpy and torch arrays (operators only).

    >>> import numpy as np
    >>> allowed(np.arange(4), np.arange(4), is_causal=True, window=(1, -1)).astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]
    >>> seg = np.array([[0, 0, 1, -1]])
    >>> m = allowed(np.arange(4), np.arange(4), is_causal=False, q_segment_ids=seg, k_segment_ids=seg)
    >>> m.shape, m[0, 0, 0].astype(int).tolist()
    ((1, 1, 1, 4, 4), [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
    """
    if (q_segment_ids is None) != (k_segment_ids is None):
        raise ValueError("pass both q_segment_ids and k_segment_ids, or neither")
    left, right = window
    if is_causal:  # keys after the query stay masked whatever the window's right side says
        right = 0
    qi, kj = q_pos[:, None], k_pos[None, :]
    mask = None
    if left >= 0:
        mask = kj >= qi - left
    if right >= 0:
        m = kj <= qi + right
        mask = m if mask is None else mask & m
    if q_segment_ids is None:
        return mask
    idx = (slice(None),) + (None,) * head_axes
    qs = q_segment_ids[idx + (slice(None), None)]  # [b, 1.., sq, 1]
    ks = k_segment_ids[idx + (None, slice(None))]  # [b, 1.., 1, sk]
    seg = (qs == ks) & (qs >= 0)
    return seg if mask is None else seg & mask


def segment_ids_from_cu_seqlens(cu_seqlens, seq_len: int) -> np.ndarray:
    """Segment ids (int32) of sequences packed back to back, from flash-attn's varlen ``cu_seqlens``.

    ``cu_seqlens`` holds the cumulative lengths ``[0, n0, n0 + n1, ..., total]`` of the packed sequences
    (ints, non-decreasing, starting at 0, ``total <= seq_len``; a repeated value is an empty sequence).
    Sequence ``s`` covers tokens ``cu_seqlens[s] .. cu_seqlens[s+1] - 1`` and gets id ``s``; tokens from
    ``total`` to ``seq_len - 1`` are padding, id -1.

    Shapes: a 1-D ``cu_seqlens`` gives ``[seq_len]``. A batch of rows (a 2-D array, or a list of 1-D ones
    that may differ in length: each batch row packs its own number of sequences) gives
    ``[batch, seq_len]``. (flash-attn's varlen functions pack the whole batch into one stream with one
    ``cu_seqlens``; here each batch row is a stream of ``seq_len`` tokens, so each row has its own.)
    The ids are in natural token order: put them in a layout's order with ``to_layout`` like the tokens.

    >>> segment_ids_from_cu_seqlens([0, 3, 5], 7).tolist()
    [0, 0, 0, 1, 1, -1, -1]
    >>> segment_ids_from_cu_seqlens([[0, 2, 4], [0, 1, 1]], 4).tolist()
    [[0, 0, 1, 1], [0, -1, -1, -1]]
    """
    if isinstance(seq_len, (bool, np.bool_)) or not isinstance(seq_len, (int, np.integer)) or seq_len < 0:
        raise ValueError(f"seq_len must be an int >= 0 (the number of tokens per row), got {seq_len!r}")
    seq_len = int(seq_len)
    if isinstance(cu_seqlens, (list, tuple)) and any(np.ndim(row) for row in cu_seqlens):
        return np.stack([segment_ids_from_cu_seqlens(row, seq_len) for row in cu_seqlens])  # ragged batch
    if hasattr(cu_seqlens, "detach"):  # a torch tensor, on any device
        cu_seqlens = cu_seqlens.detach().cpu()
    cu = np.asarray(cu_seqlens)
    if cu.ndim == 2:
        return np.stack([segment_ids_from_cu_seqlens(row, seq_len) for row in cu]).reshape(len(cu), seq_len)
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1] (or a batch of such rows), "
                         f"got shape {cu.shape}")
    if not np.issubdtype(cu.dtype, np.integer):
        raise TypeError(f"cu_seqlens must hold integers (e.g. int32), got dtype {cu.dtype}")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {cu.tolist()}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing (cumulative sequence lengths), got {cu.tolist()}")
    if cu[-1] > seq_len:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} tokens but a row has only seq_len={seq_len}")
    if cu.size - 1 > np.iinfo(np.int32).max:  # pragma: no cover - needs 2**31 sequences
        raise ValueError("too many sequences for int32 segment ids")
    ids = np.searchsorted(cu[1:], np.arange(seq_len), side="right")
    return np.where(np.arange(seq_len) < cu[-1], ids, -1).astype(np.int32)
