"""The driver's system-memory fallback, watched during a run (training/memory/fallback.py finds it).

`read_device` is the one place device readings come from: torch.cuda on a CUDA device, None elsewhere (a CPU run has
no VRAM to spill). Tests replace this module-level function to feed recorded readings through the real nodes.
`FallbackWatch` times each step, feeds the detector and, the first time it finds the fallback, logs a warning,
keeps the finding in the run's memory record and holds the message for the training node's text (`untold`).
`FOUND` remembers each run's finding in this process, for the VRAM monitor.
"""
from __future__ import annotations

import logging
import time

import torch

from ...training.memory.fallback import FallbackDetector, Finding, Reading, spill_finding
from ...training.memory.memory_stats import PhaseRecorder

FOUND: dict[str, dict] = {}  # run name -> its finding (Finding.as_dict), runs of this process


def read_device(device: torch.device) -> tuple[int, int, int] | None:
    """(reserved, allocated, physical total) bytes of a CUDA device now; None for any other device."""
    if device.type != "cuda":
        return None
    return (torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device),
            torch.cuda.get_device_properties(device).total_memory)


def spill_now(device: torch.device) -> Finding | None:
    """The spill sign at this moment (the VRAM monitor: no step times to compare)."""
    memory = read_device(device)
    return None if memory is None else spill_finding(*memory)


class FallbackWatch:
    """One run's watch: `start()` when a train_to call starts, `after_step(step)` after each step."""

    def __init__(self, run_name: str, record: PhaseRecorder):
        self.run_name, self.record = run_name, record  # the record's device is the run's
        self.detector = FallbackDetector()
        self._last: float | None = None
        self._untold: str | None = None

    def start(self) -> None:
        # The first step of a call includes loading the model: timed from it on, not from the call's start.
        self._last = None

    def after_step(self, step: int) -> str | None:
        """The finding's message at the step it is first found, else None."""
        now = time.perf_counter()
        seconds, self._last = (None if self._last is None else now - self._last), now
        memory = read_device(self.record.device)
        if memory is None:
            return None
        finding = self.detector.observe(Reading(step, seconds, *memory))
        if finding is None:
            return None
        logging.warning("Headroom: run '%s': %s", self.run_name, finding.message)
        self.record.warnings.append(finding.as_dict())
        FOUND[self.run_name] = finding.as_dict()
        self._untold = finding.message
        return finding.message

    def untold(self) -> list[str]:
        """The finding's message for the training node's text, once ([] otherwise)."""
        told, self._untold = self._untold, None
        return [told] if told else []
