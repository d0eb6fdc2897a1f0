"""Trained weights in host RAM (training/memory/trained_weights_on_host.py): a full fine-tune's difference lives in
host RAM, each layer's copy crosses to the compute device for its product and its gradient crosses back, where fused
backward steps it beside its optimizer state. The weights equal those of the same run with the difference on the
device (both step in host RAM: optimizer_state cpu). On a CPU both homes are the host; the CUDA test runs the
crossing itself (the GPU kit's CUDA step)."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from headroom.training.core.adapters import AdapterConfig, AdapterSet
from headroom.training.core.optimizers import OptimizerConfig, create_optimizer, create_scheduler
from headroom.training.memory.fused_backward import FusedBackward
from headroom.training.memory.policy import OffloadPolicy
from headroom.training.memory.checkpointing import wrap_blocks
from headroom.training.memory.streamed_optimizer_state import StreamedState, largest_tensor_shaped
from headroom.training.memory.trained_weights_on_host import Crossings, check_kind, trained_weights_device

# Six equal middle layers: no one layer is most of the difference (one layer's copy and gradient are in flight).
SIZES = [16] + [256] * 7 + [8]
PATHS = [str(2 * i) for i in range(len(SIZES) - 1)]


def _base(device, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for width_in, width_out in zip(SIZES, SIZES[1:]):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.GELU()]
    return torch.nn.Sequential(*layers[:-1]).to(device).requires_grad_(False)


def _train(device, on_host: bool, precision: str = "fp32", steps: int = 4, state: str = "host", clip: float = 0.0,
           optimizer: str = "AdamW", checkpointed: bool = False, blocks: int = 1, streamed: bool = False,
           after_step=None, resume: tuple | None = None, on_card: tuple[int, ...] = ()):
    """A full fine-tune of every Linear of a small model computing on `device`, its trained weights in host RAM
    (`on_host`: crossing through trained_weights_on_host.Crossings) or on `device`, stepped by fused backward with
    the state in host RAM (`state` "host") or on `device` ("device": host weights are stepped there through
    step_on_device; `streamed`: that state kept in host RAM between steps, streamed_optimizer_state.py);
    `checkpointed`: the model as `blocks` checkpointed blocks (training/memory/checkpointing.py); `after_step(fused)`
    after each step; `resume`: (weights, optimizer state, schedule state, steps done) loaded before training, the data
    drawn from there on; `on_card`: with the trained weights in host RAM, the layers (indices into PATHS) kept on
    `device` all the same (policy trained_weights_card_blocks). Returns (the adapter set, the fused optimizer, the
    crossings or None)."""
    model = _base(device)
    home = torch.device("cpu") if on_host else device
    adapters = AdapterSet(model, PATHS, AdapterConfig(kind="full", full_precision=precision), device=home,
                          on_card=[PATHS[i] for i in on_card], card_device=device if on_card else None)
    adapters.attach(model)
    config = OptimizerConfig(name=optimizer, lr=1e-2, schedule="linear", warmup_steps=0, total_steps=10)
    params = adapters.parameters()
    state_on_host = state == "host"
    where = "cpu" if state_on_host else device
    crossings = Crossings(device, adapters.parameters_in_host_ram()) if on_host else None
    fused = FusedBackward(params, lambda group: create_optimizer(group, config, device=where),
                          lambda opt: create_scheduler(opt, config), max_grad_norm=clip,
                          bf16_stochastic=precision != "fp32", state_on_host=state_on_host,
                          step_device=device if on_host and not state_on_host else None, crossings=crossings,
                          streamed_state=StreamedState(device, largest_tensor_shaped(optimizer, [p.shape for p in params]),
                                                       optimizer) if streamed else None)
    if on_host:
        adapters.weights_in_host_ram(crossings, fused.step_on_device if fused.step_device is not None else None)
    if checkpointed:  # blocks of consecutive layers, each recomputed in backward
        per = len(model) // blocks + 1
        chunks = [torch.nn.Sequential(*list(model)[i:i + per]) for i in range(0, len(model), per)]
        wrap_blocks(chunks, 1)
        model = torch.nn.Sequential(*chunks)
    generator = torch.Generator().manual_seed(1)
    if resume is not None:
        weights, state, schedule, done = resume
        adapters.load_state_dict(weights)
        fused.load_state_dict(state)
        fused.schedule.load_state_dict(schedule)
        for _ in range(done):
            torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator)
    for _ in range(steps):
        fused.zero_grad()
        x, y = torch.randn(8, 16, generator=generator), torch.randn(8, 8, generator=generator)
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        assert all(p.grad is None for p in params)  # each stepped in backward, its gradient freed (or never made)
        if crossings is not None:  # every copy a recompute kept was its backward's
            assert not any(crossings._kept.values())
        fused.step()
        fused.after_step()
        if after_step is not None:
            after_step(fused)
    return adapters, fused, crossings


@pytest.mark.parametrize("precision", ["fp32", "bf16_stochastic"])
def test_the_weights_of_a_run_with_its_trained_weights_in_host_ram(precision):
    """On this machine's compute device (the CPU here): the same weights as the difference on the device, the
    difference and every gradient in host RAM, one gradient alive at a time."""
    device = torch.device("cpu")
    on_device, _, _ = _train(device, False, precision)
    on_host, fused, _ = _train(device, True, precision)
    a, b = on_device.state_dict(), on_host.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(torch.any(v != 0) for v in b.values())  # it trained
    assert all(p.device.type == "cpu" and p.grad is None for p in on_host.parameters())
    assert fused.most_gradients_alive == 1


@pytest.mark.parametrize("state, checkpointed", [("device", True), ("device", False), ("host", True)])
def test_each_weight_crosses_twice_to_the_device_and_once_back_per_step(state, checkpointed):
    """Issue 42 item 3: a trained weight in host RAM crosses to the device once for the forward and once for the
    recompute and backward together (a checkpointed block's recompute keeps its copy for the backward right after it),
    and its update back once (state on the device; with the state in host RAM the gradient goes back through autograd
    instead); the weights are those of the run that keeps them on the device, bit for bit."""
    device, steps = torch.device("cpu"), 3
    on_device, _, _ = _train(device, False, "bf16_stochastic", steps=steps, state=state, checkpointed=checkpointed,
                             blocks=3)
    on_host, fused, crossings = _train(device, True, "bf16_stochastic", steps=steps, state=state,
                                       checkpointed=checkpointed, blocks=3)
    a, b = on_device.state_dict(), on_host.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    weights = sum(p.numel() * p.element_size() for p in on_host.parameters())
    assert crossings.to_device_bytes == 2 * weights * steps
    assert crossings.to_host_bytes == (weights * steps if state == "device" else 0)
    assert not crossings._kept  # every recompute's copy went to its backward
    assert len(crossings._in) == 2 and len(crossings._back) == (2 if state == "device" else 0)  # the fixed rings


def test_a_staging_buffer_the_driver_cannot_pin_is_pageable(monkeypatch):
    """Pinned memory is a limited resource (a host short of lockable RAM, Windows' WDDM): a buffer the driver refuses
    to pin is made pageable instead (the copies then synchronous), the run goes on."""
    from headroom.training.memory import trained_weights_on_host

    plain = torch.empty

    def refusing(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return plain(*args, **kwargs)

    monkeypatch.setattr(trained_weights_on_host.torch, "empty", refusing)
    buffer = trained_weights_on_host._Buffer(64, pinned=True)
    assert buffer.bytes.numel() == 64 and not buffer.bytes.is_pinned()


def test_crossings_stage_through_a_fixed_ring_and_land_updates_late():
    """The staging ring: copies to the device go through the same few buffers (sized for the largest tensor), and
    an update coming back is written into its host tensor only when its buffer is needed again or at `finish` (on a
    CUDA device: when its copy's event has passed), never lost."""
    tensors = [torch.full((4, 4), float(i)) for i in range(4)] + [torch.zeros(3)]
    crossings = Crossings("cpu", tensors, buffers=2)
    assert crossings.buffer_bytes == 64
    copies = [crossings.to_device(t) for t in tensors]
    assert all(torch.equal(c, t) and c.data_ptr() != t.data_ptr() for c, t in zip(copies, tensors))
    assert len(crossings._in) == 2 and crossings.to_device_bytes == 4 * 64 + 12
    for i, t in enumerate(tensors[:3]):
        crossings.to_host(t, torch.full((4, 4), 10.0 + i, dtype=torch.float64))  # converted to the tensor's dtype
    # two buffers: the third update landed the first; the other two are still in their buffers
    assert torch.equal(tensors[0], torch.full((4, 4), 10.0))
    assert torch.equal(tensors[1], torch.full((4, 4), 1.0)) and torch.equal(tensors[2], torch.full((4, 4), 2.0))
    crossings.finish()
    assert [t[0, 0].item() for t in tensors[:4]] == [10.0, 11.0, 12.0, 3.0] and crossings.to_host_bytes == 3 * 64
    # outside a recompute nothing is kept for backward
    crossings.keep(tensors[0], copies[0])
    assert not crossings._kept


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16_stochastic"])
def test_on_cuda_the_difference_crosses_the_card_and_trains_the_same_weights(precision):
    """On a CUDA device: the difference stays in host RAM, each gradient arrives there, and the weights equal
    bit for bit those of the run whose difference lives on the card (the same products on the card, the same host
    step); the card's peak is lower by about the difference."""
    cuda = torch.device("cuda")

    def peak_of(run):  # the card's peak over `run` above what was allocated before it (other tests' tensors too)
        gc.collect()  # the run before: its hooks and optimizer hold its tensors in reference cycles
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = run()
        return out, torch.cuda.max_memory_allocated() - before

    (on_device, _, _), device_peak = peak_of(lambda: _train(cuda, False, precision))
    weights = sum(p.numel() * p.element_size() for p in on_device.parameters())
    on_device_state = {k: v.cpu() for k, v in on_device.state_dict().items()}
    del on_device
    (on_host, fused, _), host_peak = peak_of(lambda: _train(cuda, True, precision))
    assert all(p.device.type == "cpu" for p in on_host.parameters())
    state = on_host.state_dict()
    assert all(torch.equal(on_device_state[k], state[k]) for k in state)
    assert fused.most_gradients_alive == 1
    print(f"{precision}: peak {device_peak} B with the difference on the card, {host_peak} B in host RAM "
          f"({weights} B of difference)")
    assert host_peak < device_peak - weights // 2


@pytest.mark.parametrize("precision, clip, optimizer, checkpointed", [
    ("fp32", 0.0, "AdamW", False), ("fp32", 0.05, "Adafactor", True), ("bf16_stochastic", 0.05, "AdamW", True)])
def test_stepped_where_the_state_is_the_same_weights(precision, clip, optimizer, checkpointed):
    """Issue 42 item 3: trained weights in host RAM with their optimizer state on the compute device: each layer's
    backward hands its gradient to the step there (FusedBackward.step_on_device), none reaches autograd, and the step
    is the one in host RAM, bit for bit (on a CPU both are the host: the same arithmetic, the hand-over checked)."""
    device = torch.device("cpu")
    on_host, _, _ = _train(device, True, precision, clip=clip, optimizer=optimizer, checkpointed=checkpointed)
    stepped_there, fused, _ = _train(device, True, precision, state="device", clip=clip, optimizer=optimizer,
                                     checkpointed=checkpointed)
    assert fused.step_device == device and fused.most_gradients_alive == 1
    assert all(layer.device_step == fused.step_on_device for layer in stepped_there.layers.values())
    a, b = on_host.state_dict(), stepped_there.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(fused.state) == len(fused.params)  # each tensor's state where its step ran
    # each tensor is stepped at its first gradient: a layer run twice in one step is refused, not stepped twice
    model = _base(device)
    adapters = AdapterSet(model, ["0"], AdapterConfig(kind="full"), device=device)
    adapters.attach(model)
    config = OptimizerConfig(name="AdamW", lr=1e-2)
    crossings = Crossings(device, adapters.parameters())
    fused = FusedBackward(adapters.parameters(), lambda group: create_optimizer(group, config, device="cpu"),
                          step_device=device, crossings=crossings)
    adapters.weights_in_host_ram(crossings, fused.step_on_device)
    first = model[0]
    with pytest.raises(RuntimeError, match=r"the trained tensor \(256, 16\) got a second gradient in one training step"):
        (first(torch.randn(2, 16)) + first(torch.randn(2, 16))).square().mean().backward()
    fused.zero_grad()  # the next step steps it again
    first(torch.randn(2, 16)).square().mean().backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16_stochastic"])
def test_on_cuda_host_weights_stepped_on_the_card_train_the_weights_of_the_card(precision):
    """Trained weights in host RAM, optimizer state on the card: the weights equal bit for bit those of the run with
    everything on the card (the same products, the same step on the card), and no trained weight, gradient or
    fp32 copy stays on the card between layers."""
    cuda = torch.device("cuda")
    on_card, _, _ = _train(cuda, False, precision, state="device", clip=0.05)
    expected = {k: v.cpu() for k, v in on_card.state_dict().items()}
    del on_card
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    on_host, fused, _ = _train(cuda, True, precision, state="device", clip=0.05)
    assert fused.step_device == cuda and all(p.device.type == "cpu" for p in on_host.parameters())
    state = on_host.state_dict()
    assert all(torch.equal(expected[k], state[k]) for k in state)
    assert all(v.device.type == "cuda" for s in fused.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1)
    # some layers kept on the card (trained_weights_card_blocks): made there, never crossing, the same weights
    split, _, crossings = _train(cuda, True, precision, state="device", clip=0.05, on_card=(1, 4))
    assert {p.device.type for i in (1, 4) for _, p in split._own_parameters(split.layers[PATHS[i]])} == {"cuda"}
    assert {p.device.type for p in split.parameters_in_host_ram()} == {"cpu"} and crossings.pinned
    state = split.state_dict()
    assert all(torch.equal(expected[k], state[k].cpu()) for k in state)


def test_only_a_full_fine_tune_keeps_its_trained_weights_in_host_ram():
    host = OffloadPolicy(trained_weights="host", fused_backward=True, optimizer_state="cpu")
    assert trained_weights_device(host, "cuda:0") == torch.device("cpu")
    assert trained_weights_device(OffloadPolicy(), "cuda:0") == torch.device("cuda:0")
    check_kind(host, "full")
    check_kind(OffloadPolicy(), "lora")
    with pytest.raises(ValueError, match="this run trains a lora: set kind full in the LoRA Config, or set "
                                         "trained_weights 'device'"):
        check_kind(host, "lora")
    with pytest.raises(ValueError, match="this run trains a ControlNet: set trained_weights 'device'"):
        check_kind(host, None)


@pytest.mark.parametrize("state", ["device", "host"])
def test_layers_kept_on_the_card_do_not_cross_and_train_the_same_weights(state):
    """trained_weights_card_blocks: with the trained weights in host RAM, the layers of the blocks the plan keeps on
    the card are made there, stepped by fused backward's hook like any weight on the card, and never cross; the others
    cross as before (twice in, once back with the state on the card); the weights are those of the run with every
    layer crossing, bit for bit."""
    device = torch.device("cpu")
    kwargs = dict(precision="bf16_stochastic", state=state, checkpointed=True, blocks=3, clip=0.05)
    crossing, _, _ = _train(device, True, **kwargs)
    kept = (0, 3, 7)
    split, fused, crossings = _train(device, True, on_card=kept, **kwargs)
    assert _same_weights(crossing, split)
    on_card = [p for i in kept for _, p in split._own_parameters(split.layers[PATHS[i]])]
    assert all(split.layers[PATHS[i]].crossings is None for i in kept)
    assert all(split.layers[path].crossings is crossings for i, path in enumerate(PATHS) if i not in kept)
    crossed = sum(p.numel() * p.element_size() for p in split.parameters_in_host_ram())
    assert crossed == sum(p.numel() * p.element_size() for p in split.parameters()) - sum(
        p.numel() * p.element_size() for p in on_card)
    assert crossings.to_device_bytes == 4 * 2 * crossed  # 4 steps
    assert crossings.to_host_bytes == (4 * crossed if state == "device" else 0)
    with pytest.raises(ValueError, match="on_card keeps a full fine-tune's trained layers on the card"):
        AdapterSet(_base(device), PATHS, AdapterConfig(kind="full"), device=device, on_card=[PATHS[0]])


def _same_weights(a, b) -> bool:
    a, b = a.state_dict(), b.state_dict()
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
