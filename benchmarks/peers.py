"""Every method the ring-attention benchmark times: this project's fused kernel through both
frontends, the reference rings, and the peers and limits it is measured against. ``benchmarks.attention``
runs them; ``benchmarks.harness`` times and checks them and writes their rows (its docstring defines the
timing, the check and the columns).

Methods, each timed in the same process group on the same inputs:

* ``torch_fused`` / ``jax_fused``: ``torch_bridge`` / ``jax_ring`` ``backend="fused"`` (this project);
* ``jax_fused_deferred``: ``jax_fused`` traced without any per-call check (``jax_ring.status.left_out()``: the
  kernel keeps a failure on the heap and ``jax_ring.check_errors()`` after the timed calls raises it; what
  ``RING_ATTENTION_ERRORS=deferred`` meant before the status check): the cost of ``jax_fused``'s per-call check
  (the default, jax_ring.status) is the difference;
* ``jax_fused_call``: ``jax_fused`` traced with ``RING_ATTENTION_ERRORS=call``: a host callback after each call;
* ``torch_ref`` / ``jax_xla``: the reference rings (``backend="torch"``, ``backend="xla"``; float32
  maths); skipped above ``--ref-max-seq`` (slow, and they run out of memory at long sequences);
* ``jax_cudnn_ring``: what a JAX user would write by hand: K/V around the mesh axis with
  ``lax.ppermute``, each block through cuDNN flash attention *with its softmax LSE*
  (``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(return_residual=True)``, float32
  LSE; if that private entry point is missing, ``jax.nn.dot_product_attention(return_residual=True)``,
  whose LSE is rounded to the input dtype, which the ``note`` column then says), blocks merged by LSE.
  Causal uses the zigzag layout and computes only the unmasked halves (as ring-flash-attn does).
  fwd+bwd is jax autodiff of that ring, which is right only if the block's LSE output carries its
  cotangent back; a probe (``check_lse_differentiates``) checks that first, and where it does not (jax's
  cuDNN attention drops the LSE's cotangent) the row's error says so instead of timing wrong gradients;
* ``torch_cp``: ``torch.distributed.tensor.experimental.context_parallel`` over
  ``F.scaled_dot_product_attention`` restricted to the cuDNN backend; causal with its head-tail load
  balancer (the zigzag layout), non-causal with it off; K/V rotation ``--cp-rotate`` (torch's default
  is ``allgather``). In fwd+bwd, dout is one of its sharded buffers, and its local q, k, v shards are the
  leaves (torch's ring backward for cuDNN SDPA);
* ``torch_flex``: ``torch.nn.attention.flex_attention`` compiled with ``torch.compile``, on the whole sequence in
  one process (world size 1 only): no mask, causal, the packed documents (a document mask on the harness's segment
  ids) or the window, all through one ``create_block_mask`` BlockMask built before the timed calls (the first call
  compiles; ``first_call_s`` says how long). fwd+bwd needs a GPU: flex_attention has no backward on a CPU;
* ``torch_flash_attn``: flash-attn's ``flash_attn_func`` (``causal``, ``window_size``), or
  ``flash_attn_varlen_func`` over the packed documents (``cu_seqlens`` of every row's documents), on the whole
  sequence in one process (world size 1 only); where ``import flash_attn`` fails, its rows say so;
* ``torch_cudnn_1gpu`` / ``jax_cudnn_1gpu``: the limit: single-GPU cuDNN attention (torch SDPA cuDNN
  backend; ``jax.nn.dot_product_attention(implementation="cudnn")``) on **one GPU's share** of the ring
  case, i.e. exactly the per-GPU FLOPs of the ring:

    - non-causal: all H heads, the rank's S_local queries against all S_global keys (what a rank of
      the ring computes, without the communication);
    - causal: H/W query heads (and H_kv/W kv heads) of causal attention over all S_global tokens
      (what each GPU of an ideal head-parallel split computes: the same FLOPs, 2*B*H*S_local*S_global*D,
      and the same sequence length; a single cuDNN call cannot express the zigzag rank's mask).

  The ``shape`` column gives the exact shapes of every method's call.

Where torch's cuDNN SDPA refuses ``enable_gqa`` for a GQA case, ``torch_cp`` and ``torch_cudnn_1gpu``
retry once with K/V heads repeated and say so in ``note``.

In the fwd pass torch methods run under no_grad. In fwd+bwd they take the gradients of q, k and v with
``torch.autograd.grad(out, (q, k, v), dout)`` (no ``.grad`` accumulation); JAX methods jit ``jax.vjp`` with
dout as the cotangent, returning (out, dq, dk, dv), inside the same ``shard_map`` as their forward.

A method is a builder, ``build(env, args, case, data, stack, **kw) -> harness.Prepared`` (or
``harness.Unavailable`` saying why it cannot run here), registered in BUILDERS under its name. Adding a
competitor: write its builder here (``_torch_prepared`` and ``_jax_compiled`` / ``_jax_ring`` make a torch or
a JAX method's calls in both passes), add it to BUILDERS, and name it in ``harness.METHODS`` (framework,
kind and a line: the CSV's columns, and the order a case runs it in).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

from benchmarks.harness import (AXIS, GRADS, METHODS, Case, Prepared, Unavailable, attention_flops, call_args,
                                packed_documents, segment_ids)


# --------------------------------------------------------------------------------- the single-GPU share


@dataclasses.dataclass(frozen=True)
class LimitProblem:
    """One GPU's share of a ring case as a single attention call (see the module docstring: the limits)."""

    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    causal: bool
    head_offset: int  # first query head of this rank's share (kv heads start at head_offset // group)

    def flops(self, batch: int, head_dim: int, mode: str = "fwd") -> float:
        return attention_flops(batch, self.q_heads, self.q_len, self.kv_len, head_dim, self.causal, mode)

    def shapes(self, batch: int, head_dim: int) -> str:
        return (f"q[{batch},{self.q_len},{self.q_heads},{head_dim}] kv[{batch},{self.kv_len},{self.kv_heads},"
                f"{head_dim}]{' causal' if self.causal else ''}")


def limit_problem(case: Case, world: int, rank: int = 0) -> LimitProblem:
    s_g = case.seq_global(world)
    if not case.causal:
        return LimitProblem(case.heads, case.kv_heads, case.seq_local, s_g, False, 0)
    if case.heads % world or case.kv_heads % world:
        raise Unavailable(f"the causal single-GPU share takes heads/W of the heads: needs heads ({case.heads}) and "
                          f"kv_heads ({case.kv_heads}) divisible by the world size {world}")
    h = case.heads // world
    return LimitProblem(h, case.kv_heads // world, s_g, s_g, True, rank * h)


def limit_sets(data, prob: LimitProblem):
    """torch (q, k, v) [b, s, h, d] of this rank's single-GPU share of the case's inputs (harness.CaseData)."""
    if not prob.causal:
        return [(q, kg, vg) for (q, _, _), (_, kg, vg) in zip(data.local_sets, data.global_sets)]
    h0, g = prob.head_offset, data.case.heads // data.case.kv_heads
    k0 = h0 // g
    return [(q[:, :, h0:h0 + prob.q_heads].contiguous(), k[:, :, k0:k0 + prob.kv_heads].contiguous(),
             v[:, :, k0:k0 + prob.kv_heads].contiguous()) for q, k, v in data.global_sets]


def limit_douts(data, prob: LimitProblem):
    """The douts of the single-GPU share's output: this rank's queries' (non-causal) or its heads' (causal)."""
    if not prob.causal:
        return list(data.local_douts)
    h0 = prob.head_offset
    return [d[:, :, h0:h0 + prob.q_heads].contiguous() for d in data.global_douts]


# ------------------------------------------------------------------------- the pure-JAX cuDNN ring


def _merge(acc, lse, out_b, lse_b):
    """Merge a block's normalised output into the running one by their LSEs ([b, h, s] float32)."""
    import jax.numpy as jnp

    new = jnp.logaddexp(lse, lse_b)
    w_acc = jnp.swapaxes(jnp.exp(lse - new), 1, 2)[..., None]  # [b, s, h, 1]
    w_b = jnp.swapaxes(jnp.exp(lse_b - new), 1, 2)[..., None]
    return acc * w_acc + out_b.astype(jnp.float32) * w_b, new


def cudnn_ring_attention(q, k, v, *, axis_name, world: int, is_causal: bool, block_attention, scale=None):
    """Ring attention written the way a JAX user would with an attention kernel that returns its LSE.

    Call inside ``shard_map``: q [b, s, h, d], k/v [b, s, hkv, d] are this rank's shard (contiguous layout
    when not causal, zigzag when causal). ``block_attention(q, k, v, is_causal, scale)`` returns
    ``(out, lse)`` with lse float32 [b, h, s]. K/V travel with ``lax.ppermute`` (the next block is sent
    before this one is used, so XLA can overlap them); blocks merge by their LSEs in float32.

    Causal (zigzag: rank r holds chunks r and 2W-1-r): step 0 is plain causal attention on the local
    pair (local order is global order); a block from an earlier rank is seen fully by both local chunks
    through its first chunk only; a block from a later rank is seen fully, and only by the second local
    chunk. So each step after the first computes exactly half a rectangle, with no mask.
    """
    import jax.numpy as jnp
    from jax import lax

    b, s, h, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    rank = lax.axis_index(axis_name)
    perm = [(i, (i + 1) % world) for i in range(world)]
    half = s // 2
    kv = (k, v)
    acc = lse = None
    for t in range(world):
        nxt = lax.ppermute(kv, axis_name, perm) if t + 1 < world else None
        kt, vt = kv
        if t == 0:
            out0, lse = block_attention(q, kt, vt, is_causal, scale)
            acc = out0.astype(jnp.float32)
        elif not is_causal:
            acc, lse = _merge(acc, lse, *block_attention(q, kt, vt, False, scale))
        else:
            def earlier(acc, lse, kt, vt):
                return _merge(acc, lse, *block_attention(q, kt[:, :half], vt[:, :half], False, scale))

            def later(acc, lse, kt, vt):
                a2, l2 = _merge(acc[:, half:], lse[:, :, half:], *block_attention(q[:, half:], kt, vt, False, scale))
                return jnp.concatenate([acc[:, :half], a2], axis=1), jnp.concatenate([lse[:, :, :half], l2], axis=2)

            acc, lse = lax.cond((rank - t) % world < rank, earlier, later, acc, lse, kt, vt)
        kv = nxt
    return acc.astype(q.dtype)


def xla_block_attention(q, k, v, is_causal, scale):
    """Stand-in for cuDNN on CPU: dense float32 attention (jax_ring.reference), same (out, lse) contract."""
    from jax_ring.reference import dense_attention

    return dense_attention(q, k, v, is_causal=is_causal, scale=scale)


def cudnn_block_attention():
    """(block_attention, note): cuDNN flash attention returning (out, float32 lse [b, h, s]), or Unavailable."""
    import inspect

    import jax
    import jax.numpy as jnp

    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        if "return_residual" not in inspect.signature(fa.dot_product_attention).parameters:
            raise ImportError("its dot_product_attention has no return_residual")
    except Exception as e:  # noqa: BLE001 - any failure of a private import means: use the public path
        private_err = f"{type(e).__name__}: {e}"
    else:
        def block(q, k, v, is_causal, scale):
            mask = fa.MaskType.CAUSAL if is_causal else fa.MaskType.NO_MASK
            out, lse = fa.dot_product_attention(q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH",
                                                return_residual=True)
            return out, lse.astype(jnp.float32)

        return block, ("cuDNN fwd per block: jax._src.cudnn.fused_attention_stablehlo.dot_product_attention"
                       "(return_residual=True), float32 LSE merge")
    if "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters:
        def block(q, k, v, is_causal, scale):
            out, res = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn",
                                                    return_residual=True)
            return out, jnp.swapaxes(res, 1, 2).astype(jnp.float32)

        return block, (f"cuDNN per block via jax.nn.dot_product_attention(return_residual=True): its LSE is rounded "
                       f"to the input dtype (private float32 path unavailable: {private_err})")
    raise Unavailable(f"jax {jax.__version__} exposes no cuDNN attention returning the softmax LSE "
                      f"(private path: {private_err}; jax.nn.dot_product_attention has no return_residual)")


# -------------------------------------------------------------------------------------------- methods



def ring_shapes(case: Case) -> str:
    b, s, d = case.batch, case.seq_local, case.head_dim
    mask = "" if case.mask == "none" else f" {case.mask_label}"
    return (f"q[{b},{s},{case.heads},{d}] kv[{b},{s},{case.kv_heads},{d}] {case.layout}"
            f"{' causal' if case.causal else ''}{mask}")


def _comparable(case, convert):
    """``Prepared.local_out``: what the check compares, by name: the output (``out``) in fwd, the gradients
    (``dq``, ``dk``, ``dv``) in fwd+bwd. ``convert(name, value)`` gives it as a torch tensor in the ring's
    local layout, or None where it is not this rank's shard of the ring's (then it is left out)."""

    def local_out(result):
        named = {"out": result} if case.mode == "fwd" else dict(zip(GRADS, result[1:]))
        conv = {name: convert(name, x) for name, x in named.items()}
        return {name: t for name, t in conv.items() if t is not None}

    return local_out


def _share_convert(prob: LimitProblem, to_local):
    """``convert`` of the single-GPU share: non-causal, its output and dq are this rank's (its queries against
    every key); its dK/dV are only this rank's queries' part of the global gradient, and the causal share
    (H/W heads, every token) matches no ring shard: those are not compared."""
    return lambda name, x: to_local(x) if not prob.causal and name in ("out", "dq") else None


def _torch_prepared(env, case, stack, attn, sets, douts, convert, note, shape, finish=None) -> Prepared:
    """A torch method's calls: ``attn(q, k, v)`` on input set i, under no_grad (fwd); in fwd+bwd, the output
    then ``torch.autograd.grad`` of it for q, k, v (leaves sharing the inputs' memory) with the set's dout."""
    torch, n = env.torch, len(sets)
    if case.mode == "fwd":
        stack.enter_context(torch.no_grad())

        def run(i):
            return attn(*sets[i % n])
    else:
        leaves = [tuple(x.detach().requires_grad_() for x in s) for s in sets]
        note = f"{note}; backward by torch.autograd.grad"

        def run(i):
            q, k, v = leaves[i % n]
            out = attn(q, k, v)
            return (out, *torch.autograd.grad(out, (q, k, v), douts[i % n]))

    return Prepared(run, _comparable(case, convert), note, shape=shape, finish=finish)


def _jax_step(case, fn):
    """What one JAX call runs: ``fn(q, k, v[, ids])`` (fwd), or (q, k, v, dout[, ids]) -> (out, dq, dk, dv) by
    ``jax.vjp`` with dout as the output's cotangent (fwd+bwd); ``ids``: a packed case's segment ids (no
    gradient)."""
    if case.mode == "fwd":
        return fn
    import jax

    def step(q, k, v, dout, *ids):
        out, pull = jax.vjp(lambda q, k, v: fn(q, k, v, *ids), q, k, v)
        return (out, *pull(dout))

    return step


def _jax_compiled(env, case, fn, args, convert, note, shape) -> Prepared:
    """``fn`` (already the step) jitted and compiled ahead on ``args[0]``; call i runs it on ``args[i % n]``."""
    jax = env.jax
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args[0]).compile()
    compile_s = time.perf_counter() - t0
    n = len(args)
    if case.mode != "fwd":
        note = f"{note}; backward by jax.vjp"
    return Prepared(lambda i: jax.block_until_ready(compiled(*args[i % n])), _comparable(case, convert), note,
                    compile_s, shape, issue=lambda i: compiled(*args[i % n]))


def _jax_ring(env, case, data, body, note) -> Prepared:
    from jax.sharding import PartitionSpec as P

    jax, torch = env.jax, env.torch
    spec = P(None, AXIS)
    args = data.jax_sharded()
    fn = jax.shard_map(_jax_step(case, body), mesh=env.mesh, in_specs=(spec,) * len(args[0]),
                       out_specs=spec if case.mode == "fwd" else (spec,) * 4)
    return _jax_compiled(env, case, fn, args, lambda name, x: torch.from_dlpack(x.addressable_shards[0].data),
                         note, ring_shapes(case))


_NEEDS_GPU = "the fused kernel needs NVIDIA GPUs and the iris heap (not in --cpu-smoke)"


def fused_ring_steps(env, case, frontend: str) -> int:
    """How many ring steps this rank's fused kernel ran in the last call of ``case`` through ``frontend``
    ("torch" or "jax", whose ring is every process in rank order): read from the flags the kernel left on the
    heap, with the plan of that call's kernel (the backward's in fwd+bwd: the last call there;
    ``ring_core.plans.LaunchPlan.ring_steps_run`` says why the flags show the steps the kernel ran)."""
    from ring_core.runtime import heap
    from ring_core import validate

    b, s = case.batch, case.seq_local
    q, kv = (b, s, case.heads, case.head_dim), (b, s, case.kv_heads, case.head_dim)
    spec = validate.check_attention_args(q, kv, kv, case.dtype, case.dtype, case.dtype, is_causal=case.causal,
                                         scale=None, layout=case.layout, backend="fused", backends=("fused",),
                                         window_size=case.window_size,
                                         segment_ids_shape=(b, s) if case.segmented else None,
                                         segment_ids_dtype="int32" if case.segmented else None)
    h = heap.get()
    p = h.plan(spec, env.world) if case.mode == "fwd" else h.plan_bwd(spec, env.world)
    epoch, flags = h.ring_flags(frontend, tuple(range(env.world)), p.kv_flags)
    return p.ring_steps_run(flags, epoch)


def _masks(case, data) -> dict:
    """The masks of a ring call's keywords (none for an unmasked case)."""
    return dict(window_size=case.window_size, segment_ids=data.local_ids)


def build_torch_ring(env, args, case, data, stack, backend, deterministic=False, **_):
    import torch_bridge

    if backend == "fused" and not env.cuda:
        raise Unavailable(_NEEDS_GPU)

    def attn(q, k, v):
        return torch_bridge.ring_attention(q, k, v, is_causal=case.causal, layout=case.layout, backend=backend,
                                           deterministic=deterministic, **_masks(case, data))

    note = f"backend={backend}" + ("; deterministic=True" if deterministic else "")
    prep = _torch_prepared(env, case, stack, attn, data.local_sets, data.local_douts, lambda name, x: x,
                           note, ring_shapes(case),
                           finish=torch_bridge.check_errors if backend == "fused" else None)
    if backend == "fused":
        prep.ring_steps = functools.partial(fused_ring_steps, env, case, "torch")
    return prep


def build_jax_ring(env, args, case, data, stack, backend, deterministic=False, **_):
    import jax_ring

    if backend == "fused" and not env.cuda:
        raise Unavailable(_NEEDS_GPU)

    def body(q, k, v, *ids):  # ids: a packed case's segment ids, the last argument of every call (jax_sharded)
        return jax_ring.ring_attention(q, k, v, axis_name=AXIS, is_causal=case.causal, layout=case.layout,
                                       backend=backend, window_size=case.window_size,
                                       segment_ids=ids[0] if ids else None, deterministic=deterministic)

    prep = _jax_ring(env, case, data, body, f"backend={backend}" + ("; deterministic=True" if deterministic else ""))
    if backend == "fused":
        prep.ring_steps = functools.partial(fused_ring_steps, env, case, "jax")
    return prep


def build_jax_fused_deferred(env, args, case, data, stack, **_):
    """``jax_fused`` traced (here) with no per-call check, ``jax_ring.status.left_out()``: a kept failure is raised by
    ``jax_ring.check_errors()`` after the timed calls."""
    import jax_ring
    from jax_ring import status

    with status.left_out():
        prep = build_jax_ring(env, args, case, data, stack, backend="fused")
    return dataclasses.replace(prep, note=f"{prep.note}; no per-call check", finish=jax_ring.check_errors)


def build_jax_fused_call(env, args, case, data, stack, **_):
    """``jax_fused`` traced (here) with RING_ATTENTION_ERRORS=call: a host callback after every call."""
    from ring_core.protocol.control import ERRORS_ENV

    old = os.environ.get(ERRORS_ENV)
    os.environ[ERRORS_ENV] = "call"
    try:
        prep = build_jax_ring(env, args, case, data, stack, backend="fused")
    finally:
        if old is None:
            os.environ.pop(ERRORS_ENV, None)
        else:
            os.environ[ERRORS_ENV] = old
    return dataclasses.replace(prep, note=f"{prep.note}; {ERRORS_ENV}=call")


def check_lse_differentiates(env, block, q, k, v):
    """Raise Unavailable unless jax autodiff of ``block`` carries the cotangent of its LSE output. The ring
    merges blocks through their LSEs, so without it ``jax.vjp`` of the ring runs but gives wrong gradients;
    jax's cuDNN attention drops it (its backward rule keeps only the output's cotangent)."""
    jax = env.jax
    scale = 1.0 / math.sqrt(q.shape[-1])
    g = jax.jit(jax.grad(lambda q: block(q, k, v, False, scale)[1].sum()))(q)
    if not bool(jax.numpy.any(g != 0)):
        raise Unavailable("jax autodiff of this ring would give wrong gradients: the gradient of the block "
                          "attention's LSE output is zero (jax's cuDNN attention backward drops the LSE's "
                          "cotangent) and the ring merges blocks through their LSEs; a hand-written ring backward "
                          "(cuDNN backward per block from the final out and LSE) would be needed")


def build_jax_cudnn_ring(env, args, case, data, stack, **_):
    if env.cuda:
        block, note = cudnn_block_attention()
    else:
        block, note = xla_block_attention, "cpu-smoke: blocks by dense XLA attention (jax_ring.reference), not cuDNN"
    if case.mode != "fwd":
        check_lse_differentiates(env, block, *(data.jax_local(x) for x in data.local_sets[0]))
        note = f"{note}; gradients by autodiff through the LSE merge"

    def body(q, k, v):
        return cudnn_ring_attention(q, k, v, axis_name=AXIS, world=env.world, is_causal=case.causal,
                                    block_attention=block)

    return _jax_ring(env, case, data, body, note)


def _repeat_kv(sets, case, dim):
    g = case.heads // case.kv_heads
    return [(q, k.repeat_interleave(g, dim=dim), v.repeat_interleave(g, dim=dim)) for q, k, v in sets]


def _fold_kv(t, case, dim):
    """The gradient of K/V heads repeated by _repeat_kv, summed back to the kv heads."""
    return t.unflatten(dim, (case.kv_heads, case.heads // case.kv_heads)).sum(dim + 1)


def _sdpa_inputs(case, sets, douts, repeat_kv, is_causal) -> tuple:
    """(sets, douts, attn, gqa) for torch SDPA: [b, h, s, d] copies of [b, s, h, d] input sets (K/V heads
    repeated when asked) and douts, and ``attn(q, k, v)``, with ``enable_gqa`` (``gqa``) where the head
    counts differ."""
    import torch.nn.functional as F

    sets = [tuple(x.transpose(1, 2).contiguous() for x in s) for s in sets]
    if repeat_kv:
        sets = _repeat_kv(sets, case, dim=1)
    douts = [d.transpose(1, 2).contiguous() for d in douts]
    gqa = case.heads != case.kv_heads and not repeat_kv
    kw = dict(is_causal=is_causal, **({"enable_gqa": True} if gqa else {}))

    def attn(q, k, v):  # F's attribute looked up at every call: context_parallel replaces it while active
        return F.scaled_dot_product_attention(q, k, v, **kw)

    return sets, douts, attn, gqa


def build_torch_cp(env, args, case, data, stack, repeat_kv=False, **_):
    if not env.cuda:
        raise Unavailable("torch context_parallel dispatches SDPA to its CUDA ring handlers (cuDNN/flash/efficient); "
                          "not in --cpu-smoke")
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = env.cp_mesh()
    set_rotate_method(args.cp_rotate)
    # [b, h, s_global, d], natural order: context_parallel shards them in place (head-tail order when balanced);
    # dout is sharded as the output is.
    sets, douts, attn, gqa = _sdpa_inputs(case, data.global_sets, data.global_douts, repeat_kv, case.causal)
    bufs = [x for s in sets for x in s] + douts
    old_balance = _cp_options.enable_load_balance
    stack.callback(setattr, _cp_options, "enable_load_balance", old_balance)
    _cp_options.enable_load_balance = case.causal  # read on entry: head-tail balancer for causal, none otherwise
    stack.enter_context(context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * len(bufs),
                                         no_restore_buffers=set(bufs)))
    stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION]))

    def convert(name, x):  # this rank's shard, [b, h, s_local, d] in the ring's layout
        return (_fold_kv(x, case, dim=1) if repeat_kv and name in ("dk", "dv") else x).transpose(1, 2)

    note = (f"rotate={args.cp_rotate}, load_balance={'head-tail' if case.causal else 'off'}, SDPA cuDNN"
            f"{', enable_gqa' if gqa else ''}")
    b, s_g, d = case.batch, case.seq_global(env.world), case.head_dim
    hkv = case.heads if repeat_kv else case.kv_heads
    shape = (f"global q[{b},{case.heads},{s_g},{d}] kv[{b},{hkv},{s_g},{d}] sharded by context_parallel "
             f"({'head-tail' if case.causal else 'contiguous'}){' causal' if case.causal else ''}")
    return _torch_prepared(env, case, stack, attn, sets, douts, convert, note, shape)


def build_torch_limit(env, args, case, data, stack, repeat_kv=False, **_):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prob = limit_problem(case, env.world, env.rank)
    sets, douts, attn, gqa = _sdpa_inputs(case, limit_sets(data, prob), limit_douts(data, prob), repeat_kv, prob.causal)
    stack.enter_context(sdpa_kernel([SDPBackend.CUDNN_ATTENTION if env.cuda else SDPBackend.MATH]))
    note = "one GPU's share, SDPA cuDNN" if env.cuda else "cpu-smoke: SDPA math backend, not cuDNN"
    return _torch_prepared(env, case, stack, attn, sets, douts, _share_convert(prob, lambda x: x.transpose(1, 2)),
                           note + (", enable_gqa" if gqa else ""), prob.shapes(case.batch, case.head_dim))


def build_jax_limit(env, args, case, data, stack, **_):
    jax, torch = env.jax, env.torch
    prob = limit_problem(case, env.world, env.rank)
    call = call_args(limit_sets(data, prob), limit_douts(data, prob))
    impl = "cudnn" if env.cuda else "xla"
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=prob.causal, implementation=impl)
    note = "one GPU's share, cuDNN" if env.cuda else "cpu-smoke: implementation='xla', not cuDNN"
    return _jax_compiled(env, case, _jax_step(case, fn), [tuple(data.jax_local(x) for x in a) for a in call],
                         _share_convert(prob, torch.from_dlpack), note, prob.shapes(case.batch, case.head_dim))


# ------------------------------------------------------------------- one-process peers (world size 1)


def _whole_sequence(env, name: str) -> None:
    """A one-process peer runs the whole sequence: at world size 1 this rank's shard is the whole sequence, in
    natural order in either layout (ring_core.layout.layout_permutation of one rank is the identity)."""
    if env.world != 1:
        raise Unavailable(f"{name} runs the whole sequence in one process: world size 1 only")


def _masked_shape(case: Case, q: str, kv: str) -> str:
    mask = "" if case.mask == "none" else f" {case.mask_label}"
    return f"q{q} kv{kv} one process{' causal' if case.causal else ''}{mask}"


def flex_mask_mod(case: Case, ids=None):
    """The case's mask as a flex_attention ``mask_mod(b, h, q_idx, kv_idx)`` (None: nothing is masked): causal,
    the window (flash-attn's (left, right), -1 unbounded) and documents (``ids``: segment ids [batch, S], the
    harness's ``segment_ids``), as ring_core.masks.allowed has them."""
    from ring_core.validate import check_window

    left, right = check_window(case.window_size)
    parts = []
    if case.causal:
        parts.append(lambda b, h, q, k: q >= k)
    if left >= 0:
        parts.append(lambda b, h, q, k: q - k <= left)
    if right >= 0 and not case.causal:
        parts.append(lambda b, h, q, k: k - q <= right)
    if ids is not None:
        parts.append(lambda b, h, q, k: (ids[b, q] == ids[b, k]) & (ids[b, q] >= 0))
    if not parts:
        return None

    def mask_mod(b, h, q_idx, kv_idx):
        m = parts[0](b, h, q_idx, kv_idx)
        for part in parts[1:]:
            m = m & part(b, h, q_idx, kv_idx)
        return m

    return mask_mod


def build_torch_flex(env, args, case, data, stack, **_):
    """torch's ``flex_attention`` compiled with ``torch.compile`` (as its documentation says), on the whole
    sequence: dense, causal, packed documents (the harness's segment ids) and the window, through one BlockMask."""
    torch = env.torch
    _whole_sequence(env, "torch_flex")
    if not env.cuda and case.mode != "fwd":
        raise Unavailable("flex_attention has no backward on a CPU (torch raises NotImplementedError); "
                          "fwd only in --cpu-smoke")
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as e:
        raise Unavailable(f"torch {torch.__version__} has no flex_attention ({e})") from None
    b, s, d = case.batch, case.seq_local, case.head_dim
    ids = segment_ids(case, 1)
    ids = None if ids is None else torch.as_tensor(ids, device=env.device)
    mask_mod = flex_mask_mod(case, ids)
    # Built once, here, outside the timed calls (as a training step builds it once for all its layers): the timed
    # calls are flex_attention's alone. Its batch axis only where the documents differ from row to row.
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, b if ids is not None else None, None, s, s,
                                                                 device=env.device)
    # A fresh compile for each case: torch.compile recompiles for every new shape and mask up to its recompile limit,
    # past which it would run flex_attention eagerly (slowly) without saying so in the row.
    torch._dynamo.reset()
    flex = torch.compile(flex_attention, dynamic=False)
    gqa = case.heads != case.kv_heads
    sets = [tuple(x.transpose(1, 2).contiguous() for x in st) for st in data.local_sets]  # [b, h, s, d]
    douts = [x.transpose(1, 2).contiguous() for x in data.local_douts]

    def attn(q, k, v):
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    note = (f"torch.compile(flex_attention){', enable_gqa' if gqa else ''}"
            f"{'' if block_mask is None else ', block mask built before timing'}"
            f"{'' if env.cuda else '; cpu-smoke: compiled for the CPU'}")
    shape = _masked_shape(case, f"[{b},{case.heads},{s},{d}]", f"[{b},{case.kv_heads},{s},{d}]")
    return _torch_prepared(env, case, stack, attn, sets, douts, lambda name, x: x.transpose(1, 2), note, shape)


def varlen_bounds(case: Case) -> tuple:
    """(cu_seqlens, the longest document) of a packed case's batch as flash-attn's varlen functions take them: every
    row's documents (``packed_documents``) back to back, row r's bounds shifted by r * S, int32."""
    import numpy as np

    docs = packed_documents(case, 1)
    s = case.seq_local
    bounds = np.concatenate([docs[0]] + [row[1:] + r * s for r, row in enumerate(docs[1:], 1)]).astype(np.int32)
    return bounds, int(max(np.diff(row).max() for row in docs))


def build_torch_flash_attn(env, args, case, data, stack, **_):
    """flash-attn's own kernels on the whole sequence: ``flash_attn_func`` (dense, causal, the window as its
    ``window_size``), or ``flash_attn_varlen_func`` over the packed documents (each batch row's documents as
    sequences of their own: ``cu_seqlens``)."""
    torch = env.torch
    _whole_sequence(env, "torch_flash_attn")
    if not env.cuda:
        raise Unavailable("flash-attn runs on NVIDIA GPUs only (not in --cpu-smoke)")
    try:
        from flash_attn import flash_attn_func, flash_attn_varlen_func
    except ImportError as e:
        raise Unavailable(f"flash_attn is not importable here ({type(e).__name__}: {e})") from None
    b, s, d, h, hkv = case.batch, case.seq_local, case.head_dim, case.heads, case.kv_heads
    if case.segmented:
        bounds, longest = varlen_bounds(case)
        cu = torch.as_tensor(bounds, device=env.device)

        def attn(q, k, v):
            out = flash_attn_varlen_func(q.reshape(b * s, h, d), k.reshape(b * s, hkv, d), v.reshape(b * s, hkv, d),
                                         cu, cu, longest, longest, causal=case.causal)
            return out.view(b, s, h, d)

        note = f"flash_attn_varlen_func over {len(bounds) - 1} documents"
    else:
        window = case.window_size or (-1, -1)

        def attn(q, k, v):
            return flash_attn_func(q, k, v, causal=case.causal, window_size=window)

        note = "flash_attn_func" + (f", window_size={window}" if case.window_size else "")
    shape = _masked_shape(case, f"[{b},{s},{h},{d}]", f"[{b},{s},{hkv},{d}]")
    return _torch_prepared(env, case, stack, attn, data.local_sets, data.local_douts, lambda name, x: x, note, shape)


BUILDERS = {  # every method of harness.METHODS, under its name there
    "torch_fused": functools.partial(build_torch_ring, backend="fused"),
    "jax_fused": functools.partial(build_jax_ring, backend="fused"),
    "jax_fused_deferred": build_jax_fused_deferred,
    "jax_fused_call": build_jax_fused_call,
    "torch_fused_det": functools.partial(build_torch_ring, backend="fused", deterministic=True),
    "jax_fused_det": functools.partial(build_jax_ring, backend="fused", deterministic=True),
    "torch_ref": functools.partial(build_torch_ring, backend="torch"),
    "jax_xla": functools.partial(build_jax_ring, backend="xla"),
    "jax_cudnn_ring": build_jax_cudnn_ring,
    "torch_cp": build_torch_cp,
    "torch_flex": build_torch_flex,
    "torch_flash_attn": build_torch_flash_attn,
    "torch_cudnn_1gpu": build_torch_limit,
    "jax_cudnn_1gpu": build_jax_limit,
}
if BUILDERS.keys() != METHODS.keys():  # a method named without a builder, or a builder without a name
    raise RuntimeError(f"peers.BUILDERS and harness.METHODS differ in {sorted(BUILDERS.keys() ^ METHODS.keys())}")
