"""Fused backward: the optimizer steps each parameter as soon as its gradient is complete, then frees that gradient,
so a full fine-tune never holds a full set of gradients (for an 8 B model: 16 GiB of bf16 gradients not kept).

    fused = FusedBackward(params, lambda group: create_optimizer(group, config), lambda opt: create_scheduler(opt, config))
    loss.backward()          # each parameter is stepped inside backward, its gradient freed
    fused.after_step()       # the learning-rate schedule advances once per step

torch provides the mechanism (Tensor.register_post_accumulate_grad_hook, the pattern of its "optimizer step in
backward" tutorial): one optimizer per parameter, stepped from that parameter's hook. What follows from it:
- gradient clipping is per parameter (`max_grad_norm` on each tensor's own norm): a global norm needs every
  gradient at once, which is what this avoids (kohya sd-scripts' fused backward clips per tensor too);
- no gradient accumulation: a step happens in every backward pass (`FusedBackward.check_accumulation` refuses it);
- `bf16_stochastic` (bf16 weights, no fp32 masters): the optimizer steps an fp32 copy of the parameter made in the
  hook, with fp32 state, and the result is written back with stochastic rounding (stochastic_rounding.py).
With the same optimizer implementation the weights equal those of the unfused step (tests/unit/test_fused_backward.py:
bitwise in fp32 with AdamW, Adafactor and clipping off).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from .cost import FeatureCost
from .stochastic_rounding import stochastic_round_to_bf16


class FusedBackward:
    def __init__(self, params: Sequence[torch.nn.Parameter], make_optimizer: Callable[[list], torch.optim.Optimizer],
                 make_scheduler: Callable[[torch.optim.Optimizer], object] | None = None, *,
                 max_grad_norm: float = 0.0, bf16_stochastic: bool = False, seed: int = 0):
        """`make_optimizer([param])`: one optimizer per parameter (training/core/optimizers.create_optimizer);
        `make_scheduler(optimizer)`: its learning-rate schedule (None: constant)."""
        self.params = [p for p in params if p.requires_grad]
        self.max_grad_norm = float(max_grad_norm)
        self.bf16_stochastic = bf16_stochastic
        if bf16_stochastic and any(p.dtype != torch.bfloat16 for p in self.params):
            raise ValueError("bf16 stochastic rounding trains bf16 weights: these parameters are not all bf16")
        # bf16_stochastic: the optimizer holds an fp32 stand-in per parameter (its state is keyed by it and fp32);
        # the stand-in's data exists only during that parameter's step.
        self._stand_ins = [torch.nn.Parameter(torch.empty(0), requires_grad=False) if bf16_stochastic else None
                           for _ in self.params]
        self.optimizers = [make_optimizer([stand_in if stand_in is not None else param])
                           for param, stand_in in zip(self.params, self._stand_ins)]
        self.schedulers = [make_scheduler(opt) for opt in self.optimizers] if make_scheduler is not None else []
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}  # per device: the rounding noise of bf16_stochastic
        self.most_gradients_alive = 0  # the most parameters holding a gradient at once (tests, bench)
        self._alive = 0
        self._handles = [param.register_post_accumulate_grad_hook(self._make_hook(index))
                         for index, param in enumerate(self.params)]

    @staticmethod
    def check_accumulation(grad_accum: int) -> None:
        if grad_accum != 1:
            raise ValueError(f"fused backward steps every parameter inside each backward pass: grad_accumulation "
                             f"{grad_accum} needs the gradients of several passes kept, which is what it avoids. Set "
                             "grad_accumulation 1 (a larger batch instead), or turn fused backward off")

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._alive += 1
            self.most_gradients_alive = max(self.most_gradients_alive, self._alive)
            try:
                self._step(index, param)
            finally:
                param.grad = None
                self._alive -= 1

        return hook

    @torch.no_grad()
    def _step(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if self.max_grad_norm > 0:  # torch's own clipping, on this parameter's gradient alone
            torch.nn.utils.clip_grad_norm_(param, self.max_grad_norm)
        stand_in = self._stand_ins[index]
        if stand_in is None:
            self.optimizers[index].step()
            return
        stand_in.data = param.detach().float()
        stand_in.grad = grad.float()
        try:
            self.optimizers[index].step()
            param.copy_(stochastic_round_to_bf16(stand_in.data, self._generator(param.device)))
        finally:
            stand_in.grad = None
            stand_in.data = torch.empty(0)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    def after_step(self) -> None:
        """Advance every parameter's learning-rate schedule (once per training step)."""
        for scheduler in self.schedulers:
            scheduler.step()

    def state_dict(self) -> dict:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers],
                "schedulers": [s.state_dict() for s in self.schedulers],
                "generators": {device: g.get_state() for device, g in self._generators.items()}}

    def load_state_dict(self, state: dict) -> None:
        if len(state.get("optimizers", [])) != len(self.optimizers):
            raise ValueError(f"fused backward state for {len(state.get('optimizers', []))} parameters, this run trains "
                             f"{len(self.optimizers)}")
        for opt, saved in zip(self.optimizers, state["optimizers"]):
            opt.load_state_dict(saved)
        for scheduler, saved in zip(self.schedulers, state.get("schedulers", [])):
            scheduler.load_state_dict(saved)
        for device, generator_state in state.get("generators", {}).items():
            self._generator(torch.device(device)).set_state(generator_state)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def gradients_cost(param_shapes: Sequence[Sequence[int]], grad_element_size: int, fused: bool) -> FeatureCost:
    """Device bytes of a full fine-tune's gradients in a training step: all of them, or with fused backward the
    largest parameter's (the one being stepped; its fp32 stand-in too with bf16 stochastic rounding is in the
    optimizer's step working set, not counted here)."""
    sizes = [int(torch.Size(shape).numel()) * grad_element_size for shape in param_shapes]
    if fused:
        return FeatureCost(training={"one parameter's gradient (fused backward)": max(sizes, default=0)})
    return FeatureCost(training={"gradients": sum(sizes)})
