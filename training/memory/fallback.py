"""The driver's silent system-memory fallback, found from device readings.

On Windows the NVIDIA driver may, instead of failing an allocation the card cannot hold, place it in system RAM
("CUDA - Sysmem Fallback Policy"): the run goes on 5-20x slower and nothing says why. `FallbackDetector` is fed one
`Reading` per training step (taken by nodes/bridge/memory_fallback.py; no torch.cuda call here, so recorded readings
test it) and returns a `Finding` the first time it sees either sign:

- spill: torch's reserved memory is larger than the card physically has. Only memory outside the card can hold the
  excess, so this is proof, whatever the step times say.
- slowdown: the median of the last RECENT_STEPS step times is over SLOWDOWN_FACTOR times the median of the first
  BASELINE_STEPS after WARMUP_STEPS, while reserved memory is within NEAR_FULL of the card. Medians, so one slow step
  (a checkpoint written inside a step) does not count; memory near full, so a slowdown with room left (another
  program using the GPU, thermal throttling) is not blamed on the fallback.

A run that spills from its first step shows no slowdown against its own start; only the spill sign finds it then.
The thresholds and why: docs/MEMORY.md, "The driver's system-memory fallback".
"""
from __future__ import annotations

import dataclasses
import statistics
from collections import deque

# The first steps load the model, tune kernels and grow the allocator's cache: not the run's speed.
WARMUP_STEPS = 3
# Five steps: their median ignores two outliers in either window, and the check can start by step 13.
BASELINE_STEPS = 5
RECENT_STEPS = 5
# Spilling costs 5-20x (PCIe instead of VRAM bandwidth); a run's own jitter (data, timesteps, sequence lengths)
# stays well under 2x, so 3x separates the two with room on both sides.
SLOWDOWN_FACTOR = 3.0
# The driver spills when the whole card is full, and on a Windows display card the desktop, the browser and
# ComfyUI's own context hold 0.5-1.5 GiB of it: torch's reserved memory then stands at about 85-95% of the card.
NEAR_FULL = 0.85

FIX = ("Lower the run's VRAM budget (the Offload Policy node's vram_budget_gb, or a larger reserve_gb on an auto "
       "budget) so the Memory Plan picks a policy that fits, or set the NVIDIA driver's 'CUDA - Sysmem Fallback Policy' to 'Prefer No Sysmem Fallback' (NVIDIA Control "
       "Panel > Manage 3D settings), so an over-budget run stops with an out-of-memory error the planner can act on.")


@dataclasses.dataclass(frozen=True)
class Reading:
    """One training step as the device saw it. step_seconds None: not a step's own time (the first step after
    the model loaded); total_bytes: the card's physical memory."""

    step: int
    step_seconds: float | None
    reserved_bytes: int
    allocated_bytes: int
    total_bytes: int


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # "spill" or "slowdown"
    step: int | None  # None: found outside training (the VRAM monitor)
    message: str
    evidence: dict

    def as_dict(self) -> dict:
        return {"kind": self.kind, "step": self.step, "message": self.message, **self.evidence}


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def spill_finding(reserved_bytes: int, allocated_bytes: int, total_bytes: int, step: int | None = None
                  ) -> Finding | None:
    """A Finding when torch holds more than the card physically has (the excess is in system RAM), else None."""
    if total_bytes <= 0 or reserved_bytes <= total_bytes:
        return None
    where = f"at step {step}" if step is not None else "now"
    message = (f"GPU memory is spilling into system RAM: {where} PyTorch holds {_gib(reserved_bytes)} but the card "
               f"has {_gib(total_bytes)}. The NVIDIA driver's system-memory fallback keeps the run going instead of "
               f"failing, 5-20x slower. {FIX}")
    return Finding("spill", step, message, {"reserved_bytes": reserved_bytes, "allocated_bytes": allocated_bytes,
                                            "total_bytes": total_bytes})


class FallbackDetector:
    """Fed each step's Reading (`observe`); returns the first Finding once, and keeps it in `finding`."""

    def __init__(self):
        self.finding: Finding | None = None
        self._timed = 0  # timed steps seen, warm-up included
        self._baseline: list[float] = []
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)

    def observe(self, reading: Reading) -> Finding | None:
        if self.finding is not None:
            return None  # said once per run
        finding = spill_finding(reading.reserved_bytes, reading.allocated_bytes, reading.total_bytes, reading.step)
        if finding is None and reading.step_seconds is not None:
            finding = self._slowdown(reading)
        self.finding = finding
        return finding

    def _slowdown(self, reading: Reading) -> Finding | None:
        self._timed += 1
        if self._timed <= WARMUP_STEPS:
            return None
        if len(self._baseline) < BASELINE_STEPS:
            self._baseline.append(reading.step_seconds)
            return None
        self._recent.append(reading.step_seconds)
        if len(self._recent) < RECENT_STEPS or reading.total_bytes <= 0:
            return None
        baseline, recent = statistics.median(self._baseline), statistics.median(self._recent)
        full = reading.reserved_bytes / reading.total_bytes
        if recent <= SLOWDOWN_FACTOR * baseline or full < NEAR_FULL:
            return None
        message = (f"Training slowed {recent / baseline:.1f}x (from {baseline:.2f} to {recent:.2f} s per step, by step "
                   f"{reading.step}) with the GPU's memory {full:.0%} full ({_gib(reading.reserved_bytes)} of "
                   f"{_gib(reading.total_bytes)}): the NVIDIA driver is likely moving memory into system RAM "
                   f"instead of failing. {FIX}")
        return Finding("slowdown", reading.step, message, {
            "baseline_s_per_step": baseline, "recent_s_per_step": recent, "reserved_bytes": reading.reserved_bytes,
            "allocated_bytes": reading.allocated_bytes, "total_bytes": reading.total_bytes})
