"""ring-flash-attn's signatures over ``ring_attention``: a ring-flash-attn user switches by changing an import.

    # from ring_flash_attn import zigzag_ring_flash_attn_func
    from torch_bridge import zigzag_ring_flash_attn_func

Same positional arguments, defaults and return convention as ring-flash-attn (flash-attn's names: ``causal``,
``softmax_scale``, ``window_size``; ``return_attn_probs=True`` gives ``(out, softmax_lse, None)``), the same
local-shard conventions (``ring_flash_attn_func``: rank r holds the r-th contiguous piece of the sequence;
``zigzag_ring_flash_attn_func``: chunks r and 2W-1-r of 2W), the same varlen convention (q/k/v
``[total_local, heads, head_dim]`` where every packed sequence is split over the ranks the same way, and
``cu_seqlens`` the LOCAL offsets, global ones divided by the world size). What the ring does not compute raises:
``dropout_p > 0``, ``alibi_slopes``, a sliding window on varlen inputs across several ranks.
``group=`` takes a ProcessGroup, a one-dimensional DeviceMesh or ``(mesh, "sp")``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_bridge.api import ring_attention
from torch_bridge.groups import resolve_group


def _check_unsupported(dropout_p, alibi_slopes, return_attn_probs):
    if dropout_p:
        raise ValueError(f"dropout_p={dropout_p}: ring attention has no attention dropout; pass dropout_p=0.0 "
                         "(models usually pass 0.0 in eval and config.attention_dropout in training: set it to 0)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes is not supported by ring attention; pass alibi_slopes=None")
    if not isinstance(return_attn_probs, bool):
        raise TypeError(f"return_attn_probs must be a bool, got {type(return_attn_probs).__name__}")


def _window(window_size, causal):
    """flash-attn's (left, right), (-1, -1) none, to ring_attention's window_size (None: none)."""
    if window_size is None:
        return None
    left, right = (int(w) for w in window_size)
    if causal:
        right = -1  # keys after the query are masked anyway (flash-attn sets the right window to 0)
    if left < 0 and right < 0:
        return None
    return (left, right)


def _call(q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs, group, layout, backend):
    out, lse = ring_attention(q, k, v, group=group, is_causal=bool(causal), scale=softmax_scale, layout=layout,
                              return_lse=True, backend=backend, window_size=_window(window_size, causal),
                              deterministic=deterministic)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                         alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                         backend="auto"):
    """ring-flash-attn's ``ring_flash_attn_func``: q ``[batch, seq_local, heads, head_dim]``, k/v with
    ``kv_heads``; rank r of ``group`` holds global tokens ``[r*seq_local, (r+1)*seq_local)``. Returns ``out``,
    or ``(out, softmax_lse [batch, heads, seq_local] float32, None)`` with ``return_attn_probs``.

    >>> import torch, torch_bridge
    >>> q = k = v = torch.randn(1, 8, 2, 16)
    >>> torch_bridge.ring_flash_attn_func(q, k, v, 0.0, None, True).shape
    torch.Size([1, 8, 2, 16])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return _call(q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs, group,
                 "contiguous", backend)


def zigzag_ring_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                backend="auto"):
    """ring-flash-attn's ``zigzag_ring_flash_attn_func``: as ``ring_flash_attn_func``, with rank r holding
    chunks r and 2W-1-r of the 2W equal chunks of the sequence (``to_layout(x, "zigzag", W)`` then a contiguous
    split gives them; ``seq_local`` even).

    >>> import torch, torch_bridge
    >>> q = k = v = torch.randn(1, 8, 2, 16)
    >>> out, lse, _ = torch_bridge.zigzag_ring_flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    >>> lse.shape
    torch.Size([1, 2, 8])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return _call(q, k, v, softmax_scale, causal, window_size, deterministic, return_attn_probs, group,
                 "zigzag", backend)


def ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                  backend="auto"):
    """``ring_flash_attn_func`` with kv ``[batch, seq_local, 2, kv_heads, head_dim]``."""
    return ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                alibi_slopes, deterministic, return_attn_probs, group, backend=backend)


def ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                   alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
                                   backend="auto"):
    """``ring_flash_attn_func`` with qkv ``[batch, seq_local, 3, heads, head_dim]``."""
    return ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                window_size, alibi_slopes, deterministic, return_attn_probs, group, backend=backend)


def zigzag_ring_flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                                         window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, backend="auto"):
    """``zigzag_ring_flash_attn_func`` with kv ``[batch, seq_local, 2, kv_heads, head_dim]``."""
    return zigzag_ring_flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], dropout_p, softmax_scale, causal, window_size,
                                       alibi_slopes, deterministic, return_attn_probs, group, backend=backend)


def zigzag_ring_flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                                          window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, backend="auto"):
    """``zigzag_ring_flash_attn_func`` with qkv ``[batch, seq_local, 3, heads, head_dim]``."""
    return zigzag_ring_flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal,
                                       window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                       backend=backend)


# ----------------------------------------------------------------------------------------------- varlen
# ring-flash-attn's varlen convention: each packed sequence i (global length L_i, a multiple of W, of 2W for
# zigzag) is split over the ranks like a sequence of its own, and rank r's buffer concatenates its pieces:
# [seq 0 piece r, seq 1 piece r, ...] (zigzag: [seq 0 chunk r, seq 0 chunk 2W-1-r, seq 1 chunk r, ...]).
# Read as one sequence in rank order, the pieces of sequence i keep their order (piece r before piece r+1,
# chunk r before chunk 2W-1-r), so that causal attention over segment ids equals causal attention within
# each sequence: the contiguous case is ring_attention's "contiguous" layout with the local segment ids of
# cu_seqlens; the zigzag case is its "zigzag" layout once each rank's buffer holds all its first chunks,
# then all its second chunks (a local permutation, undone on the output). Distances between a sequence's
# tokens on different ranks are not those of the sequence, so a window needs one rank.


def _varlen_plan(cu_seqlens, total, zigzag):
    """(segment ids [1, total] int32, local permutation or None) for this rank's varlen buffer."""
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = torch.as_tensor(cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1] (0, then each sequence's local end), got shape "
                         f"{tuple(cu_seqlens.shape)}")
    cu = cu_seqlens.to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lens < 0).any()) or int(cu[-1]) > total:
        raise ValueError(f"cu_seqlens must start at 0, not decrease and end at most at the local token count "
                         f"{total}, got {cu.tolist()}")
    ids = torch.full((total,), -1, dtype=torch.int32)
    ids[:int(cu[-1])] = torch.repeat_interleave(torch.arange(lens.numel(), dtype=torch.int32), lens)
    perm = None
    if zigzag:
        if bool((lens % 2).any()):
            raise ValueError(f"zigzag varlen: every local sequence length must be even (each global length a multiple "
                             f"of 2 x world size), got local lengths {lens.tolist()}")
        starts, halves = cu[:-1], lens // 2
        first = [torch.arange(s, s + h) for s, h in zip(starts.tolist(), halves.tolist())]
        second = [torch.arange(s + h, s + 2 * h) for s, h in zip(starts.tolist(), halves.tolist())]
        tail = torch.arange(int(cu[-1]), total)  # tokens after the last sequence: padding
        t = tail.numel()
        if t % 2:
            raise ValueError(f"zigzag varlen: the local padding after cu_seqlens[-1] ({t} tokens) must be even")
        perm = torch.cat(first + [tail[:t // 2]] + second + [tail[t // 2:]])
        ids = ids[perm]
    return ids[None], perm


def _varlen(q, k, v, cu_seqlens, softmax_scale, causal, window_size, deterministic, return_attn_probs, group,
            zigzag, backend):
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            raise ValueError(f"varlen: {name} must be a 3-D tensor [total_local, heads, head_dim], got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    total = q.shape[0]
    group = resolve_group(group)
    window = _window(window_size, causal)
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if window is not None and world > 1:
        raise ValueError("varlen with a sliding window over several ranks: the ring sees the pieces of a packed "
                         "sequence at other distances than the sequence has. Use the non-varlen functions with "
                         "segment_ids (torch_bridge.ring_attention(..., segment_ids=, window_size=)), which "
                         "keep global token distances")
    ids, perm = _varlen_plan(cu_seqlens, total, zigzag)
    ids = ids.to(q.device)
    if perm is not None:
        perm_d = perm.to(q.device)
        q, k, v = (x.index_select(0, perm_d) for x in (q, k, v))
    out, lse = ring_attention(q[None], k[None], v[None], group=group, is_causal=bool(causal), scale=softmax_scale,
                              layout="zigzag" if zigzag else "contiguous", return_lse=True, backend=backend,
                              segment_ids=ids, window_size=window, deterministic=deterministic)
    out, lse = out[0], lse[0]  # [total, h, d], [h, total]
    if perm is not None:
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        inv = inv.to(q.device)
        out, lse = out.index_select(0, inv), lse.index_select(1, inv)
    return (out, lse, None) if return_attn_probs else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                window_size=(-1, -1), alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                group=None, *, backend="auto"):
    """ring-flash-attn's ``ring_flash_attn_varlen_func``: q ``[total_local, heads, head_dim]``, k/v with
    ``kv_heads``; every packed sequence is split into W contiguous pieces and rank r holds piece r of each, back
    to back; ``cu_seqlens`` int32 [num_seqs + 1] the LOCAL offsets (the global ones divided by W). ``max_seqlen``
    is accepted and not needed. Returns ``out`` or ``(out, softmax_lse [heads, total_local] float32, None)``.

    >>> import torch, torch_bridge
    >>> q = k = v = torch.randn(7, 2, 16)
    >>> cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    >>> torch_bridge.ring_flash_attn_varlen_func(q, k, v, cu, 4, causal=True).shape
    torch.Size([7, 2, 16])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return _varlen(q, k, v, cu_seqlens, softmax_scale, causal, window_size, deterministic, return_attn_probs,
                   group, False, backend)


def zigzag_ring_flash_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                       causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                       return_attn_probs=False, group=None, *, backend="auto"):
    """ring-flash-attn's ``zigzag_ring_flash_attn_varlen_func``: as ``ring_flash_attn_varlen_func`` with each
    packed sequence cut into 2W chunks, rank r holding chunks r and 2W-1-r of each, back to back (every local
    length even).

    >>> import torch, torch_bridge
    >>> q = k = v = torch.randn(8, 2, 16)
    >>> cu = torch.tensor([0, 2, 8], dtype=torch.int32)
    >>> torch_bridge.zigzag_ring_flash_attn_varlen_func(q, k, v, cu, 6, causal=True).shape
    torch.Size([8, 2, 16])
    """
    _check_unsupported(dropout_p, alibi_slopes, return_attn_probs)
    return _varlen(q, k, v, cu_seqlens, softmax_scale, causal, window_size, deterministic, return_attn_probs,
                   group, True, backend)


def ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                         return_attn_probs=False, group=None, *, backend="auto"):
    """``ring_flash_attn_varlen_func`` with kv ``[total_local, 2, kv_heads, head_dim]``."""
    return ring_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p, softmax_scale,
                                       causal, window_size, alibi_slopes, deterministic, return_attn_probs, group,
                                       backend=backend)


def ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                          causal=False, window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                                          return_attn_probs=False, group=None, *, backend="auto"):
    """``ring_flash_attn_varlen_func`` with qkv ``[total_local, 3, heads, head_dim]``."""
    return ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                       softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                       return_attn_probs, group, backend=backend)


def zigzag_ring_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                deterministic=False, return_attn_probs=False, group=None, *,
                                                backend="auto"):
    """``zigzag_ring_flash_attn_varlen_func`` with kv ``[total_local, 2, kv_heads, head_dim]``."""
    return zigzag_ring_flash_attn_varlen_func(q, kv[:, 0], kv[:, 1], cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group, backend=backend)


def zigzag_ring_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                                 causal=False, window_size=(-1, -1), alibi_slopes=None,
                                                 deterministic=False, return_attn_probs=False, group=None, *,
                                                 backend="auto"):
    """``zigzag_ring_flash_attn_varlen_func`` with qkv ``[total_local, 3, heads, head_dim]``."""
    return zigzag_ring_flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu_seqlens, max_seqlen, dropout_p,
                                              softmax_scale, causal, window_size, alibi_slopes, deterministic,
                                              return_attn_probs, group, backend=backend)
