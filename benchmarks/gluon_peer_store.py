"""Can a TMA store write a peer's heap, and a TMA load read what a peer's TMA store wrote? (the Gluon forward's push design)

The Gluon forward's pushes (docs/design.md) would
TMA-store each local K/V block from the shared-memory slot it was loaded into straight into the needing peer's
receive slot, then release the chunk's flag there; the peer acquires the flag, fences the generic proxy against
the async one and TMA-loads the chunk (as benchmarks/gluon_ring.py, whose host-written late data it read right).
Two things in that chain are new and are what this probes, with every rank's heap mapped by iris as the fused
kernels map it:

* the TMA descriptor of a store whose global address lies in a *peer's* heap (iris's VMM mapping in this process);
* the sender's order: ``cp.async.bulk.wait_group 0`` (the bulk writes complete, not only their shared-memory
  reads), then ``fence.proxy.async.global``, then the release of the flag (a generic, system-scope store);
* that the thread releasing the flag may be another than the one that issued the stores (a CTA barrier
  between, as for ``push_unit``'s stores).

Each rank sends ``TILES`` tiles of [128, D] bf16 (a known pattern: its rank and the tile's index in every
element's bits) to rank + 1, each tile followed by its own flag, and receives rank - 1's: for each tile it
acquires the flag (bounded spin), fences, TMA-loads the tile and writes it out with plain stores; the host
compares with what rank - 1 sent. Tiles land while the receiver already spins (both ranks' kernels run side
by side: one GPU under MPS, or two GPUs).

    python -m jax_ring.launch --nproc-per-node 2 -m benchmarks.gluon_peer_store --out OUT_DIR/peer_store.json

(stage ``probe-gluon-peer-store``; any --nproc >= 2).
"""
from __future__ import annotations

import argparse
import json
import os

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ring_core.kernels.gluon_parts import cta_barrier as _cta_barrier
from ring_core.kernels.gluon_parts import tma_load as _tma_load
from ring_core.kernels.gluon_parts import tma_store as _tma_store
from benchmarks.gluon_ring import _acquire_flag

ROWS, D = 128, 128
TILES = 16
MAX_POLLS = 1 << 26


@gluon.jit
def _release_after_bulk_writes(flag_ptr, epoch):
    """The bulk (async-proxy) writes issued so far complete, ordered before the flag's generic release. Not
    ``tma.store_wait``: Gluon emits ``cp.async.bulk.wait_group.read`` for it, which waits only until the stores
    have *read* shared memory (enough to reuse the buffer, not to publish the data); without ``.read`` the wait
    lasts until the writes are complete (PTX ISA, cp.async.bulk.wait_group)."""
    gl.inline_asm_elementwise("cp.async.bulk.wait_group 0;\n fence.proxy.async.global;\n mov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)
    # The thread that issued the stores waited for them; the release may be another thread's: the barrier orders
    # it after (cumulativity through bar.sync, as ring_core.protocol.steps.push_unit relies on).
    _cta_barrier()
    gl.atomic_xchg(flag_ptr, epoch, sem="release", scope="sys")


@gluon.jit
def peer_store_kernel(src_desc, peer_desc, mine_desc, out_ptr, peer_flags, my_flags, err_ptr, epoch, max_polls,
                      TILES: gl.constexpr, NUM_WARPS: gl.constexpr):
    """One program: send TILES tiles of ``src`` to the peer's buffer (``peer_desc``), each released by its flag
    at the peer; then receive this rank's TILES tiles (``mine_desc``) as the peer sends them, each after its
    flag, and copy them to ``out`` with plain stores."""
    BLOCK: gl.constexpr = src_desc.block_type.shape[0]
    DD: gl.constexpr = src_desc.block_type.shape[1]
    smem = gl.allocate_shared_memory(src_desc.dtype, src_desc.block_type.shape, src_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    fence_async_shared()
    phase = 0
    for t in range(TILES):
        mbarrier.expect(bar, src_desc.block_type.nbytes)
        _tma_load(src_desc, [t * BLOCK, 0], bar, smem)
        mbarrier.wait(bar, phase)
        phase ^= 1
        _tma_store(peer_desc, [t * BLOCK, 0], smem)
        _release_after_bulk_writes(peer_flags + t, epoch)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, DD, layout=gl.SliceLayout(0, layout))
    for t in range(TILES):
        _acquire_flag(my_flags + t, epoch, max_polls, err_ptr)
        mbarrier.expect(bar, mine_desc.block_type.nbytes)
        _tma_load(mine_desc, [t * BLOCK, 0], bar, smem)
        mbarrier.wait(bar, phase)
        phase ^= 1
        tile = smem.load(layout)
        gl.store(out_ptr + (t * BLOCK + rows)[:, None] * DD + cols[None, :], tile)
        _cta_barrier()  # every thread's reads of the tile before the next TMA load overwrites it
        fence_async_shared()
    mbarrier.invalidate(bar)


class _Address:
    """A device address (this process's mapping of a peer's heap) as Triton's launcher and TMA descriptors take
    a tensor: its data_ptr() and dtype."""

    def __init__(self, ptr: int, dtype):
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def compile_for_sm90():
    """Compile the kernel for sm_90 without a GPU (CPU tensors give the descriptors their types)."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from ring_core.runtime import build

    t = torch.zeros((TILES * ROWS, D), dtype=torch.bfloat16)
    desc = mangle_type(TensorDescriptor(t, [TILES * ROWS, D], [D, 1], [ROWS, D],
                                        gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)))
    types = [desc] * 3 + ["*bf16", "*i32", "*i32", "*i32", "i32", "i32"]
    return build.compile_kernel(peer_store_kernel, types, {"TILES": TILES, "NUM_WARPS": 4}, num_warps=4,
                                num_stages=1, capability=90)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    import torch_bridge
    from ring_core.runtime import heap as _heap

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch_bridge.initialize()
    h = _heap.get()
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        raise SystemExit("gluon_peer_store needs at least 2 ranks")
    dev = torch.device("cuda", torch.cuda.current_device())
    peer, prev = (rank + 1) % world, (rank - 1) % world
    # The buffer and flags: the start of the heap's workspace (no fused call runs here), the same offset on every
    # rank; this process's address of a peer's copy is that peer's heap base as mapped here plus the offset.
    nbytes = TILES * ROWS * D * 2
    mine = h.workspace[:nbytes].view(torch.bfloat16).view(TILES * ROWS, D)
    my_flags = h.workspace[nbytes:nbytes + 4 * TILES].view(torch.int32)
    mine.zero_()
    my_flags.zero_()
    off = mine.data_ptr() - h.all_bases[rank][rank]
    peer_buf = _Address(h.all_bases[rank][peer] + off, torch.bfloat16)
    peer_flags = _Address(h.all_bases[rank][peer] + off + nbytes, torch.int32)
    torch.cuda.synchronize()
    dist.barrier()

    def pattern(r):
        t = torch.arange(TILES * ROWS * D, device=dev, dtype=torch.int32)
        return ((t * 7 + r * 1000003) % 30000 + 1).to(torch.int16).view(torch.bfloat16).view(TILES * ROWS, D)

    src = pattern(rank)
    out = torch.zeros_like(src)
    err = torch.zeros(1, dtype=torch.int32, device=dev)
    layout = gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.bfloat16)
    descs = [TensorDescriptor(x, [TILES * ROWS, D], [D, 1], [ROWS, D], layout) for x in (src, peer_buf, mine)]
    result = dict(rank=rank, world=world, peer=peer, shared_gpu=torch.cuda.device_count() < world)
    try:
        peer_store_kernel[(1,)](*descs, out, peer_flags, my_flags, err, 1, MAX_POLLS, TILES=TILES, NUM_WARPS=4,
                                num_warps=4)
        torch.cuda.synchronize()
        want = pattern(prev)
        same = torch.equal(out.view(torch.int16), want.view(torch.int16))
        result.update(err_word=int(err.item()), equal=bool(same),
                      wrong_rows=int((out.view(torch.int16) != want.view(torch.int16)).any(dim=1).sum().item()),
                      ok=bool(same and err.item() == 0))
    except Exception as e:  # noqa: BLE001 (a probe: report what failed)
        result.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    print(f"gluon_peer_store: {json.dumps(result)}", flush=True)
    results = [None] * world
    dist.all_gather_object(results, result)
    if rank == 0 and a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    torch_bridge.shutdown()
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
