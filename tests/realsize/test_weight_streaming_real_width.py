"""The ring streamer at Flux.1-dev's width (issue 41): three single-stream blocks of Flux.1-dev's shapes (hidden 3072,
MLP 12288: 141 M bf16 weights a block, linear1's 66 M elements well past 2^24) with a rank-16 LoRA inside, trained two
steps with every block checkpointed, all streamed through a 2-slot ring or with one block resident: the loss, the
LoRA gradients and the updated LoRA weights bit for bit those of the resident run. Tiny tensors hide what large ones
break (offsets in a 283 MB flat slot, dtype views at large offsets)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from headroom.training.memory.checkpointing import wrap_blocks
from headroom.training.memory.weight_streaming import WeightStreamer

pytestmark = pytest.mark.realsize

HIDDEN, MLP, HEADS, RANK, TOKENS = 3072, 12288, 24, 16, 8


class SingleBlock(torch.nn.Module):
    """Flux's single-stream block's weights (modulation, linear1 -> qkv + MLP in, linear2 <- attention + MLP out,
    q/k norms), bf16 storage cast to fp32 per use as ComfyUI's manual cast does on a CPU; a LoRA on linear1."""

    def __init__(self):
        super().__init__()
        self.modulation = torch.nn.Linear(HIDDEN, 3 * HIDDEN, dtype=torch.bfloat16)
        self.linear1 = torch.nn.Linear(HIDDEN, 3 * HIDDEN + MLP, dtype=torch.bfloat16)
        self.linear2 = torch.nn.Linear(HIDDEN + MLP, HIDDEN, dtype=torch.bfloat16)
        self.q_norm = torch.nn.RMSNorm(HIDDEN // HEADS, dtype=torch.bfloat16)
        self.k_norm = torch.nn.RMSNorm(HIDDEN // HEADS, dtype=torch.bfloat16)
        self.requires_grad_(False)
        self.down = torch.nn.Parameter(torch.randn(RANK, HIDDEN) * 0.01)
        self.up = torch.nn.Parameter(torch.randn(3 * HIDDEN + MLP, RANK) * 0.01)

    @staticmethod
    def _linear(layer, x):
        if not hasattr(layer, "weight"):  # a full fine-tune's layer (adapters.FullLayer): its own product
            return layer(x)
        return F.linear(x, layer.weight.float(), layer.bias.float())

    def forward(self, x, vec):
        shift, scale, gate = self._linear(self.modulation, F.silu(vec)).chunk(3, dim=-1)
        h = F.layer_norm(x, (HIDDEN,)) * (1 + scale) + shift
        h = self._linear(self.linear1, h) + F.linear(F.linear(h, self.down), self.up)
        qkv, mlp = h.split([3 * HIDDEN, MLP], dim=-1)
        q, k, v = qkv.view(*qkv.shape[:-1], 3, HEADS, HIDDEN // HEADS).unbind(-3)
        q, k = F.rms_norm(q, (HIDDEN // HEADS,), self.q_norm.weight.float()), F.rms_norm(
            k, (HIDDEN // HEADS,), self.k_norm.weight.float())
        attention = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = self._linear(self.linear2, torch.cat([attention.transpose(1, 2).flatten(2), F.gelu(mlp)], -1))
        return x + gate * out


def _blocks(count=3):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([SingleBlock() for _ in range(count)])
    with torch.no_grad():
        for name, p in blocks.named_parameters():
            if not p.requires_grad:
                p.normal_(0, 0.02)
    return blocks


def _train(blocks, trace, recorded=lambda blocks: [p for p in blocks.parameters() if p.requires_grad], steps=2):
    """AdamW steps, every block checkpointed; `trace` gets each step's loss and the gradients of `recorded`."""
    optimizer = torch.optim.AdamW([p for p in blocks.parameters() if p.requires_grad], lr=1e-3)
    restore = wrap_blocks(blocks, 1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, vec = torch.randn(1, TOKENS, HIDDEN, generator=g), torch.randn(1, 1, HIDDEN, generator=g)
        for block in blocks:
            x = block(x, vec)
        loss = x.square().mean()
        loss.backward()
        trace.append((loss.detach().clone(), [p.grad.clone() for p in recorded(blocks)]))
        optimizer.step()
        optimizer.zero_grad()
    restore()
    return [p.detach().clone() for p in blocks.parameters() if p.requires_grad]


def _assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        if isinstance(x, (list, tuple)):
            _assert_same(x, y)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("resident", [(), (1,)])
def test_the_ring_at_flux_width_is_bitwise_the_resident_run(resident):
    assert 3 * HIDDEN * HIDDEN + MLP * HIDDEN > 2 ** 24
    expected, got = [], []
    weights = _train(_blocks(), expected)
    blocks = _blocks()
    with WeightStreamer(blocks, "cpu", resident=resident, exercise_on_cpu=True, record=True) as streamer:
        streamed = _train(blocks, got)
        per_block = streamer.streamed_bytes()
    _assert_same(expected, got)
    _assert_same(weights, streamed)
    assert max(per_block) > 2 ** 28 and streamer.fallback_fetches == 0  # 283 MB a block
    assert streamer.allocations == 2 + len(resident)  # the slots (and a resident block's buffer), once


def test_blocks_past_the_pin_limit_stream_from_pageable_memory_bitwise_at_flux_width(monkeypatch):
    """A Windows PC pins at most 40 % of its RAM: the blocks past the pin limit stay pageable, and with 3 slots backward
    fetches such a block one block later (weight_streaming._prefetch). Four Flux-width blocks, one pinned (the pinning
    call stood in for on the CPU), three pageable: the loss, the gradients and the weights bit for bit the resident
    run's, every block fetched before it runs."""
    from headroom.training.memory import weight_streaming

    monkeypatch.setattr(WeightStreamer, "_pins_host_copies", lambda self: True)
    monkeypatch.setattr(WeightStreamer, "_copies_from_pageable_hold_the_cpu", lambda self: True)
    monkeypatch.setattr(weight_streaming, "_register", lambda buffer, device: True)
    monkeypatch.setattr(weight_streaming, "_unregister", lambda buffer, device: None)
    expected, got = [], []
    weights = _train(_blocks(4), expected)
    blocks = _blocks(4)
    with WeightStreamer(blocks, "cpu", slots=3, exercise_on_cpu=True, pin_limit_bytes=300 * 2 ** 20,
                        record=True) as streamer:
        streamed = _train(blocks, got)
        registered = [block.registered for block in streamer._blocks]
    _assert_same(expected, got)
    _assert_same(weights, streamed)
    assert registered == [True, False, False, False] and streamer.pageable_blocks == 3
    assert streamer.fallback_fetches == 0 and streamer.allocations == 3
    # step 1: every block in forward, block 0 in backward (1-3 still in the ring at the turn); step 2: block 3 in
    # forward (0-2 still there from backward), block 0 in backward
    assert streamer.fetch_log == [0, 1, 2, 3, 0] + [3, 0]


def test_a_full_fine_tune_at_flux_width_streams_only_what_its_step_reads():
    """Issue 42 at real width: linear1 trained whole (adapters.FullLayer, a bf16 copy of its 66 M weights, past 2^24)
    with its base layer `unread`: a streamed block carries the rest (modulation, linear2, the norms: 151 MB of its
    283), the resident block keeps only that, and the loss, the LoRA gradients and every trained weight after a step
    are bit for bit those of the run without the streamer."""
    from headroom.training.core.adapters import FullLayer

    def full_blocks():
        blocks = _blocks()
        for block in blocks:
            block.linear1 = FullLayer(block.linear1, dtype=torch.bfloat16)
        return blocks

    def lora_only(blocks):  # the LoRA's gradients (the trained copies' are large and checked through the weights)
        return [block.down for block in blocks]

    expected, got = [], []
    reference = full_blocks()
    blocks = copy.deepcopy(reference)  # the same start, without drawing 0.85 G random weights again
    weights = _train(reference, expected, lora_only, steps=1)
    unread = [block.linear1.base_layer for block in blocks]
    host = [(base.weight, base.bias) for base in unread]
    with WeightStreamer(blocks, "cpu", resident=(1,), unread=unread, exercise_on_cpu=True) as streamer:
        trained = _train(blocks, got, lora_only, steps=1)
        slot, kept, streamed = streamer.slot_bytes(), streamer.kept_bytes(), streamer.streamed_blocks()
    _assert_same(expected, got)
    _assert_same(weights, trained)
    assert all(b.weight is w and b.bias is bias for b, (w, bias) in zip(unread, host))
    whole = sum(t.numel() * 2 for t in blocks[0].parameters() if not t.requires_grad)
    read = whole - 2 * (HIDDEN * (3 * HIDDEN + MLP) + 3 * HIDDEN + MLP)  # all but linear1's weight and bias
    assert read <= slot < read + 6 * 256 and kept == read and streamed == {0, 2}
    assert slot < 0.54 * whole
