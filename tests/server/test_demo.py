"""The demo end to end: the shipped tiny_lora API workflow (what `bash .ci/demo` runs) on a real ComfyUI server.

The pretrained tiny model never saw the held-out colour; the workflow trains a LoRA on images of that colour only
and validates with compare_base, which writes a before/after grid (base samples on top, LoRA samples below, same
prompts and seeds). The pixel classifier reads that grid: the held-out colour in >= 80 % of the LoRA's samples and
in at most 20 % of the base model's. The LoRA file and the grid are where the UI outputs say."""
import json
import pathlib
import time
import uuid

import pytest
import torch

pytestmark = pytest.mark.comfyui

WORKFLOW = pathlib.Path(__file__).resolve().parents[2] / "workflows" / "api" / "tiny_lora_api.json"


def before_after_cells(path: pathlib.Path, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(base images, LoRA images) [N, size, size, 3] in 0..1 from a before/after grid, where the grid says its cells
    are (training/core/validation_grid.py: the labels around them take room)."""
    from headroom.training.core.validation_grid import grid_cells

    cells = torch.from_numpy(grid_cells(path)).float() / 255
    assert cells.shape[0] == 2 and cells.shape[2:] == (size, size, 3), cells.shape
    return cells[0], cells[1]


def test_demo_workflow_teaches_the_held_out_colour(comfy_server):
    from headroom.training.core.shape_classifier import colour_fraction

    prompt = json.loads(WORKFLOW.read_text())
    by_class = {node["class_type"]: node for node in prompt.values()}
    assert by_class["HeadroomTinyModel"]["inputs"]["weights"] == "pretrained"
    colour = by_class["HeadroomSyntheticDataset"]["inputs"]["colours"]
    assert colour == "green"
    validate = by_class["HeadroomValidate"]["inputs"]
    assert validate["compare_base"] is True
    assert all(colour in line for line in validate["prompts"].splitlines())
    run_name = f"demo_{uuid.uuid4().hex[:8]}"
    by_class["HeadroomTrainLoraInit"]["inputs"]["run_name"] = run_name

    start = time.monotonic()
    execution = comfy_server.run_workflow(prompt, timeout=600)
    seconds = time.monotonic() - start
    assert execution.status == "success", execution.error

    saved = execution.ui_entries("headroom_saved")
    [lora] = [entry for entry in saved if entry["folder"] == "loras"]
    [grid] = [entry for entry in saved if entry["kind"] == "before/after grid"]
    lora_path = comfy_server.base_dir / "models" / "loras" / lora["name"]
    grid_path = comfy_server.base_dir / "output" / grid["name"]
    assert lora_path.is_file() and lora_path.stat().st_size > 0, lora_path
    assert grid_path.is_file() and grid_path.name.endswith("_before_after.png"), grid_path

    base, trained = before_after_cells(grid_path, validate["width"])
    assert len(base) == len(validate["prompts"].splitlines())
    before, after = colour_fraction(base, colour), colour_fraction(trained, colour)
    print(f"demo workflow: {seconds:.0f} s; {colour} in {before:.0%} of base samples, {after:.0%} after the LoRA "
          f"({len(base)} prompts); LoRA {lora_path.name}, grid {grid_path.name}")
    assert before <= 0.2, f"the base model already draws {colour} ({before:.0%})"
    assert after >= 0.8, f"after the demo's steps the LoRA draws {colour} in only {after:.0%} of the samples"
