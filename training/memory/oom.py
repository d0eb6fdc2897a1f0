"""Out of memory in a phase -> checkpoint saved, memory freed, and an error that says what to do next.

    try:
        trainer.train_to(step)
    except torch.OutOfMemoryError as error:
        raise out_of_memory("training step", error, device, save_checkpoint=trainer.save,
                            free_memory=run.release, next_plan=lambda: next_smaller_policy(...)) from None

The returned `PhaseOutOfMemoryError` names the phase, the peak measured on the device before memory was
freed, and the planner's next policy to try (or says that none is smaller). Raise it `from None`: the
original error's traceback would keep the failed step's tensors alive.
"""
from __future__ import annotations

import traceback
from typing import Callable

import torch

from .. import public_module
from .planner import Plan
from .policy import GIB


class PhaseOutOfMemoryError(RuntimeError):
    """The device ran out of memory in a phase of a run; the message names the next policy to try."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report

    def __init__(self, message: str, phase: str, peak_bytes: int | None, next_plan: Plan | None):
        super().__init__(message)
        self.phase = phase
        self.peak_bytes = peak_bytes
        self.next_plan = next_plan


def is_out_of_memory(error: BaseException) -> bool:
    # torch raises OutOfMemoryError for the caching allocator; other paths (cuBLAS workspaces, some
    # extensions) raise a plain RuntimeError with the same words.
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def measured_peak_bytes(device: torch.device | str) -> int | None:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(device)
    return None


def out_of_memory(phase: str, error: BaseException, device: torch.device | str, *,
                  save_checkpoint: Callable[[], object] | None = None,
                  free_memory: Callable[[], object] | None = None,
                  next_plan: Callable[[], Plan | None] | None = None) -> PhaseOutOfMemoryError:
    """Save, free, and build the error to raise for an out-of-memory `error` in `phase`."""
    peak = measured_peak_bytes(device)
    if error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)  # drop the failed step's tensors held by its frames
    steps = []
    if save_checkpoint is not None:
        try:
            save_checkpoint()
            steps.append("the last completed step is saved")
        except Exception as save_error:  # report it, but the out-of-memory error is the one to show
            steps.append(f"saving the checkpoint failed too ({save_error})")
    if free_memory is not None:
        free_memory()
        steps.append("device memory was freed")
    plan = next_plan() if next_plan is not None else None
    peak_text = f"peak {peak / GIB:.2f} GiB allocated" if peak is not None else "no device peak figure on this device"
    message = f"Out of memory during {phase} ({peak_text}). "
    if steps:
        done = "; ".join(steps)
        message += done[0].upper() + done[1:] + ". "
    if plan is not None:
        message += (f"Next policy to try: {plan.policy.describe()} (estimated peak {plan.peak_bytes / GIB:.2f} GiB "
                    f"in {plan.peak.phase}); set it in the Offload Policy node, or run the Memory Plan node in 'auto' mode.")
    else:
        message += "No smaller policy is left: lower the batch size or the resolution, or free device memory."
    return PhaseOutOfMemoryError(message, phase, peak, plan)
