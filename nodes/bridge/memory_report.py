"""The device's memory as ComfyUI and torch see it, with ComfyUI's loaded models: one report (a dict the VRAM Monitor
node outputs as JSON, format headroom.vram_monitor) and its text."""
from __future__ import annotations

import time

import comfy.model_management

from ...training.memory.memory_stats import device_memory_snapshot, format_bytes
from .memory_fallback import FOUND, spill_now

MONITOR_FORMAT = "headroom.vram_monitor"
MONITOR_VERSION = 1


def loaded_models_report() -> list[dict]:
    """ComfyUI's loaded models (`comfy.model_management.current_loaded_models`), as plain dicts."""
    models = []
    for loaded in comfy.model_management.current_loaded_models:
        patcher = loaded.model
        if patcher is None:  # the patcher was garbage collected; ComfyUI drops the entry later
            continue
        size = patcher.model_size()
        on_device = loaded.model_loaded_memory()
        models.append(
            {
                "name": type(patcher.model).__name__,
                "patcher": type(patcher).__name__,
                "device": str(loaded.device),
                "size_bytes": size,
                "loaded_bytes": on_device,
                "fully_loaded": on_device >= size,
                "partially_loaded": 0 < on_device < size,
                "in_use": bool(loaded.currently_used),
            }
        )
    return models


def memory_report() -> dict:
    """What the monitor reports: ComfyUI's compute device, its memory, torch's counters, loaded models."""
    device = comfy.model_management.get_torch_device()
    return {
        "format": MONITOR_FORMAT,
        "version": MONITOR_VERSION,
        "time": time.time(),
        "device": str(device),
        "device_name": comfy.model_management.get_torch_device_name(device),
        "cpu_only": device.type == "cpu",
        # ComfyUI's own view, the numbers it plans loads with (system RAM on a CPU device).
        "comfy_total_bytes": comfy.model_management.get_total_memory(device),
        "comfy_free_bytes": comfy.model_management.get_free_memory(device),
        # Driver and torch allocator figures on CUDA; process RSS everywhere.
        "snapshot": device_memory_snapshot(device),
        "loaded_models": loaded_models_report(),
        "fallback": fallback_report(device),
    }


def fallback_report(device) -> list[dict]:
    """The driver's system-memory fallback: memory spilling now (CUDA), and what runs of this process found."""
    now = spill_now(device)
    return [*([now.as_dict()] if now is not None else []),
            *({"run": name, **finding} for name, finding in FOUND.items())]


def render_report_text(report: dict) -> str:
    snapshot = report["snapshot"]
    lines = [f"Headroom VRAM monitor: {report['device_name']}"]
    for found in report["fallback"]:  # first: a run going 5-20x slower matters more than the figures
        run = f"run '{found['run']}': " if "run" in found else ""
        lines.append(f"WARNING: {run}{found['message']}")
    if snapshot["cuda"]:
        lines += [
            (
                f"driver: total {format_bytes(snapshot['driver_total_bytes'])}, free {format_bytes(snapshot['driver_free_bytes'])}"
                f" (ComfyUI counts {format_bytes(report['comfy_free_bytes'])} free, torch cache included)"
            ),
            f"torch: allocated {format_bytes(snapshot['allocated_bytes'])}, reserved {format_bytes(snapshot['reserved_bytes'])}",
            (
                f"torch peak since last reset: allocated {format_bytes(snapshot['max_allocated_bytes'])},"
                f" reserved {format_bytes(snapshot['max_reserved_bytes'])}"
            ),
        ]
    elif report["cpu_only"]:
        lines += [
            "CPU only: no GPU, so no VRAM figures.",
            f"system RAM: total {format_bytes(report['comfy_total_bytes'])}, available {format_bytes(report['comfy_free_bytes'])}",
        ]
    else:
        lines.append(
            f"device memory (ComfyUI's view): total {format_bytes(report['comfy_total_bytes'])},"
            f" free {format_bytes(report['comfy_free_bytes'])}"
        )
    lines.append(
        f"process RSS: {format_bytes(snapshot['process_rss_bytes'])}, peak {format_bytes(snapshot['process_peak_rss_bytes'])}"
    )
    models = report["loaded_models"]
    lines.append(f"loaded models: {len(models)}" if models else "loaded models: none")
    for model in models:
        state = "fully loaded" if model["fully_loaded"] else "partially loaded" if model["partially_loaded"] else "offloaded"
        lines.append(
            f"- {model['name']}: {format_bytes(model['size_bytes'])}, {format_bytes(model['loaded_bytes'])}"
            f" on {model['device']} ({state})"
        )
    if report.get("peak_reset"):
        lines.append("peak counters reset after this report")
    return "\n".join(lines)
