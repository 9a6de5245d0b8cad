"""The two-level ring: the fused ring inside each node, an existing engine (NCCL, XLA) between nodes.

A job of W = N x R ranks is N nodes of R ranks; global rank g is rank ``g % R`` of node ``g // R``
(``ring_core.topology.Nodes``). iris maps peer memory only between the processes of one host, so the fused kernel
rings over the R ranks of a node; between nodes, rank (n, r) passes the K/V shard it holds to rank (n + 1, r)
(torch.distributed point-to-point, ``lax.ppermute``), so at node-step s it holds the shard of rank (n - s, r) and
the node's R ranks together hold the K/V of node n - s. Each node-step is one call of the one-node fused kernel
over the node's ring, and the partial results merge by log-sum-exp. The transfer of node-step s + 1 is posted
before node-step s's call and waited for after it (two K/V shards in flight per rank, whatever N is).

Why the one-node kernel needs nothing new. The layouts compose: the flat layout over W ranks is the node-level
layout over N nodes (node n holds a contiguous block of R shards, or, zigzag, node-level chunks n and 2N-1-n)
followed by the same layout over the node's R ranks (``test_nodes.py`` checks the identity for every W, R). So:

* node-step 0 (the node's own K/V) is the call a one-node job makes over R ranks: positions inside the node keep
  the global order, so causal masking is unchanged;
* K/V of an earlier node (m < n), causal: contiguous, every query sees every key (a non-causal call); zigzag,
  every query sees exactly the first halves of the node's K/V shards (node-level chunk m) and none of the second
  halves (chunk 2N-1-m) (``K_EARLY``);
* K/V of a later node (m > n), causal: contiguous, nothing (the step is skipped, the transfer still runs);
  zigzag, the second half of every query shard (node-level chunk 2N-1-n) sees all of it, the first half nothing
  (``Q_LATE``);
* not causal: every step is a non-causal call.

K_EARLY and Q_LATE are non-causal calls on half shards, which the kernel (one seq_local for Q and K/V) takes by
moving the halves into the head axis: K_EARLY runs the two query halves as 2H heads against the first K/V halves
(query head ``hkv * 2G + half * G + g`` reads kv head ``hkv``, as GQA's grouping wants); Q_LATE runs the second
query half twice, as 2H heads, against the two K/V halves as 2 Hkv kv heads. Zigzag keeps every rank's work
equal: S x RS/2 query-key pairs at every node-step but the first.

The backward is the forward's schedule again: K/V travel the same way, and each node-step's one-node backward
(from the final ``out`` and ``lse``, so its probabilities are the global softmax's) gives dQ and the partial
dK/dV of the K/V held; the partials travel after the K/V, float32, one node-step behind them, and the node before
a shard's owner sends them home. The node's own K/V's backward runs in two calls over halves of its kv heads
(``own_heads``), the first while the first K/V transfer runs, the second while the partials come home, so that no
transfer waits alone at the end.

Why it cannot deadlock (with ring_core.protocol's argument for each one-node call). Every rank runs the same
schedule of transfers (one per node-step; in the backward also the dK/dV partials', one node-step behind),
each a matched send and receive between fixed neighbours, posted before anything waits; the ranks of a node make the
same one-node calls in the same order (a node-step's kind depends only on the two nodes, ``step_kind``). A one-node
call needs only the ranks of its node, which launch it once their own receive has arrived, and every receive was
posted by the previous node before that node waited for anything; so by induction over node-steps every call is
launched by all of its ranks and every transfer completes. A node that is late only delays its successors; one
that dies leaves them waiting on a bounded wait: torch raises RingAttentionTimeout naming the rank it waited for
(torch_bridge.nodes), the one-node calls' waits are the kernel's own, XLA bounds its collectives (jax_ring.nodes).
On GPUs, the first call of a variant compiles on each rank before it launches: a rank that compiles while its node's
peers wait is a late rank, bounded by the same timeouts (raise ``timeout_s`` for cold caches).

Segment ids travel with the K/V (int32, beside them in every transfer), and each call takes the queries' ids
and the ids of the K/V it holds apart (``AttentionSpec.kv_ids``; the kernels' KV_IDS, ring_core.protocol.steps.
key_ids): the node's own K/V (DIAG) is the one-node call with its ids; another node's K/V is a non-causal call
whose keys carry that node's ids. Ids belong to a batch row, not to a head, so with segment ids the half-shard
steps move the halves into the batch axis instead of the head axis (K_EARLY: the two query halves as 2B rows
against the first K/V halves, twice; Q_LATE: the second query half twice against the two K/V halves), and the
copies' partials add up (dK/dV of the twice-used halves, dQ of the twice-used queries) in a fixed order.

Sliding windows: the kernels take a window on a call whose keys sit elsewhere than its queries
(``AttentionSpec.key_offset``: the band moved by the distance between them, which then need not contain the
diagonal), so a node-step under a window is a few one-node calls, each on a pair of *blocks* of the two nodes
(``window_pieces``): a node's block is a run of consecutive global positions that its R ranks hold in rank order.
Contiguous: one block, the node's whole shards (positions n x RS ..); the pair is one call with the band moved by
the nodes' distance, or none (nobody in reach), or a call without a window (everyone in reach). Zigzag: two blocks,
node-level chunks n (the ranks' first halves) and 2N-1-n (the second halves, whose positions *fall* as the rank
grows: reversed row by row they rise, so the call runs on the reversed halves with the window's sides swapped); a
pair of blocks of like direction is a call as above, a first half against a second half is either out of reach or
wholly in reach for any window of at most a node-level chunk a side (they are more than a chunk apart), and a window
that reaches partly across one raises (``check_supported``: use layout="contiguous", which a window balances
anyway). The node's own K/V under zigzag: the last node's two chunks are adjacent (its node-local positions are
global ones moved by a constant), so it makes the one-node call; every other node runs its two halves apart.
Under causal masking only the left side of a moved band is left (the keys of an earlier node all come before).

``forward`` and ``backward`` are written once for numpy, torch and jax.numpy arrays: the frontends pass an
``Ops`` (array functions, the inner fused call, the transfer between nodes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ring_core import masks

DIAG = "diag"  # the node's own K/V: the one-node call, with the call's masks
FULL = "full"  # every query sees every key: a non-causal call
K_EARLY = "k_early"  # every query sees the first halves of the K/V shards
Q_LATE = "q_late"  # the second halves of the query shards see all the K/V
SKIP = "skip"  # nothing to compute (the transfer still runs)


def step_kind(node: int, src: int, *, is_causal: bool, layout: str) -> str:
    """What node ``node`` computes with the K/V of node ``src`` (see the module docstring).

    >>> [step_kind(1, m, is_causal=True, layout="zigzag") for m in range(3)]
    ['k_early', 'diag', 'q_late']
    >>> [step_kind(1, m, is_causal=True, layout="contiguous") for m in range(3)]
    ['full', 'diag', 'skip']
    """
    if src == node:
        return DIAG
    if not is_causal:
        return FULL
    if layout == "contiguous":
        return FULL if src < node else SKIP
    if layout == "zigzag":
        return K_EARLY if src < node else Q_LATE
    raise ValueError(f"unknown layout {layout!r}")


@dataclass(frozen=True)
class Mask:
    """A one-node call's masks (``Ops.inner_fwd`` / ``inner_bwd``): causal, its shards' layout over the node, the
    window in global positions and where its keys sit in its queries' frame (``AttentionSpec.key_offset``)."""

    is_causal: bool
    layout: str
    window: tuple = masks.NO_WINDOW
    key_offset: int = 0


@dataclass(frozen=True)
class Piece:
    """One call of a node-step under a window (module docstring): the rows of every rank's query and K/V shards it
    takes (``q_half`` / ``k_half``: None the whole shard, 0 / 1 its first / second half), ``flip``: those rows
    reversed (second halves), the call's ``mask``, and ``own``: the keys are the queries' own rows (the node's own
    K/V, the same rows), whose segment ids are the queries'."""

    q_half: object
    k_half: object
    flip: bool
    mask: Mask
    own: bool = False


class WindowAcrossChunksError(NotImplementedError):
    """A window that reaches partly across a zigzag node's first and second halves (``window_pieces``)."""


def _blocks(node: int, num_nodes: int, node_len: int, layout: str):
    """(half, falling, first global position, length) of each block of node ``node`` (module docstring)."""
    if layout == "contiguous":
        return [(None, False, node * node_len, node_len)]
    c = node_len // 2
    return [(0, False, node * c, c), (1, True, (2 * num_nodes - 1 - node) * c, c)]


def window_pieces(node: int, src: int, *, num_nodes: int, node_len: int, is_causal: bool, layout: str,
                  window) -> tuple:
    """The calls (``Piece``) node ``node`` makes with the K/V of node ``src`` under ``window`` (left, right; -1
    unbounded) in a job of ``num_nodes`` nodes of ``node_len`` tokens each: () where no query of the node reaches a
    key of the other (module docstring). Raises WindowAcrossChunksError where a zigzag window reaches partly across a
    node's two halves.

    >>> [len(window_pieces(1, m, num_nodes=3, node_len=8, is_causal=True, layout="contiguous", window=(4, -1)))
    ...  for m in range(3)]
    [1, 1, 0]
    >>> window_pieces(1, 0, num_nodes=2, node_len=8, is_causal=True, layout="contiguous", window=(4, -1))[0].mask
    Mask(is_causal=False, layout='contiguous', window=(4, 0), key_offset=-8)
    """
    if src == node and (layout == "contiguous" or node == num_nodes - 1):
        return (Piece(None, None, False, Mask(is_causal, layout, tuple(window)), own=True),)
    left, right = window
    right = 0 if is_causal else right
    pieces = []
    for q_half, q_falls, q0, n in _blocks(node, num_nodes, node_len, layout):
        for k_half, k_falls, k0, _ in _blocks(src, num_nodes, node_len, layout):
            lo, hi = q0 - k0 - (n - 1), q0 - k0 + (n - 1)  # query position - key position over the pair
            if (left >= 0 and lo > left) or (right >= 0 and hi < -right):
                continue  # out of reach
            own = src == node and q_half == k_half
            if (left < 0 or hi <= left) and (right < 0 or lo >= -right):  # wholly in reach
                pieces.append(Piece(q_half, k_half, False, Mask(False, "contiguous"), own))
            elif q_falls != k_falls:
                raise WindowAcrossChunksError(
                    f"a window of {tuple(window)} reaches partly across a node's zigzag halves (node-level chunks of "
                    f"{n} tokens); use layout='contiguous' (a window needs no zigzag balance), a window of at most "
                    f"{n} tokens a side, or backend='torch' / 'xla'")
            elif not q_falls and q0 == k0:  # the node's own first halves: a one-node call on them
                pieces.append(Piece(q_half, k_half, False, Mask(is_causal, "contiguous", tuple(window)), own))
            elif not q_falls:
                pieces.append(Piece(q_half, k_half, False, Mask(False, "contiguous", (left, right), k0 - q0), own))
            else:  # reversed rows: position end - p, so the sides swap and the offset changes sign
                pieces.append(Piece(q_half, k_half, True, Mask(False, "contiguous", (right, left), q0 - k0), own))
    return tuple(pieces)


def _window_kind(node: int, src: int, num_nodes: int, node_len: int, is_causal: bool, layout: str, window):
    """``step_kind`` under a window: the pieces, or SKIP."""
    pieces = window_pieces(node, src, num_nodes=num_nodes, node_len=node_len, is_causal=is_causal, layout=layout,
                           window=window)
    return pieces if pieces else SKIP


def supports(spec, num_nodes: int, node_size: int) -> bool:
    """Whether the two-level fused ring takes a call of ``spec`` on ``num_nodes`` nodes of ``node_size`` ranks
    (``backend="auto"`` takes the reference ring else): every call but a zigzag window that reaches partly across a
    node's halves (``window_pieces``)."""
    try:
        check_supported(spec, num_nodes, node_size)
    except WindowAcrossChunksError:
        return False
    return True


def check_supported(spec, num_nodes: int, node_size: int) -> None:
    """Raise, saying what to do, for a two-level fused call of ``spec`` this module cannot run."""
    if spec.layout == "zigzag" and spec.seq_local % 2:
        raise ValueError(f"zigzag needs an even seq_local, got {spec.seq_local}")
    for _ in _all_pieces(spec, num_nodes, node_size):
        pass


def _all_pieces(spec, num_nodes: int, node_size: int, own: bool = False):
    """Every node's pieces with every node's K/V (``own``: with its own K/V only) under ``spec``'s window (none
    without one); raises as ``window_pieces`` does."""
    if tuple(spec.window) == masks.NO_WINDOW:
        return
    for n in range(num_nodes):
        for m in [n] if own else range(num_nodes):
            yield from window_pieces(n, m, num_nodes=num_nodes, node_len=node_size * spec.seq_local,
                                     is_causal=spec.is_causal, layout=spec.layout, window=spec.window)


def _piece_spec(spec, piece: Piece):
    """The one-node call's spec of ``piece`` on ranks with ``spec``'s shards."""
    mask = piece.mask
    return dataclasses.replace(spec, seq_local=spec.seq_local if piece.q_half is None else spec.seq_local // 2,
                               is_causal=mask.is_causal, layout=mask.layout, window=mask.window,
                               key_offset=mask.key_offset, kv_ids=bool(spec.segmented) and not piece.own)


def node_specs(spec, num_nodes: int = 2, node_size: int = 1) -> list:
    """The one-node calls' specs (ring_core.validate.AttentionSpec) a two-level call of ``spec`` on ``num_nodes``
    nodes of ``node_size`` ranks may make on any node, the backward's calls on a node's own K/V over part of its kv
    heads (``own_heads``) among them: the frontends check each against the heap before anything runs (the masks do
    not change what a call needs; the GPU scripts compile each)."""
    group = spec.num_heads // spec.num_kv_heads
    owns = [dataclasses.replace(spec, num_heads=(hi - lo) * group, num_kv_heads=hi - lo)
            for lo, hi in own_heads(spec.num_kv_heads, num_nodes)]
    if tuple(spec.window) != masks.NO_WINDOW:
        own_pieces = [_piece_spec(sp, p) for sp in owns for p in _all_pieces(sp, num_nodes, node_size, own=True)]
        return list(dict.fromkeys([_piece_spec(spec, p) for p in _all_pieces(spec, num_nodes, node_size)]
                                  + own_pieces))
    s, h, hkv, ids = spec.seq_local, spec.num_heads, spec.num_kv_heads, bool(spec.segmented)
    out = [spec, dataclasses.replace(spec, is_causal=False, layout="contiguous", kv_ids=ids)]
    if spec.is_causal and spec.layout == "zigzag":
        if ids:  # K_EARLY and Q_LATE, halves in the batch axis
            out.append(dataclasses.replace(spec, batch=2 * spec.batch, seq_local=s // 2, is_causal=False,
                                           layout="contiguous", kv_ids=True))
        else:
            for kv in (hkv, 2 * hkv):  # K_EARLY, Q_LATE, halves in the head axis
                out.append(dataclasses.replace(spec, seq_local=s // 2, num_heads=2 * h, num_kv_heads=kv,
                                               is_causal=False, layout="contiguous"))
    return list(dict.fromkeys(out + owns))


def inner_spec(spec, q, k, mask: Mask, ids):
    """The spec of a one-node call (``Ops.inner_fwd`` / ``inner_bwd``) on ``q`` and ``k`` (batch, rows and heads from
    them: the half-shard steps move rows into heads or the batch) with ``mask`` and ``ids`` as the Ops take them."""
    return dataclasses.replace(spec, batch=q.shape[0], seq_local=q.shape[1], num_heads=q.shape[2],
                               num_kv_heads=k.shape[2], is_causal=bool(mask.is_causal), layout=mask.layout,
                               window=tuple(mask.window), key_offset=int(mask.key_offset),
                               kv_ids=ids is not None and ids[1] is not None)


def kernel_ids(ids, stack):
    """A one-node call's ``ids`` as the kernels take them (``AttentionSpec.kv_ids``): None, the queries' [b, s], or
    the queries' and the keys' stacked [2, b, s] (``stack``: the array namespace's)."""
    if ids is None:
        return None
    q_ids, kv_ids = ids
    return q_ids if kv_ids is None else stack([q_ids, kv_ids])


@dataclass(frozen=True)
class Ops:
    """What a frontend supplies. Arrays are [batch, seq, heads, head_dim] (lse [batch, heads, seq]).

    ``xp``: the array namespace (numpy, torch, jax.numpy): ``exp``, ``logaddexp``, ``where``, ``isneginf``,
    ``zeros_like``, ``full_like``; ``permute(x, axes)``, ``cat(xs, axis)``, ``flip(x, axis)`` (the rows reversed),
    ``astype(x, like)`` (x in like's dtype), ``f32(x)`` (float32, float64 kept).
    ``inner_fwd(q, k, v, mask, ids) -> (out, lse)``: the one-node call over this node's ring with ``mask`` (a
    ``Mask``); ``ids`` None (no segment ids) or (the queries' ids, the keys' ids or None where they are the queries'
    own), int32 [b, s] each (the call's spec: ``inner_spec``; the kernels' ids: ``kernel_ids``).
    ``inner_bwd(q, k, v, out, lse, dout, dlse, mask, ids) -> (dq, dk, dv)``: its backward.
    ``send(xs) -> handle``: post the transfer of the arrays ``xs`` to the same rank of the next node and the receipt
    of the previous node's (same shapes and dtypes); ``recv(handle) -> list``: wait for what arrived.
    ``switch``: None where the node index is a Python int (the step's kind is chosen in Python); else
    ``switch(index, branches)`` (``lax.switch``) and the node index a traced value (JAX: one program for every
    node, so a node-step that differs between nodes runs the branch of the node's kind).
    """

    xp: object
    permute: object
    cat: object
    flip: object
    astype: object
    f32: object
    inner_fwd: object
    inner_bwd: object
    send: object
    recv: object
    switch: object = None


# ---------------------------------------------------------------- moving half shards into the head axis
def halves_to_heads(ops: Ops, x, hkv: int):
    """[b, s, hkv * g, d] -> [b, s / 2, hkv * 2g, d]: head ``hkv * 2g + half * g + j`` holds rows
    ``half * s / 2 + i`` of head ``hkv * g + j`` (K_EARLY's queries, and out and dout alike)."""
    b, s, h, d = x.shape
    g = h // hkv
    return ops.permute(x.reshape(b, 2, s // 2, hkv, g, d), (0, 2, 3, 1, 4, 5)).reshape(b, s // 2, 2 * h, d)


def heads_to_halves(ops: Ops, x, hkv: int):
    """The inverse of ``halves_to_heads``."""
    b, s2, h2, d = x.shape
    g = h2 // (2 * hkv)
    return ops.permute(x.reshape(b, s2, hkv, 2, g, d), (0, 3, 1, 2, 4, 5)).reshape(b, 2 * s2, h2 // 2, d)


def lse_halves_to_heads(ops: Ops, lse, hkv: int):
    """lse [b, hkv * g, s] -> [b, hkv * 2g, s / 2], the head order of ``halves_to_heads``."""
    b, h, s = lse.shape
    g = h // hkv
    return ops.permute(lse.reshape(b, hkv, g, 2, s // 2), (0, 1, 3, 2, 4)).reshape(b, 2 * h, s // 2)


def lse_heads_to_halves(ops: Ops, lse, hkv: int):
    b, h2, s2 = lse.shape
    g = h2 // (2 * hkv)
    return ops.permute(lse.reshape(b, hkv, 2, g, s2), (0, 1, 3, 2, 4)).reshape(b, h2 // 2, 2 * s2)


def twice_as_heads(ops: Ops, x, hkv: int):
    """[b, s, hkv * g, d] -> [b, s, hkv * 2g, d], head ``hkv * 2g + half * g + j`` = head ``hkv * g + j`` (Q_LATE's
    queries: the same rows against both K/V halves)."""
    b, s, h, d = x.shape
    g = h // hkv
    x = x.reshape(b, s, hkv, 1, g, d)
    return ops.cat([x, x], 3).reshape(b, s, 2 * h, d)


def lse_twice_as_heads(ops: Ops, lse, hkv: int):
    b, h, s = lse.shape
    g = h // hkv
    lse = lse.reshape(b, hkv, 1, g, s)
    return ops.cat([lse, lse], 2).reshape(b, 2 * h, s)


def kv_halves_to_heads(ops: Ops, x):
    """K/V [b, s, hkv, d] -> [b, s / 2, 2 hkv, d]: kv head ``hkv * 2 + half`` holds rows ``half * s / 2 + i``."""
    b, s, hkv, d = x.shape
    return ops.permute(x.reshape(b, 2, s // 2, hkv, d), (0, 2, 3, 1, 4)).reshape(b, s // 2, 2 * hkv, d)


def kv_heads_to_halves(ops: Ops, x):
    b, s2, hkv2, d = x.shape
    return ops.permute(x.reshape(b, s2, hkv2 // 2, 2, d), (0, 3, 1, 2, 4)).reshape(b, 2 * s2, hkv2 // 2, d)


# ------------------------------------------------------------------------------- moving half shards into the batch axis
# With segment ids (ids are per batch row, not per head). Batch row ``half * b + i`` holds half ``half`` of row i.
def _half(x, half: int, axis: int = 1):
    """The first (0) or second (1) half of ``x`` along ``axis``."""
    n = x.shape[axis] // 2
    return x[(slice(None),) * axis + (slice(half * n, (half + 1) * n),)]


def halves_to_batch(ops: Ops, x, axis: int = 1):
    """[b, s, ...] -> [2b, s / 2, ...] (lse [b, h, s]: ``axis=2``)."""
    return ops.cat([_half(x, 0, axis), _half(x, 1, axis)], 0)


def batch_to_halves(ops: Ops, x, axis: int = 1):
    """The inverse of ``halves_to_batch``."""
    b = x.shape[0] // 2
    return ops.cat([x[:b], x[b:]], axis)


def twice_in_batch(ops: Ops, x):
    """[b, ...] -> [2b, ...], the rows twice (the halves of the other side each meet all of them)."""
    return ops.cat([x, x], 0)


def batch_sum(x):
    """[2b, ...] -> [b, ...]: the two copies' partials added (first copy first)."""
    b = x.shape[0] // 2
    return x[:b] + x[b:]


# ------------------------------------------------------------------------------------- the merge
def merge(ops: Ops, out_a, lse_a, out_b, lse_b):
    """Two partial results over disjoint keys -> their union's (out float32, lse). A row with lse -inf on one side
    takes the other's; on both, out 0 and lse -inf."""
    xp = ops.xp
    lse = xp.logaddexp(lse_a, lse_b)
    safe = xp.where(xp.isneginf(lse), xp.zeros_like(lse), lse)
    wa = ops.permute(xp.exp(lse_a - safe), (0, 2, 1))[..., None]
    wb = ops.permute(xp.exp(lse_b - safe), (0, 2, 1))[..., None]
    return out_a * wa + out_b * wb, lse


def merge_heads(ops: Ops, out, lse, hkv: int):
    """Q_LATE's [b, s, hkv * 2g, d] partials (each query row against each K/V half) -> [b, s, hkv * g, d], merged."""
    b, s, h2, d = out.shape
    g = h2 // (2 * hkv)
    o = out.reshape(b, s, hkv, 2, g, d)
    lo = lse.reshape(b, hkv, 2, g, s)
    o0, o1 = (o[:, :, :, i].reshape(b, s, hkv * g, d) for i in range(2))
    l0, l1 = (lo[:, :, i].reshape(b, hkv * g, s) for i in range(2))
    return merge(ops, o0, l0, o1, l1)


def _nothing(ops: Ops, out_like, lse_like):
    """A partial result of rows that saw no key: out 0, lse -inf (shapes and dtypes of the arguments)."""
    return ops.xp.zeros_like(out_like), ops.xp.full_like(lse_like, float("-inf"))


def _listed(ids) -> list:
    """What travels beside the K/V: their ids, if any."""
    return [] if ids is None else [ids]


def _unlisted(got):
    """(k, v, ids or None) from what arrived."""
    return (got[0], got[1], got[2] if len(got) > 2 else None)


_FULL = Mask(False, "contiguous")  # every query sees every key


# ------------------------------------------------------------------------------------- pieces (under a window)
def _rows(ops: Ops, x, half, flip: bool, axis: int = 1):
    """A piece's rows of ``x`` (``Piece``): all, or one half along ``axis``, reversed with ``flip``."""
    if half is None:
        return x
    x = _half(x, half, axis)
    return ops.flip(x, axis) if flip else x


def _unrows(ops: Ops, x, half, flip: bool, fill, axis: int = 1):
    """``_rows``' inverse: a piece's rows back in their place in a whole shard, ``fill`` (like x) in the other half."""
    if half is None:
        return x
    x = ops.flip(x, axis) if flip else x
    return ops.cat([x, fill] if half == 0 else [fill, x], axis)


def _piece_ids(ops: Ops, piece: Piece, q_ids, kv_ids):
    """A piece's ids as ``Ops.inner_fwd`` takes them."""
    if q_ids is None:
        return None
    return (_rows(ops, q_ids, piece.q_half, piece.flip),
            None if piece.own else _rows(ops, kv_ids, piece.k_half, piece.flip))


def pieces_forward(ops: Ops, pieces, q, k, v, q_ids=None, kv_ids=None):
    """A node-step's partial (as ``step_forward``'s) made of ``pieces`` (``window_pieces``; at least one)."""
    acc = None
    for p in pieces:
        out, lse = ops.inner_fwd(_rows(ops, q, p.q_half, p.flip), _rows(ops, k, p.k_half, p.flip),
                                 _rows(ops, v, p.k_half, p.flip), p.mask, _piece_ids(ops, p, q_ids, kv_ids))
        out = ops.f32(out)
        none_out, none_lse = _nothing(ops, out, lse)
        part = (_unrows(ops, out, p.q_half, p.flip, none_out), _unrows(ops, lse, p.q_half, p.flip, none_lse, 2))
        acc = part if acc is None else merge(ops, *acc, *part)
    return acc


def pieces_backward(ops: Ops, pieces, q, k, v, out, lse, dout, dlse, q_ids=None, kv_ids=None):
    """A node-step's (dq, dk, dv) (as ``step_backward``'s) made of ``pieces``, added up in their order."""
    acc = None
    for p in pieces:
        qr = lambda x, axis=1: _rows(ops, x, p.q_half, p.flip, axis)  # noqa: E731
        kr = lambda x: _rows(ops, x, p.k_half, p.flip)  # noqa: E731
        grads = ops.inner_bwd(qr(q), kr(k), kr(v), qr(out), qr(lse, 2), qr(dout), qr(dlse, 2), p.mask,
                              _piece_ids(ops, p, q_ids, kv_ids))
        part = []
        for half, g in zip((p.q_half, p.k_half, p.k_half), grads):
            g = ops.f32(g)
            part.append(_unrows(ops, g, half, p.flip, ops.xp.zeros_like(g)))
        acc = part if acc is None else [a + b for a, b in zip(acc, part)]
    return tuple(acc)


# ------------------------------------------------------------------------------------- forward
def step_forward(ops: Ops, kind, q, k, v, *, is_causal: bool, layout: str, q_ids=None, kv_ids=None):
    """One node-step's partial (out float32 [b, s, h, d], lse [b, h, s]) over every row of the shard; ``kind``: a
    ``step_kind`` or, under a window, the step's pieces; ``q_ids`` / ``kv_ids``: the queries' and the held K/V's
    segment ids (int32 [b, s]), or None."""
    if isinstance(kind, tuple):
        return pieces_forward(ops, kind, q, k, v, q_ids, kv_ids)
    hkv = k.shape[2]
    if kind == DIAG:
        out, lse = ops.inner_fwd(q, k, v, Mask(is_causal, layout), None if q_ids is None else (q_ids, None))
        return ops.f32(out), lse
    if kind == FULL:
        out, lse = ops.inner_fwd(q, k, v, _FULL, None if q_ids is None else (q_ids, kv_ids))
        return ops.f32(out), lse
    s = q.shape[1]
    h = s // 2
    if q_ids is not None:  # the halves in the batch axis
        if kind == K_EARLY:
            kf, vf, kvf = (twice_in_batch(ops, x[:, :h]) for x in (k, v, kv_ids))
            out, lse = ops.inner_fwd(halves_to_batch(ops, q), kf, vf, _FULL, (halves_to_batch(ops, q_ids), kvf))
            return batch_to_halves(ops, ops.f32(out)), batch_to_halves(ops, lse, 2)
        if kind == Q_LATE:
            out, lse = ops.inner_fwd(twice_in_batch(ops, q[:, h:]), halves_to_batch(ops, k), halves_to_batch(ops, v),
                                     _FULL, (twice_in_batch(ops, q_ids[:, h:]), halves_to_batch(ops, kv_ids)))
            b = q.shape[0]
            out = ops.f32(out)
            out, lse = merge(ops, out[:b], lse[:b], out[b:], lse[b:])
            none_out, none_lse = _nothing(ops, out, lse)
            return ops.cat([none_out, out], 1), ops.cat([none_lse, lse], 2)
    if kind == K_EARLY:
        out, lse = ops.inner_fwd(halves_to_heads(ops, q, hkv), k[:, :h], v[:, :h], _FULL, None)
        return heads_to_halves(ops, ops.f32(out), hkv), lse_heads_to_halves(ops, lse, hkv)
    if kind == Q_LATE:
        out, lse = ops.inner_fwd(twice_as_heads(ops, q[:, h:], hkv), kv_halves_to_heads(ops, k),
                                 kv_halves_to_heads(ops, v), _FULL, None)
        out, lse = merge_heads(ops, ops.f32(out), lse, hkv)
        none_out, none_lse = _nothing(ops, out, lse)
        return ops.cat([none_out, out], 1), ops.cat([none_lse, lse], 2)
    raise ValueError(f"no forward for a {kind!r} step")


def _kind_of(num_nodes: int, node_len: int, is_causal: bool, layout: str, window):
    """``kind(node, src)``: what node ``node`` computes with node ``src``'s K/V (``step_kind``, or the pieces under a
    window)."""
    if tuple(window) == masks.NO_WINDOW:
        return lambda n, m: step_kind(n, m, is_causal=is_causal, layout=layout)
    return lambda n, m: _window_kind(n, m, num_nodes, node_len, is_causal, layout, window)


def _per_kind(ops: Ops, node, s: int, num_nodes: int, kind_of, fn, nothing):
    """``fn(kind)`` for this node's kind at node-step ``s``; ``nothing()`` where it skips (None: skip, concrete node
    only). A traced node runs ``ops.switch`` over the kinds the nodes have at that step."""
    kinds = [kind_of(n, (n - s) % num_nodes) for n in range(num_nodes)]
    if ops.switch is None or len(set(kinds)) == 1:
        kind = kinds[node] if ops.switch is None else kinds[0]
        if kind == SKIP:
            return None if nothing is None else nothing()
        return fn(kind)
    order = sorted(set(kinds), key=kinds.index)
    index = ops.xp.asarray([order.index(kd) for kd in kinds])[node]
    return ops.switch(index, [(lambda kd=kd: nothing() if kd == SKIP else fn(kd)) for kd in order])


def forward(ops: Ops, q, k, v, *, node, num_nodes: int, is_causal: bool, layout: str, ids=None, window=masks.NO_WINDOW,
            node_size: int = 1):
    """(out in q's dtype, lse float32) of the two-level ring for this rank's shards (module docstring); ``ids``:
    this rank's segment ids (int32 [b, s]) or None; ``window``: the call's (left, right), global positions, on
    nodes of ``node_size`` ranks."""
    kind_of = _kind_of(num_nodes, node_size * q.shape[1], is_causal, layout, window)
    acc = None
    kv_ids = ids
    for s in range(num_nodes):
        # the next step's K/V (and their ids), while this one computes
        handle = ops.send([k, v] + _listed(kv_ids)) if s < num_nodes - 1 else None
        # (a skipped step's partial, for the switch: shaped and typed like the others, from q)
        nothing = None if ops.switch is None else (lambda: _nothing(ops, ops.f32(ops.xp.zeros_like(q)),
                                                                    ops.f32(ops.permute(q[..., 0], (0, 2, 1)))))
        part = _per_kind(ops, node, s, num_nodes, kind_of,
                         lambda kind: step_forward(ops, kind, q, k, v, is_causal=is_causal, layout=layout, q_ids=ids,
                                                   kv_ids=kv_ids), nothing)
        if part is not None:
            acc = part if acc is None else merge(ops, *acc, *part)
        if handle is not None:
            k, v, kv_ids = _unlisted(ops.recv(handle))
    out, lse = acc  # node-step 0 (DIAG) is never skipped
    return ops.astype(out, q), lse


# ------------------------------------------------------------------------------------- backward
def step_backward(ops: Ops, kind, q, k, v, out, lse, dout, dlse, *, is_causal: bool, layout: str, q_ids=None,
                  kv_ids=None):
    """One node-step's (dq, dk, dv), float32, full shard shapes, from the final ``out`` / ``lse`` and the
    cotangents ``dout`` / ``dlse`` (so the step's probabilities are the global softmax's); kinds and ids as
    ``step_forward``'s."""
    if isinstance(kind, tuple):
        return pieces_backward(ops, kind, q, k, v, out, lse, dout, dlse, q_ids, kv_ids)
    hkv = k.shape[2]
    if kind == DIAG:
        return tuple(ops.f32(x) for x in ops.inner_bwd(q, k, v, out, lse, dout, dlse, Mask(is_causal, layout),
                                                       None if q_ids is None else (q_ids, None)))
    if kind == FULL:
        return tuple(ops.f32(x) for x in ops.inner_bwd(q, k, v, out, lse, dout, dlse, _FULL,
                                                       None if q_ids is None else (q_ids, kv_ids)))
    s = q.shape[1]
    h = s // 2
    if q_ids is not None:  # the halves in the batch axis
        if kind == K_EARLY:
            kf, vf, kvf = (twice_in_batch(ops, x[:, :h]) for x in (k, v, kv_ids))
            dq, dk, dv = ops.inner_bwd(halves_to_batch(ops, q), kf, vf, halves_to_batch(ops, out),
                                       halves_to_batch(ops, lse, 2), halves_to_batch(ops, dout),
                                       halves_to_batch(ops, dlse, 2), _FULL, (halves_to_batch(ops, q_ids), kvf))
            dk, dv = batch_sum(ops.f32(dk)), batch_sum(ops.f32(dv))
            return (batch_to_halves(ops, ops.f32(dq)), ops.cat([dk, ops.xp.zeros_like(dk)], 1),
                    ops.cat([dv, ops.xp.zeros_like(dv)], 1))
        if kind == Q_LATE:
            dq, dk, dv = ops.inner_bwd(twice_in_batch(ops, q[:, h:]), halves_to_batch(ops, k),
                                       halves_to_batch(ops, v), twice_in_batch(ops, out[:, h:]),
                                       twice_in_batch(ops, lse[:, :, h:]), twice_in_batch(ops, dout[:, h:]),
                                       twice_in_batch(ops, dlse[:, :, h:]), _FULL,
                                       (twice_in_batch(ops, q_ids[:, h:]), halves_to_batch(ops, kv_ids)))
            dq = batch_sum(ops.f32(dq))
            return (ops.cat([ops.xp.zeros_like(dq), dq], 1), batch_to_halves(ops, ops.f32(dk)),
                    batch_to_halves(ops, ops.f32(dv)))
    if kind == K_EARLY:
        dq, dk, dv = ops.inner_bwd(halves_to_heads(ops, q, hkv), k[:, :h], v[:, :h], halves_to_heads(ops, out, hkv),
                                   lse_halves_to_heads(ops, lse, hkv), halves_to_heads(ops, dout, hkv),
                                   lse_halves_to_heads(ops, dlse, hkv), _FULL, None)
        dk, dv = ops.f32(dk), ops.f32(dv)
        zeros = ops.xp.zeros_like(dk)
        return heads_to_halves(ops, ops.f32(dq), hkv), ops.cat([dk, zeros], 1), ops.cat([dv, ops.xp.zeros_like(dv)], 1)
    if kind == Q_LATE:
        dq, dk, dv = ops.inner_bwd(twice_as_heads(ops, q[:, h:], hkv), kv_halves_to_heads(ops, k),
                                   kv_halves_to_heads(ops, v), twice_as_heads(ops, out[:, h:], hkv),
                                   lse_twice_as_heads(ops, lse[:, :, h:], hkv), twice_as_heads(ops, dout[:, h:], hkv),
                                   lse_twice_as_heads(ops, dlse[:, :, h:], hkv), _FULL, None)
        b, s2, h2, d = dq.shape
        dq = ops.f32(dq).reshape(b, s2, hkv, 2, h2 // (2 * hkv), d)
        dq = (dq[:, :, :, 0] + dq[:, :, :, 1]).reshape(b, s2, h2 // 2, d)
        dq = ops.cat([ops.xp.zeros_like(dq), dq], 1)
        return dq, kv_heads_to_halves(ops, ops.f32(dk)), kv_heads_to_halves(ops, ops.f32(dv))
    raise ValueError(f"no backward for a {kind!r} step")


def own_heads(num_kv_heads: int, num_nodes: int) -> list:
    """The kv heads [lo, hi) of each backward call on a node's own K/V: two halves where there are two kv heads or
    more (the first while the first K/V transfer runs, the second while the last dK/dV partials come home), else one
    call, made last; one call on one node (nothing travels)."""
    if num_nodes == 1 or num_kv_heads < 2:
        return [(0, num_kv_heads)]
    half = num_kv_heads // 2
    return [(0, half), (half, num_kv_heads)]


def _heads(x, lo: int, hi: int, axis: int):
    return x[(slice(None),) * axis + (slice(lo, hi),)]


def backward(ops: Ops, q, k, v, out, lse, dout, dlse, *, node, num_nodes: int, is_causal: bool, layout: str,
             ids=None, window=masks.NO_WINDOW, node_size: int = 1):
    """(dq, dk, dv) in q's, k's and v's dtypes. ``dlse`` float32 like ``lse`` (zeros when lse carries no gradient);
    ``ids``, ``window`` and ``node_size`` as ``forward``'s.

    The other nodes' K/V come as in the forward (node-step s holds node n - s's), and the partial dK/dV of each
    travel after it, float32, one node-step behind, until the node before its owner sends them home. The node's
    own K/V's backward is split over its kv heads (``own_heads``): the first half while the first K/V transfer
    runs, the second while the partials of the node's own K/V come home, which then add to the two halves' own.
    So the last transfer runs under a call, not after every call (with one kv head the own K/V's call is made last,
    and the first transfer, half the bytes of the float32 partials, is the one that waits)."""
    kind_of = _kind_of(num_nodes, node_size * q.shape[1], is_causal, layout, window)
    group = q.shape[2] // k.shape[2]
    spans = own_heads(k.shape[2], num_nodes)
    k0, v0 = k, v

    def own(lo, hi):  # the node's own K/V's backward on kv heads [lo, hi) and their query heads
        qh = lambda x: _heads(x, lo * group, hi * group, 2)  # noqa: E731
        lh = lambda x: _heads(x, lo * group, hi * group, 1)  # noqa: E731
        kh = lambda x: _heads(x, lo, hi, 2)  # noqa: E731
        return _per_kind(ops, node, 0, num_nodes, kind_of,
                         lambda kind: step_backward(ops, kind, qh(q), kh(k0), kh(v0), qh(out), lh(lse), qh(dout),
                                                    lh(dlse), is_causal=is_causal, layout=layout, q_ids=ids,
                                                    kv_ids=ids), None)

    handle = ops.send([k, v] + _listed(ids)) if num_nodes > 1 else None
    owns = [own(*spans[0])] if len(spans) > 1 else []
    dq = None
    carry = None  # the transfer of the partial dK/dV of the K/V held, to the next node
    for s in range(1, num_nodes):
        k, v, kv_ids = _unlisted(ops.recv(handle))
        handle = ops.send([k, v] + _listed(kv_ids)) if s < num_nodes - 1 else None
        zeros = lambda: tuple(ops.f32(ops.xp.zeros_like(x)) for x in (q, k, v))  # noqa: E731
        part = _per_kind(ops, node, s, num_nodes, kind_of,
                         lambda kind: step_backward(ops, kind, q, k, v, out, lse, dout, dlse, is_causal=is_causal,
                                                    layout=layout, q_ids=ids, kv_ids=kv_ids),
                         None if ops.switch is None else zeros)
        if part is not None:
            dq = part[0] if dq is None else dq + part[0]
        if carry is None:  # node-step 1: no partials of this K/V yet
            dk_acc, dv_acc = part[1:] if part is not None else (ops.f32(ops.xp.zeros_like(k)),
                                                                ops.f32(ops.xp.zeros_like(v)))
        else:
            dk_acc, dv_acc = ops.recv(carry)
            if part is not None:
                dk_acc, dv_acc = dk_acc + part[1], dv_acc + part[2]
        carry = ops.send([dk_acc, dv_acc])  # after the last step this brings every shard's dK/dV home
    owns.append(own(*spans[-1]))  # while the last partials travel
    dq_own, dk_own, dv_own = (ops.cat([o[i] for o in owns], 2) if len(owns) > 1 else owns[0][i] for i in range(3))
    dq = dq_own if dq is None else dq + dq_own
    if carry is not None:
        dk_home, dv_home = ops.recv(carry)
        dk_own, dv_own = dk_home + dk_own, dv_home + dv_own
    return ops.astype(dq, q), ops.astype(dk_own, k0), ops.astype(dv_own, v0)
