"""What Triton's Hopper warp-specialisation pass (``tl.range(..., warp_specialize=True)``, sm_90, 4 warps) does to
the rest of a kernel: runs on CPU, no GPU needed (Triton compiles for sm_90 without one).

    python -m benchmarks.ws_pass_probe            # with the Triton of the current environment

One small attention forward (TMA descriptors made in the kernel, one K/V loop marked ``warp_specialize``),
plus one variant per row: a ring protocol's kind of operation placed before or after that loop. For each
variant, the TTGIR compiled with and without ``warp_specialize`` is searched for the variant's operations.
The findings (Triton 3.6.0, the GPU machine's, and 3.9.0, CI's) are in benchmarks/NOTES.md, 2026-12-01.
"""

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def _spin(ptr, target):
    # A wait as one inline-asm op (an acquire spin), as a ring kernel's flag wait would be under warp
    # specialisation (a `while` loop anywhere stops the pass).
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .pred %p;
        spin_again:
        ld.global.acquire.sys.b32 $0, [$1];
        setp.lt.s32 %p, $0, $2;
        @%p bra spin_again;
        }""", constraints="=r,l,r", args=[ptr, target], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _probe(Q, K, V, O, CTL, sm_scale, S, MODE: tl.constexpr, WS: tl.constexpr):
    BM: tl.constexpr = 128
    BN: tl.constexpr = 128
    D: tl.constexpr = 128
    pid = tl.program_id(0)
    offs_m = pid * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    extra = 0
    if MODE == 1:  # a release flag after a CTA barrier (a push's publication), its result unused
        tl.debug_barrier()
        tl.atomic_xchg(CTL + 0, 1, sem="release", scope="sys")
    if MODE == 2:  # a claim counter whose result feeds a store (a push)
        c = tl.atomic_add(CTL + 1, 1, sem="relaxed", scope="gpu")
        tl.store(CTL + 8 + pid, c)
    if MODE == 3:  # a counter whose result feeds the loop's TMA coordinate
        extra = tl.minimum(tl.atomic_add(CTL + 1, 1, sem="relaxed", scope="gpu"), 0)
    if MODE == 4:  # a wait (inline-asm acquire spin) whose result is unused
        _spin(CTL + 2, 1)
    if MODE == 5:  # the same wait, its result feeding the loop's TMA coordinate
        extra = tl.minimum(_spin(CTL + 2, 1) - 1, 0)
    if MODE == 6:  # a plain store of one vector
        tl.store(CTL + 64 + offs_d, offs_d)
    if MODE == 7:  # a runtime if/else
        if tl.atomic_add(CTL + 1, 1, sem="relaxed", scope="gpu") == 0:
            tl.store(CTL + 3, 1)
        else:
            tl.store(CTL + 4, 1)
    if MODE == 8:  # a bounded while loop (a spin-wait written in triton.language)
        n = 0
        while (tl.atomic_add(CTL + 2, 0, sem="acquire", scope="sys") < 1) & (n < 1000):
            n += 1
    dq = tl.make_tensor_descriptor(Q, shape=[S, D], strides=[D, 1], block_shape=[BM, D])
    dk = tl.make_tensor_descriptor(K, shape=[S, D], strides=[D, 1], block_shape=[BN, D])
    dv = tl.make_tensor_descriptor(V, shape=[S, D], strides=[D, 1], block_shape=[BN, D])
    if MODE == 9:  # Q by a pointer load instead of TMA
        q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])
    else:
        q = dq.load([pid * BM, 0])
    m_i = tl.zeros([BM], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    for j in tl.range(0, tl.cdiv(S, BN), warp_specialize=WS):
        if MODE == 10:  # a descriptor made inside the loop (base chosen per block, e.g. local K/V or a slot)
            dk2 = tl.make_tensor_descriptor(tl.where(j % 2 == 0, K, V), shape=[S, D], strides=[D, 1],
                                            block_shape=[BN, D])
            k = dk2.load([j * BN, 0])
        else:
            k = dk.load([j * BN + extra, 0])
        qk = tl.dot(q, k.T) * sm_scale
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = dv.load([j * BN + extra, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], (acc / l_i[:, None]).to(O.dtype.element_ty))
    if MODE == 11:  # the end of a call: finish counter; the last program writes status and releases a flag
        tl.debug_barrier()
        done = tl.atomic_add(CTL + 5, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.store(CTL + 6, 7)
            tl.atomic_xchg(CTL + 7, 1, sem="release", scope="sys")


MODES = ["none (the plain loop)", "release flag after a barrier, before the loop (result unused)",
         "claim counter feeding a store, before the loop", "counter feeding the TMA coordinate",
         "inline-asm wait, result unused", "inline-asm wait feeding the TMA coordinate",
         "plain store before the loop", "runtime if/else before the loop", "bounded while loop before the loop",
         "Q by pointer load", "descriptor made inside the loop",
         "finish counter + last program's status store and release flag, after the loop"]


def _compile(mode, ws):
    sig = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", CTL="*i32", sm_scale="fp32", S="i32",
               MODE="constexpr", WS="constexpr")
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if sig[n].startswith("*")}
    try:
        ck = triton.compile(ASTSource(fn=_probe, signature=sig, constexprs=dict(MODE=mode, WS=ws), attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    except Exception as e:  # the pass fails loudly on some shapes ("PassManager::run failed")
        return "compile fails: " + ((str(e).strip().splitlines() or [type(e).__name__])[-1])[:60]
    ir = ck.asm["ttgir"]
    counts = dict(xchg=ir.count("atomic_rmw exch"), add=ir.count("atomic_rmw add"), asm=ir.count("elementwise_inline_asm"),
                  store=ir.count("tt.store"))
    return ("WS" if "ttg.warp_specialize" in ir else "no WS") + " " + " ".join(f"{k}={v}" for k, v in counts.items()) + \
        f" scratch={ck.metadata.global_scratch_size}"


def main():
    print(f"Triton {triton.__version__}, sm_90, 4 warps, 2 stages; counts of ops in the TTGIR")
    print("(a consumer-side op appears once per consumer warpgroup; the plain loop's output store appears twice)")
    for mode, what in enumerate(MODES):
        print(f"{mode:2d} {what}\n     plain: {_compile(mode, False)}\n     WS:    {_compile(mode, True)}", flush=True)


if __name__ == "__main__":
    main()
