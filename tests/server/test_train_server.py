"""LoRA training on a real ComfyUI server: the saved file through stock nodes, and /interrupt mid-run."""
import copy
import json
import pathlib
import uuid

import numpy as np
import pytest
from server_harness import output_pixels

pytestmark = pytest.mark.server

TINY_LORA = json.loads((pathlib.Path(__file__).resolve().parents[2] / "workflows" / "api" / "tiny_lora_api.json").read_text())
PROMPT, SEED, STEPS, CFG = "a red circle in the center", 7, 4, 3.0


def _training_prompt(run_name: str, steps: int) -> dict:
    prompt = copy.deepcopy(TINY_LORA)
    prompt["8"]["inputs"]["run_name"] = run_name
    prompt["9"]["inputs"]["steps"] = steps
    prompt["10"]["inputs"].update(prompts=PROMPT, sample_seed=SEED, sample_steps=STEPS, cfg=CFG,
                                  sampler_name="euler", scheduler="normal", width=64, height=64)
    prompt["11"]["inputs"].update(subfolder="server_roundtrip", filename=run_name)
    prompt["20"] = {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": f"val_{run_name}"}}
    return prompt


def _stock_prompt(lora_name: str) -> dict:
    return {
        # The same tiny model as the shipped workflow trains (its pretrained weights).
        "1": {"class_type": "HeadroomTinyModel", "inputs": dict(TINY_LORA["1"]["inputs"])},
        "2": {"class_type": "LoraLoader", "inputs": {"model": ["1", 0], "clip": ["1", 1], "lora_name": lora_name,
                                                     "strength_model": 1.0, "strength_clip": 0.0}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": PROMPT}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": ""}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": SEED, "steps": STEPS, "cfg": CFG,
                                                   "sampler_name": "euler", "scheduler": "normal", "positive": ["3", 0],
                                                   "negative": ["4", 0], "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "VAEDecode", "inputs": {"samples": ["6", 0], "vae": ["1", 2]}},
        "8": {"class_type": "SaveImage", "inputs": {"images": ["7", 0], "filename_prefix": "stock_lora"}},
    }


def test_saved_lora_through_stock_loraloader_reproduces_validation_image(comfy_server):
    run_name = f"roundtrip_{uuid.uuid4().hex[:8]}"
    trained = comfy_server.run_workflow(_training_prompt(run_name, steps=10), timeout=900)
    validation = output_pixels(comfy_server, trained)
    lora_file = comfy_server.base_dir / "models" / "loras" / "server_roundtrip" / f"{run_name}.safetensors"
    assert lora_file.is_file()

    stock = output_pixels(comfy_server, comfy_server.run_workflow(_stock_prompt(f"server_roundtrip/{run_name}.safetensors")))
    # Both images went through 8-bit PNG files here; the float comparison (<= 1e-3) is in
    # tests/comfy/test_train_lora_nodes.py. One 8-bit level allows only rounding at the boundary.
    assert validation.shape == stock.shape == (64, 64, 3)
    assert np.abs(validation - stock).max() <= 1

    # Resize LoRA through the API on the file saved after the server started (its combo lists it): at the trained rank
    # every layer is copied, so the stock graph samples the same image; at rank 2 the file is another, smaller LoRA.
    for rank, name in ((8, f"{run_name}_rank8"), (2, f"{run_name}_rank2")):
        comfy_server.run_workflow({"1": {"class_type": "HeadroomResizeLora", "inputs": {
            "lora_name": f"server_roundtrip/{run_name}.safetensors", "rank": rank, "energy": 0.0,
            "subfolder": "server_roundtrip", "filename": name, "dtype": "auto"}}})
        resized = lora_file.with_name(f"{name}.safetensors")
        assert resized.is_file()
        sampled = output_pixels(comfy_server, comfy_server.run_workflow(_stock_prompt(f"server_roundtrip/{name}.safetensors")))
        if rank == 8:
            assert np.array_equal(sampled, stock)
        else:
            assert resized.stat().st_size < lora_file.stat().st_size
            assert not np.array_equal(sampled, stock)

    # Merge LoRAs through the API, the MODEL / CLIP from a node of the same prompt: half the saved file plus half of its
    # rank-8 copy is the trained LoRA again, so the stock graph samples the same image (within rounding) from the merged
    # file in kohya's names.
    merged = f"{run_name}_merged_halves"
    comfy_server.run_workflow({
        "1": {"class_type": "HeadroomTinyModel", "inputs": dict(TINY_LORA["1"]["inputs"])},
        "2": {"class_type": "HeadroomMergeLoras", "inputs": {
            "model": ["1", 0], "clip": ["1", 1], "lora_1": f"server_roundtrip/{run_name}.safetensors",
            "strength_1": 0.5, "lora_2": f"server_roundtrip/{run_name}_rank8.safetensors", "strength_2": 0.5,
            "lora_3": "none", "strength_3": 1.0, "lora_4": "none", "strength_4": 1.0, "rank": 8, "energy": 0.0,
            "subfolder": "server_roundtrip", "filename": merged, "dtype": "auto", "format": "kohya"}}})
    sampled = output_pixels(comfy_server,
                            comfy_server.run_workflow(_stock_prompt(f"server_roundtrip/{merged}.safetensors")))
    assert np.abs(sampled - stock).max() <= 1

    # Inspect LoRA through the API on the merged file: every layer applies to the tiny model (the stock graph above
    # sampled it), the kohya names and the merge are said; its text reaches the history as the node shows it.
    execution = comfy_server.run_workflow({
        "1": {"class_type": "HeadroomTinyModel", "inputs": dict(TINY_LORA["1"]["inputs"])},
        "2": {"class_type": "HeadroomInspectLora", "inputs": {
            "model": ["1", 0], "clip": ["1", 1], "lora_name": f"server_roundtrip/{merged}.safetensors"}}})
    [report] = execution.outputs["2"]["text"]
    assert report.startswith("OK: Load LoRA patches ") and "kohya (lora_unet_* / lora_te_*) names" in report, report
    assert "merged from" in report and f"{run_name}_rank8.safetensors" in report, report


def test_interrupt_mid_training_saves_a_checkpoint_and_leaves_comfyui_idle(comfy_server):
    run_name = f"interrupt_{uuid.uuid4().hex[:8]}"
    steps_seen = []

    def interrupt_after_two_steps(message):
        if message.get("type") == "headroom.train.step":
            steps_seen.append(message["data"]["step"])
            if len(steps_seen) == 2:
                comfy_server.interrupt()

    prompt_id = comfy_server.queue(_training_prompt(run_name, steps=100_000))
    execution = comfy_server.wait(prompt_id, timeout=900, on_event=interrupt_after_two_steps)
    assert execution.status == "interrupted"
    assert len(steps_seen) >= 2

    run_dir = comfy_server.base_dir / "output" / "headroom_runs" / run_name
    latest = json.loads((run_dir / "latest.json").read_text())
    saved_step = latest["step"]
    assert steps_seen[1] <= saved_step < 100_000
    assert (run_dir / "checkpoints" / f"step_{saved_step:08d}" / "adapter.safetensors").is_file()

    queue = comfy_server.queue_state()
    assert not queue["queue_running"] and not queue["queue_pending"]
    comfy_server.free(unload_models=True, free_memory=True)
    # The run resumes from that checkpoint: asking for one more step trains exactly one.
    resumed = comfy_server.run_workflow(_training_prompt(run_name, steps=saved_step + 1), timeout=900)
    resumed_steps = [m["data"]["step"] for m in resumed.events if m.get("type") == "headroom.train.step"]
    assert resumed_steps == [saved_step + 1]
