"""Optimizers by name from their libraries, schedules from diffusers, and state that resumes exactly."""
from __future__ import annotations

import io

import pytest
import torch

from headroom.training.core.optimizers import (OPTIMIZERS, OptimizerConfig, create_optimizer, create_scheduler,
                                          current_lr)


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


def test_schedules_come_from_diffusers():
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

