"""A ControlNet run's planned activations at real width: SD1.5's whole UNet (the cldm ControlNet copies its encoder,
its hint encoder runs at the image's pixel size) and SD3.5-Large at its width (2432, 2 joint blocks, the ControlNet
copying the first), built from ComfyUI's own classes with random weights (tests/realsize_models.py), cached and
opened through the nodes. The plan (its own step's calibration, planning._ControlNetStep) against what the run's
training forward keeps for backward (family_checks.controlnet_plan_over_step), without checkpointing and with every
block checkpointed. The tiny models' check: tests/comfy/test_controlnet_training.py; the step times:
bench/bench_step_prediction.py --kind controlnet."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]


@pytest.mark.parametrize("arch, depth", [("sd15", None), ("sd35_large", 2)])
def test_a_controlnet_runs_plan_counts_what_its_step_keeps_at_real_width(comfyui, arch, depth):
    import realsize_models
    from family_checks import controlnet_plan_over_step
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.families import controlnet_type_of
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.nodes.train_lora import HeadroomOptimizerConfig

    model, clip, vae = realsize_models.build_family(arch, depth)
    with torch.inference_mode():  # as ComfyUI runs nodes
        images, captions, controls = data_nodes.HeadroomSyntheticDataset.execute(1, 64, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 64, 64, "center", False, 0,
                                                                control_images=controls).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, controlnet_type_of(model).hint).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        optimizer = HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
        run = HeadroomTrainControlNetInit.execute(
            model=model, latent_cache=latents, text_cache=texts, optimizer_config=optimizer,
            run_name=f"controlnet_plan_{arch}_{time.time_ns()}", seed=0, batch_size=1, grad_accumulation=1,
            precision="fp32", max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform",
            loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False,
            checkpoint_depth=1, holdout=0).args[0]
    try:
        for checkpointing, (planned, kept) in controlnet_plan_over_step(run).items():
            print(f"{arch}, checkpointing {checkpointing}: planned {planned / 2 ** 20:.1f} MiB, the step keeps "
                  f"{kept / 2 ** 20:.1f} MiB ({planned / kept:.3f}x)")
            assert planned == pytest.approx(kept, rel=0.1), (checkpointing, planned, kept)
    finally:
        run.release()
