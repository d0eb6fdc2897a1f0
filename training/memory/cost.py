"""The common shape of a memory feature's cost. Each feature module says what it costs with one function returning a
`FeatureCost` (checkpointing.activation_cost, activation_offload.activation_cost, weight_streaming.placement_cost,
optimizer_parking.optimizer_cost; lowbit, which changes sizes rather than adding items, gives stored_bytes /
copies_kept / weight_in_flight); the planner (planner.estimate) adds them up per phase."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class FeatureCost:
    """Device bytes by item, per phase of a run, and what lives in host RAM instead; named as the plan shows them."""

    training: dict[str, int] = dataclasses.field(default_factory=dict)  # the training step
    validation: dict[str, int] = dataclasses.field(default_factory=dict)  # sampling, beside the frozen weights
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    # Host RAM the feature allocates, per phase, beyond the models already loaded (host_ram.py budgets it).
    host_added_training: dict[str, int] = dataclasses.field(default_factory=dict)
    host_added_validation: dict[str, int] = dataclasses.field(default_factory=dict)
    training_notes: list[str] = dataclasses.field(default_factory=list)
    validation_notes: list[str] = dataclasses.field(default_factory=list)
