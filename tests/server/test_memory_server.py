"""Memory cooperation with ComfyUI on a real server: a run that trains and validates, then a stock KSampler on
another model in the same prompt; /free afterwards leaves nothing loaded. A run that fails (interrupted while
training, or an error inside validation) leaves, without /free, neither its training clone loaded nor its
adapter on the MODEL other nodes share.

What is loaded is read from HeadroomVRAMMonitor's report in /history (ComfyUI's `current_loaded_models`).
"""
import copy
import json
import re
import pathlib
import uuid

import numpy as np
import pytest
from server_harness import output_pixels

pytestmark = pytest.mark.server

TINY_LORA = json.loads((pathlib.Path(__file__).resolve().parents[2] / "workflows" / "api" / "tiny_lora_api.json").read_text())
TRAIN_STEPS = 3
PROMPT = "a red circle in the center"

# Not the defaults: recompute blocks, optimizer state in host RAM, parked while validating.
POLICY = {
    "vram_budget_gb": 0.0, "reserve_gb": 1.0, "base_placement": "resident", "base_storage": "as_loaded",
    "checkpointing": "blocks", "checkpoint_depth": 1, "optimizer_state": "cpu",
    "park_optimizer_during_validation": True, "vae_tiled_decode": "auto", "encoders": "unload_after_use",
}


def _run_prompt(run_name: str, steps: int) -> dict:
    """tiny_lora_api.json up to HeadroomValidate (nodes 1-10), with an offload policy on caching and training."""
    prompt = {node_id: copy.deepcopy(TINY_LORA[node_id]) for node_id in map(str, range(1, 11))}
    prompt["30"] = {"class_type": "HeadroomOffloadPolicy", "inputs": dict(POLICY)}
    for node_id in ("4", "5", "8"):
        prompt[node_id]["inputs"]["policy"] = ["30", 0]
    prompt["8"]["inputs"]["run_name"] = run_name
    prompt["9"]["inputs"]["steps"] = steps
    prompt["10"]["inputs"].update(prompts=PROMPT, sample_steps=2, width=64, height=64, loss_timesteps=1)
    return prompt


def _stock_sampling(model, clip, vae, seed, prefix: str) -> dict:
    """Stock nodes only: CLIPTextEncode, EmptyLatentImage, KSampler, VAEDecode, SaveImage (links or values)."""
    return {
        "40": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": PROMPT}},
        "41": {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": ""}},
        "42": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "43": {"class_type": "KSampler", "inputs": {"model": model, "seed": seed, "steps": 2, "cfg": 3.0,
                                                    "sampler_name": "euler", "scheduler": "normal",
                                                    "positive": ["40", 0], "negative": ["41", 0],
                                                    "latent_image": ["42", 0], "denoise": 1.0}},
        "44": {"class_type": "VAEDecode", "inputs": {"samples": ["43", 0], "vae": vae}},
        "45": {"class_type": "SaveImage", "inputs": {"images": ["44", 0], "filename_prefix": prefix}},
    }


def stock_image_of_the_trained_model(server) -> np.ndarray:
    """A stock KSampler image of the MODEL the runs train (tiny sd15, seed 0: the same cached MODEL object).

    The MODEL goes through a monitor with report_every_run, so ComfyUI samples again instead of replaying
    its cached image: an adapter left attached to the shared module would show in the pixels."""
    prompt = {
        "1": copy.deepcopy(TINY_LORA["1"]),
        "2": {"class_type": "HeadroomVRAMMonitor", "inputs": {"value": ["1", 0], "reset_peak": False, "report_every_run": True}},
        **_stock_sampling(["2", 0], ["1", 1], ["1", 2], seed=5, prefix="stock_trained_model"),
    }
    return output_pixels(server, server.run_workflow(prompt))


MONITOR_PROMPT = {
    "1": {"class_type": "PrimitiveInt", "inputs": {"value": 0}},
    # report_every_run: a fresh report on each queue, not ComfyUI's cached one.
    "2": {"class_type": "HeadroomVRAMMonitor", "inputs": {"value": ["1", 0], "reset_peak": False, "report_every_run": True}},
    "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 1]}},
}


def loaded_models(server) -> list[dict]:
    """ComfyUI's loaded models, as the monitor reports them from inside the server's prompt worker."""
    execution = server.run_workflow(MONITOR_PROMPT)
    [report] = execution.outputs["2"]["headroom_vram"]
    return report["loaded_models"]


def describe(models: list[dict]) -> str:
    return ", ".join(f"{m['name']} ({m['loaded_bytes']} bytes on {m['device']}, in use: {m['in_use']})" for m in models)


def free_and_wait(server) -> None:
    """POST /free and wait until the prompt worker has acted on it.

    /free only sets flags; the worker reads them after a prompt, or when it wakes with an empty queue. A prompt
    queued right after /free can run before the flags are read, so one prompt is run first: the flags are
    read at the latest after it, before the next one starts.
    """
    server.free(unload_models=True, free_memory=True)
    server.run_workflow(MONITOR_PROMPT)


def _executed_order(execution) -> list[str]:
    return [m["data"]["node"] for m in execution.events if m.get("type") == "executing" and m["data"].get("node")]


def test_train_validate_then_stock_ksampler_on_another_model_then_free_leaves_nothing_loaded(comfy_server):
    run_name = f"memory_{uuid.uuid4().hex[:8]}"
    prompt = _run_prompt(run_name, TRAIN_STEPS)
    prompt["50"] = {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd3", "seed": 1}}
    # The stock KSampler's seed is the step HeadroomTrainSteps reports for the *validated* run (same target: no
    # training, only an INT that exists once validation is done), so the stock part runs after validation.
    prompt["51"] = {"class_type": "HeadroomTrainSteps", "inputs": {"run": ["10", 2], "steps": TRAIN_STEPS}}
    prompt.update(_stock_sampling(["50", 0], ["50", 1], ["50", 2], seed=["51", 2], prefix=f"stock_after_{run_name}"))

    execution = comfy_server.run_workflow(prompt, timeout=600)
    assert execution.status == "success"
    order = _executed_order(execution)
    assert order.index("10") < order.index("43")  # validated, then sampled with the other model
    [stock_image] = execution.outputs["45"]["images"]
    assert comfy_server.output_path(stock_image).is_file()
    assert [m["data"]["step"] for m in execution.events if m.get("type") == "headroom.train.step"] == [1, 2, 3]

    run_dir = comfy_server.base_dir / "output" / "headroom_runs" / run_name
    latest = json.loads((run_dir / "latest.json").read_text())
    assert latest["step"] == TRAIN_STEPS
    # Validation adds to the run's history, so the run is saved again after it: a re-save of step N goes to
    # step_N.<k> (the folder latest.json named is never replaced, training/core/run_dir.py).
    assert re.fullmatch(rf"checkpoints/step_{TRAIN_STEPS:08d}(\.\d+)?", latest["checkpoint"]), latest
    assert (run_dir / latest["checkpoint"] / "adapter.safetensors").is_file()
    assert (run_dir / "validation" / f"step_{TRAIN_STEPS:08d}.png").is_file()

    free_and_wait(comfy_server)
    still_loaded = loaded_models(comfy_server)
    assert still_loaded == [], f"loaded after /free: {describe(still_loaded)}"


@pytest.mark.parametrize("failure", ["interrupt_training", "error_in_validation"])
def test_a_failed_run_leaves_neither_its_clone_loaded_nor_its_adapter_on_the_model(comfy_server, failure):
    free_and_wait(comfy_server)  # start from nothing loaded, whatever earlier tests on this server left
    assert loaded_models(comfy_server) == []
    untrained = stock_image_of_the_trained_model(comfy_server)
    free_and_wait(comfy_server)
    run_name = f"failed_{failure}_{uuid.uuid4().hex[:8]}"
    prompt = _run_prompt(run_name, steps=100_000 if failure == "interrupt_training" else TRAIN_STEPS)
    # A large learning rate: an adapter left attached to the shared module would change the stock image by
    # tens of 8-bit levels after one step (1e-3 changes it by a few levels only).
    prompt["7"]["inputs"]["learning_rate"] = 0.05

    if failure == "interrupt_training":
        steps_seen = []

        def interrupt_after_one_step(message):
            if message.get("type") == "headroom.train.step":
                steps_seen.append(message["data"]["step"])
                if len(steps_seen) == 1:
                    comfy_server.interrupt()

        execution = comfy_server.wait(comfy_server.queue(prompt), timeout=600, on_event=interrupt_after_one_step)
        assert execution.status == "interrupted"
        assert execution.error["node_id"] == "9"
    else:
        # The validation prompts are encoded with another family's text encoder (4096 wide; this UNet takes 32):
        # the run trains and computes its validation loss, then HeadroomValidate refuses the CLIP before sampling.
        prompt["60"] = {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd3", "seed": 1}}
        prompt["10"]["inputs"]["clip"] = ["60", 1]
        execution = comfy_server.wait(comfy_server.queue(prompt), timeout=600)
        assert execution.status == "error"
        assert execution.error["node_id"] == "10"
        assert "the clip input encodes prompts 4096 wide, but the run's captions were cached 32 wide" in \
            execution.error["exception_message"]

    # No /free: the failed node itself must have given the training clone back.
    still_loaded = loaded_models(comfy_server)
    clone = [m for m in still_loaded if m["name"] == "BaseModel"]  # the tiny sd15 denoiser the run trains
    assert clone == [], f"the training clone is still loaded after the failed run: {describe(clone)}"
    # The policy loads text encoders and VAE for caching and validation only (encoders="unload_after_use").
    assert still_loaded == [], f"loaded after the failed run: {describe(still_loaded)}"
    assert np.array_equal(stock_image_of_the_trained_model(comfy_server), untrained)


def test_the_policy_fitted_to_the_card_shows_on_the_init_node_before_the_first_step(comfy_server):
    """A policy with card "this GPU (auto)": the Init node's text (ComfyUI's progress text, over the websocket)
    says what the planner chose before any training step, and stays in the node's output."""
    from headroom.workflows.headroom_run import TEXT_EVENT

    prompt = _run_prompt(f"card_{uuid.uuid4().hex[:8]}", TRAIN_STEPS)
    prompt["30"]["inputs"]["card"] = "this GPU (auto)"
    events = []
    execution = comfy_server.run_workflow(prompt, timeout=600, on_event=events.append)
    kinds = [(e["type"], (e.get("data") or {})) for e in events]
    shown = [i for i, (kind, data) in enumerate(kinds) if kind == TEXT_EVENT and data.get("node") == "8"]
    steps = [i for i, (kind, _) in enumerate(kinds) if kind == "headroom.train.step"]
    assert shown and steps and shown[0] < steps[0], kinds
    text = kinds[shown[0]][1]["text"]
    assert text.startswith("Train LoRA: Init (Headroom): this GPU (auto): base resident") and "planned peak" in text
    assert text in execution.outputs["8"]["text"][0]
