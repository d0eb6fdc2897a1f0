"""Streamed blocks: the mechanics with CPU->CPU copies (exercise_on_cpu), and identical results."""
from __future__ import annotations

import pytest
import torch

from headroom.training.memory.activation_offload import enable_offloaded_checkpointing
from headroom.training.memory.checkpointing import wrap_blocks
from headroom.training.memory.weight_streaming import WeightStreamer, stream_blocks



def enable_checkpointing(blocks, depth=1):
    return wrap_blocks(blocks, depth)  # the trainer's plain per-block checkpointing


class Block(torch.nn.Module):
    """A frozen linear + norm + frozen buffer, and a trainable low-rank path (what an adapter adds)."""

    def __init__(self, width=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.base = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, 2, bias=False)
        self.up = torch.nn.Linear(2, width, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        for module in (self.norm, self.base):
            module.requires_grad_(False)

    def forward(self, x):
        h = self.norm(x)
        return x + torch.nn.functional.gelu(self.base(h) * self.scale + self.up(self.down(h)))


def make_blocks(seed=0, count=4):
    torch.manual_seed(seed)
    return torch.nn.ModuleList([Block() for _ in range(count)])


def train(blocks, steps=3, checkpointing=None, depth=1):
    optimizer = torch.optim.AdamW([p for p in blocks.parameters() if p.requires_grad], lr=1e-2)
    restore = checkpointing(blocks, depth) if checkpointing else (lambda: None)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(3, 5, 16, generator=g)
        for block in blocks:
            x = block(x)
        x.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    restore()
    return [p.detach().clone() for p in blocks.parameters() if p.requires_grad]


def reference():
    return train(make_blocks())


@pytest.mark.parametrize("checkpointing, depth", [
    (None, 1), (enable_checkpointing, 1), (enable_checkpointing, 2), (enable_offloaded_checkpointing, 1)])
def test_streamed_training_is_bitwise_equal(checkpointing, depth):
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        result = train(blocks, checkpointing=checkpointing, depth=depth)
    for a, b in zip(reference(), result):
        assert torch.equal(a, b)
    assert streamer.max_on_device <= 2


def test_fetch_order_is_one_block_ahead_forward_then_backward():
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        train(blocks, steps=1, checkpointing=enable_checkpointing)
    assert streamer.fetch_log == [0, 1, 2, 3, 3, 2, 1, 0]
    assert streamer.install_log == [("forward", i) for i in range(4)] + [("backward", i) for i in (3, 2, 1, 0)]


def test_blocks_compute_with_device_copies_and_get_their_host_tensors_back():
    blocks = make_blocks()
    host = dict(blocks.named_parameters()) | dict(blocks.named_buffers())
    seen = {}

    def probe(module, args):  # runs inside block 1, after the streamer installed its weights
        block = blocks[1]
        seen.update(weight_is_host=block.base.weight is host["1.base.weight"],
                    weight_equal=torch.equal(block.base.weight, host["1.base.weight"]),
                    buffer_is_host=block.scale is host["1.scale"],
                    trainable_is_host=block.down.weight is host["1.down.weight"])

    handle = blocks[1].base.register_forward_pre_hook(probe)
    streamer = stream_blocks(blocks, "cpu", exercise_on_cpu=True)
    x = torch.randn(2, 16)
    for block in blocks:
        x = block(x)
    streamer.detach()
    handle.remove()
    # a copy of the frozen weight and buffer with equal values; the trainable weight is left alone
    assert seen == {"weight_is_host": False, "weight_equal": True, "buffer_is_host": False, "trainable_is_host": True}
    now = dict(blocks.named_parameters()) | dict(blocks.named_buffers())
    assert all(now[name] is tensor for name, tensor in host.items())


def test_cpu_device_is_a_no_op():
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu") as streamer:
        assert not streamer.enabled and all(not b._forward_pre_hooks for b in blocks)
        result = train(blocks)
    for a, b in zip(reference(), result):
        assert torch.equal(a, b)


def test_attach_twice_is_refused_and_detach_is_idempotent():
    blocks = make_blocks()
    streamer = WeightStreamer(blocks, "cpu", exercise_on_cpu=True).attach()
    assert streamer.streamed_bytes() == [sum(t.numel() * 4 for t in (b.norm.weight, b.norm.bias, b.base.weight,
                                                                        b.base.bias, b.scale)) for b in blocks]
    with pytest.raises(RuntimeError, match="already attached"):
        streamer.attach()
    streamer.detach()
    streamer.detach()
    assert all(not b._forward_pre_hooks and not b._forward_hooks for b in blocks)


def test_inference_without_grad_streams_without_backward_hooks():
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        with torch.no_grad():
            x = torch.randn(2, 16)
            for block in blocks:
                x = block(x)
    assert streamer.install_log == [("forward", i) for i in range(4)]
