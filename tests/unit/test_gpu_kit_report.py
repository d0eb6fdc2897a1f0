"""What the GPU kit's page says its figures show is computed from the results (bench/gpu/report.py)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]

GIB = 1024 ** 3


def report():
    spec = importlib.util.spec_from_file_location("gpukit_report", REPO_ROOT / "bench" / "gpu" / "report.py")
    module = sys.modules["gpukit_report"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora(config, s_per_step, estimate_gib, peak_gib, reserved_gib, status="ok"):
    budget = None if config == "resident" else float(config.removesuffix("GB"))
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
