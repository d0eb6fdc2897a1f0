"""Optimizers and learning-rate schedules, by name, from the libraries that implement them.

AdamW: torch. AdamW8bit / PagedAdamW8bit / Lion8bit: bitsandbytes. Adafactor: transformers.
CAME: the `came-pytorch` package (the reference implementation of the CAME paper, as Sana uses).
Prodigy: `prodigyopt`. Schedules: `transformers.optimization.get_scheduler`.
bitsandbytes, came-pytorch and prodigyopt are optional packages: choosing an optimizer from one that is missing names
the pip line to install it (check_available), before a run starts.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterable, Sequence

import torch

from ..checks import MissingPackageError, check_finite, require_package  # noqa: F401  (MissingPackageError: for nodes/)

OPTIMIZERS = ("AdamW", "AdamW8bit", "PagedAdamW8bit", "Lion8bit", "Adafactor", "CAME", "Prodigy")
SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
LORAPLUS_MAX = 64.0
SCALE_WEIGHT_NORMS_MAX = 100.0  # scale_weight_norms: past this no LoRA layer's update is ever capped
_BITSANDBYTES = ("AdamW8bit", "PagedAdamW8bit", "Lion8bit")
# Optimizers from optional packages (not installed with Headroom): optimizer -> (import name, pip name).
OPTIONAL_PACKAGES = {**{name: ("bitsandbytes", "bitsandbytes") for name in _BITSANDBYTES},
                     "CAME": ("came_pytorch", "came-pytorch"), "Prodigy": ("prodigyopt", "prodigyopt")}


def check_available(name: str) -> None:
    """Raise MissingPackageError when optimizer `name` needs a package this Python does not have (or cannot import)."""
    if name not in OPTIONAL_PACKAGES:
        return
    module, package = OPTIONAL_PACKAGES[name]
    require_package(module, package, f"optimizer {name}", "choose AdamW or Adafactor, which need no extra package")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "AdamW"
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000  # horizon of decaying schedules (linear / cosine / polynomial)
    # LoRA+ (Hayou et al. 2024; kohya's and musubi-tuner's network_args loraplus_lr_ratio): the learning rate of a
    # LoRA's up matrices (B, zero at the start) is this many times lr. 1: off.
    loraplus_lr_ratio: float = 1.0
    # Max-norm regularisation (kohya's scale_weight_norms): after each step, a LoRA layer whose update (scale * up @
    # down) has a Frobenius norm above this is scaled back to it (AdapterSet.cap_norms). 0: off; 1 is usual.
    scale_weight_norms: float = 0.0

    def validate(self) -> None:
        check_finite("optimizer", lr=self.lr, weight_decay=self.weight_decay, eps=self.eps, beta1=self.betas[0],
                     beta2=self.betas[1], loraplus_lr_ratio=self.loraplus_lr_ratio,
                     scale_weight_norms=self.scale_weight_norms)
        if not 0.0 <= self.scale_weight_norms <= SCALE_WEIGHT_NORMS_MAX:
            raise ValueError(f"scale_weight_norms={self.scale_weight_norms}: give 0 (off) to "
                             f"{SCALE_WEIGHT_NORMS_MAX:g}, the largest norm a layer's update may reach (1 is usual)")
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}: choose one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise ValueError(f"learning rate {self.lr} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay} must be >= 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown LR schedule {self.schedule!r}: choose one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0 or self.total_steps <= 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0 and total_steps={self.total_steps} > 0")
        if not 1.0 <= self.loraplus_lr_ratio <= LORAPLUS_MAX:
            raise ValueError(f"loraplus_lr_ratio={self.loraplus_lr_ratio} must be between 1 (off) and "
                             f"{LORAPLUS_MAX:g}: the up matrices' learning rate is that many times the others' (4 to 16 "
                             "for LoRA+)")
        if self.loraplus_lr_ratio != 1.0 and self.name == "Prodigy":
            raise ValueError(f"Prodigy finds one step size for all trained weights, and loraplus_lr_ratio "
                             f"{self.loraplus_lr_ratio:g} asks for two: set loraplus_lr_ratio to 1, or choose another "
                             "optimizer")


def create_optimizer(params: Iterable[torch.nn.Parameter], config: OptimizerConfig, device: torch.device | None = None,
                     lr_scales: Sequence[float] | None = None):
    """The optimizer `config.name` over `params`. `device` is where the parameters live (for bitsandbytes).
    `lr_scales`: one per parameter, its learning rate as a multiple of config.lr (LoRA+: learning_rate_scales); the
    parameters are then grouped by it, the group at 1x first, each group's multiple in its "lr_scale" (what current_lr
    divides out)."""
    config.validate()
    params = list(params)
    groups = params if lr_scales is None else _groups_by_scale(params, lr_scales, config.lr)
    if config.name == "AdamW":
        # torch's fused kernel, one pass per tensor: on CUDA the default (foreach) step makes a temporary the size of
        # every trained tensor at once (the sqrt of exp_avg_sq), which a full fine-tune's plan has no room for; on a
        # CPU the default steps tensor by tensor in about ten passes, 7-9x the time of the fused one
        # (bench/bench_host_optimizer_step.py), which a host step (optimizer_state cpu) waits for. All parameters on
        # one kind of device; not for DTensor shards.
        tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]  # groups, as given
        kinds = {t.device.type for t in tensors}
        fused = len(kinds) == 1 and kinds <= {"cuda", "cpu"} and all(
            type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
        return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                                 weight_decay=config.weight_decay, fused=fused or None)
    if config.name in _BITSANDBYTES:
        return _bitsandbytes_optimizer(groups, params, config, device)
    if config.name == "Adafactor":
        from transformers.optimization import Adafactor

        # Fixed external LR (relative_step off) so schedules and the lr input mean the same as for AdamW.
        return Adafactor(groups, lr=config.lr, scale_parameter=False, relative_step=False, warmup_init=False,
                         weight_decay=config.weight_decay)
    check_available(config.name)
    if config.name == "CAME":
        from came_pytorch import CAME

        return CAME(groups, lr=config.lr, weight_decay=config.weight_decay,
                    betas=(config.betas[0], config.betas[1], 0.9999), eps=(1e-30, 1e-16))
    from prodigyopt import Prodigy

    # Prodigy estimates the step size itself; lr is a multiplier, 1.0 is the recommended value.
    return Prodigy(groups, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)


def _groups_by_scale(params: list, lr_scales: Sequence[float], lr: float) -> list[dict]:
    if len(lr_scales) != len(params):
        raise ValueError(f"{len(lr_scales)} learning-rate scales for {len(params)} parameters")
    scales = sorted(set(lr_scales), key=lambda scale: (scale != 1.0, scale))
    return [{"params": [p for p, s in zip(params, lr_scales) if s == scale], "lr": lr * scale, "lr_scale": scale}
            for scale in scales]


def _bitsandbytes_optimizer(groups, params, config: OptimizerConfig, device: torch.device | None):
    check_available(config.name)
    import bitsandbytes as bnb
    cls = getattr(bnb.optim, config.name)
    kwargs = dict(lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    if config.name != "Lion8bit":
        kwargs["eps"] = config.eps
    optimizer = cls(groups, **kwargs)
    probe_device = torch.device(device) if device is not None else (params[0].device if params else torch.device("cpu"))
    if (config.name, str(probe_device)) in _KERNELS_FOUND:  # fused backward makes one optimizer per tensor
        return optimizer
    try:
        # One step on a zero gradient finds out now, not mid-run, whether this bitsandbytes build has
        # 8-bit kernels for the parameters' device (older builds have none for the CPU).
        probe = torch.nn.Parameter(torch.zeros(4096, device=probe_device))
        probe.grad = torch.zeros_like(probe)
        cls([probe], **kwargs).step()
    except Exception as error:
        raise RuntimeError(
            f"optimizer {config.name} (bitsandbytes {getattr(bnb, '__version__', '?')}) cannot run on "
            f"{probe_device.type}: {error}. Use AdamW, Adafactor, CAME or Prodigy on this device."
        ) from error
    _KERNELS_FOUND.add((config.name, str(probe_device)))
    return optimizer


_KERNELS_FOUND: set[tuple[str, str]] = set()  # (bitsandbytes optimizer, device) whose probe step ran


# The host step's probe (host_step_s_per_weight): one matrix (Adafactor factors it) of 8 M weights, larger than a
# CPU's caches as a model's layers are (1 M weights measured 2-3x faster than a layer's step); about 0.2 s per step on
# one thread.
HOST_STEP_PROBE_SHAPE = (4096, 2048)


@functools.lru_cache(maxsize=None)
def host_step_s_per_weight(name: str, bf16_stochastic: bool, threads: int) -> float:
    """Seconds per weight of one trained tensor's optimizer step in host RAM as fused backward runs it (Offload Policy
    optimizer_state "cpu", or a run on the CPU: an fp32 stand-in, optimizer `name` with create_optimizer's settings,
    the bf16 rounding with `bf16_stochastic`), for the planner's time model (planner.TrainableSpec): measured on a
    HOST_STEP_PROBE_SHAPE tensor, the best of 3 steps after the one that makes the state, once per process per
    (optimizer, rounding, torch's CPU `threads`: the probe runs with the current ones). Where the optimizer cannot step
    on this CPU (a missing package or kernel) the time model's default."""
    from ..memory.fused_backward import FusedBackward
    from ..memory.time_model import DEFAULT_HOST_STEP_S_PER_WEIGHT

    del threads  # the cache key
    dtype = torch.bfloat16 if bf16_stochastic else torch.float32
    # Planning runs inside ComfyUI's node execution, under torch.inference_mode(): the probe trains as a run does.
    with torch.inference_mode(False), torch.enable_grad():
        generator = torch.Generator().manual_seed(0)
        param = torch.nn.Parameter(torch.randn(HOST_STEP_PROBE_SHAPE, generator=generator).to(dtype))
        gradient = (torch.randn(HOST_STEP_PROBE_SHAPE, generator=generator) * 1e-3).to(dtype)
        start = param.detach().clone()
        try:
            fused = FusedBackward([param], lambda group: create_optimizer(group, OptimizerConfig(name=name)),
                                  bf16_stochastic=bf16_stochastic, state_on_host=True)
            times = []
            for _ in range(4):
                started = time.perf_counter()
                param.backward(gradient)  # the tensor's hook steps it (as in a run's backward), frees the gradient
                times.append(time.perf_counter() - started)
            fused.remove()
        except Exception:  # noqa: BLE001 - a planner's figure: the run itself reports a missing package by name
            return DEFAULT_HOST_STEP_S_PER_WEIGHT
        if torch.equal(param, start):  # nothing stepped: not a figure of the step
            return DEFAULT_HOST_STEP_S_PER_WEIGHT
    return min(times[1:]) / param.numel()


def host_step_rate(name: str, bf16_stochastic: bool) -> float:
    """host_step_s_per_weight with torch's current CPU threads."""
    return host_step_s_per_weight(name, bf16_stochastic, torch.get_num_threads())


def create_scheduler(optimizer, config: OptimizerConfig):
    # transformers' schedules: the names and formulas diffusers has (tests/unit/test_optimizers.py compares them), from
    # a package ComfyUI already requires. diffusers' newer releases need a huggingface-hub that ComfyUI's transformers
    # 4.x cannot import, so installing it for this one function broke users' ComfyUI (issue 40).
    from transformers.optimization import get_scheduler

    return get_scheduler(config.schedule, optimizer, num_warmup_steps=config.warmup_steps,
                         num_training_steps=config.total_steps)


def current_lr(optimizer) -> float:
    """The optimizer's learning rate now (its schedule applied): what the chart shows. A group trained at a multiple
    of it (LoRA+, layer_lr_scales) says the multiple in "lr_scale" (checkpoints written before have none: 1)."""
    group = optimizer.param_groups[0]
    lr = group["lr"] / group.get("lr_scale", 1.0)
    if "d" in group:  # Prodigy: the effective step size is d * lr
        return float(group["d"] * lr)
    return float(lr)
