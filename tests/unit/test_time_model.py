"""The planner's time model (training/memory/time_model.py) and selective checkpointing, on recorded timings: a
Flux.1-dev-like description (19 double + 38 single blocks, their bf16 weight bytes; activations at 1024 px sized so
the resident plan is about the GPU kit's 53 GiB; forward times splitting the kit's resident 0.605 s/step by weight)."""
from __future__ import annotations

import dataclasses
import json
import math
import types

import pytest
import torch

from headroom.training.memory import planner, time_model
from headroom.training.memory.planner import (ActivationLaw, BlockProfile, ModelDescription, RunShape, TrainableSpec,
                                              candidate_policies, estimate, plan_auto, selective_plans)
from headroom.training.memory.policy import GIB, OffloadPolicy

MIB = 2 ** 20
AREA = 128 * 128  # Flux's latent at 1024 px
RESIDENT_S = 0.605  # GPU kit, H200, Flux.1-dev LoRA rank 16, batch 1, 1024 px, bf16


def flux_like(h2d: float = 25e9) -> ModelDescription:
    double, single = 339_700_000 * 2, 141_600_000 * 2  # bf16 weight bytes of a double / single block
    total = 19 * double + 38 * single
    forward = RESIDENT_S / (1 + time_model.BACKWARD_PER_FORWARD)  # the step's forward, split by weight

    def block(name, weights, saved_mib):
        return BlockProfile(name, weights, linear_weight_bytes=weights, linear_weight_numel=weights // 2,
                            linear_rows=30_000, linear_count=10, saved=ActivationLaw(0, saved_mib * MIB / AREA),
                            inputs=ActivationLaw(0, 30 * MIB / AREA),
                            forward_s=ActivationLaw(0, forward * weights / total / AREA))

    blocks = (*(block(f"double_blocks.{i}", double, 700) for i in range(19)),
              *(block(f"single_blocks.{i}", single, 300) for i in range(38)))
    return ModelDescription("Flux", blocks, other_param_bytes=400 * MIB, latent_channels=16, text_tokens=512,
                            inference_bytes_per_latent_px=5e4, h2d_bytes_per_s=h2d)


LORA = TrainableSpec(((16, 3072), (3072, 16)) * 500, "AdamW")  # ~49M trained weights: a rank-16 LoRA's order
SHAPE = RunShape(1, 1024, 1024)


def resident_peak(d):
    return estimate(d, LORA, SHAPE, OffloadPolicy()).peak_bytes


def test_the_step_is_the_per_block_pipeline_or_the_transfer_plus_what_does_not_overlap():
    """Per block max(compute, copy); the ring keeps its slots' blocks across each turn, so they do not cross."""
    forward, bytes_ = [0.1, 0.2, 0.1, 0.1], [10 ** 9] * 3 + [0]  # blocks 0-2 streamed, 3 resident
    t = time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, 1e9, optimizer_s=0.01, slots=2)
    assert time_model.ring_fetches(bytes_, 2) == ([2], [0])  # 0, 1 still in the ring in forward; 1, 2 in backward
    assert t.compute_s == pytest.approx(2.5 * 0.55 + 0.4) and t.recompute_s == pytest.approx(0.4)
    assert t.transfer_s == pytest.approx(2.0) and t.fill_s == 0 and t.serial_s == 0  # two block copies
    # forward: block 2's copy starts when block 0 (its slot's last user) is done at 0.1, in at 1.1, then 2 and 3
    # compute: 1.3 s; backward (3, 2, 1, 0: 0.15, 0.25, 0.5, 0.25 s): block 0's copy waits for block 2 (done at
    # 0.4), in at 1.4, then 0 computes: 1.65 s; + the work outside the blocks, 2.5 x 0.05
    assert t.pipeline_s == pytest.approx(0.125 + 1.3 + 1.65)
    assert t.bound == "transfer" and t.total_s == pytest.approx(t.pipeline_s + 0.01)
    assert t.limit_s == pytest.approx(2.0)  # max(compute + optimizer, transfer)
    # phase by phase: forward is bound by its copy (1.0 s against 0.55 s of compute), backward by its compute
    # (1.225 s against a 1.0 s copy); the forward's idle link cannot carry backward's copy across the turn
    assert (t.forward_compute_s, t.forward_copy_s, t.backward_copy_s) == pytest.approx((0.55, 1.0, 1.0))
    assert t.phase_limit_s == pytest.approx(1.0 + 1.225 + 0.01) and t.to_dict()["phase_limit_s"] == t.phase_limit_s
    assert ("physical limit 2.000 s, 2.235 s phase by phase: forward transfer-bound, backward compute-bound)"
            in t.describe())
    # copies queued on the compute stream (trained weights in host RAM, streamed state, offloaded inputs): the card
    # computes nothing meanwhile, so they add to the step; the physical limit counts them as if overlapped
    serial = time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, 1e9, serial_transfer_bytes=5 * 10 ** 8,
                                  optimizer_s=0.01, slots=2)
    assert serial.transfer_s == pytest.approx(2.5) and serial.serial_s == pytest.approx(0.5)
    assert serial.total_s == pytest.approx(t.total_s + 0.5) and serial.limit_s == pytest.approx(2.5)
    assert "0.500 s of it on the compute stream" in serial.describe()
    # the part of them the CPU also copies through the pinned staging buffers (trained weights in host RAM, streamed
    # state): the step takes at least those copies, whatever the card does meanwhile
    staged = dict(serial_transfer_bytes=5 * 10 ** 8, optimizer_s=0.01, slots=2, staged_bytes=5 * 10 ** 8)
    slow_copies = time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, 1e9, host_copy_bytes_per_s=1e8, **staged)
    assert slow_copies.host_copy_s == pytest.approx(5.0) and slow_copies.total_s == pytest.approx(5.0)
    assert slow_copies.bound == "host-copy" and slow_copies.ring_floor_s == pytest.approx(5.0)
    assert "the CPU's staging copies 5.000 s" in slow_copies.describe()
    fast_copies = time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, 1e9, host_copy_bytes_per_s=1e10, **staged)
    assert fast_copies.host_copy_s == pytest.approx(0.05) and fast_copies.total_s == pytest.approx(serial.total_s)
    assert time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, None, **staged).host_copy_s == 0  # a CPU: none
    roomy = time_model.step_time(forward, 0.05, [0, 1, 2], bytes_, 1e9, optimizer_s=0.01, slots=3)
    assert roomy.transfer_s == 0 and roomy.total_s == pytest.approx(roomy.compute_s + 0.01)  # all stay in the ring
    cpu = time_model.step_time([0.1, 0.2], 0.05, [1], [10 ** 9, 0], None, optimizer_s=0.01)
    assert cpu.transfer_s == cpu.fill_s == 0 and cpu.bound == "compute"
    assert cpu.total_s == pytest.approx(2.5 * 0.35 + 0.2 + 0.01)
    assert cpu.phase_limit_s == cpu.limit_s == pytest.approx(cpu.total_s) and "phase by phase" not in cpu.describe()
    # on a plan: what streams crosses twice (forward, recompute), at the description's bandwidth
    d = flux_like()
    plan = estimate(d, LORA, SHAPE, OffloadPolicy(base_placement="streamed", checkpointing="blocks"))
    assert plan.streamed_blocks == tuple(range(57)) and plan.resident_blocks == ()
    sizes = [b.param_bytes for b in d.blocks]
    assert plan.step_time.transfer_s == pytest.approx((2 * sum(sizes) - sum(sizes[:2]) - sum(sizes[-2:])) / 25e9)
    assert plan.step_time.bound == "transfer"
    assert estimate(d, LORA, SHAPE, OffloadPolicy()).predicted_s_per_step == pytest.approx(RESIDENT_S, rel=0.01)


def test_a_budget_slightly_under_resident_checkpoints_a_few_blocks_not_all():
    """SDXL at 12 GiB in the GPU kit: 0.95 GiB over without checkpointing, and every block was checkpointed (2.04x
    the resident step). Now: the blocks cheapest to recompute per byte saved, until it fits, with the slack."""
    d = flux_like()
    budget = resident_peak(d) - int(0.95 * GIB)
    plan = plan_auto(d, LORA, SHAPE, OffloadPolicy(), budget)
    assert plan.fits and plan.policy.base_placement == "resident" and plan.policy.checkpointing == "blocks"
    assert 0 < len(plan.checkpointed_blocks) < 6, plan.checkpointed_blocks
    assert plan.policy.checkpoint_selection == set(plan.checkpointed_blocks)
    assert plan.peak_bytes <= budget * (1 - planner.SELECTION_SLACK)  # the allocator's slack kept
    every = estimate(d, LORA, SHAPE, OffloadPolicy(checkpointing="blocks"), budget)
    assert plan.predicted_s_per_step < every.predicted_s_per_step
    assert plan.predicted_s_per_step < 1.1 * RESIDENT_S
    # double blocks free 700 MiB for 2.4x the recompute of a single block's 300: per byte, they are cheaper
    assert all(d.blocks[i].name.startswith("double") for i in plan.checkpointed_blocks)
    assert "Checkpointing" in plan.reason and "allocator slack" in plan.reason
    text = plan.to_text()
    assert "predicted" in text and "s/step" in text and "blocks (57): checkpointed" in text
    data = json.loads(plan.to_json())
    assert data["predicted_s_per_step"] == pytest.approx(plan.predicted_s_per_step)
    assert data["blocks"]["checkpointed"] == list(plan.checkpointed_blocks)
    assert f"({len(plan.checkpointed_blocks)} of 57 blocks)" in plan.summary() and "s/step" in plan.summary()


@pytest.mark.parametrize("budget_gib", [6, 8, 12, 16, 24, 40])
def test_the_chosen_policy_is_the_fastest_predicted_of_those_that_fit(budget_gib):
    d = flux_like()
    budget = budget_gib * GIB
    plan = plan_auto(d, LORA, SHAPE, OffloadPolicy(), budget)
    fitting = []
    for policy in candidate_policies(OffloadPolicy(), ["as_loaded"]):
        whole = estimate(d, LORA, SHAPE, policy, budget)
        if whole.fits:
            fitting += [whole, *selective_plans(d, LORA, SHAPE, policy, budget)]
    assert plan.fits and fitting
    fastest = min(fitting, key=lambda p: p.predicted_s_per_step)  # at the ring's default two slots
    # each with the slots that predict the fastest step for it (planner.with_best_slots), every one weighed: the plan
    # skips those that cannot win (planner.fastest_with_slots) and finds the same; never slower than two slots
    deepest = min((planner.with_best_slots(d, LORA, SHAPE, p, budget) for p in fitting),
                  key=lambda p: p.predicted_s_per_step)
    assert plan.predicted_s_per_step == pytest.approx(deepest.predicted_s_per_step)
    assert plan.predicted_s_per_step <= fastest.predicted_s_per_step
    # the plan says which whole blocks stay and which stream; a block not recomputed stays
    assert sorted(plan.resident_blocks + plan.streamed_blocks) == list(range(57))
    assert set(plan.streamed_blocks) <= set(plan.checkpointed_blocks)


def test_the_predicted_step_does_not_grow_with_the_budget():
    d = flux_like()
    budgets = [6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 56, 64, 80]
    times = [plan_auto(d, LORA, SHAPE, OffloadPolicy(), b * GIB).predicted_s_per_step for b in budgets]
    assert all(later <= earlier * (1 + 1e-9) for earlier, later in zip(times, times[1:])), times
    assert times[-1] == pytest.approx(RESIDENT_S, rel=0.01) and times[0] > times[-1]


def test_partial_placement_recomputes_fewer_blocks_where_streaming_would_cost_more():
    """A partial plan checkpoints what frees room for resident blocks only while that is faster (the time model
    weighs recompute against the bytes streamed); blocks it does not recompute stay on the device."""
    d = flux_like()
    plan = plan_auto(d, LORA, SHAPE, OffloadPolicy(), 24 * GIB)
    assert plan.policy.base_placement == "partial"
    every = estimate(d, LORA, SHAPE, OffloadPolicy(base_placement="partial", checkpointing="blocks"), 24 * GIB)
    assert plan.predicted_s_per_step <= every.predicted_s_per_step
    kept = set(range(57)) - set(plan.checkpointed_blocks)
    assert kept <= set(plan.resident_blocks)
    # the run estimates its own policy again, with the slots it suits best (nodes/bridge/planning.run_plan, for the
    # share of the base its load keeps): the same plan, the slack kept
    again = planner.with_best_slots(d, LORA, SHAPE, estimate(d, LORA, SHAPE, plan.policy, 24 * GIB), 24 * GIB)
    assert again.base_device_bytes == plan.base_device_bytes and again.to_dict() == plan.to_dict() | {"reason": ""}
    assert again.peak_bytes <= planner.planned_room(plan.policy, 24 * GIB) + MIB


def test_a_selection_that_leaves_streamed_blocks_unrecomputed_does_not_fit():
    """Partial placement with too few blocks recomputed: the blocks that must stay do not fit the resident share, and
    autograd would keep the streamed ones' weights: the plan counts them and goes over the budget."""
    d = flux_like()
    policy = OffloadPolicy(base_placement="partial", checkpointing="blocks", checkpoint_blocks="0")
    plan = estimate(d, LORA, SHAPE, policy, 12 * GIB)
    assert plan.phase("training step").items["streamed blocks not checkpointed (autograd keeps their weights)"] > 0
    assert plan.fits is False
    with pytest.raises(ValueError, match="not among this model's 57 blocks"):
        estimate(d, LORA, SHAPE, OffloadPolicy(checkpointing="blocks", checkpoint_blocks="57"))


def test_without_measured_times_blocks_cost_reading_their_weights_and_a_cpu_moves_nothing():
    d = ModelDescription.from_dict({**flux_like().to_dict(), "compute_device": "cpu"})
    assert d.timed and d.h2d() is None
    plan = estimate(d, LORA, SHAPE, OffloadPolicy(base_placement="streamed", checkpointing="blocks"))
    assert plan.step_time.transfer_s == 0 and plan.step_time.bound == "compute"
    untimed = ModelDescription.from_dict({**flux_like().to_dict(), "blocks": [
        {**b, "forward_s": {}} for b in flux_like().to_dict()["blocks"]]})
    assert not untimed.timed
    forward = untimed.forward_seconds(AREA, 512, 1)
    assert forward[0] == pytest.approx(untimed.blocks[0].param_bytes / time_model.DEVICE_BYTES_PER_S["cuda"])
    assert "not measured" in estimate(untimed, LORA, SHAPE, OffloadPolicy()).step_time.describe()
    # a description written before the time model reads back (no forward_s, no outside_forward_s)
    old = flux_like().to_dict()
    old.pop("outside_forward_s")
    for b in old["blocks"]:
        b.pop("forward_s")
    assert not ModelDescription.from_dict(old).timed


def test_measured_times_fit_a_line_in_the_area_never_below_zero():
    assert time_model.fit_seconds([1, 2, 3], [1.0, 2.0, 3.0]) == pytest.approx((0.0, 1.0))
    const, slope = time_model.fit_seconds([1, 2, 3], [3.0, 2.0, 1.0])  # noise that fell with the area: flat
    assert slope == 0 and const == pytest.approx(2.0)
    assert time_model.h2d_bytes_per_s("cpu") is None


def test_the_optimizer_step_is_bandwidth_bound_on_a_card_and_priced_per_weight_in_host_ram():
    on_device = time_model.optimizer_step_s(4 * 10 ** 8, 8 * 10 ** 8, False, "cuda", 2e10)
    on_host = time_model.optimizer_step_s(4 * 10 ** 8, 8 * 10 ** 8, True, "cuda", 2e10, 15e-9, 10 ** 8)
    assert on_device == pytest.approx((3 * 4 + 2 * 8) * 10 ** 8 / 1e12)
    assert on_host == pytest.approx(10 ** 8 * 15e-9 + 2 * 4 * 10 ** 8 / 2e10)  # the step, gradients down, weights up
    assert math.isfinite(on_host) and on_host > on_device
    # a CPU run steps in host RAM whatever the policy says, and nothing crosses
    assert time_model.optimizer_step_s(4 * 10 ** 8, 0, False, "cpu", None, 15e-9, 10 ** 8) == pytest.approx(1.5)


def test_the_host_step_is_measured_once_per_optimizer_as_fused_backward_runs_it(monkeypatch):
    """core/optimizers.host_step_s_per_weight times fused backward's own step of a probe tensor in host RAM (a
    bandwidth figure was 6-27x too fast: docs/benchmarks/full_finetune.md): a positive rate, below a microsecond per
    weight on any CPU; cached per (optimizer, rounding, threads); an optimizer that cannot step here gets the time
    model's default. The planner prices a host step at the TrainableSpec's rate (the nodes' planning measures it)."""
    import torch

    from headroom.training.core import optimizers

    monkeypatch.setattr(optimizers, "HOST_STEP_PROBE_SHAPE", (256, 128))
    optimizers.host_step_s_per_weight.cache_clear()
    try:
        fp32 = optimizers.host_step_rate("AdamW", False)
        assert 0 < fp32 < 1e-6 and fp32 != time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT  # measured, not the fallback
        assert optimizers.host_step_s_per_weight.cache_info().currsize == 1
        assert optimizers.host_step_rate("AdamW", False) == fp32  # measured once
        with torch.inference_mode():  # as ComfyUI runs a node that plans: the probe still steps
            under_comfy = optimizers.host_step_s_per_weight("AdamW", False, -1)
        assert under_comfy != time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT and 0 < under_comfy < 1e-6
        assert 0 < optimizers.host_step_rate("Adafactor", True) < 1e-6  # bf16 weights: the copy and the rounding
        assert optimizers.host_step_s_per_weight("no such optimizer", False, torch.get_num_threads()) == \
            time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT
    finally:
        optimizers.host_step_s_per_weight.cache_clear()
    d = flux_like()
    host_state = OffloadPolicy(optimizer_state="cpu")
    slow, fast = (estimate(d, dataclasses.replace(LORA, host_step_s_per_weight=rate), SHAPE, host_state)
                  for rate in (40e-9, 4e-9))
    assert slow.step_time.optimizer_s - fast.step_time.optimizer_s == pytest.approx(36e-9 * LORA.param_count)
    assert estimate(d, LORA, SHAPE, host_state).step_time.optimizer_s == pytest.approx(
        estimate(d, dataclasses.replace(LORA, host_step_s_per_weight=time_model.DEFAULT_HOST_STEP_S_PER_WEIGHT), SHAPE,
                 host_state).step_time.optimizer_s)  # not measured: the default


@pytest.fixture
def clock(monkeypatch):
    """A virtual clock for the planner's timers: `clock.sleep(s)` advances it by exactly s. A real sleep overshoots by
    milliseconds at random on a busy machine (these tests failed under CI's load: a fitted slope, a backward ratio)."""
    class Clock:
        now = 0.0

        def sleep(self, seconds):
            self.now += seconds

    virtual = Clock()
    # the planner's own `time` only (it reads perf_counter alone): the process's clock stays real
    monkeypatch.setattr(planner, "time", types.SimpleNamespace(perf_counter=lambda: virtual.now))
    return virtual


def test_calibration_forwards_time_each_block_and_the_fit_follows_the_area(clock):
    """planner.measure_activations times each block's forward (the time model's input on the machine that plans: a
    CPU's own time there); the first forward is left out of the fit (one-time setup)."""
    import torch

    class Sleepy(torch.nn.Module):
        def __init__(self, per_px):
            super().__init__()
            self.linear, self.per_px = torch.nn.Linear(4, 4), per_px

        def forward(self, x):
            clock.sleep(self.per_px * x.shape[0])
            return self.linear(x)

    blocks = [Sleepy(2e-4), Sleepy(0.0)]
    samples = []
    for area in (64, 32, 64, 128, 32):
        x = torch.randn(area, 4)

        def run(x=x):
            h = x
            for block in blocks:
                h = block(h)
            return h.sum()

        samples.append(planner.measure_activations(run, blocks, latent_area=area))
    assert [s.block_forward_s for s in samples] == [pytest.approx([2e-4 * s.latent_area, 0.0]) for s in samples]
    forward, outside = planner.fit_times(samples)
    # the virtual clock's seconds: the fit is the block's own slope, and the empty block costs nothing
    assert forward[0].per_latent_px == pytest.approx(2e-4) and forward[0].const == pytest.approx(0.0, abs=1e-12)
    assert forward[1].per_latent_px == pytest.approx(0.0, abs=1e-12)
    assert outside.const >= 0 and outside.per_latent_px >= 0
    profiles = planner.describe_blocks([("a", blocks[0]), ("b", blocks[1])], [ActivationLaw()] * 2,
                                       [ActivationLaw()] * 2, samples, forward)
    assert profiles[0].forward_s == forward[0]


def test_block_times_at_the_runs_size_are_each_blocks_own_in_the_last_forward_and_proportional_to_the_area(clock):
    """planner.time_blocks (the nodes time each block at the run's size: nodes/bridge/planning.time_at_run_size): per
    block the seconds between its own hooks, hooks registered before (a block brought to the device) outside the
    span; the last of `repeats` forwards counts (the first pays for one-time setup); the laws are exact at the area
    timed and proportional elsewhere."""
    import torch

    class Sleepy(torch.nn.Module):
        def __init__(self, seconds, first=0.0):
            super().__init__()
            self.linear, self.seconds, self.first, self.calls = torch.nn.Linear(4, 4), seconds, first, 0

        def forward(self, x):
            self.calls += 1
            clock.sleep(self.seconds + (self.first if self.calls == 1 else 0.0))
            return self.linear(x)

    blocks = [Sleepy(0.02), Sleepy(0.0, first=0.5)]
    before = blocks[0].register_forward_pre_hook(lambda module, args: clock.sleep(0.3))  # e.g. a copy to the device

    def run():
        clock.sleep(0.01)  # outside the blocks
        h = torch.randn(8, 4)
        for block in blocks:
            h = block(h)
        return h.sum()

    times = planner.time_blocks(run, blocks, latent_area=4096, repeats=2)
    before.remove()
    assert [b.calls for b in blocks] == [2, 2]
    assert times.block_forward_s[0] == pytest.approx(0.02)  # its sleep, not the hook's before it
    assert times.block_forward_s[1] == pytest.approx(0.0, abs=1e-12)  # the first forward's one-time cost left out
    assert times.outside_forward_s == pytest.approx(0.3 + 0.01)  # the earlier hook ran outside the block's span
    assert not blocks[0]._forward_pre_hooks and not blocks[0]._forward_hooks  # its hooks removed
    forward, outside = times.laws()
    assert [law.at(4096, 77) for law in forward] == pytest.approx(list(times.block_forward_s))
    assert forward[0].at(2048, 77) == pytest.approx(times.block_forward_s[0] / 2)
    assert outside.at(4096, 0) == pytest.approx(times.outside_forward_s)


def test_the_backward_is_timed_once_per_kind_of_block_and_prices_the_step(clock):
    """planner.time_blocks(backward=True): the first block of each kind (class, tensor shapes) runs again on the inputs
    it had, with gradients, and its backward's seconds per forward second stand for every block of its kind; a block
    that adds into its input in place is run through the trainer's protection (checkpointing.inplace_safe). The time
    model prices each block's backward with its ratio (BACKWARD_PER_FORWARD where none was measured)."""
    import torch

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            clock.sleep(ctx.seconds)
            return grad * 2, None

    class Block(torch.nn.Module):
        def __init__(self, width, forward_s, backward_s, inplace=False):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.forward_s, self.backward_s, self.inplace = forward_s, backward_s, inplace

        def forward(self, x):
            clock.sleep(self.forward_s)
            h = SlowBackward.apply(self.norm(x), self.backward_s)
            if self.inplace:
                x += h  # as Flux's blocks do: autograd refuses it on an input a layer saved
                return x
            return x + h

    blocks = [Block(4, 0.02, 0.2), Block(4, 0.02, 0.2), Block(8, 0.02, 0.1, inplace=True)]

    def run():
        h = torch.randn(2, 4)
        h = blocks[1](blocks[0](h))
        return blocks[2](torch.cat([h, h], dim=1))

    with torch.no_grad():
        times = planner.time_blocks(run, blocks, latent_area=64, backward=True, inplace_inputs=True)
        plain = planner.time_blocks(run, blocks, latent_area=64, backward=True)
    ratios = times.block_backward_per_forward
    assert ratios[0] == ratios[1] == pytest.approx(10.0)  # one kind, timed once: its backward's 0.2 s per 0.02 s
    assert ratios[2] == pytest.approx(5.0)  # its own kind, run through the protection: 0.1 s per 0.02 s
    assert plain.block_backward_per_forward[2] == 0.0  # refused in place without the protection: not measured
    assert times.outside_backward_per_forward > 0
    # priced per block: the step is each forward (1 + its ratio), not 2.5x every forward
    forward = list(times.block_forward_s)
    step = time_model.step_time(forward, 0.0, [], [0, 0, 0], None, backward_per_forward=ratios)
    assert step.compute_s == pytest.approx(sum((1 + r) * f for r, f in zip(ratios, forward)))
    rule = time_model.step_time(forward, 0.0, [], [0, 0, 0], None, backward_per_forward=(0.0, 0.0, 0.0))
    assert rule.compute_s == pytest.approx((1 + time_model.BACKWARD_PER_FORWARD) * sum(forward))

    # A frozen block (a ControlNet run's base: nothing in it trains) is timed too: its backward is its input's gradient,
    # which time_blocks' no_grad must not switch off (it did: the input's clone needed none, and the ratio read 0)
    frozen = Block(4, 0.02, 0.2).requires_grad_(False)
    with torch.no_grad():
        alone = planner.time_blocks(lambda: frozen(torch.randn(2, 4)), [frozen], latent_area=64, backward=True)
    assert alone.block_backward_per_forward == (pytest.approx(10.0),)


def test_after_out_of_memory_a_selective_plan_is_followed_by_every_block_checkpointed():
    d = flux_like()
    budget = resident_peak(d) - int(0.95 * GIB)
    selective = plan_auto(d, LORA, SHAPE, OffloadPolicy(), budget)
    assert selective.policy.checkpoint_selection is not None
    following = planner.next_smaller_policy(d, LORA, SHAPE, selective.policy, budget)
    assert following.policy == selective.policy.replace(checkpoint_blocks="")
    assert following.peak_bytes <= 0.9 * selective.peak_bytes


def test_whole_block_placement_more_budget_more_resident_blocks_less_streamed_time():
    """On recorded timings (the Flux-like description): the plan keeps the non-block layers and whole blocks on the
    device and streams the rest through the ring; each GiB more keeps more blocks and predicts a faster step; the
    prediction is the per-block pipeline, never under the physical limit max(compute, transfer)."""
    d = flux_like()
    plans = [plan_auto(d, LORA, SHAPE, OffloadPolicy(), gib * GIB) for gib in (8, 12, 16, 24, 32)]
    resident = [len(p.resident_blocks) for p in plans]
    assert all(p.fits and p.policy.base_placement in ("partial", "streamed") for p in plans)
    assert resident == sorted(resident) and resident[0] < resident[-1] and 0 < resident[-1] < 57
    assert [p.predicted_s_per_step for p in plans] == sorted((p.predicted_s_per_step for p in plans), reverse=True)
    for p in plans:
        assert set(p.resident_blocks) | set(p.streamed_blocks) == set(range(57))
        assert not set(p.resident_blocks) & set(p.streamed_blocks)
        assert set(p.streamed_blocks) <= set(p.checkpointed_blocks)  # a streamed block is always recomputed
        t = p.step_time
        assert t.limit_s <= t.phase_limit_s <= t.total_s <= t.limit_s + max(t.compute_s, t.transfer_s)
        blocks = p.to_dict()["blocks"]
        assert blocks["resident"] == list(p.resident_blocks) and blocks["slots"] == p.stream_slots
        # resident blocks spread among the streamed ones hide the ring's copies: within 12 % of the physical limit
        # (16 GiB, where the copies nearly equal the compute: 1.116x with four slots, 1.167x with two)
        assert t.total_s <= 1.12 * t.limit_s, (p.budget_bytes / GIB, t.total_s, t.limit_s)
        assert max(p.resident_blocks) > len(p.resident_blocks)  # not the first blocks in a row
    # four of eight equal blocks resident, copies twice a block's forward: in a row the copy stream idles while they
    # compute; spread (as planned) every copy overlaps a resident block's compute
    forward = [0.1] * 8

    def resident(kept):
        return time_model.step_time(forward, 0.0, range(8), [0 if i in kept else 2 * 10 ** 8 for i in range(8)], 1e9)

    in_row, spread = resident({0, 1, 2, 3}), resident(set(planner.spread(list(range(8)))[:4]))
    assert in_row.limit_s == spread.limit_s == pytest.approx(spread.total_s) and spread.total_s < in_row.total_s


def test_streamed_blocks_past_the_pin_limit_cross_at_the_pageable_bandwidth():
    """Windows lets a process lock about half its RAM and ComfyUI keeps its pins within 40 % of it: the ring pins its
    blocks in forward order, each that still fits (as weight_streaming.WeightStreamer does: tests/unit/
    test_weight_streaming.py checks the two agree), and the rest cross from pageable memory at its own measured
    bandwidth. The predicted step prices each copy at its own rate and says how much of the transfer is pageable."""
    assert time_model.pinned_blocks([3, 3, 1, 3, 0], 5) == {0, 2}  # block 1 does not fit beside 0, block 2 does
    assert time_model.pinned_blocks([3, 3, 0, 3], None) == {0, 1, 3}  # no limit: every streamed block
    assert time_model.pinned_blocks([3, 3], 0) == set()  # --disable-pinned-memory
    forward, bytes_ = [0.1] * 4, [10 ** 9] * 4
    pinned = time_model.step_time(forward, 0.0, range(4), bytes_, 1e9, slots=2)
    limited = time_model.step_time(forward, 0.0, range(4), bytes_, 1e9, slots=2, pin_limit_bytes=2 * 10 ** 9,
                                   pageable_bytes_per_s=5e8)
    # blocks 0, 1 pinned; 2, 3 pageable. Copied: 2, 3 in forward (0, 1 still in the ring), 0, 1 in backward
    assert pinned.transfer_s == pytest.approx(4.0) and pinned.pageable_s == 0
    assert limited.transfer_s == pytest.approx(2 * 2.0 + 2 * 1.0) and limited.pageable_s == pytest.approx(4.0)
    assert limited.total_s > pinned.total_s and limited.limit_s == pytest.approx(6.0)
    assert "4.000 s from pageable memory" in limited.describe() and "pageable" not in pinned.describe()
    # A pageable copy holds the CPU, which queues nothing meanwhile. Forward: block 2's copy (2 s), started after block
    # 1 is queued, overlaps block 1 only; block 3's overlaps block 2: 0.4 + 2 x 1.9 = 4.2 s. Backward (0.25 s a block:
    # 1.5 x forward + the recompute) copies the pinned blocks 1 and 0 through the ring: 2.5 s.
    assert limited.pipeline_s == pytest.approx(4.2 + 2.5) and limited.total_s == pytest.approx(6.7)
    # Every block pageable: with 2 slots backward's copies overlap nothing (before_backward starts the next copy before
    # queueing its own block, into the slot the block running now frees): 4.2 + 4 x 0.25 + 2 x 2 = 9.2 s, in the
    # pipeline (a deeper ring overlaps them: the floor below which no depth goes leaves them out)
    unpinned = time_model.step_time(forward, 0.0, range(4), bytes_, 1e9, slots=2, pin_limit_bytes=0,
                                    pageable_bytes_per_s=5e8)
    assert unpinned.serial_s == 0 and unpinned.total_s == pytest.approx(9.2)
    assert unpinned.ring_floor_s == pytest.approx(unpinned.compute_s)
    # With 3 slots backward starts a pageable copy one block later (weight_streaming._prefetch), so it overlaps the
    # block queued before: forward copies block 3 over block 1 (0.4 + 1.9), backward block 0 over block 2
    # (1.0 + 1.75): 5.05 s, nothing serial
    deeper = time_model.step_time(forward, 0.0, range(4), bytes_, 1e9, slots=3, pin_limit_bytes=0,
                                  pageable_bytes_per_s=5e8)
    assert deeper.serial_s == 0 and deeper.total_s == pytest.approx(2.3 + 2.75)
    default = time_model.step_time(forward, 0.0, range(4), bytes_, 1e9, slots=2, pin_limit_bytes=0)
    assert default.pageable_s == pytest.approx(4 * 10 ** 9 / time_model.DEFAULT_PAGEABLE_H2D_BYTES_PER_S)
    # on a plan: the Flux-like description on a 12 GiB budget with 8 GiB left to pin (a 32 GB Windows PC beside
    # ComfyUI's own pins), and the pageable bandwidth a third of the pinned one
    d = flux_like()
    free = plan_auto(d, LORA, SHAPE, OffloadPolicy(), 12 * GIB)
    tight_d = dataclasses.replace(d, pinnable_bytes=8 * GIB, pageable_h2d_bytes_per_s=25e9 / 3)
    tight = estimate(tight_d, LORA, SHAPE, free.policy, 12 * GIB, slots=free.stream_slots)
    sizes = [b.param_bytes if i in free.streamed_blocks else 0 for i, b in enumerate(d.blocks)]
    kept = time_model.pinned_blocks(sizes, 8 * GIB)
    assert free.pageable_bytes == 0 and free.pinnable_bytes is None
    assert tight.pageable_bytes == sum(sizes) - sum(sizes[i] for i in kept) > 0
    assert tight.predicted_s_per_step > free.predicted_s_per_step and tight.step_time.pageable_s > 0
    assert "priced in the predicted step" in tight.pinned_line()
    # the planner weighs it: with the pin limit it chooses another plan (here the block inputs to host RAM, pinned by
    # torch's own allocator, for more resident blocks: 2.35 s against 2.64 s for the unlimited choice under the limit)
    chosen = plan_auto(tight_d, LORA, SHAPE, OffloadPolicy(), 12 * GIB)
    assert chosen.fits and chosen.policy != free.policy
    assert chosen.predicted_s_per_step < 0.95 * tight.predicted_s_per_step
    # a CPU run pins nothing and crosses nothing: the limit is not applied
    on_cpu = estimate(dataclasses.replace(tight_d, compute_device="cpu"), LORA, SHAPE, free.policy, 12 * GIB)
    assert on_cpu.pageable_bytes == 0 and on_cpu.pinnable_bytes is None


def test_a_plan_far_slower_than_a_card_holding_the_whole_run_says_so():
    """Issue 42 item 3: a placement that fits only with the trained weights and the optimizer in host RAM is offered,
    but its summary, reason and JSON say how much slower than a card that holds the whole run it is predicted, and
    what costs most; a plan near that card's step says nothing."""
    d = flux_like()
    full = TrainableSpec(((3072, 3072),) * 1000, "AdamW", element_size=2, full=True)  # 9.4 B weights, bf16
    fused = OffloadPolicy(fused_backward=True)
    tight = plan_auto(d, full, SHAPE, fused, 16 * GIB)
    # the optimizer state streamed to the card for each tensor's step beats stepping 9.4 B weights in host RAM
    assert tight.fits and tight.policy.trained_weights == "host" and tight.policy.optimizer_state == "streamed"
    unbounded = estimate(d, full, SHAPE, candidate_policies(fused)[0], None)
    ratio = tight.predicted_s_per_step / unbounded.predicted_s_per_step
    assert ratio >= planner.SLOW_STEP_RATIO
    assert tight.slow.startswith(f"predicted {ratio:.1f}x the step of a card that holds the whole run")
    # the CPU copies every crossing of the weights and the state through the pinned staging buffers, at 10 GB/s here
    # (time_model.DEFAULT_HOST_COPY_BYTES_PER_S) against the link's 25: those copies take longest
    assert "most of it the CPU's copies through the staging buffers" in tight.slow
    assert tight.step_time.bound == "host-copy" and tight.predicted_s_per_step == tight.step_time.host_copy_s
    assert "the CPU's staging copies" in tight.step_time.describe()
    fast_copies = estimate(dataclasses.replace(d, host_copy_bytes_per_s=1e12), full, SHAPE, tight.policy, 16 * GIB)
    assert "most of it host <-> device copies" in planner._slowness(fast_copies, unbounded)
    on_host = estimate(d, full, SHAPE, tight.policy.replace(optimizer_state="cpu"), 16 * GIB)
    assert on_host.fits and on_host.predicted_s_per_step > tight.predicted_s_per_step
    assert "most of it the optimizer step in host RAM" in planner._slowness(on_host, unbounded)
    assert f"SLOW: {tight.slow}" in tight.summary() and f"Slow: {tight.slow}." in tight.reason
    assert json.loads(tight.to_json())["slow"] == tight.slow
    roomy = plan_auto(d, LORA, SHAPE, OffloadPolicy(), 48 * GIB)
    assert roomy.slow == "" and "SLOW" not in roomy.summary()
    # without measured block times the ratio rests on an estimate, and the note says so
    untimed = dataclasses.replace(d, blocks=tuple(dataclasses.replace(b, forward_s=ActivationLaw()) for b in d.blocks))
    assert plan_auto(untimed, full, SHAPE, fused, 16 * GIB).slow.endswith("compute estimated from weight bytes, so "
                                                                           "the ratio is high)")


def test_a_full_fine_tune_keeps_the_trained_weights_of_the_most_blocks_that_fit_on_the_card():
    """Issue 42: with the trained weights in host RAM the card often has room left in the step; the planner keeps the
    trained weights of as many blocks as fit there (trained_weights_card_blocks, the largest first: each byte kept
    saves its three crossings), counts them on the card in training and validation and only the rest crossing, and
    one block more would not fit."""
    d = flux_like()
    double, single = (3072, 110_592), (3072, 46_080)  # a Flux double / single block's trained elements, bf16
    full = TrainableSpec((double,) * 19 + (single,) * 38, "Adafactor", element_size=2, full=True,
                         block_layers=tuple(((f"{i}.w", math.prod(s)),) for i, s in
                                            enumerate((double,) * 19 + (single,) * 38)),
                         unread_base_blocks=d.blocks)  # every block's weights trained: their base never read
    chosen = plan_auto(d, full, SHAPE, OffloadPolicy(fused_backward=True), 24 * GIB)
    policy = chosen.policy
    kept = policy.trained_card_blocks
    assert chosen.fits and policy.trained_weights == "host" and 0 < len(kept) < 57
    assert sorted(kept)[:3] == [0, 1, 2]  # the double blocks (largest) first
    on_card = sum(math.prod(full.shapes[i]) for i in kept) * 2
    assert chosen.phase("training step").items["trained weights kept on the card (bf16, trained weights in host RAM)"] \
        == chosen.phase("validation").items["trained weights kept on the card (bf16, trained weights in host RAM)"] \
        == on_card
    assert chosen.host_bytes["trained weights (bf16, in host RAM)"] == full.weight_bytes() - on_card
    all_crossing = estimate(d, full, SHAPE, policy.replace(trained_weights_card_blocks=""), 24 * GIB)
    assert all_crossing.fits and chosen.predicted_s_per_step < all_crossing.predicted_s_per_step
    assert all_crossing.step_time.transfer_s - chosen.step_time.transfer_s == pytest.approx(3 * on_card / d.h2d())
    assert all_crossing.step_time.host_copy_s - chosen.step_time.host_copy_s == pytest.approx(
        3 * on_card / time_model.DEFAULT_HOST_COPY_BYTES_PER_S)  # and the CPU copies none of them through staging
    order = sorted(range(57), key=lambda i: (-math.prod(full.shapes[i]), i))
    one_more = policy.replace(trained_weights_card_blocks=",".join(map(str, order[:len(kept) + 1])))
    assert not estimate(d, full, SHAPE, one_more, 24 * GIB).fits
    assert f"{len(kept)} blocks' kept on the card" in chosen.summary() and "stay on the card" in chosen.reason


def test_the_plan_chooses_the_rings_slots_each_a_block_fewer_resident():
    """planner.with_best_slots: the streamer's ring of device slots (prefetch depth + 1) is the plan's choice among
    SLOT_CHOICES, the fastest predicted within the budget. Each slot is a block's buffer on the card, so a resident
    block fewer; at 16 GiB on the Flux-like recorded timings the copies nearly equal the compute and a deeper ring
    smooths their bursts. The run's streamer takes the plan's slots (nodes/bridge/planning.run_plan)."""
    d = flux_like()
    plan = plan_auto(d, LORA, SHAPE, OffloadPolicy(), 16 * GIB)
    two = estimate(d, LORA, SHAPE, plan.policy, 16 * GIB)  # the same policy with the default two slots
    assert plan.stream_slots in planner.SLOT_CHOICES and plan.stream_slots > 2
    assert plan.fits and plan.predicted_s_per_step < two.predicted_s_per_step
    largest = max(b.weight_bytes("as_loaded") for b in d.blocks)
    items = plan.phase("training step").items
    assert items[f"streamed block buffers ({plan.stream_slots} blocks)"] == plan.stream_slots * largest
    assert len(plan.resident_blocks) < len(two.resident_blocks)
    assert f"through a ring of {plan.stream_slots} device slots" in plan.to_text()
    assert plan.to_dict()["blocks"]["slots"] == plan.stream_slots
    # nothing streamed (a card that holds the run), or nothing crossing (a CPU): nothing to choose
    roomy = plan_auto(d, LORA, SHAPE, OffloadPolicy(), 80 * GIB)
    assert not roomy.streamed_blocks and roomy.stream_slots == 2
    on_cpu = dataclasses.replace(d, compute_device="cpu")
    assert planner.with_best_slots(on_cpu, LORA, SHAPE, two, 16 * GIB) is two
    # every fitting policy is weighed with its own best ring, not only the fastest at two slots: at 24 GiB checkpointing
    # 52 blocks with three slots beats the 56 that were fastest with two (and with their own best ring)
    budget = 24 * GIB
    fitting = [p for policy in candidate_policies(OffloadPolicy(), ["as_loaded"])
               if (whole := estimate(d, LORA, SHAPE, policy, budget)).fits
               for p in (whole, *selective_plans(d, LORA, SHAPE, policy, budget))]
    at_two = min(fitting, key=lambda p: p.predicted_s_per_step)
    plan = plan_auto(d, LORA, SHAPE, OffloadPolicy(), budget)
    assert plan.policy != at_two.policy and plan.stream_slots > 2
    assert plan.predicted_s_per_step < planner.with_best_slots(d, LORA, SHAPE, at_two, budget).predicted_s_per_step
    # what it skips cannot win: no ring takes a step below its compute, serial copies and optimizer step
    for p in fitting:
        deeper = planner.with_best_slots(d, LORA, SHAPE, p, budget)
        assert deeper.predicted_s_per_step >= p.step_time.ring_floor_s == pytest.approx(deeper.step_time.ring_floor_s)


def test_of_plans_the_cpus_staging_copies_bind_alike_the_one_whose_card_is_done_sooner_wins():
    """Where the CPU's copies through the staging buffers bound the step (time_model: host_copy_s), placements that
    differ on the card predict the same step; the planner then takes the one whose card does its share sooner (more
    of the base resident) rather than whichever came first."""
    d = flux_like()
    full = TrainableSpec(((3072, 3072),) * 1000, "AdamW", element_size=2, full=True)  # 9.4 B weights, bf16
    on_host = OffloadPolicy(fused_backward=True, trained_weights="host", optimizer_state="streamed",
                            checkpointing="blocks")
    streamed = estimate(d, full, SHAPE, on_host.replace(base_placement="streamed"), 48 * GIB)
    resident = estimate(d, full, SHAPE, on_host.replace(base_placement="resident"), 48 * GIB)
    assert streamed.fits and resident.fits
    assert streamed.step_time.bound == resident.step_time.bound == "host-copy"
    assert streamed.predicted_s_per_step == resident.predicted_s_per_step
    assert resident.step_time.card_s < streamed.step_time.card_s
    assert planner.fastest_with_slots(d, full, SHAPE, [streamed, resident], 48 * GIB) is resident


def test_the_bandwidth_probes_give_their_pinned_buffer_back(monkeypatch):
    """torch's pinned allocator keeps a freed buffer locked for the process: the probes' 256 MiB would stay out of
    what the OS can page and ComfyUI can pin (Windows: about half the RAM in all). Each probe gives it back."""
    from headroom.training.memory import pinned_host

    released = []
    monkeypatch.setattr(pinned_host, "release_cached", lambda: released.append(1))
    monkeypatch.setattr(time_model, "H2D_PROBE_BYTES", 1 << 20)
    time_model.measured_host_copy.cache_clear()
    try:
        assert time_model.measured_host_copy(False) > 0 and released == [1]
        assert time_model.measured_host_copy(False) > 0 and released == [1]  # measured once
    finally:
        time_model.measured_host_copy.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned probes need CUDA")
def test_after_the_probes_torch_keeps_no_pinned_buffer_cached():
    from headroom.training.memory import pinned_host

    pinned_host.release_cached()  # what earlier tests of this process left cached
    time_model._measured_h2d.cache_clear()
    time_model.measured_host_copy.cache_clear()
    try:
        assert time_model.h2d_bytes_per_s("cuda") > 0 and time_model.host_copy_bytes_per_s("cuda") > 0
        stats = torch.cuda.host_memory_stats()
        assert stats["allocated_bytes.current"] - stats["active_bytes.current"] < time_model.H2D_PROBE_BYTES
    finally:
        time_model._measured_h2d.cache_clear()
        time_model.measured_host_copy.cache_clear()


def test_blocks_backward_skips_run_no_backward_and_their_copies_move_to_the_turn():
    """The first blocks with no trained layer in or before them (planner.blocks_without_backward) run no backward and
    no recompute; the ring fetches the first of them in backward, for the next forward (weight_streaming._prefetch;
    tests/unit/test_weight_streaming.py checks ring_fetches against the ring)."""
    from headroom.training.memory.planner import blocks_without_backward

    names = ["input_blocks.0.0", "input_blocks.1.0", "input_blocks.1.1", "input_blocks.10.1", "middle_block"]
    assert blocks_without_backward(names, ["input_blocks.1.1.attn.to_q", "input_blocks.10.1.proj"]) == 2
    assert blocks_without_backward(names, ["input_blocks.10.1.proj"]) == 3  # "input_blocks.1." is not its block
    assert blocks_without_backward(names, ["input_blocks.1.1.attn.to_q", "time_embed.0"]) == 0  # feeds any block
    assert blocks_without_backward(names, []) == 0
    forward, bytes_ = [0.1, 0.2, 0.1, 0.1], [10 ** 9] * 4
    every = time_model.step_time(forward, 0.05, [0, 1, 2, 3], bytes_, 1e9, slots=2)
    skips = time_model.step_time(forward, 0.05, [0, 1, 2, 3], bytes_, 1e9, slots=2, without_backward=2)
    assert every.compute_s - skips.compute_s == pytest.approx(2.5 * 0.3)  # blocks 0, 1: backward 1.5x + recompute
    assert skips.recompute_s == pytest.approx(0.2)
    assert time_model.ring_fetches(bytes_, 2, 2) == ([1, 2, 3], [0])  # block 1 no longer fetched twice
    assert time_model.ring_fetches(bytes_, 2) == ([2, 3], [1, 0])
    assert skips.transfer_s == pytest.approx(4.0) and every.transfer_s == pytest.approx(4.0)
    assert (skips.forward_copy_s, skips.backward_copy_s) == pytest.approx((3.0, 1.0))
    assert skips.total_s < every.total_s


def test_a_controlnets_copies_of_the_first_blocks_run_their_forward_and_backward_again():
    """A ControlNet run (TrainableSpec.copied_blocks): its trainable copy of the base's first blocks adds their forward
    and backward, timed as the base's, and their recompute only where every block is checkpointed (the run checkpoints
    its own blocks only then); the base's blocks before the control joins run no backward (without_backward)."""
    forward, ratios = [0.1, 0.2, 0.3, 0.4], [2.0, 1.0, 1.0, 1.0]
    base = dict(backward_per_forward=ratios, without_backward=2)
    plain = time_model.step_time(forward, 0.05, [], [0] * 4, None, **base)
    controlnet = time_model.step_time(forward, 0.05, [], [0] * 4, None, copied_blocks=2, **base)
    assert controlnet.compute_s - plain.compute_s == pytest.approx(3 * 0.1 + 2 * 0.2)  # (1 + ratio) x forward
    assert controlnet.forward_compute_s - plain.forward_compute_s == pytest.approx(0.3)
    every = time_model.step_time(forward, 0.05, [0, 1, 2, 3], [0] * 4, None, copied_blocks=2, **base)
    assert every.recompute_s == pytest.approx(0.3 + 0.4 + 0.1 + 0.2)  # the base's from block 2, the copies' two
    some = time_model.step_time(forward, 0.05, [2, 3], [0] * 4, None, copied_blocks=2, **base)
    assert some.recompute_s == pytest.approx(0.3 + 0.4)
    # on a card, beside the ring: in the pipeline as the work outside the blocks
    streamed = [0, 0, 10 ** 8, 10 ** 8]
    ring = time_model.step_time(forward, 0.05, [2, 3], streamed, 1e9, **base)
    with_copies = time_model.step_time(forward, 0.05, [2, 3], streamed, 1e9, copied_blocks=2, **base)
    assert with_copies.pipeline_s - ring.pipeline_s == pytest.approx(0.7)
    assert with_copies.transfer_s == ring.transfer_s
    # the ControlNet's own blocks timed (planning._ControlNetStep: ModelDescription.controlnet_blocks) stand for the
    # copies, their backward as measured (weight gradients too), or the rule where none was measured
    measured = time_model.step_time(forward, 0.05, [], [0] * 4, None, copied_blocks=2, copies=[(0.15, 2.5), (0.1, 0)],
                                    **base)
    rule = 1 + time_model.BACKWARD_PER_FORWARD
    assert measured.compute_s - plain.compute_s == pytest.approx(3.5 * 0.15 + rule * 0.1)
    assert measured.forward_compute_s - plain.forward_compute_s == pytest.approx(0.25)
    every = time_model.step_time(forward, 0.05, [0, 1, 2, 3], [0] * 4, None, copies=[(0.15, 2.5), (0.1, 0)], **base)
    assert every.recompute_s == pytest.approx(0.3 + 0.4 + 0.15 + 0.1)
