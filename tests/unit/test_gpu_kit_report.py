"""What the GPU kit's page says its figures show is computed from the results (bench/gpu/report.py)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

GIB = 1024 ** 3


def report():
    spec = importlib.util.spec_from_file_location("gpukit_report", REPO_ROOT / "bench" / "gpu" / "report.py")
    module = sys.modules["gpukit_report"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora(config, s_per_step, estimate_gib, peak_gib, reserved_gib, status="ok"):
    budget = float(config.removesuffix("GB")) if config.endswith("GB") else None
    return {"type": "measurement", "id": f"lora/flux_dev/{config}", "kind": "lora", "model": "flux_dev",
            "config": config, "budget_gb": budget, "status": status, "s_per_step": s_per_step,
            "planner_train_bytes": estimate_gib * GIB, "train_peak_allocated": peak_gib * GIB,
            "train_peak_reserved": reserved_gib * GIB, "policy": f"policy {config}"}


def test_findings_flag_planner_misses_budget_overruns_and_slow_streaming():
    records = [lora("resident", 1.0, 10.5, 10.0, 11.0),  # planner 5 % high: within 10 %
               lora("8GB", 1.2, 6.0, 8.0, 9.0),  # planner 25 % low, reserved over 8 GiB, 1.2x the resident step
               lora("16GB", 1.1, 14.0, 12.0, 13.0),  # planner 17 % high; 1.1x: fast enough
               {**lora("6GB", None, 5.0, 0, 0, status="oom"), "error": "out of memory\nmore"},
               {**lora("8GB", 1.25, 6.0, 8.0, 9.0)}]  # a later record of the same measurement replaces the first
    found = report().findings(report().latest(records))
    assert [line.split("`")[1] for line in found["planner"]] == ["lora/flux_dev/8GB", "lora/flux_dev/16GB"]
    assert [line.split("`")[1] for line in found["budget"]] == ["lora/flux_dev/8GB", "lora/flux_dev/6GB"]
    assert found["budget"][1] == "`lora/flux_dev/6GB`: out of memory under the 6 GiB cap (policy 6GB)"
    assert found["speed"] == ["`lora/flux_dev/8GB`: 1.25 s/step = 1.25x the resident 1.00 s (policy 8GB)"]
    assert found["failed"] == ["`lora/flux_dev/6GB`: oom (out of memory)"]


def test_page_replaces_only_its_own_section(tmp_path):
    module = report()
    page = tmp_path / "gpu_kit.md"
    page.write_text("# Benchmarks\n\nabove\n")
    module.write_page(page, module.section([lora("resident", 1.0, 10.0, 10.0, 10.0)]))
    first = page.read_text()
    assert first.startswith("# Benchmarks\n\nabove\n\n" + module.BEGIN) and first.endswith(module.END + "\n")
    page.write_text(first + "\nbelow\n")
    module.write_page(page, module.section([lora("8GB", 2.0, 7.0, 7.5, 7.9)]))
    second = page.read_text()
    assert second.count(module.BEGIN) == 1 and second.endswith("\nbelow\n") and "| Flux.1-dev | 8GB |" in second
    assert "| Flux.1-dev | resident |" not in second


def test_rows_against_their_physical_limit_the_prediction_and_the_allocator():
    """Issue 41's rows: the ratio to max(compute, streamed bytes / bandwidth) (compute measured by the resident
    every-block-checkpointed row where the row recomputes every block), and phase by phase (the forward's copies
    against its compute, the backward's against its), predicted vs measured, allocator retries."""
    def timed(config, s_per_step, predicted, compute, transfer, checkpointed, retries=0, phases=None):
        row = lora(config, s_per_step, 5.0, 5.0, 5.0)
        split = dict(zip(("forward_compute_s", "forward_copy_s", "backward_copy_s"), phases or ()))
        row.update(predicted_s_per_step=predicted, plan_blocks={"resident": 50, "streamed": 7,
                                                                "checkpointed": checkpointed, "slots": 2},
                   step_time={"compute_s": compute, "transfer_s": transfer, "limit_s": max(compute, transfer),
                              "optimizer_s": 0.0, **split},
                   allocator={"timed": {"num_alloc_retries": retries, "num_ooms": 0, "num_sync_all_streams": 0},
                              "timed_per_step": {"num_alloc_retries": retries / 10, "num_sync_all_streams": 0.0,
                                                 "num_ooms": 0.0}})
        return row

    module = report()
    records = [{"type": "measurement", "id": "h2d", "kind": "h2d", "model": "", "config": "", "status": "ok",
                "h2d_bytes_per_s": 50e9, "pageable_h2d_bytes_per_s": 21e9,
                "host_copy_bytes_per_s": 12e9},
               lora("resident", 0.6, 10.0, 10.0, 10.0),
               timed("ckpt", 0.8, 0.8, 0.8, 0.0, 57),
               # every block recomputed: limit from the ckpt row, 0.8 s; phase by phase the forward measured as the ckpt
               # row less the resident one (its recompute: 0.2 s): forward max(0.2, 0.35) + backward max(0.6, 0.25)
               timed("24GB", 0.9, 0.85, 0.7, 0.6, 57, phases=(0.2, 0.35, 0.25)),
               # selective: the plan's compute; 1.25x its limit; phase by phase max(0.2, 0.7) + max(0.7, 0.5) = 1.4 s
               timed("8GB", 1.5, 1.0, 0.9, 1.2, 20, retries=30, phases=(0.2, 0.7, 0.5)),
               timed("12GB", 1.45, 1.0, 0.9, 1.2, 20)]  # a record from before the split: no phase floor
    measured = module.latest(records)
    assert module.physical_limit(measured["lora/flux_dev/24GB"], measured) == (0.8, "measured compute")
    assert module.physical_limit(measured["lora/flux_dev/8GB"], measured) == (1.2, "planned compute")
    found = module.findings(measured)
    assert module.phase_floor(measured["lora/flux_dev/24GB"], measured) == pytest.approx(0.35 + 0.6)
    # without the resident row the plan's split, scaled to the measured compute (8 / 7): 0.35 + 0.5714
    unsplit = {k: v for k, v in measured.items() if k != "lora/flux_dev/resident"}
    assert module.phase_floor(measured["lora/flux_dev/24GB"], unsplit) == pytest.approx(0.35 + 0.5 * 8 / 7)
    assert module.phase_floor(measured["lora/flux_dev/8GB"], measured) == pytest.approx(1.4)
    assert module.phase_floor(measured["lora/flux_dev/12GB"], measured) is None
    assert found["limit"] == ["`lora/flux_dev/8GB`: 1.50 s/step = 1.25x its physical limit 1.20 s (1.07x its phase "
                              "floor 1.40 s)", "`lora/flux_dev/12GB`: 1.45 s/step = 1.21x its physical limit 1.20 s"]
    assert found["predicted"][0] == ("`lora/flux_dev/8GB`: predicted 1.00 s/step vs measured 1.50 s (0.67x; block "
                                     "times from the calibration fit)")
    measured["lora/flux_dev/8GB"]["step_time"]["timed_at_run_size"] = True  # planner.time_blocks, where it fits
    assert module.findings(measured)["predicted"][0].endswith("(0.67x; block times at the run's size)")
    assert found["allocator"] == ["`lora/flux_dev/8GB`: 30 allocator retries, 0 out-of-memory in the timed steps"]
    assert found["start"] == []  # no first step recorded
    measured["lora/flux_dev/8GB"]["first_step_seconds"] = 9.5  # re-pinning 20 GB at the second Steps call, say
    measured["lora/flux_dev/24GB"]["first_step_seconds"] = 1.2  # under the note's 1 s over the median
    assert module.findings(measured)["start"] == ["`lora/flux_dev/8GB`: 8.0 s"]
    # where it went, as the kit records it (the run's ComfyUI load, the streamer's attach by part)
    measured["lora/flux_dev/8GB"]["start_seconds"] = {"comfy_load": 5.25, "pack": 1.5, "pin": 0.75, "keep": None}
    assert module.findings(measured)["start"] == ["`lora/flux_dev/8GB`: 8.0 s (comfy_load 5.2, pack 1.5, pin 0.8 s)"]
    # With the per-step counters: the first timed step (after the second Steps call's attach) apart from the steady ones
    measured["lora/flux_dev/8GB"]["allocator"]["per_step"] = [{"num_alloc_retries": 28}, {"num_alloc_retries": 2},
                                                              {"num_alloc_retries": 0}]
    assert module.findings(measured)["allocator"] == [
        "`lora/flux_dev/8GB`: 30 allocator retries, 0 out-of-memory in the timed steps (28 in the first, after the "
        "attach; 2 in the 2 steady steps after it)"]
    text = module.section(records)
    assert ("Pinned host->device bandwidth, measured once: 50.0 GB/s; pageable (the streamed blocks past the pin "
            "limit) 21.0 GB/s; the CPU's copies into pinned staging buffers (trained weights in host RAM, streamed "
            "state) 12.0 GB/s." in text)
    assert ("| Flux.1-dev | 24GB | 50 / 7 (2) | 0.900 | 0.850 | 0.94 | 0.800 (measured compute) | 1.12x | 0.950 | "
            "0.95x | 0 | 0 | 0 |") in text
    assert ("| Flux.1-dev | 8GB | 50 / 7 (2) | 1.500 | 1.000 | 0.67 | 1.200 (planned compute) | 1.25x | 1.400 | 1.07x "
            "| 3 | 0 | 0 |") in text
    assert ("| Flux.1-dev | 12GB | 50 / 7 (2) | 1.450 | 1.000 | 0.69 | 1.200 (planned compute) | 1.21x |  |  | 0 |"
            in text)
    assert "phase by phase (the phase floor: max(forward compute, forward copies)" in text


def test_the_kit_counts_the_allocator_per_step():
    """bench/gpu/suite.py: the counters over the warm-up, the timed steps, and each timed step (from the run's per-step
    figures); none without CUDA."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_unit", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(suite)

    def counters(retries, syncs):
        return dict.fromkeys(suite.ALLOCATOR_COUNTERS, 0) | {"num_alloc_retries": retries,
                                                             "num_sync_all_streams": syncs}

    class Run:
        step_figures = {1: (0, 0, {"allocator": counters(5, 1)}), 2: (0, 0, {"allocator": counters(7, 1)}),
                        3: (0, 0, {"allocator": counters(7, 4)})}

    per_step = suite.step_counters(Run(), 1, counters(5, 1))
    assert [(c["num_alloc_retries"], c["num_sync_all_streams"]) for c in per_step] == [(2, 0), (0, 3)]
    deltas = suite.allocator_deltas([counters(0, 0), counters(5, 1), counters(7, 4)], 2, per_step)
    assert deltas["warmup"]["num_alloc_retries"] == 5 and deltas["timed"]["num_sync_all_streams"] == 3
    assert deltas["timed_per_step"]["num_alloc_retries"] == 1.0 and deltas["per_step"] == per_step
    assert suite.allocator_deltas([None, None, None], 2) is None
    assert suite.allocator_counters(__import__("torch").device("cpu")) is None


def test_the_kit_emulates_sdxl_at_16_gib_with_a_ballast_too():
    """Issue 41: SDXL at 16 GiB ran 1.40x its resident step with the resident policy; the kit measures it again with
    the smaller card made by one allocation beside the memory fraction ("16GB-ballast"), which leaves the process the
    card's bytes however much the allocator already holds, and its row sorts beside the 16 GiB one."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_unit", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    steps = suite.plan(["flux_dev", "sdxl"], [8, 16], [])
    sdxl = [configs for kind, model, configs in steps if (kind, model) == ("lora", "sdxl")]
    # the rows the last lease left open first (resident, 8 GiB); the 16 GiB pair it answered in a later entry
    assert sdxl == [["resident", "8GB"], ["16GB", "16GB-ballast"]]
    assert all("16GB-ballast" not in configs for _, model, configs in steps if model == "flux_dev")
    assert [(kind, model) for kind, model, _ in steps][2:4] == [("lora", "flux_dev"), ("lora", "sdxl")]
    assert all("16GB-ballast" not in configs for _, _, configs in suite.plan(["sdxl"], [8], []))
    # 141 GB card, 140 GB free, the allocator holding 1 GB already: a 16 GB card leaves 15 GB more to allocate
    assert suite.ballast_bytes(16 * GIB, 140 * GIB, 1 * GIB) == 125 * GIB
    assert suite.ballast_bytes(16 * GIB, 10 * GIB, 1 * GIB) == 0  # the card is no larger: nothing to fill
    keys = sorted(["resident", "16GB-ballast", "8GB", "16GB", "policy-ckpt", "12GB-pin8"], key=report()._config_key)
    assert keys == ["8GB", "12GB-pin8", "16GB", "16GB-ballast", "resident", "policy-ckpt"]


def test_the_kit_measures_flux_at_12_gib_with_8_gib_left_to_pin():
    """A Windows PC pins at most 40 % of its RAM (ComfyUI's share): the kit's "12GB-pin8" row runs Flux.1-dev at 12 GiB
    with ComfyUI's account set to leave 8 GiB to pin, so the streamed blocks past it cross from pageable memory and
    the prediction that prices them is measured (the row's run: tests/comfy/test_gpu_kit.py)."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_pin", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    entries = {(kind, model): configs for kind, model, configs in suite.plan(["flux_dev", "sdxl"], [8, 12, 16], [])}
    assert entries[("lora", "flux_dev")][-1] == "12GB-pin8" and "12GB-pin8" not in entries[("lora", "sdxl")]
    assert all("12GB-pin8" not in configs for _, _, configs in suite.plan(["flux_dev"], [8, 16], []))
    assert [suite.parse_config(c) for c in ("resident", "8GB", "16GB-ballast", "12GB-pin8", "policy-ckpt")] == [
        (None, False, None), (8.0, False, None), (16.0, True, None), (12.0, False, 8.0), (None, False, None)]
    args = suite.arguments().parse_args(["--results", "unused"])
    assert suite.step_counts(args, "lora", "flux_dev", "12GB-pin8") == {"warmup": 3, "steps": 10}


def test_issue_41s_rows_take_three_warm_up_and_ten_timed_steps():
    """Issue 41 asks its streaming rows (Flux.1-dev, SDXL, Qwen-Image resident, checkpointed and at each budget) be
    timed over 10 steps after 3 of warm-up; the kit's other rows keep 1 + 4 so a device command measures more of them.
    The page says which rows took which."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_counts", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    args = suite.arguments().parse_args(["--results", "unused"])  # the defaults
    streaming = [("lora", m, c) for m in ("flux_dev", "sdxl", "qwen_image")
                 for c in ("resident", "ckpt", "6GB", "24GB", "16GB-ballast")]
    others = [("lora", "sd35_large", "8GB"), ("lora", "flux_dev", "policy-ckpt"), ("full", "flux_dev", "full-24GB"),
              ("native", "sdxl", "offload_on"), ("lora", "wan22_14b", "resident")]
    assert all(suite.step_counts(args, *row) == {"warmup": 3, "steps": 10} for row in streaming)
    assert all(suite.step_counts(args, *row) == {"warmup": 1, "steps": 4} for row in others)
    rows = {"a": {"status": "ok", "warmup_steps": 3, "timed_steps": 10},
            "b": {"status": "ok", "warmup_steps": 3, "timed_steps": 10},
            "c": {"status": "ok", "warmup_steps": 1, "timed_steps": 4}, "d": {"status": "oom"}}
    assert report().step_counts_text(rows) == "1 row 1 + 4; 2 rows 3 + 10"
    assert report().step_counts_text({}) == "steps per row not recorded"


def test_failed_cuda_tests_are_listed_each_with_its_message(tmp_path):
    """The kit's CUDA tests record each failure's message from pytest's junit XML (the output's tail keeps only the
    last failure), and the page lists them; a failed record with a summary and no error text is a finding, not a
    crash (the first GPU session's page stopped on one: IndexError)."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_junit", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    (tmp_path / "test_two.py").write_text("def test_fine():\n    pass\n\n\ndef test_off():\n"
                                          "    assert [1, 2] == [1, 3], 'the second differs'\n")
    junit = tmp_path / "junit.xml"
    __import__("subprocess").run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                  f"--junitxml={junit}", str(tmp_path / "test_two.py")], cwd=tmp_path,
                                 capture_output=True)
    failures = suite.failed_tests(junit)
    assert [(f["test"].split("::")[-1], f["kind"]) for f in failures] == [("test_off", "failure")]
    assert "the second differs" in failures[0]["message"]
    assert suite.failed_tests(tmp_path / "absent.xml") == []
    record = {"type": "measurement", "id": "cuda_tests", "kind": "cuda_tests", "model": "", "config": "",
              "status": "failed", "files": ["tests/unit/test_two.py"], "passed": 1, "failed": 1,
              "summary": "1 failed, 1 passed in 0.1s", "failures": failures}
    module = report()
    assert module.findings({"cuda_tests": record})["failed"] == ["`cuda_tests`: failed (1 failed, 1 passed in 0.1s)"]
    assert module.findings({"cuda_tests": {**record, "summary": ""}})["failed"] == ["`cuda_tests`: failed"]
    text = module.section([record])
    assert "- `test_two::test_off`: failure: AssertionError: the second differs" in text


def test_a_traced_step_splits_into_copying_computing_both_and_idle():
    """Issue 41: one streamed step's profiler trace, as device seconds copying, computing, both at once and idle;
    overlapping spans of one kind counted once, spans clipped to the step by the kit."""
    spec = importlib.util.spec_from_file_location("gpukit_suite_overlap", REPO_ROOT / "bench" / "gpu" / "suite.py")
    suite = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    # a 10 ms step: copies 0-3 and 2-4 ms (one span 0-4), kernels 3-6 and 8-9 ms: both 3-4, idle 6-8 and 9-10
    figures = suite.overlap_figures(0, 10_000, [(0, 3_000), (2_000, 4_000)], [(3_000, 6_000), (8_000, 9_000)])
    assert figures == {"step_s": 0.01, "copy_s": 0.004, "compute_s": 0.004, "overlap_s": 0.001, "idle_s": 0.003,
                       "copies": 2}
    row = {**lora("8GB", 1.5, 5.0, 5.0, 5.0), "plan_blocks": {"resident": 5, "streamed": 52, "slots": 3},
           "step_time": {"compute_s": 1.0, "transfer_s": 1.2, "limit_s": 1.2, "recompute_s": 0.0},
           "predicted_s_per_step": 1.4, "overlap": figures}
    text = report().section([row])
    assert "| Flux.1-dev | 8GB | 0.010 | 0.004 | 0.004 | 0.001 | 0.003 | 2 |" in text
    # the kernels with the most device time: launches and seconds summed per name, most first
    kernels = suite.top_kernels([("conv_fft", 0, 3_000), ("gemm", 3_000, 4_000), ("conv_fft", 5_000, 6_000),
                                 ("x" * 200, 6_000, 6_500)], count=2)
    assert kernels == [["conv_fft", 2, 0.004], ["gemm", 1, 0.001]]
    assert suite.top_kernels([("x" * 200, 0, 500)]) == [["x" * 120, 1, 0.0005]]
    resident = {**lora("resident", 1.0, 5.0, 5.0, 5.0), "step_time": row["step_time"], "overlap": figures,
                "kernels": [["winograd_conv", 12, 0.1], ["gemm", 40, 0.05]]}
    text = report().section([{**row, "kernels": kernels}, resident])
    assert "- Flux.1-dev 8GB: `conv_fft` x2 4.0 ms; `gemm` x1 1.0 ms" in text
    assert "- Flux.1-dev resident: `winograd_conv` x12 100.0 ms; `gemm` x40 50.0 ms" in text
