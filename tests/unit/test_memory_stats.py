"""Memory snapshots, per-phase records, and their text/JSON/chart renderings (no ComfyUI)."""
import gc
import json
import mmap
import sys

import pytest
import torch

from headroom.training import os_compat
from headroom.training.memory.memory_stats import (PhaseRecorder, device_memory_snapshot, process_peak_rss_bytes,
                                                   process_rss_bytes, reset_peak)

GPU_KEYS = {"name", "driver_total_bytes", "driver_free_bytes", "allocated_bytes", "reserved_bytes",
            "max_allocated_bytes", "max_reserved_bytes"}


def _touch(n_bytes: int) -> mmap.mmap:
    """Map n_bytes of fresh anonymous memory and write every page, so exactly that much becomes resident (malloc could
    hand back heap pages an earlier test left resident)."""
    block = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for offset in range(0, n_bytes, mmap.PAGESIZE):
        block[offset] = 1
    return block


def test_cpu_snapshot_reports_the_process_and_no_gpu_figures():
    snapshot = device_memory_snapshot("cpu")
    assert snapshot["device"] == "cpu" and snapshot["cuda"] is False
    assert not GPU_KEYS & snapshot.keys()
    assert snapshot["process_rss_bytes"] > 10 * 2**20  # a Python process with torch loaded
    assert snapshot["process_peak_rss_bytes"] >= snapshot["process_rss_bytes"] * 0.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-phase RSS peaks need Linux /proc/self/clear_refs")
def test_recorder_records_each_phase_rss_peak_and_time():
    # Earlier tests' garbage first, and no collection inside the phases: in a pytest-xdist worker that had run the
    # large-tensor tests, both phases once peaked at the RSS of their start (cyclic garbage of ~200 MiB or more
    # collected inside the "large" phase freed as much as the phase added).
    gc.collect()
    gc.disable()
    try:
        recorder = PhaseRecorder("cpu")
        with recorder.phase("small"):
            pass
        with recorder.phase("large"):
            block = _touch(200 * 2**20)
            del block
    finally:
        gc.enable()
    small, large = recorder.phases
    assert [small["phase"], large["phase"]] == ["small", "large"]
    assert small["peak_rss_scope"] == large["peak_rss_scope"] == "phase"
    # The 200 MiB lived only in the second phase; the first phase's peak started from a reset.
    assert large["peak_rss_bytes"] - small["peak_rss_bytes"] > 150 * 2**20
    assert large["seconds"] > 0 and small["seconds"] >= 0
    assert small["completed"] and large["completed"]
    assert "peak_allocated_bytes" not in large and large["cuda"] is False


def test_a_failed_phase_is_recorded_and_the_error_propagates():
    recorder = PhaseRecorder("cpu")
    with pytest.raises(MemoryError), recorder.phase("validation"):
        raise MemoryError("out of memory")
    assert recorder.phases[0]["phase"] == "validation" and recorder.phases[0]["completed"] is False
    assert "FAILED" in recorder.render_text()


def test_phases_cannot_nest():
    recorder = PhaseRecorder("cpu")
    with recorder.phase("training"), pytest.raises(RuntimeError, match="cannot nest"), recorder.phase("validation"):
        pass
    assert [p["phase"] for p in recorder.phases] == ["training"]


def test_reset_peak_lowers_the_rss_peak():
    # An anonymous mapping, not a Python object: unmapping it always returns its pages to the OS, whatever malloc's
    # state after the tests before this one (a bytearray's freed pages can stay resident, leaving RSS at its peak).
    block = mmap.mmap(-1, 150 * 2**20)
    for offset in range(0, len(block), 4096):
        block[offset] = 1
    block.close()
    before = process_peak_rss_bytes()
    if not reset_peak("cpu"):
        pytest.skip("this OS cannot reset the RSS peak")
    assert process_peak_rss_bytes() < before - 100 * 2**20


def test_json_round_trip(tmp_path):
    recorder = PhaseRecorder("cpu")
    with recorder.phase("caching"):
        pass
    with recorder.phase("training"):
        pass
    restored = PhaseRecorder.from_json(recorder.to_json())
    assert restored.phases == recorder.phases
    assert restored.render_text() == recorder.render_text()
    path = tmp_path / "memory.json"
    recorder.save(path)
    assert PhaseRecorder.from_json(path.read_text()).phases == recorder.phases
    assert [p.name for p in tmp_path.iterdir()] == ["memory.json"]  # no temp file left behind


def test_warnings_are_kept_and_shown_and_older_records_have_none():
    recorder = PhaseRecorder("cpu", warnings=[{"kind": "spill", "step": 3, "message": "memory spilled"}])
    assert "WARNING: memory spilled" in recorder.render_text()  # also with no phases
    with recorder.phase("training"):
        pass
    restored = PhaseRecorder.from_json(recorder.to_json())
    assert restored.warnings == recorder.warnings and "WARNING: memory spilled" in restored.render_text()
    older = {key: value for key, value in recorder.as_dict().items() if key != "warnings"}
    assert PhaseRecorder.from_json(json.dumps(older)).warnings == []


def test_the_step_time_keeps_the_plans_prediction_beside_the_measured_one_and_is_read_back_strictly():
    recorder = PhaseRecorder("cpu")
    with recorder.phase("training"):
        pass
    assert "step_time" not in recorder.as_dict()  # none until a run trains
    recorder.record_step_time(1.0, 1.25, 20)
    restored = PhaseRecorder.from_json(recorder.to_json())
    assert restored.step_time == {"predicted_s_per_step": 1.0, "measured_s_per_step": 1.25, "steps": 20}
    assert ("step time: measured 1.250 s/step (median of 20 steps), predicted 1.000 s/step by the plan (measured "
            "1.25x)") in restored.render_text()
    recorder.record_step_time(None, 0.5, 3)  # no plan was made (a CPU run with its own policy)
    assert "no plan's prediction" in PhaseRecorder.from_json(recorder.to_json()).render_text()
    record = recorder.as_dict()
    for bad in ({"predicted_s_per_step": float("inf"), "measured_s_per_step": 1.0, "steps": 1},
                {"predicted_s_per_step": -1.0, "measured_s_per_step": 1.0, "steps": 1},
                {"predicted_s_per_step": 1.0, "measured_s_per_step": 0, "steps": 1},
                {"predicted_s_per_step": 1.0, "measured_s_per_step": True, "steps": 1},
                {"predicted_s_per_step": 1.0, "measured_s_per_step": 1.0, "steps": 1.5},
                {"predicted_s_per_step": 1.0, "measured_s_per_step": 1.0},
                {"predicted_s_per_step": 1.0, "measured_s_per_step": 1.0, "steps": 1, "extra": 2}, [1.0]):
        with pytest.raises(ValueError, match="step_time|Infinity is not a number"):
            PhaseRecorder.from_json(json.dumps({**record, "step_time": bad}))
    with pytest.raises(ValueError):  # NaN / Infinity literals are no JSON
        PhaseRecorder.from_json(recorder.to_json().replace('"measured_s_per_step": 0.5', '"measured_s_per_step": NaN'))
    with pytest.raises(ValueError, match="step_time"):
        recorder.record_step_time(float("nan"), 1.0, 1)


@pytest.mark.parametrize(
    "text, message",
    [("{not json", "not valid JSON"), ('{"phases": []}', "not a 'headroom.memory_record'"),
     ('{"format": "headroom.memory_record", "version": 99, "phases": []}', "version 99"),
     ('{"format": "headroom.memory_record", "version": 1, "phases": [{"seconds": 1}]}', "name their 'phase'"),
     ('{"format": "headroom.memory_record", "version": 1, "phases": [], "warnings": [{"kind": "spill"}]}',
      "warning 0: field 'message' is missing"),
     ('{"format": "headroom.memory_record", "version": 1, "phases": [], "warnings": {"kind": "spill"}}',
      "'warnings' must be a list")],
)
def test_bad_json_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        PhaseRecorder.from_json(text)


def _cuda_like_record(peaks_mib):
    """A record as a CUDA run writes it; rendering must not need a GPU."""
    phases = [
        {"phase": name, "seconds": 1.5, "completed": True, "device": "cuda:0", "cuda": True,
         "peak_rss_bytes": 3 * 2**30, "peak_rss_scope": "phase",
         "peak_allocated_bytes": allocated * 2**20, "peak_reserved_bytes": reserved * 2**20}
        for name, (allocated, reserved) in peaks_mib.items()
    ]
    return PhaseRecorder.from_json(json.dumps({"format": "headroom.memory_record", "version": 1,
                                               "device": "cuda:0", "phases": phases}))


def test_text_names_each_phase_with_its_figures():
    text = _cuda_like_record({"training": (1000, 1200), "validation": (500, 800)}).render_text()
    assert "training [blue]" in text and "validation [orange]" in text
    assert "peak allocated 1,000.0 MiB" in text and "peak reserved 800.0 MiB" in text
    assert "peak process RSS 3.00 GiB" in text
    cpu_text = PhaseRecorder("cpu").render_text()
    assert "no phases" in cpu_text


def _bar_height(chart: torch.Tensor, column: int) -> int:
    background = chart[0, 0, 0]
    return int((chart[0, :, column] != background).any(-1).sum())


def test_chart_shape_range_and_bars_follow_the_values():
    chart = _cuda_like_record({"training": (1000, 1200), "validation": (300, 400)}).render_chart(200, 100)
    assert chart.shape == (1, 100, 200, 3) and chart.dtype == torch.float32
    assert 0.0 <= chart.min() and chart.max() <= 1.0
    training_bar, validation_bar = _bar_height(chart, 50), _bar_height(chart, 150)
    assert training_bar > 2 * validation_bar > 0
    # Distinct colours per phase.
    assert not torch.equal(chart[0, 95, 50], chart[0, 95, 150])
    # Allocated is drawn brighter inside the reserved bar: two colours in the training bar.
    assert len({tuple(pixel.tolist()) for pixel in chart[0, 10:95, 50]}) >= 2

    swapped = _cuda_like_record({"training": (300, 400), "validation": (1000, 1200)}).render_chart(200, 100)
    assert _bar_height(swapped, 50) < _bar_height(swapped, 150)


def test_chart_of_cpu_and_empty_records():
    recorder = PhaseRecorder("cpu")
    with recorder.phase("training"):
        pass
    chart = recorder.render_chart(64, 32)
    assert chart.shape == (1, 32, 64, 3)
    assert _bar_height(chart, 32) > 20  # the only phase is the tallest bar
    empty = PhaseRecorder("cpu").render_chart(64, 32)
    assert empty.shape == (1, 32, 64, 3)
    with pytest.raises(ValueError, match="too small"):
        recorder.render_chart(8, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_snapshot_and_phase_peaks():
    snapshot = device_memory_snapshot("cuda")
    assert GPU_KEYS <= snapshot.keys() and snapshot["driver_total_bytes"] >= snapshot["driver_free_bytes"] > 0
    recorder = PhaseRecorder("cuda")
    with recorder.phase("big"):
        block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        del block
    with recorder.phase("small"):
        pass
    big, small = recorder.phases
    assert big["peak_allocated_bytes"] >= 256 * 2**20 > small["peak_allocated_bytes"]
    assert big["peak_reserved_bytes"] >= big["peak_allocated_bytes"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap: Windows and macOS return freed memory")
def test_freed_tensors_memory_goes_back_to_the_os():
    """Host tensors below glibc's mmap threshold (raised to 32 MiB by the first large free) are freed into its heap and
    stay in RSS (the GPU kit: Flux.1-dev's RSS grew with the budget, ComfyUI's load and the streamer's packing freeing
    budget-sized sets of weights): os_compat.release_freed_host_memory gives their pages back."""
    large = torch.ones(20 * 2**20, dtype=torch.uint8)
    del large  # a freed mmapped chunk: later 8 MiB tensors come from the heap
    tensors = [torch.ones(8 * 2**20, dtype=torch.uint8) for _ in range(40)]
    del tensors[::2]  # holes between live tensors: the heap's top cannot shrink past them
    before = process_rss_bytes()
    assert os_compat.release_freed_host_memory()
    assert process_rss_bytes() < before - 80 * 2**20  # of the 160 MiB freed
    del tensors
