"""Memory nodes: a pass-through VRAM monitor and the per-phase memory report of a run."""
from __future__ import annotations

import itertools
import json

import comfy.model_management
from comfy_api.latest import io

from ..training.memory import memory_stats
from ..training.memory.memory_stats import PhaseRecorder
from .bridge.comfy_bridge import node_name
from .bridge.memory_report import memory_report, render_report_text
from .io_types import TrainingRunType

_fingerprints = itertools.count()


class HeadroomVRAMMonitor(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        passthrough = io.MatchType.Template("value")  # output type follows whatever is connected
        return io.Schema(
            node_id="HeadroomVRAMMonitor",
            display_name="VRAM Monitor (Headroom)",
            category="Headroom/memory",
            description=(
                "Passes its input through unchanged and reports memory at the moment it runs: device, total and "
                "free memory, torch allocated/reserved/peak (CUDA), process RSS, and ComfyUI's loaded models; "
                "first, a warning when GPU memory spills into system RAM (the NVIDIA driver's fallback, now or in "
                "a run of this ComfyUI). "
                "Like any node it runs again when its input changes; with report_every_run it runs on every "
                "queue, and then nodes fed by its output run again too."
            ),
            inputs=[
                io.MatchType.Input("value", template=passthrough, tooltip="Anything; passed through unchanged."),
                io.Boolean.Input(
                    "reset_peak",
                    default=False,
                    tooltip="After reporting, reset the peak counters, so the next monitor shows the peak since this one.",
                ),
                io.Boolean.Input(
                    "report_every_run",
                    default=False,
                    tooltip="Report on every queue instead of replaying ComfyUI's cached report. Nodes fed by this "
                    "node's value output then run again too (ComfyUI keys its cache on upstream changes), so leave "
                    "it off where a training node is downstream.",
                ),
            ],
            outputs=[
                io.MatchType.Output(template=passthrough, id="value", display_name="value",
                                    tooltip="The input, unchanged."),
                io.String.Output("report", display_name="report", tooltip="The memory report as text."),
                io.String.Output("report_json", display_name="report_json",
                                 tooltip="The memory report as JSON (also in /history)."),
            ],
        )

    @classmethod
    def fingerprint_inputs(cls, report_every_run: bool = False, **kwargs):
        # A new value on every queue: ComfyUI would otherwise replay the first run's report from its cache.
        return next(_fingerprints) if report_every_run else None

    @classmethod
    def execute(cls, value, reset_peak: bool = False, report_every_run: bool = False) -> io.NodeOutput:
        report = memory_report()
        report["peak_reset"] = reset_peak
        if reset_peak:
            memory_stats.reset_peak(comfy.model_management.get_torch_device())
        text = render_report_text(report)
        # ui entries are lists: ComfyUI concatenates them across batched calls and stores them in /history.
        return io.NodeOutput(value, text, json.dumps(report), ui={"text": [text], "headroom_vram": [report]})


class HeadroomMemoryReport(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomMemoryReport",
            display_name="Memory Report (Headroom)",
            category="Headroom/memory",
            description=(
                "Turns a run's per-phase memory record (caching, training, validation, save: peak memory and time "
                "of each, and any warning such as the driver's system-memory fallback) into text, JSON and a bar "
                "chart of the peaks."
            ),
            inputs=[
                TrainingRunType.Input(
                    "run", optional=True,
                    tooltip="A training run: its record (caching, training, validation and save phases so far, "
                    "also kept in the run folder as memory_record.json).",
                ),
                io.String.Input(
                    "record_json",
                    multiline=True,
                    default="",
                    optional=True,
                    tooltip="Or a per-phase memory record as JSON (a run folder's memory_record.json).",
                ),
            ],
            outputs=[
                io.String.Output("report", display_name="report", tooltip="Each phase's peak memory and time, as text."),
                io.String.Output("report_json", display_name="report_json", tooltip="The record as JSON."),
                io.Image.Output("chart", display_name="chart", tooltip="A bar chart of each phase's peak, as an IMAGE."),
            ],
        )

    @classmethod
    def execute(cls, run=None, record_json: str = "") -> io.NodeOutput:
        if run is not None:
            recorder = PhaseRecorder(run.memory.device, phases=list(run.memory.phases), warnings=run.memory.warnings,
                                     step_time=run.memory.step_time)
        elif record_json.strip():
            try:
                recorder = PhaseRecorder.from_json(record_json)
            except ValueError as error:
                raise ValueError(f"{node_name(cls)}: {error}") from None
        else:
            raise ValueError(
                f"{node_name(cls)}: connect the run output of a Headroom training node, or paste a run folder's "
                "memory_record.json into record_json"
            )
        text = recorder.render_text()
        return io.NodeOutput(
            text,
            recorder.to_json(),
            recorder.render_chart(width=320, height=160),
            ui={"text": [text], "headroom_memory_record": [recorder.as_dict()]},
        )


NODES = [HeadroomVRAMMonitor, HeadroomMemoryReport]
