"""Checkpointing with the saved block inputs in host RAM: what gets offloaded, and identical results."""
from __future__ import annotations

import contextlib

import pytest
import torch

from headroom.training.memory import activation_offload, pinned_host, trained_weights_on_host
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

    def __init__(self, placeholders=False):
        # torch before 2.14's non-reentrant checkpoint saves an empty placeholder per call beside the inputs
        # (torch 2.11 on the GPU kit's image): not a block input, counted only where a test asks
        self.packed, self.unpacked, self.placeholders = [], 0, placeholders

    def __call__(self, tensors):
        def pack(tensor):
            if tensor.numel() or self.placeholders:
                self.packed.append(tuple(tensor.shape))
            return tensor.clone()

        def unpack(copy):
            if copy.numel() or self.placeholders:
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


def test_the_default_hooks_move_device_tensors_to_host_ram_and_leave_a_cpu_run_alone():
    # The default hooks are the pinned-or-pageable ones whenever a block input is not on the CPU; on the CPU none.
    on_device = torch.empty(1, device="meta")
    assert isinstance(activation_offload._default_offload_hooks([torch.zeros(1), on_device]),
                      torch.autograd.graph.saved_tensors_hooks)
    assert isinstance(activation_offload._default_offload_hooks([torch.zeros(1)]), contextlib.nullcontext)


@pytest.mark.parametrize("pin_refused", [False, True])
def test_a_refused_pin_leaves_the_inputs_in_pageable_ram_and_the_results_unchanged(monkeypatch, caplog, pin_refused):
    """Windows lets a process lock about half of its RAM, and ComfyUI and the weight streamer pin up to 40 % of it:
    a block input the driver refuses to pin waits in pageable host RAM (said once), where torch's own save_on_cpu
    would stop the step with "CUDA error: out of memory". Here the refusal is real: this CUDA build of torch without
    a driver refuses every pin once told CUDA is there. Gradients bitwise those of no checkpointing either way."""
    monkeypatch.setattr(activation_offload, "_refused_said", False)
    monkeypatch.setattr(pinned_host, "_allowed", True)  # not --disable-pinned-memory (a CPU ComfyUI's bridge sets it)
    card = torch.cuda.is_available()
    if pin_refused and card:  # a driver that pins: its refusal played, with the error torch raises
        real_empty = torch.empty

        def refusing(*args, pin_memory=False, **kwargs):
            if pin_memory:
                raise RuntimeError("CUDA error: out of memory")
            return real_empty(*args, **kwargs)

        monkeypatch.setattr(torch, "empty", refusing)
    elif pin_refused:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(RuntimeError):
            torch.empty(1, pin_memory=True)
    packed = []
    real = activation_offload._to_host
    monkeypatch.setattr(activation_offload, "_to_host", lambda t: packed.append(real(t)) or packed[-1])

    def hooks(tensors):
        return activation_offload.pinned_or_pageable_offload()

    plain, _ = grads_after_step()
    with caplog.at_level("WARNING"):
        offloaded, _ = grads_after_step(enable_offloaded_checkpointing, offload_hooks=hooks)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    inputs = [copy for _, copy in packed if copy.numel()]  # not torch 2.11's empty placeholders (RecordingHooks)
    # pinned only where a driver is there and agrees; the CPU's own tensors are never "offloaded" by the default hooks
    assert len(inputs) == 9 and all(copy.device.type == "cpu" and copy.is_pinned() == (card and not pin_refused)
                                    for copy in inputs)
    said = [r.getMessage() for r in caplog.records if "refused to pin" in r.getMessage()]
    assert len(said) == (1 if pin_refused else 0)  # once, though 9 inputs were refused


def test_the_pinned_buffers_torch_caches_are_given_back_when_offloading_ends(monkeypatch):
    """torch keeps freed pinned buffers locked for reuse until the process ends: the offload's restore gives them back
    (pinned_host.release_cached), on a card only, once; the CUDA test above checks torch's own figures."""
    calls = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append(1), raising=False)
    grads_after_step(enable_offloaded_checkpointing)
    assert calls == ([1] if torch.cuda.is_available() else [])  # no card: nothing to give back, nothing called
    calls.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    restore = enable_offloaded_checkpointing(make_model(), offload_hooks=RecordingHooks())
    restore()
    assert calls == [1]

    def pending_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch._C, "_host_emptyCache", pending_error)  # the run's own error on its way out: not hidden
    enable_offloaded_checkpointing(make_model(), offload_hooks=RecordingHooks())()
    monkeypatch.delattr(torch._C, "_host_emptyCache")  # an older torch without the call: skipped
    enable_offloaded_checkpointing(make_model(), offload_hooks=RecordingHooks())()


def test_with_pinning_disabled_no_pin_is_tried(monkeypatch, caplog):
    """ComfyUI's --disable-pinned-memory (mirrored by the bridge around its attach: pinned_host.allowing): every host
    buffer the run makes is pageable, none is even tried, nothing is said; as before after the block."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(activation_offload, "_refused_said", False)
    monkeypatch.setattr(pinned_host, "_allowed", True)
    tried = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: tried.append(k.get("pin_memory")) or real_empty(
        *a, **{key: v for key, v in k.items() if key != "pin_memory"}))
    pinned_host.host_empty(4, torch.float32, pinned=True)
    assert tried == [True]  # allowed: tried
    tried.clear()
    with caplog.at_level("WARNING"), pinned_host.allowing(False):
        device, copy = activation_offload._to_host(torch.ones(3))
        buffer = trained_weights_on_host._Buffer(4, pinned=True).bytes  # the staging buffers' own call
    assert tried == [None, None] and not copy.is_pinned() and not buffer.is_pinned() and torch.equal(copy, torch.ones(3))
    assert not caplog.records and pinned_host.allowed()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: block inputs offloaded to pinned host RAM")
def test_on_a_card_the_block_inputs_wait_in_pinned_host_ram_and_the_results_are_unchanged(monkeypatch):
    """The default hooks on a card: each block input copied to pinned host RAM (asynchronously) and back for its
    recompute; gradients bitwise those of plain checkpointing on the card. After the run the pinned buffers torch
    cached for reuse are given back (still locked they would count against Windows' limit)."""
    packed, cached, pinned = [], [], []
    real = activation_offload._to_host

    def to_host(tensor):
        packed.append(real(tensor))
        if tensor.numel():  # not torch 2.11's empty placeholder (RecordingHooks)
            pinned.append(packed[-1][0].type == "cuda" and packed[-1][1].is_pinned())
        return packed[-1]

    monkeypatch.setattr(activation_offload, "_to_host", to_host)

    def on_card(enable=None):
        blocks = make_model().cuda()
        g = torch.Generator().manual_seed(1)
        img, txt, vec = (torch.randn(2, 5, 8, generator=g).cuda() for _ in range(3))
        restore = enable(blocks) if enable else (lambda: None)
        run(blocks, img, txt, vec).backward()
        torch.cuda.synchronize()
        packed.clear()  # what backward brought back is freed: torch's allocator caches it
        stats = torch.cuda.host_memory_stats()
        cached.append(stats["allocated_bytes.current"] - stats["active_bytes.current"])
        restore()
        stats = torch.cuda.host_memory_stats()
        cached.append(stats["allocated_bytes.current"] - stats["active_bytes.current"])
        return [p.grad.clone() for p in blocks.parameters() if p.requires_grad]

    plain = on_card(enable_checkpointing)
    offloaded = on_card(enable_offloaded_checkpointing)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))
    assert len(pinned) == 9 and all(pinned)
    assert cached[3] == 0  # the offload's buffers, cached by torch after backward, given back by its restore


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
    offload_hooks = RecordingHooks(placeholders=True) if recording else activation_offload._default_offload_hooks
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
