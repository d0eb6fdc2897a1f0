"""The GPU kit's dry run (bench/gpu/suite.py --dry-run): the code path the borrowed GPU runs, on the CPU with the tiny
models, so the kit never rots between GPU sessions. Three commands as on the GPU machine: the first measures, the
second stops at its time guard and records what is left, the third resumes after the first and writes the page."""
from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from PIL import Image

from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH, REPO_ROOT

pytestmark = [pytest.mark.comfyui, pytest.mark.skipif(COMFYUI_PATH is None, reason=COMFYUI_FOUND_BY)]

SUITE = REPO_ROOT / "bench" / "gpu" / "suite.py"
OLD_PAGE = """# Benchmarks

Kept above.

<!-- gpu-kit:begin (old) -->
an older GPU section
<!-- gpu-kit:end -->

Kept below.
"""


def suite(results, *args: str) -> None:
    """One command of the kit, in this process (ComfyUI is imported once, as on the GPU machine)."""
    spec = importlib.util.spec_from_file_location("gpukit_suite", SUITE)
    module = sys.modules["gpukit_suite"] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(module)
    # issue 41's rows one warm-up step and two timed, the others one and one (the defaults, 3 + 10 and 1 + 4: the GPU's)
    assert module.main(["--dry-run", "--results", str(results), "--warmup", "1", "--steps", "2", "--other-steps", "1",
                        *args]) == 0


def measurements(results) -> list[dict]:
    lines = (results / "results.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == "measurement"]


def test_dry_run_measures_resumes_and_writes_the_page(comfyui, tmp_path):
    results, page, png = tmp_path / "results", tmp_path / "gpu_kit.md", tmp_path / "gpu_vram.png"
    page.write_text(OLD_PAGE)

    # the CUDA tests' step with one of their files (every one of them runs in this suite anyway)
    suite(results, "--models", "sdxl", "--budgets", "8", "--no-native", "--policies", "none", "--no-controlnet",
          "--no-text-encoder", "--cuda-test-files", "tests/unit/test_memory_stats.py")
    first = {r["id"]: r for r in measurements(results)}
    assert list(first) == ["cuda_tests", "h2d", "lora/sdxl/resident", "lora/sdxl/8GB"]

    # The time guard: nothing starts, what is left is recorded.
    suite(results, "--models", "sdxl,wan22_14b", "--budgets", "8", "--policies", "streamed_ckpt", "--minutes", "0",
          "--no-controlnet", "--no-text-encoder")
    records = [json.loads(line) for line in (results / "results.jsonl").read_text().splitlines()]
    assert len(measurements(results)) == 4
    assert records[-1]["type"] == "left"
    assert records[-1]["ids"] == ["native/sdxl/offload_off", "native/sdxl/offload_on", "lora/wan22_14b/resident",
                                  "lora/wan22_14b/8GB", "lora/sdxl/policy-streamed_ckpt"]

    suite(results, "--models", "sdxl,wan22_14b", "--budgets", "8", "--policies", "streamed_ckpt", "--page", str(page),
          "--png", str(png), "--no-controlnet", "--no-text-encoder")
    by_id = {r["id"]: r for r in measurements(results)}
    assert len(by_id) == len(measurements(results)) == 9  # nothing measured twice
    assert [r["id"] for r in measurements(results)][:4] == list(first)  # resumed after the first command
    for ident in ("lora/sdxl/resident", "lora/sdxl/8GB", "lora/wan22_14b/resident", "lora/wan22_14b/8GB",
                  "lora/sdxl/policy-streamed_ckpt"):
        run = by_id[ident]
        assert run["status"] == "ok", run.get("traceback")
        assert run["planner_train_bytes"] > 0 and run["planner_validation_bytes"] > 0 and run["s_per_step"] > 0
        assert run["policy"].startswith("budget ")
        assert run["fallback"] is None  # the driver's fallback finding, per run: none on a CPU
        # Validation timed on its own placement and on training's (issue 28 item 3's A/B) where the plan makes them
        # differ (the same placement twice measures nothing)
        same = run["validation_base_device_bytes"] == run["base_device_bytes"]
        assert run["validation_seconds"] > 0
        assert (run["validation_seconds_training_placement"] is None) if same else \
            run["validation_seconds_training_placement"] > 0
        # issue 41: the plan's predicted step beside the measured one; no allocator counters without CUDA
        assert run["predicted_s_per_step"] > 0 and run["step_time"]["limit_s"] > 0 and run["allocator"] is None
        assert run["plan_blocks"]["resident"] + run["plan_blocks"]["streamed"] > 0
    assert by_id["lora/sdxl/8GB"]["budget_gb"] == 8 and by_id["lora/sdxl/resident"]["budget_gb"] is None
    counts = {ident: (r.get("warmup_steps"), r.get("timed_steps")) for ident, r in by_id.items()}
    assert counts["lora/sdxl/8GB"] == counts["lora/sdxl/resident"] == (1, 2)  # issue 41's rows
    assert counts["lora/wan22_14b/8GB"] == counts["lora/sdxl/policy-streamed_ckpt"] == (1, 1)
    assert counts["native/sdxl/offload_on"] == (1, 1)
    # where the timed Steps call's start went: ComfyUI's load (no streamer on a CPU, so no attach parts)
    assert by_id["lora/sdxl/8GB"]["start_seconds"]["comfy_load"] >= 0
    # one steady step traced (torch.profiler), under a budget and resident: on a CPU no device work, the step all idle
    for ident in ("lora/sdxl/8GB", "lora/sdxl/resident"):
        overlap = by_id[ident]["overlap"]
        assert overlap["step_s"] > 0 and overlap["idle_s"] == overlap["step_s"] and overlap["copies"] == 0
        assert by_id[ident]["kernels"] == []
    assert by_id["lora/sdxl/policy-streamed_ckpt"]["policy_fields"]["base_placement"] == "streamed"
    assert (by_id["lora/wan22_14b/8GB"]["frames"], by_id["lora/sdxl/8GB"]["frames"]) == (5, 1)  # a clip, an image
    assert by_id["native/sdxl/offload_on"]["status"] == "ok" and by_id["native/sdxl/offload_on"]["offloading"]
    tests = by_id["cuda_tests"]
    # which test failed, read from pytest's junit XML (each failure's message), or why pytest did not finish
    assert tests["status"] == "ok", tests.get("failures") or tests.get("error") or tests.get("output")
    assert tests["files"] == ["tests/unit/test_memory_stats.py"] and tests["skipped"] >= 1 and tests["failures"] == []
    assert tests["passed"] > 0
    # what the GPU machine runs without --cuda-test-files: every marked file
    marked = set(sys.modules["gpukit_suite"].cuda_test_files())
    assert {"tests/unit/test_memory_stats.py", "tests/unit/test_weight_streaming.py"} <= marked

    text = page.read_text()
    assert text.startswith("# Benchmarks\n\nKept above.\n") and text.endswith("\n\nKept below.\n")
    assert "an older GPU section" not in text and text.count("<!-- gpu-kit:begin") == 1
    assert "Dry run on the CPU" in text and "set_per_process_memory_fraction" in text
    for row in ("| SDXL | 8GB |", "| SDXL | resident |", "| Wan 2.2 14B | 8GB |", "| Wan 2.2 14B | resident |",
                "| SDXL | policy-streamed_ckpt |", "| SDXL | off |", "| SDXL | on |"):
        assert row in text
    assert by_id["h2d"]["h2d_bytes_per_s"] is None and "not measured (no CUDA device)" in text
    assert "Streaming at the physical limit" in text and "| SDXL | 8GB | " in text.split("physical limit (issue 41)")[1]
    assert re.search(r"CUDA-marked tests \([^)]*tests/unit/test_memory_stats\.py", text)
    assert "Validation on its own placement" in text and "| SDXL | 8GB | " in text.split("its own placement")[1]
    assert "Left for the next command (time guard): none" in text
    assert "median of the timed steps after the warm-up (" in text and " rows 1 + 2" in text
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size == (1200, 560)


def test_dry_run_measures_flux_with_8_gib_left_to_pin(comfyui, tmp_path):
    """The "12GB-pin8" row: ComfyUI's pinned-memory account leaves 8 GiB to pin while the row plans and trains (as on
    a PC with less RAM: the streamed blocks past it cross from pageable memory, priced by the plan), and is put back
    after it."""
    import comfy.model_management as mm

    before = (mm.MAX_PINNED_MEMORY, mm.TOTAL_PINNED_MEMORY)
    results = tmp_path / "results"
    suite(results, "--models", "flux_dev", "--budgets", "12", "--no-native", "--no-cuda-tests", "--policies", "none",
          "--full-cards", "none", "--full-host-cards", "none", "--full-streamed-state-cards", "none", "--no-controlnet")
    by_id = {r["id"]: r for r in measurements(results)}
    assert list(by_id) == ["h2d", "lora/flux_dev/resident", "lora/flux_dev/ckpt", "lora/flux_dev/12GB",
                           "lora/flux_dev/12GB-pin8"]
    pinned = by_id["lora/flux_dev/12GB-pin8"]
    assert pinned["status"] == "ok", pinned.get("traceback")
    assert pinned["pin_share_gb"] == 8 and pinned["pinnable_bytes_at_plan"] == 8 * 2 ** 30 and pinned["budget_gb"] == 12
    assert "plan_pageable_bytes" in pinned and "pin_share_gb" not in by_id["lora/flux_dev/12GB"]
    assert (mm.MAX_PINNED_MEMORY, mm.TOTAL_PINNED_MEMORY) == before


def test_dry_run_measures_a_full_fine_tune_fitted_to_a_card(comfyui, tmp_path):
    """The kit's full fine-tune (issue 27): kind full with the bf16 difference, fused backward and Adafactor, the Init
    node's planner fitting it to a card; the row on the page."""
    results, page = tmp_path / "results", tmp_path / "gpu_kit.md"
    suite(results, "--models", "flux_dev", "--budgets", "8", "--no-native", "--no-cuda-tests", "--policies", "none",
          "--full-cards", "24", "--full-host-cards", "16", "--page", str(page), "--no-controlnet")
    by_id = {r["id"]: r for r in measurements(results)}
    assert list(by_id) == ["h2d", "lora/flux_dev/resident", "lora/flux_dev/ckpt", "lora/flux_dev/8GB",
                           "full/flux_dev/full-24GB", "full/flux_dev/full-16GB-host"]
    ckpt = by_id["lora/flux_dev/ckpt"]  # resident, every block checkpointed, no cap: the limit's compute part
    assert ckpt["status"] == "ok" and ckpt["budget_gb"] is None and ckpt["policy_fields"]["checkpointing"] == "blocks"
    assert ckpt["policy_fields"]["base_placement"] == "resident"
    host = by_id["full/flux_dev/full-16GB-host"]  # the trained weights in host RAM, through the kit's own path
    assert host["status"] == "ok", host.get("traceback")
    # the optimizer state where the planner put it: the card (each tensor stepped there) or host RAM
    state = host["policy_fields"]["optimizer_state"]
    said = "optimizer state streamed from host RAM" if state == "streamed" else f"optimizer state on {state}"
    assert host["policy_fields"]["trained_weights"] == "host" and said in host["policy"]
    assert "trained weights in host RAM" in host["policy"] and "| Flux.1-dev | 16GB-host |" in page.read_text()
    # each trained weight crossed to the card twice per step (forward; recompute and backward), back once (its update,
    # or with the state in host RAM its gradient through autograd, which the crossings do not carry)
    # (all but the blocks the plan keeps on the card)
    assert host["crossed_to_device_per_step"] == 2 * host["crossing_weight_bytes"] > 0
    assert host["crossed_to_host_per_step"] == (host["crossing_weight_bytes"] if state != "cpu" else 0)
    assert host["crossing_weight_bytes"] <= host["trained_weight_bytes"]
    run = by_id["full/flux_dev/full-24GB"]
    assert run["status"] == "ok", run.get("traceback")
    assert run["policy_fields"]["fused_backward"] and run["policy_fields"]["vram_budget_gb"] == 23.0  # 24 GB - reserve
    assert run["plan_reason"].startswith("Train LoRA: Init (Headroom): 24 GB:")
    assert run["planner_train_bytes"] > 0 and run["s_per_step"] > 0 and run["budget_gb"] == 24
    assert "| Flux.1-dev | 24GB |" in page.read_text().split("Full fine-tunes")[1]


def test_dry_run_measures_a_full_fine_tune_with_its_optimizer_state_streamed(comfyui, tmp_path):
    """The kit's AdamW full fine-tune of SD3.5-Large with its optimizer state streamed from host RAM for each tensor's
    step (issue 42 item 3): the row records the state's bytes crossed each way (back at every step, in from the
    second), beside the trained weights' (none: they stay on the card)."""
    results, page = tmp_path / "results", tmp_path / "gpu_kit.md"
    suite(results, "--models", "sd35_large", "--budgets", "", "--no-native", "--no-cuda-tests", "--policies", "none",
          "--full-cards", "none", "--full-host-cards", "none", "--full-streamed-state-cards", "24", "--page", str(page))
    by_id = {r["id"]: r for r in measurements(results)}
    assert list(by_id) == ["h2d", "full/sd35_large/full-24GB-streamed-state", "lora/sd35_large/resident"]
    run = by_id["full/sd35_large/full-24GB-streamed-state"]
    assert run["status"] == "ok", run.get("traceback")
    assert run["policy_fields"]["optimizer_state"] == "streamed" and run["policy_fields"]["vram_budget_gb"] == 23.0
    assert "optimizer state streamed from host RAM" in run["policy"] and "AdamW" in run["work"]
    steps, state = run["steps"], run["optimizer_state_bytes"]
    assert steps == 2 and state > 0  # warm-up + 1 timed step
    assert (run["state_crossed_to_device"], run["state_crossed_to_host"]) == ((steps - 1) * state, steps * state)
    assert "crossed_to_device_per_step" not in run  # the trained weights stay on the card
    assert "| SD3.5-Large | 24GB-streamed-state |" in page.read_text().split("Full fine-tunes")[1]


def test_dry_run_measures_controlnet_runs_against_their_plan(comfyui, tmp_path):
    """The kit's ControlNet rows (suite.CONTROLNET_ROWS): Train ControlNet: Init on a cache whose items carry a control
    of the kind the model's ControlNet takes (SDXL's pixels, Flux's latents), resident (planned for the record) and
    with the Offload Policy's card (the Init node's plan from its ControlNet's own step); planned peak and predicted
    s/step beside the measured, on the page."""
    results, page = tmp_path / "results", tmp_path / "gpu_kit.md"
    suite(results, "--models", "sdxl,flux_dev", "--budgets", "", "--no-native", "--no-cuda-tests", "--policies", "none",
          "--full-cards", "none", "--full-host-cards", "none", "--full-streamed-state-cards", "none",
          "--no-text-encoder", "--page", str(page))
    by_id = {r["id"]: r for r in measurements(results)}
    rows = ["controlnet/sdxl/resident", "controlnet/sdxl/16GB", "controlnet/flux_dev/resident",
            "controlnet/flux_dev/24GB"]
    assert list(by_id)[-4:] == rows
    for ident in rows:
        run = by_id[ident]
        assert run["status"] == "ok", run.get("traceback")
        assert run["planner_train_bytes"] > 0 and run["s_per_step"] > 0 and run["predicted_s_per_step"] > 0, run
        assert run["train_peak_rss"] > 0 and run["loss"] == run["loss"] and run["work"].startswith("ControlNet")
        assert run["policy_fields"]["fused_backward"]  # as the SDXL and Flux ControlNet templates train:
        assert run["precision"] == "bf16" and run["work"].endswith("bf16 weights")  # controlnet_precision bf16
    for ident, card in (("controlnet/sdxl/16GB", 16), ("controlnet/flux_dev/24GB", 24)):
        run = by_id[ident]  # the card's plan made by the ControlNet Init node, the card's budget less the reserve
        assert run["budget_gb"] == card and run["policy_fields"]["vram_budget_gb"] == card - 1.0
        assert run["plan_reason"].startswith(f"Train ControlNet: Init (Headroom): {card} GB:"), run["plan_reason"]
    assert by_id["controlnet/sdxl/resident"]["budget_gb"] is None
    text = page.read_text().split("ControlNet runs")[1]
    for row in ("| SDXL | resident |", "| SDXL | 16GB |", "| Flux.1-dev | resident |", "| Flux.1-dev | 24GB |"):
        assert row in text


def test_dry_run_measures_text_encoder_runs_against_their_plan(comfyui, tmp_path):
    """The kit's text-encoder rows (suite.TEXT_ENCODER_ROWS): a LoRA run with the family's CLIP and text_encoder_lr,
    resident (planned for the record) and with the Offload Policy's card (the Init node's plan, the CLIP counted on
    the card); the planned peak, the text encoder's part of it and the predicted s/step beside the measured, on the
    page."""
    results, page = tmp_path / "results", tmp_path / "gpu_kit.md"
    suite(results, "--models", "sdxl", "--budgets", "", "--no-native", "--no-cuda-tests", "--policies", "none",
          "--full-cards", "none", "--full-host-cards", "none", "--full-streamed-state-cards", "none",
          "--no-controlnet", "--page", str(page))
    by_id = {r["id"]: r for r in measurements(results)}
    rows = ["text_encoder/sdxl/resident", "text_encoder/sdxl/16GB"]
    assert list(by_id)[-2:] == rows
    for ident in rows:
        run = by_id[ident]
        assert run["status"] == "ok", run.get("traceback")
        assert run["planner_train_bytes"] > run["planner_text_encoder_bytes"] > 0, run
        assert run["s_per_step"] > 0 and run["predicted_s_per_step"] > 0 and run["loss"] == run["loss"], run
        assert run["work"].startswith("LoRA rank 16 + the CLIP's text encoders")
    card = by_id["text_encoder/sdxl/16GB"]
    assert card["budget_gb"] == 16 and card["policy_fields"]["vram_budget_gb"] == 15.0
    assert card["plan_reason"].startswith("Train LoRA: Init (Headroom): 16 GB:"), card["plan_reason"]
    assert "for the text encoder" in card["plan_reason"]
    text = page.read_text().split("training the CLIP's text encoders too")[1]
    for row in ("| SDXL | resident |", "| SDXL | 16GB |"):
        assert row in text
