"""Streamed blocks through the ring of device slots: the mechanics with CPU->CPU copies (exercise_on_cpu), and results
bit for bit those of the resident run."""
from __future__ import annotations

import pytest
import torch

from headroom.training.memory.activation_offload import enable_offloaded_checkpointing
from headroom.training.memory import time_model
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


def train(blocks, steps=3, checkpointing=None, depth=1, order=None, trace=None):
    """A few AdamW steps on the blocks' trainable weights; `order`: the blocks' execution order (default in order);
    `trace`: a list receiving (loss, LoRA gradients) per step."""
    optimizer = torch.optim.AdamW([p for p in blocks.parameters() if p.requires_grad], lr=1e-2)
    restore = checkpointing(blocks, depth) if checkpointing else (lambda: None)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(3, 5, 16, generator=g)
        for i in order or range(len(blocks)):
            x = blocks[i](x)
        loss = x.square().mean()
        loss.backward()
        if trace is not None:
            trace.append((loss.detach().clone(), [p.grad.clone() for p in blocks.parameters() if p.requires_grad]))
        optimizer.step()
        optimizer.zero_grad()
    restore()
    return [p.detach().clone() for p in blocks.parameters() if p.requires_grad]


def reference(count=4, **options):
    return train(make_blocks(count=count), **options)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, (list, tuple)):
            assert_same(x, y)
        else:
            assert torch.equal(x, y)


@pytest.mark.parametrize("checkpointing, depth", [(enable_checkpointing, 1), (enable_offloaded_checkpointing, 1)])
def test_streamed_training_is_bitwise_equal(checkpointing, depth):
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        result = train(blocks, checkpointing=checkpointing, depth=depth)
    assert_same(reference(), result)
    assert streamer.max_on_device <= 2 and streamer.fallback_fetches == 0


@pytest.mark.parametrize("slots, resident", [(2, ()), (3, ()), (2, (0, 1)), (3, (0, 2, 5)), (2, (5,))])
def test_the_ring_is_bitwise_the_resident_run(slots, resident):
    """Loss, LoRA gradients and updated weights of every step, with 2 and 3 slots, all blocks streamed or some
    whole blocks resident and the rest streamed."""
    expected, got = [], []
    reference_weights = train(make_blocks(count=6), steps=4, checkpointing=enable_checkpointing, trace=expected)
    blocks = make_blocks(count=6)
    with WeightStreamer(blocks, "cpu", slots=slots, resident=resident, exercise_on_cpu=True) as streamer:
        weights = train(blocks, steps=4, checkpointing=enable_checkpointing, trace=got)
        assert streamer.streamed_blocks() == set(range(6)) - set(resident)
    assert_same(expected, got)
    assert_same(reference_weights, weights)
    assert streamer.max_on_device <= slots and streamer.fallback_fetches == 0


class Net(torch.nn.Module):
    """Blocks between frozen layers outside them (an embedder and a final norm)."""

    def __init__(self, count=5):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Linear(16, 16).requires_grad_(False)
        self.blocks = make_blocks(count=count)
        self.final = torch.nn.LayerNorm(16).requires_grad_(False)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.final(x)


def train_net(net, steps=3, trace=None):
    optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    restore = enable_checkpointing(net.blocks)
    g = torch.Generator().manual_seed(11)
    for _ in range(steps):
        loss = net(torch.randn(2, 7, 16, generator=g)).square().mean()
        loss.backward()
        trace.append((loss.detach().clone(), [p.grad.clone() for p in net.parameters() if p.requires_grad]))
        optimizer.step()
        optimizer.zero_grad()
    restore()
    return [p.detach().clone() for p in net.parameters() if p.requires_grad]


def test_whole_blocks_and_non_block_layers_kept_on_the_device_the_rest_streamed():
    """The plan's placement: non-block layers and whole resident blocks copied once at attach and kept installed,
    the other blocks through the ring; bit for bit the resident run."""
    expected, got = [], []
    reference_weights = train_net(Net(), trace=expected)
    net = Net()
    host = {name: t for name, t in net.named_parameters()}
    seen = {}
    handle = net.blocks[1].base.register_forward_pre_hook(lambda m, a: seen.update({"block 1": m.weight}))
    with WeightStreamer(net.blocks, "cpu", resident=(1, 3), keep=[net], exercise_on_cpu=True,
                        record=True) as streamer:
        assert net.embed.weight.untyped_storage().data_ptr() not in streamer.slot_pointers()
        kept, streamed = streamer.kept_bytes(), streamer.streamed_blocks()
        weights = train_net(net, trace=got)
    handle.remove()
    assert all(t is host[name] for name, t in net.named_parameters())  # detached: the host tensors back
    assert_same(expected, got)
    assert_same(reference_weights, weights)
    per_block = sum(t.numel() * 4 for t in (net.blocks[0].norm.weight, net.blocks[0].norm.bias,
                                            net.blocks[0].base.weight, net.blocks[0].base.bias, net.blocks[0].scale))
    outside = sum(t.numel() * 4 for t in (*net.embed.parameters(), *net.final.parameters()))
    assert kept == 2 * per_block + outside
    assert streamed == {0, 2, 4} and streamer.allocations == 2 + 3  # slots + kept buffers
    assert {i for _, i in streamer.install_log} == {0, 2, 4} and set(streamer.fetch_log) == {0, 2, 4}
    assert seen["block 1"] is not net.blocks[1].base.weight  # a device copy, installed from attach to detach
    # the attach's seconds by part (the GPU kit records where a Steps call's start goes); no pin on a CPU
    parts = streamer.setup_seconds
    assert set(parts) == {"pack", "pin", "keep", "slots"} and all(v >= 0 for v in parts.values())
    assert parts["pack"] > 0 and parts["keep"] > 0


def test_fetch_order_keeps_the_last_blocks_across_the_turn():
    """One copy per block per pass, except the blocks still in a slot: the last ones at the forward -> backward
    turn, the first ones at the next step's forward."""
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        train(blocks, steps=1, checkpointing=enable_checkpointing)
        assert streamer.fetch_log == [0, 1, 2, 3, 1, 0]
        assert streamer.install_log == [("forward", i) for i in range(4)] + [("backward", i) for i in (3, 2, 1, 0)]
        train(blocks, steps=1, checkpointing=enable_checkpointing)
        assert streamer.fetch_log[6:] == [2, 3, 1, 0]
    blocks = make_blocks(count=6)
    with WeightStreamer(blocks, "cpu", slots=3, exercise_on_cpu=True, record=True) as streamer:
        train(blocks, steps=2, checkpointing=enable_checkpointing)
    # 3 slots: two blocks in flight ahead; three kept at each turn
    assert streamer.fetch_log == [0, 1, 2, 3, 4, 5, 2, 1, 0] + [3, 4, 5, 2, 1, 0]


def frozen_first(count, frozen=2):
    """Blocks whose first `frozen` carry no trained weight: nothing before them needs a gradient, so backward never
    runs them (SDXL's first five with attention-only targets; a UNet ControlNet's base input and middle blocks)."""
    blocks = make_blocks(count=count)
    for block in list(blocks)[:frozen]:
        block.requires_grad_(False)
    return blocks


@pytest.mark.parametrize("slots, count", [(2, 4), (3, 6)])
def test_backward_fetches_no_block_it_skips_and_leaves_the_next_forwards_first_in_the_ring(slots, count):
    blocks = frozen_first(count)
    with WeightStreamer(blocks, "cpu", slots=slots, exercise_on_cpu=True, record=True) as streamer:
        trained = train(blocks, steps=2, checkpointing=enable_checkpointing)
    assert_same(trained, train(frozen_first(count), steps=2, checkpointing=enable_checkpointing))
    forward = [("forward", i) for i in range(count)]
    backward = [("backward", i) for i in range(count - 1, 1, -1)]  # blocks 1 and 0 never run backward
    assert streamer.install_log == (forward + backward) * 2
    # Each block crosses once per step: backward's fetches are the blocks it runs and, past them, the next forward's
    # first two (before: 2 slots fetched block 1 in backward for nothing, then block 0 in the next forward's start,
    # with nothing to overlap; 3 slots fetched both in backward, which the next forward happened to want).
    if slots == 2:
        assert streamer.fetch_log == [0, 1, 2, 3] + [0] + [1, 2, 3] + [0]
    else:
        assert streamer.fetch_log == [0, 1, 2, 3, 4, 5] + [2, 0, 1] + [3, 4, 5] + [2, 0, 1]
    assert streamer.fallback_fetches == 0


@pytest.mark.parametrize("slots, count, frozen", [(2, 4, 0), (3, 6, 0), (2, 4, 2), (2, 6, 3), (3, 6, 1), (3, 6, 2),
                                                 (3, 6, 4), (4, 8, 2)])
def test_the_time_models_ring_fetches_are_the_rings(slots, count, frozen):
    """time_model.ring_fetches says which blocks a steady step copies in forward and which in backward (the planner
    prices each phase's copies from it): the ring's own, with and without blocks that backward skips."""
    blocks = frozen_first(count, frozen)
    restore = enable_checkpointing(blocks)
    g = torch.Generator().manual_seed(7)
    with WeightStreamer(blocks, "cpu", slots=slots, exercise_on_cpu=True, record=True) as streamer:
        phases = []
        for _ in range(2):
            start = len(streamer.fetch_log)
            x = torch.randn(3, 5, 16, generator=g)
            for block in blocks:
                x = block(x)
            turn = len(streamer.fetch_log)
            x.square().mean().backward()
            phases.append((streamer.fetch_log[start:turn], streamer.fetch_log[turn:]))
    restore()
    assert phases[1] == time_model.ring_fetches([1] * count, slots, frozen)


@pytest.mark.parametrize("slots", [2, 3])
def test_a_forward_starts_the_next_copies_after_queueing_its_own_block(slots):
    """The next blocks' copies are started after a block's kernels are queued, not before: a refill waits on the CPU
    for its slot's previous block, and the device must still have this block to run meanwhile (on a GPU the wait
    before it left the device idle at every block boundary, and a pageable copy ran serially). Each block still
    finds itself in a slot: no synchronous fetch in the steady state."""
    blocks = make_blocks(count=6)
    with WeightStreamer(blocks, "cpu", slots=slots, exercise_on_cpu=True, record=True) as streamer:
        fetched_when_run = {}

        def at_compute(index):
            def hook(module, args):
                if torch.is_grad_enabled():
                    fetched_when_run.setdefault(index, list(streamer.fetch_log))
            return hook

        handles = [block.register_forward_pre_hook(at_compute(i)) for i, block in enumerate(blocks)]
        train(blocks, steps=1, checkpointing=enable_checkpointing)
        for handle in handles:
            handle.remove()
    for index in range(1, 5):  # in flight when block `index` runs: the blocks after it the block before started
        later = [i for i in fetched_when_run[index] if i > index]
        assert later == list(range(index + 1, index + slots - 1)), (index, fetched_when_run)
    assert streamer.fetch_log[:6] == list(range(6))  # forward: each block once, in order, none out of turn


@pytest.mark.parametrize("pinned", [True, False, "pinning off"])
def test_backward_starts_a_copy_from_pageable_memory_one_block_later(monkeypatch, pinned):
    """A copy from pageable memory (past the pin limit, or every block with pinning off) holds the CPU until it is
    done. Backward starts its copies before queueing its block, and with 3 slots the deepest one's slot frees only
    when the block running then ends: the device would idle through the copy. So a pageable block is fetched one
    block later (still before it runs: no synchronous fetch), a pinned one as deep as the ring allows. Results
    bitwise the resident run's. (CPU: CUDA's copy semantics and the pinning call stood in for.)"""
    from headroom.training.memory import weight_streaming

    monkeypatch.setattr(WeightStreamer, "_copies_from_pageable_hold_the_cpu", lambda self: True)
    monkeypatch.setattr(WeightStreamer, "_pins_host_copies", lambda self: self.pin_host_copies)
    monkeypatch.setattr(weight_streaming, "_register", lambda buffer, device: pinned is True)
    monkeypatch.setattr(weight_streaming, "_unregister", lambda buffer, device: None)
    blocks = make_blocks(count=6)
    with WeightStreamer(blocks, "cpu", slots=3, exercise_on_cpu=True, record=True,
                        pin_host_copies=pinned != "pinning off") as streamer:
        fetched_after, real = {}, streamer._before_backward

        def spy(index):
            real(index)
            fetched_after.setdefault(index, streamer.fetch_log[6:])  # backward's fetches so far (forward: 0-5)

        streamer._before_backward = spy
        got = train(blocks, steps=1, checkpointing=enable_checkpointing)
        assert streamer.fallback_fetches == 0
    assert_same(got, reference(count=6, steps=1, checkpointing=enable_checkpointing))
    # blocks 5, 4, 3 are still in the ring at the turn; 2, 1, 0 are fetched in backward
    expected = {4: [2], 3: [2, 1], 2: [2, 1, 0]} if pinned is True else {4: [], 3: [2], 2: [2, 1]}
    assert {k: fetched_after[k] for k in (4, 3, 2)} == expected


def test_no_allocation_in_steady_state():
    blocks = make_blocks(count=5)
    with WeightStreamer(blocks, "cpu", slots=3, exercise_on_cpu=True) as streamer:
        assert streamer.allocations == 3  # the slots, at attach
        pointers = streamer.slot_pointers()
        train(blocks, steps=1, checkpointing=enable_checkpointing)
        seen = []
        handle = blocks[2].base.register_forward_pre_hook(lambda m, a: seen.append(m.weight))
        train(blocks, steps=3, checkpointing=enable_checkpointing)
        handle.remove()
        assert streamer.allocations == 3 and streamer.fallback_fetches == 0
        assert streamer.slot_pointers() == pointers
        # the installed weights are cached views of the slots: no new tensor per install either
        assert len({id(w) for w in seen}) <= 3 and all(w.untyped_storage().data_ptr() in pointers for w in seen)


def test_a_block_run_out_of_order_is_fetched_synchronously_and_stays_correct():
    order = [0, 2, 1, 3, 1]  # skips ahead, comes back, runs a block twice
    expected = reference(order=order, checkpointing=enable_checkpointing)
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, record=True) as streamer:
        result = train(blocks, order=order, checkpointing=enable_checkpointing)
    assert_same(expected, result)
    assert streamer.fallback_fetches == 0 and streamer.max_on_device <= 2


@pytest.mark.parametrize("checkpointing, depth", [(None, 1), (enable_checkpointing, 2)])
def test_a_block_autograd_keeps_weights_of_pins_its_slot(checkpointing, depth):
    """Not checkpointed (or checkpointed below the block, with a frozen buffer used outside the checkpoints):
    autograd saves views of the slot for backward. The slot is pinned until that backward ran, the next blocks go to
    one-off buffers: bitwise correct, slow (the policy streams only checkpointed blocks)."""
    blocks = make_blocks()
    with WeightStreamer(blocks, "cpu", exercise_on_cpu=True) as streamer:
        result = train(blocks, checkpointing=checkpointing, depth=depth)
        assert streamer.fallback_fetches > 0
        assert all(slot.pins == 0 for slot in streamer._ring)  # released with the graph
    assert_same(reference(), result)


def test_host_tensors_become_views_of_one_packed_buffer_reused_by_the_next_attach():
    blocks = make_blocks()
    host = dict(blocks.named_parameters()) | dict(blocks.named_buffers())
    values = {name: t.detach().clone() for name, t in host.items()}
    streamer = WeightStreamer(blocks, "cpu", exercise_on_cpu=True).attach()
    storages = {name: t.untyped_storage().data_ptr() for name, t in host.items()}
    streamer.detach()
    for b in range(4):  # one storage per block for its frozen tensors; the trainable ones untouched
        frozen = {storages[f"{b}.{n}"] for n in ("norm.weight", "norm.bias", "base.weight", "base.bias", "scale")}
        assert len(frozen) == 1 and storages[f"{b}.down.weight"] not in frozen
    WeightStreamer(blocks, "cpu", exercise_on_cpu=True).attach().detach()
    now = dict(blocks.named_parameters()) | dict(blocks.named_buffers())
    assert all(now[name] is t and torch.equal(t, values[name]) for name, t in host.items())
    assert {name: t.untyped_storage().data_ptr() for name, t in host.items()} == storages  # not packed again


def test_an_attach_that_fails_gives_the_modules_their_host_tensors_back(monkeypatch):
    from headroom.training.memory import weight_streaming

    net = Net()
    host = {name: t for name, t in [*net.named_parameters(), *net.named_buffers()]}

    def no_room(*args):
        raise RuntimeError("CUDA out of memory (the slots)")

    monkeypatch.setattr(weight_streaming, "_Slot", no_room)
    streamer = WeightStreamer(net.blocks, "cpu", resident=(1,), keep=[net], exercise_on_cpu=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        streamer.attach()
    assert not streamer.active and all(not b._forward_pre_hooks for b in net.blocks)
    assert all(t is host[name] for name, t in [*net.named_parameters(), *net.named_buffers()])


def test_fewer_than_two_slots_are_refused():
    with pytest.raises(ValueError, match="slots"):
        WeightStreamer(make_blocks(), "cpu", slots=1)


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
    assert_same(reference(), result)


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


def test_memory_features_with_the_plans_placement_checkpoints_what_streams_and_matches_the_resident_run():
    """policy.memory_features with the streamer options the bridge sets from the plan: resident whole blocks (not
    checkpointed, as selective checkpointing leaves them), the non-block layers kept, the rest streamed through a
    3-slot ring and always recomputed."""
    from headroom.training.memory.policy import OffloadPolicy, memory_features

    expected, got = [], []
    reference_weights = train_net(Net(count=6), trace=expected)
    net = Net(count=6)
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks", checkpoint_blocks="1")
    wrapped = []
    with memory_features(policy, net.blocks, "cpu", exercise_on_cpu=True, resident=(0, 3), keep=[net],
                         slots=3) as streamer:
        wrapped = {i for i, block in enumerate(net.blocks) if "forward" in block.__dict__}
        optimizer = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
        g = torch.Generator().manual_seed(11)
        for _ in range(3):
            loss = net(torch.randn(2, 7, 16, generator=g)).square().mean()
            loss.backward()
            got.append((loss.detach().clone(), [p.grad.clone() for p in net.parameters() if p.requires_grad]))
            optimizer.step()
            optimizer.zero_grad()
    assert wrapped == {1, 2, 4, 5}  # the selection and every streamed block; resident 0 and 3 keep activations
    assert streamer.fallback_fetches == 0 and streamer.allocations == 3 + 3
    assert_same(expected, got)
    assert_same(reference_weights, [p.detach().clone() for p in net.parameters() if p.requires_grad])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the copy stream, the slot events, pinned buffers")
@pytest.mark.parametrize("slots", [2, 3])
def test_the_ring_on_cuda_is_bitwise_the_resident_run(slots):
    """On a GPU (the kit's CUDA-marked tests): frozen weights in host RAM through the ring (pinned packed buffers, the
    copy stream, free / ready events), the LoRA on the device; bit for bit the all-resident run, the slots fixed,
    no fallback, no allocator retry."""
    device = torch.device("cuda")

    def run(streamed):
        blocks = make_blocks(count=6)
        if streamed:
            for block in blocks:
                block.down.to(device), block.up.to(device)  # trainable on the device, frozen in host RAM
        else:
            blocks.to(device)
        optimizer = torch.optim.AdamW([p for p in blocks.parameters() if p.requires_grad], lr=1e-2)
        restore = enable_checkpointing(blocks)
        g = torch.Generator().manual_seed(7)
        trace = []
        streamer = WeightStreamer(blocks, device, slots=slots).attach() if streamed else None
        try:
            pointers = streamer.slot_pointers() if streamer else []
            pinned = all(t.is_pinned() for b in blocks for t in (b.base.weight, b.norm.weight, b.scale)) \
                if streamer else None
            for _ in range(4):
                x = torch.randn(3, 5, 16, generator=g).to(device)
                for block in blocks:
                    x = block(x)
                loss = x.square().mean()
                loss.backward()
                trace.append((loss.detach().cpu(), [p.grad.cpu() for p in blocks.parameters() if p.requires_grad]))
                optimizer.step()
                optimizer.zero_grad()
            torch.cuda.synchronize()
            if streamer:
                assert streamer.slot_pointers() == pointers and streamer.allocations == slots
                assert streamer.fallback_fetches == 0 and pinned
        finally:
            if streamer:
                streamer.detach()
            restore()
        return trace, [p.detach().cpu() for p in blocks.parameters() if p.requires_grad]

    expected = run(False)
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    got = run(True)
    assert torch.cuda.memory_stats(device).get("num_alloc_retries", 0) == retries
    assert_same(expected[0], got[0])
    assert_same(expected[1], got[1])


def test_pinning_stops_at_its_limit_and_the_rest_streams_pageable(monkeypatch, caplog):
    """Windows lets a process lock about half of its RAM and ComfyUI keeps its pins within 40 % of it: the streamer
    pins no more than `pin_limit_bytes` (comfy_bridge.pinnable_host_bytes), the blocks past it cross from pageable
    memory, said once; a refused pin counts the same. Results bitwise those of the resident run. (CPU: the pinning
    call is stood in for; the CUDA test below pins for real.)"""
    from headroom.training.memory import weight_streaming

    calls = []
    monkeypatch.setattr(WeightStreamer, "_pins_host_copies", lambda self: True)
    monkeypatch.setattr(weight_streaming, "_register", lambda buffer, device: calls.append(buffer.numel()) or True)
    monkeypatch.setattr(weight_streaming, "_unregister", lambda buffer, device: calls.append(-buffer.numel()))
    blocks = make_blocks()
    one_block = WeightStreamer(blocks, "cpu", exercise_on_cpu=True).attach()
    nbytes = one_block._blocks[0].nbytes
    one_block.detach()
    calls.clear()
    with caplog.at_level("WARNING"):
        with WeightStreamer(blocks, "cpu", exercise_on_cpu=True, pin_limit_bytes=int(2.5 * nbytes)) as streamer:
            assert [b.registered for b in streamer._blocks] == [True, True, False, False]
            # the time model's price of the step counts the same blocks pageable (time_model.pinned_blocks)
            assert {i for i, b in enumerate(streamer._blocks) if b.registered} == \
                time_model.pinned_blocks([b.nbytes for b in streamer._blocks], int(2.5 * nbytes))
            assert streamer.pinned_bytes == 2 * nbytes and streamer.pageable_blocks == 2
            got = train(blocks, checkpointing=enable_checkpointing)
    assert calls == [nbytes, nbytes, -nbytes, -nbytes] and streamer.pinned_bytes == 0  # unpinned at detach
    assert_same(got, reference(checkpointing=enable_checkpointing))
    said = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert len(said) == 1 and "ComfyUI leaves to pin" in said[0] and "pageable" in said[0]

    caplog.clear()
    monkeypatch.setattr(weight_streaming, "_register", lambda buffer, device: False)  # CUDA refuses
    with caplog.at_level("WARNING"):
        with WeightStreamer(make_blocks(), "cpu", exercise_on_cpu=True) as streamer:
            assert streamer.pageable_blocks == 4 and streamer.pinned_bytes == 0
    assert any("CUDA refused" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cudaHostRegister and its last error")
def test_a_refused_pin_leaves_no_cuda_error_behind():
    """cudaHostRegister refusing (here: a buffer registered twice) leaves the thread's last CUDA error set, which
    torch's next kernel-launch check would raise as its own; the streamer's pin reads and drops it."""
    from headroom.training.memory import weight_streaming

    device = torch.device("cuda", torch.cuda.current_device())
    buffer = torch.empty(1 << 20, dtype=torch.uint8)
    assert weight_streaming._register(buffer, device)
    assert buffer.is_pinned() and not weight_streaming._register(buffer, device)  # pinned already: not again
    assert int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 1)) != 0  # the raw refusal
    weight_streaming._discard_cuda_error(device)
    assert torch.ones(4, device=device).add_(1).sum().item() == 8  # the next kernel runs
    weight_streaming._unregister(buffer, device)
    assert not buffer.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned and pageable packed buffers")
def test_the_ring_on_cuda_with_a_pin_limit_is_bitwise_the_resident_run():
    device = torch.device("cuda")
    expected = train_on(make_blocks().to(device), device)  # every weight on the card
    blocks = make_blocks()
    for block in blocks:
        block.down.to(device), block.up.to(device)
    with WeightStreamer(blocks, device, pin_limit_bytes=1) as streamer:  # nothing fits: every block pageable
        assert streamer.pinned_bytes == 0 and streamer.pageable_blocks == 4
        got = train_on(blocks, device)
    assert_same(got, expected)


def train_on(blocks, device, steps=3):
    """train() with the inputs made on the CPU generator and moved to `device` (the same numbers as train's)."""
    optimizer = torch.optim.AdamW([p for p in blocks.parameters() if p.requires_grad], lr=1e-2)
    restore = enable_checkpointing(blocks)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randn(3, 5, 16, generator=g).to(device)
        for block in blocks:
            x = block(x)
        x.square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    restore()
    return [p.detach().clone() for p in blocks.parameters() if p.requires_grad]


def test_a_full_fine_tunes_base_layers_are_neither_streamed_nor_kept():
    """A full fine-tune's trained layer computes with its own copy alone (adapters.FullLayer): its base layer is
    `unread`, left in host RAM, so the card holds one copy of each trained weight and a streamed block carries only
    what the step reads (issue 42). Bit for bit the run without the streamer."""
    from headroom.training.core.adapters import FullLayer

    def full_blocks():
        blocks = make_blocks(count=4)
        for block in blocks:
            block.base = FullLayer(block.base)
        return blocks

    expected = []
    reference_weights = train(full_blocks(), checkpointing=enable_checkpointing, trace=expected)
    blocks = full_blocks()
    bases = [block.base.base_layer for block in blocks]
    host = [(base.weight, base.bias) for base in bases]
    seen = []
    handles = [block.base.register_forward_pre_hook(lambda m, a: seen.append((m.base_layer.weight,
                                                                              m.base_layer.bias)))
               for block in blocks]
    got = []
    with WeightStreamer(blocks, "cpu", resident=(1,), unread=bases, exercise_on_cpu=True, record=True) as streamer:
        weights = train(blocks, checkpointing=enable_checkpointing, trace=got)
        kept, slot, streamed = streamer.kept_bytes(), streamer.slot_bytes(), streamer.streamed_blocks()
    for handle in handles:
        handle.remove()
    assert_same(expected, got)
    assert_same(reference_weights, weights)
    # the base weights stayed the host objects all through the step, resident block or streamed
    assert len(seen) >= 4 and all(any(w is h[0] and b is h[1] for h in host) for w, b in seen)
    read = sum(t.numel() * 4 for t in (blocks[0].norm.weight, blocks[0].norm.bias, blocks[0].scale))
    assert kept == read  # block 1: its norm and buffer, not its base Linear
    assert slot == 3 * 256  # three tensors at 256-byte aligned offsets: the base's weight and bias are not packed
    assert streamed == {0, 2, 3}
    # without `unread` the same blocks carry the base too
    with WeightStreamer(full_blocks(), "cpu", resident=(1,), exercise_on_cpu=True) as streamer:
        assert streamer.slot_bytes() == 3 * 256 + 16 * 16 * 4 + 256
