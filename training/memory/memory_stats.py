"""Memory figures of the training device and of this process, and per-phase peak records.

On CUDA: the driver's total/free (`torch.cuda.mem_get_info`) and torch's caching-allocator
counters. On anything else no GPU figure is reported at all, only the process's resident set
(RSS) and its peak, so a CPU run never shows made-up VRAM numbers.

`PhaseRecorder` wraps the phases of a run (caching, training, validation, save) and keeps,
for each, the peak allocated/reserved bytes (CUDA) and the peak RSS, plus wall time; it
serialises to JSON for the run directory and renders text and a small bar-chart image.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator

import torch

from .. import os_compat
from ..data.files import no_json_constants, write_bytes

RECORD_FORMAT = "headroom.memory_record"
RECORD_VERSION = 1


def _as_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # A record read back on a machine without CUDA still names a concrete device.
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def process_rss_bytes() -> int | None:
    return os_compat.process_rss_bytes()


def process_peak_rss_bytes() -> int | None:
    """Peak RSS since the last `reset_peak` (Linux) or since the process started (elsewhere)."""
    return os_compat.process_peak_rss_bytes()


def reset_peak(device: torch.device | str | None = None) -> bool:
    """Start new peak counters for `device` (and for the process RSS).

    Returns whether the RSS peak could be reset; when not, RSS peaks count from process start.
    """
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return os_compat.reset_peak_rss()


def device_memory_snapshot(device: torch.device | str | None = None) -> dict:
    """Memory figures for `device` now; GPU keys appear only for a CUDA device."""
    device = _as_device(device)
    snapshot = {
        "device": str(device),
        "cuda": device.type == "cuda",
        "process_rss_bytes": process_rss_bytes(),
        "process_peak_rss_bytes": process_peak_rss_bytes(),
    }
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        snapshot.update(
            name=torch.cuda.get_device_name(device),
            driver_total_bytes=total,
            driver_free_bytes=free,
            allocated_bytes=torch.cuda.memory_allocated(device),
            reserved_bytes=torch.cuda.memory_reserved(device),
            max_allocated_bytes=torch.cuda.max_memory_allocated(device),
            max_reserved_bytes=torch.cuda.max_memory_reserved(device),
        )
    return snapshot


def format_bytes(value: int | None) -> str:
    if value is None:
        return "n/a"
    if value >= 2**30:
        return f"{value / 2**30:,.2f} GiB"
    if value >= 2**20:
        return f"{value / 2**20:,.1f} MiB"
    return f"{value / 2**10:,.1f} KiB"


# Bar colours of the chart, in phase order; render_text names them so text and chart line up.
_BAR_COLOURS: list[tuple[str, tuple[float, float, float]]] = [
    ("blue", (0.27, 0.51, 0.93)),
    ("orange", (1.00, 0.60, 0.20)),
    ("green", (0.30, 0.75, 0.35)),
    ("red", (0.90, 0.30, 0.30)),
    ("purple", (0.65, 0.45, 0.90)),
    ("teal", (0.20, 0.75, 0.75)),
    ("yellow", (0.95, 0.85, 0.25)),
    ("pink", (0.95, 0.55, 0.75)),
]


def _checked_device(value, where: str) -> torch.device:
    try:
        if not isinstance(value, str) or len(value) > 40:
            raise TypeError
        return _as_device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{where}: device {str(value)[:40]!r} is not a torch device name") from None


def _is_count(value) -> bool:
    return type(value) is int and 0 <= value < 2**63


def _is_seconds(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


# Every field a phase record has (as `PhaseRecorder.phase` writes it), with its check; the CUDA peaks only on CUDA.
_PHASE_FIELDS = {
    "phase": lambda v: isinstance(v, str) and 0 < len(v) <= 200,
    "seconds": _is_seconds,
    "completed": lambda v: type(v) is bool,
    "device": lambda v: isinstance(v, str),  # checked as a device name below
    "cuda": lambda v: type(v) is bool,
    "peak_rss_bytes": lambda v: v is None or _is_count(v),
    "peak_rss_scope": lambda v: v in ("phase", "process"),
}
_CUDA_FIELDS = {"peak_allocated_bytes": _is_count, "peak_reserved_bytes": _is_count}


def check_phase(record: dict, where: str) -> None:
    """One phase record read back (from a file or pasted JSON): exactly the fields `phase` writes, each of its type
    and range (finite, non-negative), or a ValueError naming the field."""
    _check_exact_fields(record, {**_PHASE_FIELDS, **(_CUDA_FIELDS if record.get("cuda") is True else {})}, where)
    _checked_device(record["device"], where)


def _check_exact_fields(record: dict, fields: dict, where: str) -> None:
    """`record` has exactly `fields` (name -> check), each valid, or a ValueError naming the field."""
    unknown = sorted(str(key)[:40] for key in record if key not in fields)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for name, valid in fields.items():
        if name not in record:
            raise ValueError(f"{where}: field {name!r} is missing")
        if not valid(record[name]):
            raise ValueError(f"{where}: field {name!r} = {str(record[name])[:40]!r} is not valid")


# Every field a warning has (training/memory/fallback.py's Finding.as_dict), with its check.
_WARNING_FIELDS = {
    "kind": lambda v: v in ("spill", "slowdown"),
    "step": lambda v: v is None or _is_count(v),
    "message": lambda v: isinstance(v, str) and 0 < len(v) <= 2000,
    "reserved_bytes": _is_count, "allocated_bytes": _is_count, "total_bytes": _is_count,
    "baseline_s_per_step": _is_seconds, "recent_s_per_step": _is_seconds,
}


def check_warning(record, where: str) -> None:
    """One warning read back: an object with a kind and a message, every field known and of its type."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: must be an object")
    for name in ("kind", "message"):
        if name not in record:
            raise ValueError(f"{where}: field {name!r} is missing")
    for name, value in record.items():
        valid = _WARNING_FIELDS.get(name)
        if valid is None:
            raise ValueError(f"{where}: unknown field {str(name)[:40]!r}")
        if not valid(value):
            raise ValueError(f"{where}: field {name!r} = {str(value)[:40]!r} is not valid")


# The step time (`PhaseRecorder.step_time`): the planner's predicted s/step (planner.Plan.predicted_s_per_step; None: no
# plan was made) beside the measured one (the median of the last training call's steps after its first) and how many
# steps that median is of.
_STEP_TIME_FIELDS = {
    "predicted_s_per_step": lambda v: v is None or (_is_seconds(v) and v > 0),
    "measured_s_per_step": lambda v: v is None or (_is_seconds(v) and v > 0),
    "steps": _is_count,
}


def check_step_time(record, where: str) -> None:
    """The step time read back: an object of exactly its fields, each finite and > 0 (or null), or a ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: must be an object")
    _check_exact_fields(record, _STEP_TIME_FIELDS, where)


def step_time_line(step_time: dict) -> str:
    """"step time: measured 1.10 s/step (median of 20 steps), predicted 1.00 s/step by the plan (measured 1.10x)"."""
    measured, predicted = step_time["measured_s_per_step"], step_time["predicted_s_per_step"]
    text = "step time: " + ("not measured" if measured is None else
                            f"measured {measured:.3f} s/step (median of {step_time['steps']} steps)")
    text += ", no plan's prediction" if predicted is None else f", predicted {predicted:.3f} s/step by the plan"
    if measured is not None and predicted is not None:
        text += f" (measured {measured / predicted:.2f}x)"
    return text


class PhaseRecorder:
    """Per-phase peak memory and wall time of one run.

        recorder = PhaseRecorder(device)
        with recorder.phase("training"):
            ...
        recorder.to_json()

    Each phase resets the peak counters when it starts, so phases do not nest. `warnings`: what was found about
    the run's memory on the way (each a dict with a "message": the driver's fallback, training/memory/fallback.py).
    """

    def __init__(self, device: torch.device | str | None = None, phases: list[dict] | None = None,
                 warnings: list[dict] | None = None, step_time: dict | None = None):
        self.device = _as_device(device)
        self.phases: list[dict] = list(phases or [])
        self.warnings: list[dict] = list(warnings or [])
        self.step_time: dict | None = None if step_time is None else dict(step_time)
        self._open_phase: str | None = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._open_phase is not None:
            raise RuntimeError(
                f"PhaseRecorder: phase {name!r} started inside phase {self._open_phase!r}; phases reset the "
                "peak counters and cannot nest, end the first one before starting the next"
            )
        self._open_phase = name
        on_cuda = self.device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(self.device)  # earlier queued GPU work belongs to the previous phase
        rss_peak_is_per_phase = reset_peak(self.device)
        started = time.perf_counter()
        completed = False
        try:
            yield
            completed = True
        finally:
            # Recorded even when the phase raised (an OOM in validation is exactly what to see).
            if on_cuda and completed:
                torch.cuda.synchronize(self.device)  # the phase's time includes its queued GPU work
            seconds = time.perf_counter() - started
            record = {
                "phase": name,
                "seconds": seconds,
                "completed": completed,
                "device": str(self.device),
                "cuda": self.device.type == "cuda",
                "peak_rss_bytes": process_peak_rss_bytes(),
                "peak_rss_scope": "phase" if rss_peak_is_per_phase else "process",
            }
            if on_cuda:
                record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
                record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(self.device)
            self.phases.append(record)
            self._open_phase = None

    def record_step_time(self, predicted_s: float | None, measured_s: float | None, steps: int) -> None:
        """The planner's predicted s/step beside the measured one (see _STEP_TIME_FIELDS)."""
        step_time = {"predicted_s_per_step": None if predicted_s is None else float(predicted_s),
                     "measured_s_per_step": None if measured_s is None else float(measured_s), "steps": int(steps)}
        check_step_time(step_time, "memory record: step_time")
        self.step_time = step_time

    def as_dict(self) -> dict:
        data = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "device": str(self.device), "phases": self.phases,
                "warnings": self.warnings}
        if self.step_time is not None:  # absent until a run trains (and in records written before it was kept)
            data["step_time"] = dict(self.step_time)
        return data

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> PhaseRecorder:
        """A record as `to_json` writes it. It may come from a file anyone could upload (a run folder's
        memory_record.json) or a pasted string: every field is checked, anything else is a ValueError."""
        try:
            data = json.loads(text, parse_constant=no_json_constants)
        except (ValueError, RecursionError) as error:  # RecursionError: brackets nested beyond Python's stack
            raise ValueError(f"memory record: not valid JSON ({str(error)[:200]}); pass the record_json of a "
                             "Headroom run") from None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            raise ValueError(
                f"memory record: JSON is not a {RECORD_FORMAT!r} record; pass the record_json of a Headroom run"
            )
        if data.get("version") != RECORD_VERSION:
            raise ValueError(
                f"memory record: version {repr(data.get('version'))[:40]} is not supported (this Headroom reads "
                f"{RECORD_VERSION})"
            )
        phases = data.get("phases")
        if not isinstance(phases, list) or not all(isinstance(p, dict) and "phase" in p for p in phases):
            raise ValueError("memory record: 'phases' must be a list of objects that each name their 'phase'")
        for index, phase in enumerate(phases):
            check_phase(phase, f"memory record: phase {index}")
        warnings = data.get("warnings", [])  # records written before warnings were kept have none
        if not isinstance(warnings, list):
            raise ValueError("memory record: 'warnings' must be a list")
        for index, warning in enumerate(warnings):
            check_warning(warning, f"memory record: warning {index}")
        step_time = data.get("step_time")
        if step_time is not None:
            check_step_time(step_time, "memory record: step_time")
        return cls(_checked_device(data.get("device", "cpu"), "memory record"), phases, warnings, step_time)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON record atomically (a reader never sees half a file)."""
        write_bytes(path, self.to_json().encode("utf-8"), "memory record", make_parents=False)

    @staticmethod
    def _bar_value(record: dict) -> int:
        """The figure a phase's bar shows: peak reserved on CUDA, peak RSS elsewhere."""
        return record.get("peak_reserved_bytes", record.get("peak_rss_bytes")) or 0

    def render_text(self) -> str:
        warnings = [f"WARNING: {warning['message']}" for warning in self.warnings]
        if not self.phases:
            return "\n".join(["Headroom memory report: no phases recorded.", *warnings])
        lines = ["Headroom memory report (peak per phase; bar colour in the chart):", *warnings]
        if self.step_time is not None:
            lines.append(step_time_line(self.step_time))
        for index, record in enumerate(self.phases):
            colour = _BAR_COLOURS[index % len(_BAR_COLOURS)][0]
            status = "" if record.get("completed", True) else "  FAILED"
            line = f"- {record['phase']} [{colour}]: {record.get('seconds', 0.0):.2f} s"
            if "peak_reserved_bytes" in record:
                line += (
                    f", peak allocated {format_bytes(record['peak_allocated_bytes'])}, "
                    f"peak reserved {format_bytes(record['peak_reserved_bytes'])} on {record.get('device', 'cuda')}"
                )
            else:
                line += f", no GPU ({record.get('device', 'cpu')})"
            scope = "" if record.get("peak_rss_scope", "phase") == "phase" else " (since process start)"
            line += f", peak process RSS {format_bytes(record.get('peak_rss_bytes'))}{scope}{status}"
            lines.append(line)
        return "\n".join(lines)

    def render_chart(self, width: int = 256, height: int = 128) -> torch.Tensor:
        """Bars of each phase's peak (reserved on CUDA, with allocated as a brighter inner bar;
        RSS elsewhere), scaled to the largest; an IMAGE tensor [1, height, width, 3] in 0..1."""
        if width < 16 or height < 16:
            raise ValueError(f"memory chart: {width}x{height} is too small; use at least 16x16 pixels")
        # Drawn with tensor slicing: bars need no plotting library, and the node stays dependency-free.
        image = torch.full((height, width, 3), 0.12)
        margin = 4
        baseline = height - margin
        image[baseline, margin : width - margin] = 0.7
        if not self.phases:
            return image.unsqueeze(0)
        values = [self._bar_value(record) for record in self.phases]
        largest = max(values) or 1
        slot = (width - 2 * margin) / len(self.phases)
        usable_height = baseline - margin
        for index, (record, value) in enumerate(zip(self.phases, values)):
            colour = torch.tensor(_BAR_COLOURS[index % len(_BAR_COLOURS)][1])
            left = margin + round(index * slot + slot * 0.15)
            right = max(left + 1, margin + round((index + 1) * slot - slot * 0.15))
            top = baseline - round(usable_height * value / largest)
            image[top:baseline, left:right] = colour * 0.6
            allocated = record.get("peak_allocated_bytes")
            if allocated is not None:
                inner_top = baseline - round(usable_height * allocated / largest)
                image[inner_top:baseline, left:right] = colour
            else:
                image[top:baseline, left:right] = colour
        return image.unsqueeze(0)
