"""Optimizer state in host RAM: parked while validating, or kept there for the whole run.

    with parked(trainer.optimizer, trainer.params):      # policy.park_optimizer_during_validation
        ... validation sampling: the device holds no optimizer state and no gradients ...
    # restored bitwise, on the devices they came from

    optimizer = HostOptimizer(params, lambda host_params: create_optimizer(host_params, config, device="cpu"))
    # policy.optimizer_state == "cpu": the optimizer steps fp32 host copies of the trainable weights;
    # gradients go host-ward and updated weights device-ward once per step. It *is* a torch Optimizer
    # (LR schedulers, GradScaler, clip_grad_norm_ and state_dict work unchanged); its state_dict is the
    # inner optimizer's, so checkpoints are interchangeable with the on-device optimizer's.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator

import torch

from .cost import FeatureCost
from .sharded_optimizer import local_optimizer

_HOST = torch.device("cpu")


def _parks(tensor: torch.Tensor, exercise_on_cpu: bool) -> bool:
    # bitsandbytes' paged states live in unified memory that the driver already pages out under pressure.
    if getattr(tensor, "is_paged", False):
        return False
    return tensor.device.type != "cpu" or exercise_on_cpu


@contextlib.contextmanager
def parked(optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter], *,
           exercise_on_cpu: bool = False) -> Iterator[None]:
    """Move the optimizer's per-parameter state and the gradients of `params` to host RAM for the block.

    Tensors shared between parameters' states (bitsandbytes' quantisation maps) stay shared. On exit (also
    on an exception) every tensor goes back to its device with the same bits. `exercise_on_cpu`: CPU
    tensors take the round trip too (tests), otherwise they are left in place.
    """
    moved: dict[int, tuple[torch.Tensor, torch.device]] = {}  # id(original) -> (host copy, device)
    state_entries = []  # (state dict, key, id(original))
    for state in local_optimizer(optimizer).state.values():  # a sharded optimizer: this rank's share
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and _parks(value, exercise_on_cpu):
                if id(value) not in moved:
                    moved[id(value)] = (value.to(_HOST, copy=True), value.device)
                state_entries.append((state, key, id(value)))
    grads = []  # (param, host copy, device)
    for param in params:
        if param.grad is not None and _parks(param.grad, exercise_on_cpu):
            grads.append((param, param.grad.to(_HOST, copy=True), param.grad.device))
    # Only now drop the device tensors, so an error while copying leaves everything as it was.
    for state, key, original in state_entries:
        state[key] = moved[original][0]
    for param, _, _ in grads:
        param.grad = None
    try:
        yield
    finally:
        back: dict[int, torch.Tensor] = {}
        for host, device in moved.values():
            back[id(host)] = host.to(device, copy=True)
        for state, key, original in state_entries:
            state[key] = back[id(moved[original][0])]
        for param, host, device in grads:
            param.grad = host.to(device, copy=True)


class HostOptimizer(torch.optim.Optimizer):
    """An optimizer whose state and fp32 master weights live in host RAM (policy optimizer_state="cpu").

    `param_groups` hold the device parameters (what schedulers, GradScaler and clipping see); the inner
    optimizer, built by `make_optimizer(host_params)`, holds the state. `step()`: gradients -> host,
    inner step, updated weights -> device, and group values the inner optimizer changes (Prodigy's `d`)
    copied back for logging.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.device_params = list(params)
        if not self.device_params:
            raise ValueError("HostOptimizer: no parameters to optimise")
        self.host_params = [torch.nn.Parameter(p.detach().to(_HOST, torch.float32, copy=True)) for p in self.device_params]
        self.inner = make_optimizer(self.host_params)
        index = {id(h): i for i, h in enumerate(self.host_params)}
        groups = []
        for group in self.inner.param_groups:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": [self.device_params[index[id(h)]] for h in group["params"]]})
        super().__init__(groups, dict(self.inner.defaults))

    def _push_group_values(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    def _pull_group_values(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("HostOptimizer.step does not take a closure")
        self._push_group_values()
        for device_param, host_param in zip(self.device_params, self.host_params):
            host_param.grad = None if device_param.grad is None else device_param.grad.to(_HOST, torch.float32)
        self.inner.step()
        for device_param, host_param in zip(self.device_params, self.host_params):
            device_param.copy_(host_param)
            host_param.grad = None
        self._pull_group_values()

    def state_dict(self) -> dict:
        self._push_group_values()
        return self.inner.state_dict()

    @torch.no_grad()
    def weights_changed(self) -> None:
        """The device weights were changed outside a step (scale_weight_norms' cap): the host masters follow them."""
        for device_param, host_param in zip(self.device_params, self.host_params):
            host_param.copy_(device_param)

    def load_state_dict(self, state_dict: dict) -> None:
        # The device weights are restored first (the trainer loads the adapter, then the optimizer):
        # the host masters follow them.
        self.weights_changed()
        self.inner.load_state_dict(state_dict)
        self._pull_group_values()


# --- what it costs (the planner adds it up: planner.estimate) ---------------------------------------------------
def optimizer_cost(optimizer_state: str, park_during_validation: bool, optimizer: str, state_bytes: int,
                   trainable_bytes: int, gradient_bytes: int | None = None, gradient_dtype: str = "fp32",
                   fused_backward: bool = False) -> FeatureCost:
    """Where the optimizer state (`state_bytes` of `optimizer`) and the gradients kept between steps
    (`gradient_bytes`, default the fp32 trainable weights' `trainable_bytes`; 0 with fused backward) are: policy
    optimizer_state "gpu" keeps the state on the device, "cpu" in host RAM with fp32 master weights;
    park_optimizer_during_validation moves state and gradients to host RAM while sampling. `fused_backward` with the
    state on "cpu": no master weights and no gradients there (fused_backward.py steps a copy of one tensor at a time)."""
    gradient_bytes = trainable_bytes if gradient_bytes is None else gradient_bytes
    on_device = optimizer_state == "gpu"
    state = {f"optimizer state ({optimizer})": state_bytes} if on_device else {}
    cost = FeatureCost(training=dict(state))
    if not on_device and fused_backward:
        for added in (cost.host, cost.host_added_training, cost.host_added_validation):
            added[f"optimizer state ({optimizer})"] = state_bytes
    elif not on_device:
        cost.host["optimizer state + fp32 master weights"] = state_bytes + trainable_bytes
        # allocated for the whole run, fp32 gradients copied host-ward each step beside them
        cost.host_added_training["optimizer state + fp32 master weights + gradients"] = state_bytes + 2 * trainable_bytes
        cost.host_added_validation["optimizer state + fp32 master weights"] = state_bytes + trainable_bytes
    if park_during_validation:
        cost.validation_notes.append("optimizer state and gradients parked in host RAM while sampling")
        if on_device:
            cost.host_added_validation["parked optimizer state + gradients"] = state_bytes + gradient_bytes
    else:
        cost.validation = {**({f"gradients ({gradient_dtype})": gradient_bytes} if gradient_bytes else {}), **state}
    return cost
