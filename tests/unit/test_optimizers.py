"""Optimizers by name from their libraries, schedules from transformers (diffusers' formulas), and state that
resumes exactly."""
from __future__ import annotations

import importlib.util
import io
import math
import sys

import pytest
import torch

from headroom.training.checks import MissingPackageError
from headroom.training.core.optimizers import (OPTIMIZERS, OPTIONAL_PACKAGES, SCHEDULES, OptimizerConfig,
                                               check_available, create_optimizer, create_scheduler, current_lr)


def _quadratic_run(config: OptimizerConfig, steps: int, state: dict | None = None, start: torch.Tensor | None = None):
    torch.manual_seed(0)
    target = torch.randn(64, 96)
    weight = torch.nn.Parameter(torch.zeros(64, 96) if start is None else start.clone())
    optimizer = create_optimizer([weight], config)
    scheduler = create_scheduler(optimizer, config)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (weight - target).square().mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return weight.detach(), optimizer, scheduler, losses


def _lr_for(name):
    return {"Prodigy": 1.0, "Adafactor": 1e-2, "CAME": 1e-2}.get(name, 5e-2)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_descends_and_resumes_exactly(name):
    config = OptimizerConfig(name=name, lr=_lr_for(name), schedule="cosine", warmup_steps=2, total_steps=40)
    straight, _, _, losses = _quadratic_run(config, 20)
    assert losses[-1] < 0.8 * losses[0], f"{name} did not descend: {losses[0]:.4f} -> {losses[-1]:.4f}"

    half, optimizer, scheduler, _ = _quadratic_run(config, 10)
    buffer = io.BytesIO()  # the run directory's format: torch.save, read back without pickle
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed, _, _, _ = _quadratic_run(config, 10, state=state, start=half)
    assert torch.equal(resumed, straight), f"{name}: 10 + 10 resumed steps differ from 20 straight steps"


def test_schedules_warm_up_then_decay():
    weight = torch.nn.Parameter(torch.zeros(2))
    config = OptimizerConfig(lr=1.0, schedule="cosine", warmup_steps=4, total_steps=12)
    optimizer = create_optimizer([weight], config)
    scheduler = create_scheduler(optimizer, config)
    lrs = []
    for _ in range(12):
        lrs.append(current_lr(optimizer))
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert lrs[5] > lrs[8] > lrs[11] > 0


POLYNOMIAL_END = 1e-7  # the final LR of diffusers' (and transformers') polynomial schedule


def _reference_factor(schedule: str, step: int, warmup: int, total: int, lr: float) -> float:
    """The LR multiplier at `step` of each schedule as diffusers.optimization defines it (the schedules runs used before
    they came from transformers): a linear warm-up, then the decay over total - warmup steps; constant has no warm-up;
    cosine is half a cosine wave, cosine_with_restarts one cycle, polynomial power 1 down to 1e-7."""
    if schedule == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    if schedule == "constant_with_warmup":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if schedule == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    if schedule == "cosine_with_restarts":
        return 0.0 if progress >= 1.0 else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (progress % 1.0))))
    assert schedule == "polynomial"
    if step > total:
        return POLYNOMIAL_END / lr
    return ((lr - POLYNOMIAL_END) * (1 - (step - warmup) / (total - warmup)) + POLYNOMIAL_END) / lr


def _lrs(scheduler_for, lr: float, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    scheduler = scheduler_for(optimizer)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


SCHEDULE_CASES = [(warmup, total) for warmup, total in ((0, 10), (3, 12), (2, 7), (0, 1))]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_keeps_the_lrs_it_had_from_diffusers(schedule):
    """Every schedule gives the LR diffusers' gave at every step, warm-up, decay and past the horizon: against
    diffusers' formulas always, and against diffusers itself where it is installed (an optional package now)."""
    lr = 1e-3
    for warmup, total in SCHEDULE_CASES:
        config = OptimizerConfig(lr=lr, schedule=schedule, warmup_steps=warmup, total_steps=total)
        ours = _lrs(lambda optimizer: create_scheduler(optimizer, config), lr, total + 3)
        expected = [lr * _reference_factor(schedule, step, warmup, total, lr) for step in range(total + 3)]
        assert ours == pytest.approx(expected, rel=1e-12, abs=1e-18), (schedule, warmup, total)
        if importlib.util.find_spec("diffusers") is not None:
            from diffusers.optimization import get_scheduler

            theirs = _lrs(lambda optimizer: get_scheduler(schedule, optimizer, num_warmup_steps=warmup,
                                                          num_training_steps=total), lr, total + 3)
            assert ours == theirs, (schedule, warmup, total)


def test_a_checkpoint_from_when_schedules_came_from_diffusers_resumes():
    """diffusers' schedules are LambdaLRs over plain functions (their state dict holds lr_lambdas [None]);
    transformers' over functools.partial: a run saved before the switch resumes on the same LRs."""
    lr, warmup, total = 1e-3, 2, 10
    config = OptimizerConfig(lr=lr, schedule="cosine", warmup_steps=warmup, total_steps=total)

    def as_diffusers_made_it(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: _reference_factor("cosine", step, warmup, total, lr))

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    old = as_diffusers_made_it(optimizer)
    for _ in range(4):
        optimizer.step()
        old.step()
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": old.state_dict()}, buffer)  # as a checkpoint
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    state = saved["scheduler"]
    assert state["lr_lambdas"] == [None]

    resumed_optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
    resumed = create_scheduler(resumed_optimizer, config)
    from headroom.training.core.trainer import _fields_mismatch

    assert _fields_mismatch("LR scheduler", state, resumed.state_dict()) is None  # what resuming checks first
    resumed_optimizer.load_state_dict(saved["optimizer"])  # the trainer's order: optimizer, then scheduler
    resumed.load_state_dict(state)
    lrs = []
    for _ in range(6):
        lrs.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        resumed.step()
    assert lrs == pytest.approx([lr * _reference_factor("cosine", step, warmup, total, lr) for step in range(4, 10)],
                                rel=1e-12)


@pytest.mark.parametrize("name", sorted(OPTIONAL_PACKAGES))
def test_an_optimizer_whose_package_is_missing_names_the_pip_line(monkeypatch, name):
    """bitsandbytes, prodigyopt and came-pytorch are not installed with Headroom: choosing their optimizer without
    them says which package and how to install it (also in the Windows portable build), before any step."""
    module, package = OPTIONAL_PACKAGES[name]
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    message = (rf"optimizer {name} needs the pip package '{package}', which is not installed\. Install it into "
               rf"ComfyUI's Python: python -m pip install {package} \(Windows portable build, in its folder: "
               rf"python_embeded\\python\.exe -m pip install {package}\), then restart ComfyUI; or choose AdamW")
    with pytest.raises(MissingPackageError, match=message):
        check_available(name)
    with pytest.raises(MissingPackageError, match=message):
        create_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(name=name))


def test_optimizers_from_torch_and_transformers_need_no_optional_package(monkeypatch):
    for module, _ in OPTIONAL_PACKAGES.values():
        monkeypatch.setitem(sys.modules, module, None)
    assert set(OPTIMIZERS) - set(OPTIONAL_PACKAGES) == {"AdamW", "Adafactor"}
    for name in ("AdamW", "Adafactor"):
        check_available(name)
        create_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(name=name))


def test_bad_optimizer_settings_are_named():
    with pytest.raises(ValueError, match="unknown optimizer 'SGD'"):
        OptimizerConfig(name="SGD").validate()
    with pytest.raises(ValueError, match="learning rate -1 must be > 0"):
        OptimizerConfig(lr=-1).validate()
    with pytest.raises(ValueError, match="unknown LR schedule 'step'"):
        OptimizerConfig(schedule="step").validate()


def test_bitsandbytes_kernels_are_probed_once_per_optimizer_and_device(monkeypatch):
    """Fused backward makes one optimizer per trained tensor: the probe step that finds out whether this bitsandbytes
    build has 8-bit kernels for the device runs once; a probe that fails says so every time."""
    import bitsandbytes as bnb

    from headroom.training.core import optimizers

    made = []

    class Counted(bnb.optim.AdamW8bit):
        def __init__(self, params, **kwargs):
            made.append(1)
            super().__init__(params, **kwargs)

    class NoKernels(bnb.optim.AdamW8bit):
        def step(self, closure=None):
            raise RuntimeError("no 8-bit kernel for this device")

    monkeypatch.setattr(optimizers, "_KERNELS_FOUND", set())
    monkeypatch.setattr(bnb.optim, "AdamW8bit", Counted)
    config = OptimizerConfig(name="AdamW8bit")
    for _ in range(3):
        create_optimizer([torch.nn.Parameter(torch.zeros(8, 8))], config, device="cpu")
    assert len(made) == 3 + 1  # three optimizers, one probe
    monkeypatch.setattr(optimizers, "_KERNELS_FOUND", set())
    monkeypatch.setattr(bnb.optim, "AdamW8bit", NoKernels)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cannot run on cpu: no 8-bit kernel"):
            create_optimizer([torch.nn.Parameter(torch.zeros(8, 8))], config, device="cpu")



@pytest.mark.parametrize("name", [name for name in OPTIMIZERS if name != "Prodigy"])
def test_learning_rate_scales_group_the_parameters_and_follow_the_schedule(name):
    """LoRA+ (loraplus_lr_ratio): each parameter in the group of its scale, the 1x group first (current_lr reports
    it), and the schedule scales every group's rate alike, so the ratio holds at every step."""
    config = OptimizerConfig(name=name, lr=_lr_for(name), schedule="cosine", warmup_steps=2, total_steps=10,
                             loraplus_lr_ratio=4.0)
    down, up, other = (torch.nn.Parameter(torch.randn(8, 8)) for _ in range(3))
    optimizer = create_optimizer([up, down, other], config, lr_scales=[4.0, 1.0, 1.0])
    scheduler = create_scheduler(optimizer, config)
    assert [[id(p) for p in group["params"]] for group in optimizer.param_groups] == [[id(down), id(other)], [id(up)]]
    for _ in range(4):
        (up.sum() + down.square().sum() + other.sum()).backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        low, high = (group["lr"] for group in optimizer.param_groups)
        assert 0 < low <= config.lr and high == pytest.approx(4 * low, rel=1e-12)
        assert current_lr(optimizer) == low
    with pytest.raises(ValueError, match="2 learning-rate scales for 3 parameters"):
        create_optimizer([up, down, other], config, lr_scales=[1.0, 4.0])


def test_adamw_steps_cpu_tensors_with_torchs_fused_kernel():
    """AdamW on CPU tensors (a run on the CPU, optimizer_state cpu's host step) uses torch's fused kernel, as on CUDA:
    one pass per tensor instead of about ten (bench/bench_host_optimizer_step.py). It steps as torch's default AdamW
    does, to rounding; parameter groups (LoRA+, layer_lr_scales) are fused too, and the state resumes exactly."""
    config = OptimizerConfig(name="AdamW", lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(32, 48, generator=generator)
    gradients = [torch.randn(32, 48, generator=generator) for _ in range(4)]
    weights = {}
    for fused in (True, False):
        weight = torch.nn.Parameter(start.clone())
        optimizer = create_optimizer([weight], config) if fused else torch.optim.AdamW(
            [weight], lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)
        assert optimizer.defaults["fused"] is (True if fused else None)
        for gradient in gradients:
            weight.grad = gradient.clone()
            optimizer.step()
        weights[fused] = weight.detach()
    assert not torch.equal(weights[True], start)
    torch.testing.assert_close(weights[True], weights[False], rtol=1e-6, atol=1e-6)
    grouped = create_optimizer([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))], config,
                               lr_scales=[1.0, 4.0])
    assert grouped.defaults["fused"] is True and len(grouped.param_groups) == 2
    first, _, _, _ = _quadratic_run(config, 6)
    _, optimizer, scheduler, _ = _quadratic_run(config, 3)
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    middle = optimizer.param_groups[0]["params"][0].detach()
    resumed, _, _, _ = _quadratic_run(config, 3, state=state, start=middle)
    assert torch.equal(resumed, first)
