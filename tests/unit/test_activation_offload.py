"""Checkpointing with the saved block inputs in host RAM: what gets offloaded, and identical results."""
from __future__ import annotations

import contextlib

import pytest
import torch

from headroom.training.memory import activation_offload
from headroom.training.memory.activation_offload import enable_offloaded_checkpointing
from headroom.training.memory.checkpointing import wrap_blocks



def enable_checkpointing(blocks, depth=1):
    return wrap_blocks(blocks, depth)  # the trainer's plain per-block checkpointing


class KwargBlock(torch.nn.Module):
    """Called like ComfyUI's Flux blocks: tensors as keywords, a tuple back, a non-tensor option."""

    def __init__(self, width=8):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, img, txt, vec=None, options=None):
        assert options == {"flag": True}
        return img + torch.tanh(self.a(img + vec)), txt + self.b(txt) * vec


def make_model(seed=0):
    torch.manual_seed(seed)
    blocks = torch.nn.ModuleList([KwargBlock() for _ in range(3)])
    for block in blocks:
        block.a.weight.requires_grad_(False)  # a frozen base linear next to a trainable one
    return blocks


def run(blocks, img, txt, vec):
    for block in blocks:
        img, txt = block(img=img, txt=txt, vec=vec, options={"flag": True})
    return (img.square().mean() + txt.square().mean())


def grads_after_step(enable=None, **options):
    blocks = make_model()
    g = torch.Generator().manual_seed(1)
    img, txt, vec = (torch.randn(2, 5, 8, generator=g) for _ in range(3))
    restore = enable(blocks, **options) if enable else (lambda: None)
    run(blocks, img, txt, vec).backward()
    restore()
    return [p.grad.clone() for p in blocks.parameters() if p.requires_grad], blocks


class RecordingHooks:
    """Offload hooks for tests: copy each packed tensor (a stand-in for the device->host move), count calls."""

    def __init__(self):
        self.packed, self.unpacked = [], 0

    def __call__(self, tensors):
        def pack(tensor):
            self.packed.append(tuple(tensor.shape))
            return tensor.clone()

        def unpack(copy):
            self.unpacked += 1
            return copy

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def test_results_are_bitwise_those_of_plain_checkpointing_and_of_no_checkpointing():
    plain, _ = grads_after_step()
    checkpointed, _ = grads_after_step(enable_checkpointing)
    offloaded, blocks = grads_after_step(enable_offloaded_checkpointing)
    copied, _ = grads_after_step(enable_offloaded_checkpointing, offload_hooks=RecordingHooks())
    for a, b, c, d in zip(plain, checkpointed, offloaded, copied):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert not any("forward" in m.__dict__ for m in blocks.modules())


def test_exactly_the_block_inputs_are_offloaded_keywords_included():
    hooks = RecordingHooks()
    grads_after_step(enable_offloaded_checkpointing, offload_hooks=hooks)
    # per block: img, txt and vec, all passed as keywords by the caller; nothing saved inside the block
    assert hooks.packed == [(2, 5, 8)] * 9
    assert hooks.unpacked == 9  # each brought back once, when backward recomputes the block


def test_depth_two_offloads_the_inputs_of_each_child():
    hooks = RecordingHooks()
    grads_after_step(enable_offloaded_checkpointing, depth=2, offload_hooks=hooks)
    assert hooks.packed == [(2, 5, 8)] * 6  # a and b of each of the 3 blocks, one input each


def test_no_grad_calls_are_not_checkpointed():
    blocks = make_model()
    hooks = RecordingHooks()
    restore = enable_offloaded_checkpointing(blocks, offload_hooks=hooks)
    with torch.no_grad():
        run(blocks, *(torch.randn(2, 5, 8) for _ in range(3)))
    restore()
    assert hooks.packed == []


class InPlaceBlock(torch.nn.Module):
    """Adds to its input in place, as ComfyUI's Flux double blocks do (`img += ...`); `inplace=False` is the
    same arithmetic out of place, which plain autograd can differentiate."""

    def __init__(self, inplace=True):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.inplace = inplace

    def forward(self, x):
        if not self.inplace:
            return x + self.a(x)
        x += self.a(x)
        return x


@pytest.mark.parametrize("enable", [enable_checkpointing, enable_offloaded_checkpointing])
def test_inputs_changed_in_place_are_still_caught_on_cpu(enable):
    # On the CPU nothing is offloaded, so autograd's own in-place check stays active.
    blocks = torch.nn.ModuleList([InPlaceBlock(), InPlaceBlock()])
    restore = enable(blocks)
    x = torch.randn(2, 8, requires_grad=True) * 1.0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out = x
        for block in blocks:
            out = block(out)
        out.sum().backward()
    restore()


def test_save_on_cpu_is_used_for_device_tensors(monkeypatch):
    # The default hooks are torch's own save_on_cpu whenever a block input is not on the CPU.
    chosen = []
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu",
                        lambda pin_memory: chosen.append(pin_memory) or contextlib.nullcontext())
    on_device = torch.empty(1, device="meta")
    activation_offload._default_offload_hooks([torch.zeros(1), on_device])
    activation_offload._default_offload_hooks([torch.zeros(1)])
    assert chosen == [torch.cuda.is_available()]


def inplace_run(inplace=True, offload_hooks=None):
    """Gradients (input's first) and the number of block computations of two InPlaceBlocks called by keyword;
    in-place blocks protected by wrap_blocks and, given offload_hooks, offload-checkpointed on top, as the
    policy composes them."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([InPlaceBlock(inplace) for _ in range(2)])
    calls = []
    for block in blocks:
        block.a.register_forward_pre_hook(lambda *_: calls.append(1))
    restores = [wrap_blocks(blocks, None, inplace_inputs=True)] if inplace else []
    if offload_hooks is not None:
        restores.append(enable_offloaded_checkpointing(blocks, offload_hooks=offload_hooks))
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = x
    for block in blocks:
        out = block(x=out)
    out.square().mean().backward()
    for restore in reversed(restores):
        restore()
    assert not any("forward" in m.__dict__ for m in blocks.modules())
    return [x.grad, *(p.grad for p in blocks.parameters())], len(calls)


@pytest.mark.parametrize("recording", [False, True])
def test_blocks_updating_inputs_in_place_get_the_uncheckpointed_gradients(recording):
    offload_hooks = RecordingHooks() if recording else activation_offload._default_offload_hooks
    reference, reference_calls = inplace_run(inplace=False)
    protected, _ = inplace_run()
    offloaded, calls = inplace_run(offload_hooks=offload_hooks)
    for a, b, c in zip(reference, protected, offloaded, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert (reference_calls, calls) == (2, 4)  # each block recomputed once in backward
    if recording:
        # per block: the reentrant checkpoint's empty anchor and the block input, each brought back once
        assert offload_hooks.packed == [(0,), (2, 5, 8)] * 2
        assert offload_hooks.unpacked == 4
