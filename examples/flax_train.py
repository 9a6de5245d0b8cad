"""Train a small Flax (Linen) causal language model with sequence-parallel ring attention, and check it against
the same model trained on one device.

GPUs (one process per GPU, fused forward and backward kernels):
    python -m jax_ring.launch --nproc-per-node 2 examples/flax_train.py
    python -m jax_ring.launch --nproc-per-node 4 examples/flax_train.py --dp 2     # data x sequence parallel
CPU (2 simulated devices per data-parallel group, reference ring):
    python examples/flax_train.py --cpu [--dp 2]

The devices form a ("dp", "sp") mesh. Every device holds the same weights; each "dp" index takes its slice of
the batch, and ring attention runs over "sp", each device holding its zigzag shard of every sequence (balanced
causal work); the next-token targets are taken on the whole sequence before it is sharded, so the tokens at
the edges of a shard keep their true successors. Inside ``jax.shard_map`` (under JAX's defaults, check_vma
on) the loss is the ``psum`` over both axes of every device's tokens' cross-entropy (divided by the global
token count), and ``jax.value_and_grad`` of it gives the gradient of the whole batch: the weights are the
same on every device, so JAX sums their per-device gradients itself, and ring attention's backward returns
to every device the gradients of its K/V from all devices' queries. The same model, with dense causal
attention on the full sequences, is trained on one device from the same initial weights and data; the two
loss curves must agree (float32 throughout). The gradient sum is an XLA collective across the processes:
it needs a GPU per process (NCCL; ranks sharing one GPU cannot run it, see the README).

The model is written with ``flax.linen``, which imports on every jax this project supports (flax 0.12's
``nnx`` does not import on jax 0.11).
"""

import argparse
import os
from typing import Callable

import numpy as np

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--cpu", action="store_true", help="2 x dp simulated CPU devices and backend='xla'")
p.add_argument("--dp", type=int, default=1, help="data-parallel groups (the devices are dp x sp)")
p.add_argument("--seq", type=int, default=1024, help="global sequence length")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--batch", type=int, default=2)
args = p.parse_args()
if args.cpu:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={2 * args.dp}")

import jax_ring  # noqa: E402

if not args.cpu:
    jax_ring.initialize()  # torch.distributed + jax.distributed + iris heap; before JAX touches the GPU

import jax  # noqa: E402
import optax  # noqa: E402
import flax.linen as nn  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

# Plain float32 matmuls in XLA too (GPUs would otherwise use TF32), as the fused kernel does for float32.
jax.config.update("jax_default_matmul_precision", "highest")

VOCAB, D_MODEL, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 128, 4, 2, 32, 2
backend = "xla" if args.cpu else "fused"
mesh = Mesh(np.array(jax.devices()).reshape(args.dp, -1), ("dp", "sp"))
W = mesh.shape["sp"]


def ring_attention(q, k, v):
    return jax_ring.ring_attention(q, k, v, axis_name="sp", is_causal=True, layout="zigzag", backend=backend)


def dense_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)  # GQA: k/v heads shared by query groups


class Block(nn.Module):
    attention: Callable

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        h = nn.LayerNorm()(x)
        q = nn.Dense(HEADS * HEAD_DIM, use_bias=False)(h).reshape(b, s, HEADS, HEAD_DIM)
        kv = nn.Dense(2 * KV_HEADS * HEAD_DIM, use_bias=False)(h).reshape(b, s, 2, KV_HEADS, HEAD_DIM)
        x = x + nn.Dense(D_MODEL, use_bias=False)(self.attention(q, kv[:, :, 0], kv[:, :, 1]).reshape(b, s, -1))
        return x + nn.Dense(D_MODEL)(jax.nn.gelu(nn.Dense(4 * D_MODEL)(nn.LayerNorm()(x))))


class TinyLM(nn.Module):
    """No positional embedding: the causal mask alone orders the tokens (enough for this check)."""
    attention: Callable

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D_MODEL)(tokens)
        for _ in range(LAYERS):
            x = Block(self.attention)(x)
        return nn.Dense(VOCAB)(x)


# The same seed: the same weights in every process (the attention function holds no parameters).
init_params = jax.tree.map(np.asarray, TinyLM(dense_attention).init(jax.random.key(0), np.zeros((1, 8), np.int32)))
tx = optax.adamw(3e-3)


def token_loss(params, tokens, targets, attention, n_tokens):
    """The sum of these tokens' next-token cross-entropy / n_tokens."""
    logits = TinyLM(attention).apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).sum() / n_tokens


def dense_loss_and_grads(params, tokens, targets):
    return jax.value_and_grad(token_loss)(params, tokens, targets, dense_attention, targets.size)


def sequence_parallel_loss_and_grads(params, tokens, targets):
    """Global arrays in: the batch over "dp", the zigzag-ordered sequence over "sp"; the loss of the whole
    batch (every device's tokens, summed over both axes) and its gradient."""
    n_tokens = targets.size

    def local(params, tokens, targets):
        loss = lambda p: jax.lax.psum(token_loss(p, tokens, targets, ring_attention, n_tokens), ("dp", "sp"))  # noqa
        return jax.value_and_grad(loss)(params)

    data = P("dp", "sp")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), data, data), out_specs=P())(params, tokens, targets)


def train_step(compute_loss_and_grads):
    @jax.jit
    def step(params, opt_state, tokens, targets):
        loss, grads = compute_loss_and_grads(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def on_mesh(x, spec):
    """A global array over the mesh from the same host value in every process."""
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def zigzag_shards(x):
    """A global [batch, seq] host array, reordered into the zigzag layout, the batch sharded over "dp" and the
    sequence over "sp"."""
    return on_mesh(jax_ring.to_layout(x, "zigzag", W), P("dp", "sp"))


# Learnable data: each sequence follows t -> (5 t + 3) mod VOCAB from a random start.
data = np.empty((args.steps, args.batch, args.seq + 1), np.int32)
data[..., 0] = np.random.default_rng(0).integers(0, VOCAB, (args.steps, args.batch))
for t in range(args.seq):
    data[..., t + 1] = (5 * data[..., t] + 3) % VOCAB

ring_step = train_step(sequence_parallel_loss_and_grads)
dense_step = train_step(dense_loss_and_grads)
ring_params = jax.tree.map(lambda x: on_mesh(x, P()), init_params)
dense_params = jax.device_put(init_params, jax.local_devices()[0])
ring_opt, dense_opt = jax.jit(tx.init)(ring_params), jax.jit(tx.init)(dense_params)

losses = []
for step in range(args.steps):
    inputs, targets = data[step, :, :-1], data[step, :, 1:]  # targets from the global sequence
    ring_params, ring_opt, ring_loss = ring_step(ring_params, ring_opt, zigzag_shards(inputs),
                                                 zigzag_shards(targets))
    dense_params, dense_opt, dense_loss = dense_step(dense_params, dense_opt, inputs, targets)
    losses.append((float(ring_loss), float(dense_loss)))
    if jax.process_index() == 0:
        print(f"step {step}: loss ring ({args.dp} x {W} devices, backend={backend}) {losses[-1][0]:.6f}, "
              f"one device {losses[-1][1]:.6f}", flush=True)

worst = max(abs(a - b) for a, b in losses)
if jax.process_index() == 0:
    print(f"max |loss difference| over {args.steps} steps: {worst:.2e}; loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}")
# float32: the two attentions round differently (online softmax over ring steps vs one dense softmax), which
# moves the loss by ~1e-6 (5e-7 over the 8 default steps on CPU). Wrong training moves it far past 1e-3
# (on CPU, seq 256, 4 steps: gradients not summed over devices 0.8; targets taken per shard 0.1).
assert worst < 1e-3, f"ring and single-device training diverged ({worst})"
assert losses[-1][1] < losses[0][1], "the loss did not decrease"
if not args.cpu:
    jax_ring.shutdown()
