"""The VRAM monitor and memory report nodes, run in-process against a real ComfyUI."""
import json
import mmap

import pytest
import torch

pytestmark = pytest.mark.comfyui


class HeadroomMonitorProbe(torch.nn.Module):
    """A model with a class name no other test uses, to find it among ComfyUI's loaded models."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)  # 64*64 + 64 float32 = 16,640 bytes


@pytest.fixture
def loaded_probe(comfyui):
    import comfy.model_management
    import comfy.model_patcher

    patcher = comfy.model_patcher.ModelPatcher(
        HeadroomMonitorProbe(), comfy.model_management.get_torch_device(), comfy.model_management.unet_offload_device()
    )
    comfy.model_management.load_models_gpu([patcher])
    yield patcher
    comfy.model_management.unload_model_and_clones(patcher)


def _probe_entries(report: dict) -> list[dict]:
    return [model for model in report["loaded_models"] if model["name"] == "HeadroomMonitorProbe"]


def test_monitor_lists_the_loaded_model_and_passes_the_value_through(loaded_probe):
    from headroom.nodes.monitor import HeadroomVRAMMonitor

    value = {"anything": object()}
    output = HeadroomVRAMMonitor.execute(value=value, reset_peak=False)
    passed, text, report_json = output.result
    assert passed is value

    report = json.loads(report_json)
    [probe] = _probe_entries(report)
    assert probe["size_bytes"] == 64 * 64 * 4 + 64 * 4
    assert probe["loaded_bytes"] == probe["size_bytes"] and probe["fully_loaded"] is True
    assert probe["device"] == str(loaded_probe.load_device)
    assert "HeadroomMonitorProbe: 16.2 KiB, 16.2 KiB on cpu" in text and "(fully loaded)" in text

    # /history gets the same report: every ui entry is a list, and the whole ui is JSON.
    assert set(output.ui) == {"text", "headroom_vram"}
    assert all(isinstance(entry, list) for entry in output.ui.values())
    assert json.loads(json.dumps(output.ui))["headroom_vram"][0] == report
    assert output.ui["text"] == [text]


def test_monitor_on_cpu_says_so_and_reports_rss_not_vram(comfyui):
    from headroom.nodes.monitor import HeadroomVRAMMonitor

    _, text, report_json = HeadroomVRAMMonitor.execute(value=1, reset_peak=False).result
    report = json.loads(report_json)
    assert report["device"] == "cpu" and report["cpu_only"] is True
    assert report["snapshot"]["cuda"] is False
    assert "allocated_bytes" not in report["snapshot"] and "driver_total_bytes" not in report["snapshot"]
    assert report["snapshot"]["process_rss_bytes"] > 0
    assert report["comfy_total_bytes"] >= report["comfy_free_bytes"] > 0  # system RAM on a CPU device
    assert "CPU only" in text and "process RSS" in text


def test_unloaded_model_leaves_the_report(loaded_probe):
    import comfy.model_management
    from headroom.nodes.bridge.memory_report import loaded_models_report

    assert len([m for m in loaded_models_report() if m["name"] == "HeadroomMonitorProbe"]) == 1
    comfy.model_management.unload_model_and_clones(loaded_probe)
    assert not [m for m in loaded_models_report() if m["name"] == "HeadroomMonitorProbe"]


def test_monitor_reruns_on_every_queue_and_can_reset_the_peak(comfyui):
    from headroom.nodes.monitor import HeadroomVRAMMonitor
    from headroom.training.memory.memory_stats import process_peak_rss_bytes

    schema = HeadroomVRAMMonitor.define_schema()
    assert schema.is_output_node is False  # a pass-through must not force dead branches to run
    fingerprint = HeadroomVRAMMonitor.fingerprint_inputs
    assert fingerprint(value=1, reset_peak=False, report_every_run=True) != fingerprint(
        value=1, reset_peak=False, report_every_run=True
    )
    # Off (the default), the node caches like any other, so downstream training is not re-run.
    assert fingerprint(value=1, reset_peak=False, report_every_run=False) is None
    # Input and value output share one MatchType template: the output takes the input's type.
    [value_input, _, _] = schema.inputs
    assert value_input.template is schema.outputs[0].template

    # The peak is raised by memory mapped and unmapped here, not by malloc: glibc may keep a freed block in its heap,
    # and RSS then stays at the peak, which no reset can lower (CI failed once so).
    block = mmap.mmap(-1, 120 * 2**20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    block.close()
    before = process_peak_rss_bytes()
    _, text, report_json = HeadroomVRAMMonitor.execute(value=None, reset_peak=True).result
    assert json.loads(report_json)["peak_reset"] is True and "reset" in text
    assert json.loads(report_json)["snapshot"]["process_peak_rss_bytes"] >= before - 2**20  # reported before the reset
    assert process_peak_rss_bytes() < before - 80 * 2**20


def test_memory_report_node_renders_a_run_record(comfyui):
    from headroom.nodes.monitor import HeadroomMemoryReport
    from headroom.training.memory.memory_stats import PhaseRecorder

    recorder = PhaseRecorder("cpu")
    with recorder.phase("caching"):
        pass
    with recorder.phase("training"):
        pass
    output = HeadroomMemoryReport.execute(record_json=recorder.to_json())
    text, record_json, chart = output.result
    assert "caching [blue]" in text and "training [orange]" in text
    assert PhaseRecorder.from_json(record_json).phases == recorder.phases
    assert chart.shape == (1, 160, 320, 3) and chart.dtype == torch.float32
    assert json.loads(json.dumps(output.ui))["headroom_memory_record"][0]["phases"] == recorder.phases

    with pytest.raises(ValueError, match=r"Memory Report \(Headroom\): connect the run output"):
        HeadroomMemoryReport.execute(record_json="  ")
    with pytest.raises(ValueError, match=r"Memory Report \(Headroom\): memory record: not valid JSON"):
        HeadroomMemoryReport.execute(record_json="{")


def test_executor_reruns_the_monitor_on_every_queue_and_puts_its_report_in_the_history(comfyui, monkeypatch):
    """Through ComfyUI's own PromptExecutor: the second queue of the same prompt re-runs the monitor
    (fresh report) while its cached upstream node does not run again; a monitor nothing consumes is skipped."""
    from comfy_harness import new_executor, queue_prompt, register_nodes
    from headroom.nodes import data, monitor

    register_nodes(monkeypatch, data.NODES, monitor.NODES)
    executor = new_executor()
    prompt = {
        "1": {"class_type": "HeadroomSyntheticDataset", "inputs": {"count": 2, "resolution": 32, "seed": 0}},
        "2": {"class_type": "HeadroomVRAMMonitor", "inputs": {"value": ["1", 0], "reset_peak": False,
                                                              "report_every_run": True}},
        "3": {"class_type": "PreviewImage", "inputs": {"images": ["2", 0]}},
        "4": {"class_type": "HeadroomVRAMMonitor", "inputs": {"value": ["1", 1], "reset_peak": False}},
    }
    reports, cached = [], []
    for run in range(2):
        queue_prompt(prompt, f"run{run}", executor)
        assert executor.success
        history = json.loads(json.dumps(executor.history_result["outputs"]))
        assert "4" not in history  # not an output node: an unused monitor does not force a run
        reports.append(history["2"]["headroom_vram"][0])
        cached.append(next(msg["nodes"] for event, msg in executor.status_messages if event == "execution_cached"))
    assert cached == [[], ["1"]]
    assert reports[1]["time"] > reports[0]["time"]

    # Default (report_every_run off): the second queue replays the cache, monitor and downstream alike.
    prompt["2"]["inputs"]["report_every_run"] = False
    queue_prompt(prompt, "run2", executor)
    queue_prompt(prompt, "run3", executor)
    assert executor.success
    assert set(next(msg["nodes"] for event, msg in executor.status_messages if event == "execution_cached")) == {"1", "2", "3"}
