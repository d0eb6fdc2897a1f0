"""ControlNet training on a real ComfyUI server: the saved file through stock nodes only reproduces the
trainer's own validation sample."""
import uuid

import numpy as np
import pytest
from safetensors.torch import load_file
from server_harness import output_pixels

pytestmark = pytest.mark.server

PROMPT, SEED, STEPS, CFG, STRENGTH, TRAIN_STEPS = "a red circle in the center", 7, 4, 3.0, 0.8, 4
SUBFOLDER = "server_roundtrip"


def _control_image_nodes() -> dict:
    """The synthetic dataset and its first control image: the same nodes (and so the same pixels) in both prompts."""
    return {
        "1": {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd15", "seed": 0}},
        "2": {"class_type": "HeadroomSyntheticDataset", "inputs": {"count": 4, "resolution": 64, "seed": 0}},
        "3": {"class_type": "ImageFromBatch", "inputs": {"image": ["2", 2], "batch_index": 0, "length": 1}},
    }


def _training_prompt(run_name: str) -> dict:
    return {
        **_control_image_nodes(),
        "4": {"class_type": "HeadroomDatasetFromImages",
              "inputs": {"images": ["2", 0], "captions": ["2", 1], "control_images": ["2", 2], "resolution": 64,
                         "step": 64, "crop": "center", "flip": False, "seed": 0}},
        "5": {"class_type": "HeadroomCacheLatents", "inputs": {"dataset": ["4", 0], "vae": ["1", 2],
                                                               "control_encoding": "pixels"}},
        "6": {"class_type": "HeadroomCacheText", "inputs": {"dataset": ["4", 0], "clip": ["1", 1]}},
        "7": {"class_type": "HeadroomOptimizerConfig",
              "inputs": {"optimizer": "AdamW", "learning_rate": 1e-3, "weight_decay": 0.0, "schedule": "constant",
                         "warmup_steps": 0, "schedule_steps": 1000}},
        "8": {"class_type": "HeadroomTrainControlNet", "inputs": {
            "model": ["1", 0], "latent_cache": ["5", 0], "text_cache": ["6", 0], "optimizer_config": ["7", 0],
            "run_name": run_name, "seed": 0, "batch_size": 2, "grad_accumulation": 1, "precision": "fp32",
            "max_grad_norm": 1.0, "caption_dropout": 0.5, "timestep_sampling": "uniform", "loss_weighting": "none",
            "min_snr_gamma": 5.0, "noise_offset": 0.0, "gradient_checkpointing": False, "checkpoint_depth": 1,
            "holdout": 0, "blocks": 0, "init_seed": 0, "validation_control": ["3", 0], "validation_strength": STRENGTH,
            "steps": TRAIN_STEPS, "validate_every": 0, "save_every": 0, "controlnet_subfolder": SUBFOLDER,
            "clip": ["1", 1], "vae": ["1", 2], "prompts": PROMPT, "negative": "", "sample_seed": SEED,
            "sample_steps": STEPS, "cfg": CFG, "sampler_name": "euler", "scheduler": "normal", "width": 64,
            "height": 64, "loss_timesteps": 2}},
    }


def _stock_prompt(controlnet_name: str, prefix: str) -> dict:
    """Stock nodes only (the tiny model and the control image aside): load, apply, sample, save."""
    return {
        **_control_image_nodes(),
        "4": {"class_type": "ControlNetLoader", "inputs": {"control_net_name": controlnet_name}},
        "5": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": PROMPT}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 1], "text": ""}},
        "7": {"class_type": "ControlNetApplyAdvanced",
              "inputs": {"positive": ["5", 0], "negative": ["6", 0], "control_net": ["4", 0], "image": ["3", 0],
                         "strength": STRENGTH, "start_percent": 0.0, "end_percent": 1.0, "vae": ["1", 2]}},
        "8": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "9": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": SEED, "steps": STEPS, "cfg": CFG,
                                                   "sampler_name": "euler", "scheduler": "normal", "positive": ["7", 0],
                                                   "negative": ["7", 1], "latent_image": ["8", 0], "denoise": 1.0}},
        "10": {"class_type": "SaveLatent", "inputs": {"samples": ["9", 0], "filename_prefix": prefix}},
        "11": {"class_type": "VAEDecode", "inputs": {"samples": ["9", 0], "vae": ["1", 2]}},
        "12": {"class_type": "SaveImage", "inputs": {"images": ["11", 0], "filename_prefix": prefix}},
        # The same sampling without the ControlNet: shows the ControlNet's effect is far above the tolerance.
        "13": {"class_type": "KSampler", "inputs": {"model": ["1", 0], "seed": SEED, "steps": STEPS, "cfg": CFG,
                                                    "sampler_name": "euler", "scheduler": "normal", "positive": ["5", 0],
                                                    "negative": ["6", 0], "latent_image": ["8", 0], "denoise": 1.0}},
        "14": {"class_type": "SaveLatent", "inputs": {"samples": ["13", 0], "filename_prefix": f"plain_{prefix}"}},
    }


def test_saved_controlnet_through_stock_nodes_reproduces_validation_sample(comfy_server):
    from headroom.training.core.validation_grid import grid_cells

    run_name = f"cn_roundtrip_{uuid.uuid4().hex[:8]}"
    comfy_server.run_workflow(_training_prompt(run_name), timeout=900)
    controlnet_name = f"{SUBFOLDER}/{run_name}_step{TRAIN_STEPS:06d}.safetensors"
    assert (comfy_server.base_dir / "models" / "controlnet" / controlnet_name).is_file()
    validation_dir = comfy_server.base_dir / "output" / "headroom_runs" / run_name / "validation"
    validation_latents = load_file(validation_dir / f"step_{TRAIN_STEPS:08d}_latents.safetensors")["samples"]
    [[validation_pixels]] = grid_cells(validation_dir / f"step_{TRAIN_STEPS:08d}.png").astype(np.int16)  # 1 prompt

    stock = comfy_server.run_workflow(_stock_prompt(controlnet_name, f"stock_controlnet_{run_name}"))
    # SaveLatent's file (by node id): what KSampler returned, float, under the key "latent_tensor".
    stock_latents, plain_latents = (load_file(comfy_server.output_path(stock.outputs[node]["latents"][0]))["latent_tensor"]
                                    for node in ("10", "14"))
    stock_pixels = output_pixels(comfy_server, stock)

    assert validation_latents.shape == stock_latents.shape == (1, 4, 8, 8)
    assert (validation_latents - plain_latents).abs().max() > 1e-2, "the trained ControlNet must change the sample"
    assert (validation_latents - stock_latents).abs().max() <= 1e-3
    # The trainer's grid rounds to 8 bits, SaveImage truncates: one level apart at most.
    assert validation_pixels.shape == stock_pixels.shape == (64, 64, 3)
    assert np.abs(validation_pixels - stock_pixels).max() <= 1
