"""The planner for a full fine-tune (issue 27): the blocks' own weights trained, itemised per phase like a LoRA plan.

    plan = estimate_full(description, TrainableSpec.from_parameters(block_params, "Adafactor"), shape,
                         FullTraining(weights="bf16_stochastic", fused_backward=True), budget_bytes)

Each option is a memory feature with its own cost (fused_backward.gradients_cost, stochastic_rounding.weights_cost,
checkpointing / activation_offload for activations); the sum is what a training step holds on the device, and what
the optimizer state (and fp32 masters) put in host RAM when `optimizer_state` is "cpu". Planned, not measured: the
engine pieces exist (fused_backward.py, stochastic_rounding.py), the full fine-tune node does not yet.
"""
from __future__ import annotations

import dataclasses
import math

from . import activation_offload, checkpointing, fused_backward, stochastic_rounding
from .planner import (ALLOCATOR_OVERHEAD, ModelDescription, Plan, PhaseEstimate, RunShape, TrainableSpec,
                      _optimizer_state_bytes as optimizer_state_bytes)
from .policy import OffloadPolicy

FULL_WEIGHTS = ("bf16_stochastic", "fp32_masters")


@dataclasses.dataclass(frozen=True)
class FullTraining:
    """How a full fine-tune keeps what it trains."""

    weights: str = "bf16_stochastic"  # bf16 weights updated with stochastic rounding, or fp32 masters + a bf16 copy
    fused_backward: bool = True  # each parameter stepped in backward: one gradient at a time
    optimizer_state: str = "gpu"  # "cpu": optimizer state (and fp32 masters) in host RAM
    checkpointing: str = "blocks"  # as the offload policy's

    def __post_init__(self):
        if self.weights not in FULL_WEIGHTS:
            raise ValueError(f"full fine-tune weights {self.weights!r}: choose one of {', '.join(FULL_WEIGHTS)}")
        if self.optimizer_state not in ("gpu", "cpu"):
            raise ValueError(f"optimizer_state {self.optimizer_state!r}: choose gpu or cpu")

    def describe(self, optimizer: str) -> str:
        return (f"full fine-tune: {self.weights.replace('_', ' ')}, "
                f"{'fused backward' if self.fused_backward else 'all gradients kept'}, {optimizer} state on "
                f"{self.optimizer_state}, checkpointing {self.checkpointing}")


def estimate_full(description: ModelDescription, trainable: TrainableSpec, shape: RunShape, options: FullTraining,
                  budget_bytes: int | None = None) -> Plan:
    """Device bytes of a full fine-tune's training step and validation (`trainable`: the trained block weights'
    shapes and the optimizer), and the host RAM it keeps instead."""
    area, tokens, batch = shape.latent_area(description), shape.tokens(description), shape.batch
    blocks = description.blocks
    saved = [b.saved.at(area, tokens) * batch for b in blocks]
    copies = [b.copies_kept("as_loaded") for b in blocks]
    inputs = [b.inputs.at(area, tokens) * batch for b in blocks]
    host: dict[str, int] = {}

    weights = stochastic_rounding.weights_cost(trainable.param_bytes(), options.weights == "bf16_stochastic").training
    if options.optimizer_state == "cpu" and "fp32 master weights" in weights:
        host["fp32 master weights"] = weights.pop("fp32 master weights")
    gradients = fused_backward.gradients_cost(trainable.shapes, 2, options.fused_backward).training  # bf16 grads
    state = {f"optimizer state ({trainable.optimizer})": trainable.optimizer_bytes()}
    if options.optimizer_state == "cpu":
        host.update(state)
        state = {}
    largest = max((math.prod(s) for s in trainable.shapes), default=0)
    # The step of one parameter: its fp32 copy and fp32 gradient (bf16 stochastic rounding steps an fp32 stand-in;
    # state on the host brings that parameter's state over too).
    step = 8 * largest if options.weights == "bf16_stochastic" else 4 * largest
    if options.optimizer_state == "cpu":
        step += max((optimizer_state_bytes(trainable.optimizer, s) for s in trainable.shapes), default=0)
    activation_costs = [feature(options.checkpointing, saved, copies, inputs)
                        for feature in (checkpointing.activation_cost, activation_offload.activation_cost)]
    activations = {name: value for cost in activation_costs for name, value in cost.training.items()}
    host.update({name: value for cost in activation_costs for name, value in cost.host.items()})
    activations["saved activations outside the blocks"] = int(description.outside_saved.at(area, tokens) * batch)
    activations["gradient buffers of one block"] = int(2 * max(inputs, default=0))

    outer = {"frozen weights outside the blocks": description.other_param_bytes}
    training_items = {**outer, **weights, **gradients, **state, "one parameter's optimizer step in flight": step,
                      **activations}
    training_items["allocator overhead (5%)"] = int(ALLOCATOR_OVERHEAD * sum(training_items.values()))
    validation_items = {**outer, **weights, **state,
                        "sampling working set (ComfyUI estimate, cond+uncond)": int(
                            description.inference_bytes_per_latent_px * area * 2)}
    validation_items["allocator overhead (5%)"] = int(ALLOCATOR_OVERHEAD * sum(validation_items.values()))
    # The trained weights stay on the device (streaming them through the card is not planned yet).
    policy = OffloadPolicy(checkpointing=options.checkpointing, optimizer_state=options.optimizer_state)
    return Plan(policy, [PhaseEstimate("training step", training_items), PhaseEstimate("validation", validation_items)],
                budget_bytes, reason=options.describe(trainable.optimizer), host_bytes=host)
