"""Host (system) RAM as a budget beside the device's (policy field `host_ram_budget_gb`).

A run that fits the card can still be ended by the operating system's out-of-memory killer: what a run keeps in
host RAM is planned here and checked before the first step, so it stops with a message naming what to change.

What a run adds to host RAM, per phase, is each memory feature's `FeatureCost.host_added_*` (optimizer state and
fp32 master weights on the host, parked optimizer state while sampling, offloaded block inputs; the planner adds
them up) plus the EMA copy of the trainable weights. The models ComfyUI loaded are not added: the loaders put them
in host RAM before any Headroom node runs, so they are already in the process's resident set (`in_use_bytes`);
placing them on the device only frees host RAM, so leaving that out errs on the safe side.

    room = host_room(policy.host_ram_budget_gb)   # in use now, and the limit: the budget, or in use + available - reserve
    room.fits(peak_added(added_by_phase(features, ema, trainable_bytes)))   # in use + added <= limit
"""
from __future__ import annotations

import dataclasses

from .memory_stats import process_rss_bytes

GIB = 1024 ** 3
# Kept free for the OS, the desktop and the page cache when the budget is "auto" (what the OS reports available).
HOST_RESERVE_BYTES = 2 * GIB


@dataclasses.dataclass(frozen=True)
class HostRoom:
    """The process's host RAM when a run is planned, and what it may grow to."""

    in_use_bytes: int
    limit_bytes: int
    auto: bool  # the limit is what the OS said was available (less the reserve), not a given budget

    def fits(self, added_bytes: int) -> bool:
        return self.in_use_bytes + added_bytes <= self.limit_bytes

    def describe(self, added_bytes: int) -> str:
        limit = (f"{self.limit_bytes / GIB:.2f} GiB (in use + available - {HOST_RESERVE_BYTES / GIB:g} GiB reserve)"
                 if self.auto else f"budget {self.limit_bytes / GIB:.2f} GiB")
        verdict = "fits" if self.fits(added_bytes) else "DOES NOT FIT"
        return (f"host RAM: {self.in_use_bytes / GIB:.2f} GiB in use + {added_bytes / GIB:.2f} GiB added by the run, "
                f"limit {limit} - {verdict}")


def available_bytes() -> int | None:
    """What the OS says a process can still allocate without swapping (psutil's `available`), or None."""
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def host_room(budget_gb: float | str, in_use_bytes: int | None = None, available: int | None = None
              ) -> HostRoom | None:
    """The room for policy field `host_ram_budget_gb` (GiB the process may use, or "auto"), measured now unless
    given; None where the process's memory cannot be read (no budget is then applied)."""
    in_use = process_rss_bytes() if in_use_bytes is None else in_use_bytes
    if in_use is None:
        return None
    if budget_gb != "auto":
        return HostRoom(int(in_use), int(float(budget_gb) * GIB), auto=False)
    free = available_bytes() if available is None else available
    if free is None:
        return None
    return HostRoom(int(in_use), int(in_use + free - HOST_RESERVE_BYTES), auto=True)


def ema_cost(trainable_param_bytes: int) -> dict[str, int]:
    """The EMA's averaged copy of the trainable weights (fp32, host RAM, the whole run: core/ema.py)."""
    return {"EMA of the trainable weights (fp32)": int(trainable_param_bytes)}


def added_by_phase(features, ema: bool, trainable_param_bytes: int, trained_bytes: int | None = None
                   ) -> dict[str, dict[str, int]]:
    """What the run adds to host RAM in the training step and in validation, by item: the features' costs
    (`cost.FeatureCost.host_added_*`) and the EMA copy where kept; while validation samples the EMA, the trained
    weights (`trained_bytes`, as trained; default the fp32 size) wait in host RAM too (core/ema.py swapped_in)."""
    phases = {"training step": {k: v for cost in features for k, v in cost.host_added_training.items()},
              "validation": {k: v for cost in features for k, v in cost.host_added_validation.items()}}
    if ema:
        for items in phases.values():
            items.update(ema_cost(trainable_param_bytes))
        kept = trainable_param_bytes if trained_bytes is None else trained_bytes
        phases["validation"]["trained weights, kept while their EMA is sampled"] = int(kept)
    return phases


def peak_added(phases: dict[str, dict[str, int]]) -> int:
    """The most host RAM the run adds in any one phase (of `added_by_phase`)."""
    return max((sum(items.values()) for items in phases.values()), default=0)


def advice(room: HostRoom, added_bytes: int) -> str:
    """What to change when a run's host RAM does not fit."""
    over = room.in_use_bytes + added_bytes - room.limit_bytes
    return (f"{over / GIB:.2f} GiB over: close other programs or free ComfyUI's model and node cache, "
            "keep the optimizer state on the device (optimizer_state gpu), use checkpointing 'blocks' rather than "
            "'blocks_cpu_offload', turn EMA off, or raise host_ram_budget_gb if the machine has the RAM")
