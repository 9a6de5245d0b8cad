"""torch_bridge.hf and torch_bridge.batch: transformers models (Llama, Mistral) with every attention layer
through the ring, against the same model on one device with transformers' own sdpa attention.

Multi-rank cases run on the session's gloo workers (tests/conftest.py, backend="torch"); worker functions are
top level so that they pickle. Weights are random (models built from a config; nothing is downloaded).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed: pip install -e '.[test]'")

import torch_bridge  # noqa: E402
from ring_core import testing  # noqa: E402

VOCAB = 97


def _llama(dtype=torch.float64, heads=4, kv_heads=2, head_dim=16, layers=2, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=12 * heads, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256, use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def _mistral(dtype=torch.float64, window=5, seed=0):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=5, num_key_value_heads=1, head_dim=8, sliding_window=window,
                        max_position_embeddings=256, use_cache=False)
    torch.manual_seed(seed)
    return MistralForCausalLM(cfg).to(dtype)


def _qwen2(dtype=torch.float64, seed=0):
    """Qwen2 with a sliding window on its second layer only (layer_types from max_window_layers)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=40, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=5, num_key_value_heads=1, use_sliding_window=True, sliding_window=5,
                      max_window_layers=1, max_position_embeddings=256, use_cache=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(cfg).to(dtype)


def _packed_batch(seed, batch, seq, lens=None):
    """A packed batch as transformers' DataCollatorWithFlattening makes it: position_ids restart at each
    sequence, the first label of each sequence is -100."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    seg = torch.from_numpy(testing.random_segment_ids(seed, batch, seq, padding=False)).long()
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    idx = torch.arange(seq).expand(batch, seq)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    position_ids = idx - first
    labels = torch.where(starts, torch.full_like(ids, -100), ids)
    return {"input_ids": ids, "position_ids": position_ids, "labels": labels}


def _one_device_loss(model, batch):
    """The causal-LM loss on one device with transformers' sdpa attention (packed: its mask from position_ids),
    as transformers computes it (labels shifted by one, mean over those not -100), in the logits' precision."""
    model.set_attn_implementation("sdpa")
    kw = {k: v for k, v in batch.items() if v is not None and k != "labels"}
    logits = model(**kw).logits
    labels = batch["labels"]
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)


# ---------------------------------------------------------------------------------------- worker functions
def _train_worker(rank, world, layout, batches, steps, lr):
    torch.set_num_threads(1)
    name = torch_bridge.hf.register("ring_attention_test", layout=layout, backend="torch")
    ring, dense = _llama(), _llama()
    ring.set_attn_implementation(name)
    opt_r = torch.optim.AdamW(ring.parameters(), lr=lr)
    opt_d = torch.optim.AdamW(dense.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        batch = batches[step % len(batches)]
        local = torch_bridge.shard_batch(batch, layout=layout)
        labels = local.pop("shift_labels")
        loss = torch_bridge.cross_entropy(ring(**local).logits, labels)
        opt_r.zero_grad()
        loss.backward()
        torch_bridge.reduce_gradients(ring.parameters())
        opt_r.step()
        ref = _one_device_loss(dense, batch)
        opt_d.zero_grad()
        ref.backward()
        opt_d.step()
        losses.append((loss.item(), ref.item()))
    drift = max((a - b).abs().max().item() for a, b in zip(ring.parameters(), dense.parameters()))
    return losses, drift


def _logits_worker(rank, world, model_fn, layout, batch):
    torch.set_num_threads(1)
    name = torch_bridge.hf.register("ring_attention_test", layout=layout, backend="torch")
    model = model_fn()
    model.set_attn_implementation(name)
    local = torch_bridge.shard_batch(batch, layout=layout)
    local.pop("shift_labels", None)
    logits = torch_bridge.gather(model(**local).logits, layout=layout)
    return logits.numpy()


def _segments_from_positions_worker(rank, world, layout, batch):
    """The ring's segment ids from position_ids alone (no segment_ids given) equal shard_batch's."""
    torch.set_num_threads(1)
    name = torch_bridge.hf.register("ring_attention_test", layout=layout, backend="torch")
    model = _llama()
    model.set_attn_implementation(name)
    local = torch_bridge.shard_batch(batch, layout=layout)
    local.pop("shift_labels", None)
    with_ids = model(**local).logits
    local.pop("segment_ids")
    without = model(**local).logits
    return (with_ids - without).abs().max().item()


def _mesh_worker(rank, world, batch):
    """group= as a DeviceMesh and as (mesh, dim name) everywhere a group is taken."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "sp"))
    name = torch_bridge.hf.register("ring_attention_mesh", group=(mesh, "sp"), layout="zigzag", backend="torch")
    model = _llama()
    model.set_attn_implementation(name)
    local = torch_bridge.shard_batch(batch, group=mesh["sp"], layout="zigzag")
    labels = local.pop("shift_labels")
    loss = torch_bridge.cross_entropy(model(**local).logits, labels, group=(mesh, "sp"))
    return loss.item()


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_llama_training_matches_one_device(torch_group, layout):
    """A tiny Llama (GQA, packed batches) trained 3 steps on 2 ranks: the loss of every step and the final
    weights equal one device's (float64: the float64 slack of the tolerance table)."""
    batches = [_packed_batch(s, 2, 24) for s in range(2)]
    results = torch_group(2).run(_train_worker, layout, batches, 3, 1e-2)
    tol = testing.TOLERANCES["float64"]["grad"]
    for losses, drift in results:
        for ring, ref in losses:
            assert abs(ring - ref) <= tol * max(1.0, abs(ref)), losses
        assert drift <= 1e-8, drift
    assert results[0][0] == results[1][0]  # the same loss on every rank
    assert losses[-1][1] < losses[0][1], "the loss did not decrease"


@pytest.mark.parametrize("world, model_fn", [(2, _mistral), (3, _mistral), (2, _qwen2)],
                         ids=["mistral-W2", "mistral-W3", "qwen2-W2"])
def test_sliding_window_odd_heads(torch_group, world, model_fn):
    """Sliding windows of 5 tokens (Mistral: every layer; Qwen2: its second layer) with 5 query heads on 1 KV
    head: logits over the ring gathered back in natural order equal one device's sdpa logits."""
    seq = 2 * world * 5
    batch = {"input_ids": torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))}
    model = model_fn()
    model.set_attn_implementation("sdpa")
    want = model(**batch).logits.detach().numpy()
    for got in torch_group(world).run(_logits_worker, model_fn, "zigzag", batch):
        np.testing.assert_allclose(got, want, rtol=0, atol=testing.TOLERANCES["float64"]["out"] * 100)


def test_padding_mask_becomes_segment_ids(torch_group):
    """Right padding given as attention_mask: shard_batch turns it into segment ids; the loss equals one
    device's with the same attention_mask (labels -100 on the padding)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0
    mask[1, 14:] = 0
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    results = torch_group(2).run(_train_worker, "zigzag", [batch], 1, 1e-2)
    for losses, _ in results:
        (ring, ref), = losses
        assert abs(ring - ref) <= testing.TOLERANCES["float64"]["grad"], losses


def test_segments_from_position_ids(torch_group):
    """Packed position_ids without segment_ids: the ring derives the same segments on every rank."""
    batch = _packed_batch(5, 2, 16)
    batch.pop("labels")
    for diff in torch_group(2).run(_segments_from_positions_worker, "zigzag", batch):
        assert diff == 0.0


def test_device_mesh_group(torch_group):
    batch = _packed_batch(7, 1, 16)
    want = _one_device_loss(_llama(), batch).item()
    for got in torch_group(2).run(_mesh_worker, batch):
        assert abs(got - want) <= testing.TOLERANCES["float64"]["grad"]


def test_one_process_matches_sdpa_odd_shapes():
    """World size 1 (no process group): 7 query heads on 1 KV head, head_dim 20, 13 tokens."""
    name = torch_bridge.hf.register("ring_attention_test", layout="contiguous")
    model = _llama(heads=7, kv_heads=1, head_dim=20)
    ids = torch.randint(0, VOCAB, (3, 13), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    want = model(input_ids=ids).logits
    model.set_attn_implementation(name)
    got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_unsupported_raise():
    name = torch_bridge.hf.register("ring_attention_test", layout="contiguous")
    model = _llama()
    model.set_attn_implementation(name)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match="segment ids"):
        model(input_ids=ids, attention_mask=torch.tensor([[1] * 6 + [0] * 2]))
    with pytest.raises(ValueError, match="4-D mask"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool))
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(ValueError, match="attention_dropout"):
        model(input_ids=ids)
    model.eval()
    model(input_ids=ids)  # dropout is 0 in eval


def test_shard_batch_and_gather_one_process():
    batch = _packed_batch(4, 2, 12)
    local = torch_bridge.shard_batch(batch, layout="zigzag")
    assert torch.equal(local["input_ids"], batch["input_ids"])
    assert torch.equal(local["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert (local["shift_labels"][:, -1] == -100).all()
    assert local["segment_ids"].dtype == torch.int32
    assert torch.equal(torch_bridge.gather(local["input_ids"], layout="zigzag"), batch["input_ids"])
    assert torch_bridge.shard_batch({"input_ids": batch["input_ids"]})["segment_ids"] is None
    flattened = dict(batch, cu_seq_lens_q=torch.tensor([0, 5, 12]), max_length_q=7)  # DataCollatorWithFlattening
    local = torch_bridge.shard_batch(flattened)
    assert "cu_seq_lens_q" not in local and "max_length_q" not in local
    with pytest.raises(ValueError, match="attention_mask must be 2-D"):
        torch_bridge.shard_batch({"input_ids": batch["input_ids"], "attention_mask": torch.ones(2, 1, 12, 12)})
    with pytest.raises(TypeError, match="mapping"):
        torch_bridge.shard_batch(batch["input_ids"])


def test_from_pretrained_and_from_config(tmp_path):
    """attn_implementation=name in from_config and from_pretrained (a local save: nothing is downloaded)."""
    from transformers import AutoModelForCausalLM

    name = torch_bridge.hf.register()
    assert name == "ring_attention"
    model = _llama()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name, dtype=torch.float64)
    built = AutoModelForCausalLM.from_config(model.config, attn_implementation=name).to(torch.float64)
    assert loaded.config._attn_implementation == built.config._attn_implementation == name
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=1e-10)
