"""Fused backward: the optimizer steps each parameter as soon as its gradient is complete, then frees that gradient,
so a full fine-tune never holds a full set of gradients (for an 8 B model: 16 GiB of bf16 gradients not kept).

    fused = FusedBackward(params, lambda group: create_optimizer(group, config), lambda opt: create_scheduler(opt, config))
    loss.backward()          # each parameter is stepped inside backward, its gradient freed
    fused.schedule.step()    # the learning-rate schedule advances once per step

The Trainer uses it in place of its optimizer (policy field `fused_backward`): it has the optimizer's face
(`param_groups`, `state`, `zero_grad`, `state_dict` in torch's one-optimizer layout, so checkpoints are checked as
any other), `step()` only lands updates still crossing to host RAM (every parameter was stepped in backward) and
`schedule` is the one schedule of all the parameters.

torch provides the mechanism (Tensor.register_post_accumulate_grad_hook, the pattern of its "optimizer step in
backward" tutorial): one optimizer per parameter, stepped from that parameter's hook. What follows from it:
- gradient clipping is per parameter (`max_grad_norm` on each tensor's own norm): a global norm needs every
  gradient at once, which is what this avoids (kohya sd-scripts' fused backward clips per tensor too);
- no gradient accumulation: a step happens in every backward pass (`FusedBackward.check_accumulation` refuses it);
- `bf16_stochastic` (bf16 weights, no fp32 masters): the optimizer steps an fp32 copy of the parameter made in the
  hook, with fp32 state, and the result is written back with stochastic rounding (stochastic_rounding.py);
- `state_on_host` (policy optimizer_state "cpu"): that fp32 copy, the gradient and the optimizer state are in host RAM;
  each tensor crosses to the host and back once per step, and no gradient or state is kept on the device (the
  ZeRO-Offload pattern, without a second set of master weights: the device tensor is the weight). The two fp32
  copies go into two host buffers the size of the largest tensor, made at the first step and kept (pinned when the
  tensors come from CUDA): fresh ones per tensor, first-touched page by page, made the host step 1.2-1.4x slower
  (bench/bench_host_optimizer_step.py);
- `step_device` (trained weights in host RAM, optimizer state on the card: trained_weights_on_host.py): a host tensor
  is stepped on the card while its layer is there, its gradient handed over by the layer's backward
  (`step_on_device`: adapters.FullLayer) instead of accumulated by autograd on the host; the updated tensor is
  copied back (through `crossings`' staging buffers, landed in host RAM by `step()` at the latest), and no gradient
  crosses. Each such tensor is stepped once per training step (a layer run twice in one
  step is refused: its first gradient would be stepped alone).
With the same optimizer implementation the weights equal those of the unfused step (tests/unit/test_fused_backward.py:
bitwise in fp32 with AdamW, Adafactor and clipping off).
"""
from __future__ import annotations

import contextlib
import types
import warnings
from typing import Callable, Sequence

import torch

from ..gradient_clipping import clip_gradients
from .cost import FeatureCost
from .stochastic_rounding import stochastic_round_to_bf16
from . import pinned_host
from .trained_weights_on_host import staged_bytes


class FusedBackward:
    def __init__(self, params: Sequence[torch.nn.Parameter], make_optimizer: Callable[[list], torch.optim.Optimizer],
                 make_scheduler: Callable[[torch.optim.Optimizer], object] | None = None, *,
                 max_grad_norm: float = 0.0, bf16_stochastic: bool = False, seed: int = 0,
                 state_on_host: bool = False, step_device: torch.device | str | None = None, crossings=None,
                 streamed_state=None, lr_scales: Sequence[float] | None = None):
        """`make_optimizer([param])`: one optimizer per parameter (training/core/optimizers.create_optimizer; with
        `state_on_host`, one for the CPU); `make_scheduler(optimizer)`: its learning-rate schedule (None: constant).
        `state_on_host`: the optimizer state lives in host RAM and each parameter's step runs there, on an fp32 copy
        of the parameter and its gradient (device to host), the result copied back (host to device). `step_device`:
        the parameters are in host RAM and each is stepped on this device, where its state lives, when its layer hands
        over its gradient (`step_on_device`). `crossings` (trained_weights_on_host.Crossings: the parameters in host
        RAM): the updates go back through it, landed in the parameters by `step` (the step's end) and `zero_grad`.
        `streamed_state` (streamed_optimizer_state.StreamedState): each optimizer's state in host RAM between its
        steps, on the card for its step (landed in host RAM by `step` and `zero_grad` too). `lr_scales`: one per
        parameter (LoRA+): its optimizer's learning rate times that, before its schedule is made."""
        self.params = [p for p in params if p.requires_grad]
        self.max_grad_norm = float(max_grad_norm)
        self.bf16_stochastic = bf16_stochastic
        if bf16_stochastic and any(p.dtype != torch.bfloat16 for p in self.params):
            raise ValueError("bf16 stochastic rounding trains bf16 weights: these parameters are not all bf16")
        # bf16_stochastic or state_on_host: the optimizer steps an fp32 stand-in per parameter (its state is keyed by
        # it, and fp32) whose data exists only during that parameter's step; on the parameter's device, or the host.
        # Placed there now: loading a checkpoint moves the state to where the stand-in is.
        self.state_on_host = state_on_host
        self.step_device = None if step_device is None or state_on_host else torch.device(step_device)
        home = torch.device("cpu") if state_on_host else self.step_device
        self._stand_ins = [self._empty(home or p.device) if bf16_stochastic or state_on_host or home is not None
                           else None for p in self.params]
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._stepped_on_device: set[int] = set()  # this training step's (step_on_device), cleared by zero_grad
        self.crossings = crossings
        if streamed_state is not None and state_on_host:
            raise ValueError("optimizer state streamed to the card for its step, or stepped in host RAM: not both")
        self.streamed_state = streamed_state
        self.optimizers = [make_optimizer([stand_in if stand_in is not None else param])
                           for param, stand_in in zip(self.params, self._stand_ins)]
        if lr_scales is not None:
            if len(lr_scales) != len(self.params):
                raise ValueError(f"{len(lr_scales)} learning-rate scales for {len(self.params)} trained parameters")
            for optimizer, scale in zip(self.optimizers, lr_scales):
                optimizer.param_groups[0]["lr"] *= scale
                optimizer.param_groups[0]["lr_scale"] = scale  # what current_lr divides out
        self.schedulers = [make_scheduler(opt) for opt in self.optimizers] if make_scheduler is not None else []
        # The learning-rate schedule of every parameter's optimizer, advanced together once per training step.
        self.schedule = _Schedules(self.schedulers)
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}  # per device: the rounding noise of bf16_stochastic
        self._host_copies: list[torch.Tensor] | None = None  # state_on_host: the fp32 weight and gradient buffers
        self.most_gradients_alive = 0  # the most parameters holding a gradient at once (tests, bench)
        self._alive = 0
        self._handles = [param.register_post_accumulate_grad_hook(self._make_hook(index))
                         for index, param in enumerate(self.params)]

    @staticmethod
    def check_bf16_weights(setting: str, fused_backward: bool, precision: str | None = None) -> None:
        """Where a node's `setting` asks for bf16 trained weights (bf16_stochastic): they are stepped with stochastic
        rounding by fused backward alone, and a module built in bf16 (a ControlNet's) computes in bf16 (`precision`:
        the run's compute precision; None where the trained layers cast, a full fine-tune's)."""
        if not fused_backward:
            raise ValueError(f"{setting} bf16_stochastic: the bf16 weights are stepped with stochastic rounding inside "
                             f"backward; turn fused_backward on in the Offload Policy (Headroom), or set {setting} to "
                             "fp32")
        if precision is not None and precision != "bf16":
            raise ValueError(f"{setting} bf16_stochastic computes in bf16: set precision to bf16 (it is {precision}), "
                             f"or {setting} to fp32")

    @staticmethod
    def check_accumulation(grad_accum: int) -> None:
        if grad_accum != 1:
            raise ValueError(f"fused backward steps every parameter inside each backward pass: grad_accumulation "
                             f"{grad_accum} needs the gradients of several passes kept, which is what it avoids. Set "
                             "grad_accumulation 1 (a larger batch instead), or turn fused backward off")

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # autograd got none: the layer stepped it on the device (step_on_device)
                return
            try:
                with self._one_gradient():
                    self._step(index, param.detach(), param.grad, param.copy_)
            finally:
                param.grad = None

        return hook

    @contextlib.contextmanager
    def _one_gradient(self):
        """Count the gradients alive at once (most_gradients_alive) around one tensor's step."""
        self._alive += 1
        self.most_gradients_alive = max(self.most_gradients_alive, self._alive)
        try:
            yield
        finally:
            self._alive -= 1

    @torch.no_grad()
    def _step(self, index: int, weight: torch.Tensor, grad: torch.Tensor, write: Callable[[torch.Tensor], object]
              ) -> None:
        """One tensor's step: `grad` clipped in its own dtype (as the plain step clips, on this tensor alone); then the
        optimizer steps the parameter itself, or an fp32 stand-in of `weight` and `grad` where the state lives, whose
        result (stochastically rounded to bf16) goes to `write`."""
        if self.max_grad_norm > 0:
            clip_gradients([types.SimpleNamespace(grad=grad)], self.max_grad_norm)
        stand_in = self._stand_ins[index]
        if stand_in is None:  # the parameter itself, its gradient `grad`
            with self._state_here(index):
                self.optimizers[index].step()
            return
        where = stand_in.device
        if self.state_on_host:
            stand_in.data, stand_in.grad = self._in_host_buffers(weight, grad)
        else:
            stand_in.data = weight.to(where, torch.float32, copy=True)
            stand_in.grad = grad.to(where, torch.float32, copy=True)
        try:
            with self._state_here(index):
                self.optimizers[index].step()
            write(stochastic_round_to_bf16(stand_in.data, self._generator(where)) if self.bf16_stochastic
                  else stand_in.data)
        finally:
            stand_in.grad = None
            stand_in.data = torch.empty(0, device=where)

    def _in_host_buffers(self, weight: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 copies of `weight` and `grad` in the kept host buffers (made at the first step: the largest tensor's
        size, pinned when the tensors come from CUDA, so the copy down is a DMA)."""
        if self._host_copies is None:
            largest = max(p.numel() for p in self.params)
            pinned = weight.is_cuda or grad.is_cuda
            self._host_copies = [pinned_host.host_empty(largest, torch.float32, pinned) for _ in range(2)]
        copies = [buffer[:weight.numel()].view(weight.shape) for buffer in self._host_copies]
        for copy, source in zip(copies, (weight, grad)):
            copy.copy_(source)
        return copies[0], copies[1]

    def _state_here(self, index: int):
        """Where the optimizer's step runs, its state for the step (streamed from host RAM: `streamed_state`)."""
        if self.streamed_state is None:
            return contextlib.nullcontext()
        return self.streamed_state.on_card(index, self.optimizers[index])

    def step_on_device(self, param: torch.Tensor, on_device: torch.Tensor, grad: torch.Tensor) -> None:
        """Step `param` (in host RAM) on the card: `on_device` its copy there (its dtype), `grad` its gradient there (its
        dtype); the same step as the hook's (`_step`), the result copied back into `param`."""
        index = self._index[id(param)]
        if self.step_device is None:
            raise RuntimeError("fused backward: a tensor handed to step_on_device, but this run steps no tensor there")
        if index in self._stepped_on_device:
            raise RuntimeError(f"fused backward: the trained tensor {tuple(param.shape)} got a second gradient in one "
                               "training step (its layer runs twice per step): with the trained weights in host RAM "
                               "and their optimizer state on the card each tensor is stepped at its first gradient. "
                               "Set the Offload Policy's optimizer_state to cpu for this model")
        self._stepped_on_device.add(index)
        with self._one_gradient():
            # Back to host RAM: the one crossing of the update (landed in `param` by `step` at the latest).
            self._step(index, on_device, grad, self._to_host(param))

    def _to_host(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        if self.crossings is not None:
            return lambda update: self.crossings.to_host(param, update)
        # Through .data: a layer run twice in the step would otherwise fail in torch's in-place check before the guard
        # in step_on_device could say why.
        return param.data.copy_

    @staticmethod
    def _empty(device: torch.device) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.empty(0, device=device), requires_grad=False)

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[key]

    # --- the optimizer's face (what the Trainer, checkpoints and parking use) ---------------------------------
    def after_step(self) -> None:
        self.schedule.step()

    @property
    def param_groups(self) -> list[dict]:
        """One group per parameter (its optimizer's), the live dicts: a schedule or a reader of `lr` sees them."""
        return [opt.param_groups[0] for opt in self.optimizers]

    @property
    def state(self) -> dict:
        """Each parameter's optimizer state by its index (the live dicts: optimizer_parking moves their tensors)."""
        state = {}
        for index, opt in enumerate(self.optimizers):
            stepped = opt.param_groups[0]["params"][0]  # the parameter, or its fp32 stand-in
            if stepped in opt.state:
                state[index] = opt.state[stepped]
        return state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Before each training step (the Trainer's first call): no gradient left, none stepped on the device yet."""
        for param in self.params:  # normally none is left: each hook frees its gradient
            param.grad = None
        self._stepped_on_device.clear()
        self._land_updates()  # normally done by step(): a backward that failed half-way leaves none in flight

    def step(self) -> None:
        """Every parameter was stepped inside backward: only the updates still crossing to host RAM are landed."""
        self._land_updates()

    def _land_updates(self) -> None:
        if self.crossings is not None:
            self.crossings.finish()
        if self.streamed_state is not None:
            self.streamed_state.finish()

    def state_dict(self) -> dict:
        """torch's layout of one optimizer with a group per parameter (index i: the i-th parameter), and the
        stochastic rounding's generators."""
        state, groups = {}, []
        for index, opt in enumerate(self.optimizers):
            saved = opt.state_dict()
            if 0 in saved["state"]:
                state[index] = saved["state"][0]
            groups.append({**saved["param_groups"][0], "params": [index]})
        return {"state": state, "param_groups": groups,
                "rounding_generators": {device: g.get_state() for device, g in self._generators.items()}}

    def load_state_dict(self, saved: dict) -> None:
        groups = saved.get("param_groups", [])
        if len(groups) != len(self.optimizers):
            raise ValueError(f"fused backward state for {len(groups)} parameters, this run trains "
                             f"{len(self.optimizers)}")
        for position, (opt, group) in enumerate(zip(self.optimizers, groups)):
            index = group["params"][0]
            entry = saved["state"].get(index)
            opt.load_state_dict({"state": {0: entry} if entry is not None else {},
                                 "param_groups": [{**group, "params": [0]}]})
            if self.streamed_state is not None:  # torch put it where the tensor is stepped: back to host RAM
                self.streamed_state.park(position, opt)
        generators = saved.get("rounding_generators", {})
        if not isinstance(generators, dict) or not all(
                isinstance(device, str) and isinstance(state, torch.Tensor) and state.dtype == torch.uint8
                for device, state in generators.items()):
            raise ValueError("its stochastic rounding generators are not a {device: generator state} table")
        for device, generator_state in generators.items():
            self._generator(torch.device(device)).set_state(generator_state)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._host_copies = None


class _Schedules:
    """Every parameter's learning-rate schedule as one (they are equal: same settings, stepped together)."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def step(self) -> None:
        # A parameter that has had no gradient yet (one the loss does not reach, such as the context outputs of an SD3
        # ControlNet's last block) has not stepped its optimizer, and torch warns once in the user's console that the
        # schedule steps before the optimizer. Nothing is skipped here: every schedule counts training steps, so a
        # parameter's first update gets the rate of the step it comes at.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            for scheduler in self.schedulers:
                scheduler.step()

    def state_dict(self) -> dict:
        return self.schedulers[0].state_dict() if self.schedulers else {}

    def load_state_dict(self, state: dict) -> None:
        for scheduler in self.schedulers:
            scheduler.load_state_dict(state)

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr() if self.schedulers else []


def gradients_cost(param_shapes: Sequence[Sequence[int]], grad_element_size: int, fused: bool,
                   state_on_host: bool = False, weights_on_host: bool = False, pinned: bool = False) -> FeatureCost:
    """Bytes of the trained tensors' gradients in a training step (the gradient has the weight's dtype): all of them
    on the device, or with fused backward the largest tensor's (the one being stepped), and the fp32 copy of that
    tensor and its gradient the optimizer steps (bf16 weights, or the state in host RAM: there, beside it, in two
    buffers kept for the run, `pinned` on CUDA: rounded up to a power of two).
    `weights_on_host` (trained_weights_on_host.py): that gradient accumulates on the host weight."""
    sizes = [int(torch.Size(shape).numel()) for shape in param_shapes]
    dtype = {4: "fp32", 2: "bf16"}.get(grad_element_size, f"{grad_element_size}-byte")
    if not fused:
        return FeatureCost(training={f"gradients ({dtype})": sum(sizes) * grad_element_size})
    largest = max(sizes, default=0)
    cost = FeatureCost()
    if weights_on_host and state_on_host:
        cost.host_added_training["one tensor's gradient (fused backward, in host RAM)"] = largest * grad_element_size
    else:  # weights in host RAM stepped on the card (step_on_device): the gradient stays there
        cost.training["one tensor's gradient (fused backward)"] = largest * grad_element_size
    if state_on_host:  # kept from the first step on (FusedBackward._in_host_buffers), validation too
        kept = 2 * staged_bytes(4 * largest, pinned)
        cost.host_added_training["one tensor's fp32 copy + gradient in its step (kept buffers)"] = kept
        cost.host_added_validation["one tensor's fp32 copy + gradient in its step (kept buffers)"] = kept
    elif weights_on_host:
        cost.training["one tensor's copy + fp32 copy + gradient in its step (stepped on the device)"] = (
            (grad_element_size + 8) * largest)
    elif grad_element_size != 4:
        cost.training["one tensor's fp32 copy + gradient in its step (stochastic rounding)"] = 8 * largest
    return cost
