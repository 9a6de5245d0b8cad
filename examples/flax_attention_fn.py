"""Train a small Flax (Linen) language model whose ``nn.MultiHeadDotProductAttention`` runs the ring through
``attention_fn``, on global arrays under plain ``jax.jit`` (no shard_map in user code), and check it step by step
against the same model trained on one device with flax's own attention and a causal mask.

GPUs (one process per GPU, fused kernels):   python -m jax_ring.launch --nproc-per-node 2 examples/flax_attention_fn.py
CPU (2 simulated devices, the xla ring):     python examples/flax_attention_fn.py --cpu

All the user writes for the ring is the attention_fn, the sharding of the inputs' sequence axis and the mesh
the step runs under:

    attn = nn.MultiHeadDotProductAttention(num_heads=4, attention_fn=jax_ring.flax.ring_attention_fn(is_causal=True))
    tokens = jax.device_put(tokens, NamedSharding(mesh, P(None, "sp")))     # the axis comes from here
    with jax.set_mesh(mesh):                                                # the devices from here
        params, state, loss = step(params, state, tokens, labels)

(Under jax.jit an input's sharding carries an abstract mesh, without devices; the fused kernels need to know
which process holds which position of the ring, so they take the mesh set with jax.set_mesh, or mesh=.)

Prints the loss of every step for the ring and for one device; exits non-zero if they differ by more than
--tol (float32; matmuls at "highest" precision) or if the loss does not decrease. The gradient sum over the
devices is an XLA collective: on GPUs it needs a GPU per process.
"""

import argparse
import os
import sys

import numpy as np

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--cpu", action="store_true", help="2 simulated CPU devices and backend='xla'")
p.add_argument("--seq", type=int, default=1024, help="global sequence length")
p.add_argument("--batch", type=int, default=2)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--tol", type=float, default=1e-3, help="largest allowed |ring loss - one-device loss|")
args = p.parse_args()
if args.cpu:
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax_ring  # noqa: E402

if not args.cpu:
    jax_ring.initialize()  # torch.distributed + jax.distributed + the heap; before JAX touches the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import flax.linen as nn  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # float32 matmuls as the fused kernel computes them

VOCAB, D_MODEL, HEADS, LAYERS = 256, 128, 4, 2
backend = "xla" if args.cpu else "fused"
mesh = Mesh(np.array(jax.devices()), ("sp",))
W = mesh.shape["sp"]


class LM(nn.Module):
    ring: bool

    @nn.compact
    def __call__(self, tokens):
        kw = dict(attention_fn=jax_ring.flax.ring_attention_fn(is_causal=True, backend=backend)) if self.ring else {}
        mask = None if self.ring else nn.make_causal_mask(tokens)
        x = nn.Embed(VOCAB, D_MODEL)(tokens)
        for _ in range(LAYERS):
            x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS, **kw)(nn.LayerNorm()(x), mask=mask)
            x = x + nn.Dense(D_MODEL)(jax.nn.gelu(nn.Dense(4 * D_MODEL)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(x)


def global_array(x, spec):
    """A host array (the same on every process) as a global array sharded by ``spec`` over the mesh."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda idx: x[idx])


def make_step(model):
    opt = optax.adam(3e-3)

    def loss_fn(params, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return opt, step


# Learnable data: each sequence follows t -> (5 t + 3) mod VOCAB from a random start.
rng = np.random.default_rng(0)
data = rng.integers(0, VOCAB, (args.steps, args.batch, 1))
for _ in range(args.seq):
    data = np.concatenate([data, (5 * data[..., -1:] + 3) % VOCAB], axis=-1)

ring_model, dense_model = LM(ring=True), LM(ring=False)
params = jax.jit(dense_model.init)(jax.random.key(0), jnp.asarray(data[0, :, :-1]))
opt, ring_step = make_step(ring_model)
_, dense_step = make_step(dense_model)
ring_params = jax.tree.map(lambda a: global_array(a, P()), params)  # replicated over the mesh
ring_state = jax.tree.map(lambda a: global_array(a, P()), opt.init(params))
dense_params, dense_state = params, opt.init(params)

losses = []
for step in range(args.steps):
    x, y = data[step, :, :-1], data[step, :, 1:]
    with jax.set_mesh(mesh):
        ring_params, ring_state, loss = ring_step(ring_params, ring_state, global_array(x, P(None, "sp")),
                                                  global_array(y, P(None, "sp")))
    dense_params, dense_state, ref = dense_step(dense_params, dense_state, jnp.asarray(x), jnp.asarray(y))
    losses.append((float(loss), float(ref)))
    if jax.process_index() == 0:
        print(f"step {step}: loss ring ({W} devices, backend={backend}) {losses[-1][0]:.6f}, "
              f"one device {losses[-1][1]:.6f}", flush=True)

worst = max(abs(a - b) for a, b in losses)
ok = worst <= args.tol and losses[-1][1] < losses[0][1]
if jax.process_index() == 0:
    print(f"max |loss difference| over {args.steps} steps: {worst:.2e} (tolerance {args.tol:g}); "
          f"loss {losses[0][1]:.3f} -> {losses[-1][1]:.3f}", flush=True)
if not args.cpu:
    jax_ring.shutdown()
if not ok:
    print("FAILED: the ring's losses differ from one device's beyond the tolerance, or the loss did not decrease",
          file=sys.stderr)
    sys.exit(1)
