"""Validation predicts the saved LoRA file in stock ComfyUI, at real width (Flux-dev, 3072 wide, one double and one
single block, bf16 weights computed in fp32 on a CPU through ComfyUI's manual cast).

The stock LoraLoader bakes a LoRA into the bf16 weights (comfy/lora.py, stochastic rounding seeded by the key);
validation with lora_application="as_saved_file" samples exactly that, so its latents equal what LoraLoader +
KSampler give from the saved file. "unmerged" computes the LoRA beside the frozen weights in full precision; its
difference from the stock result is printed (docs/memory/VALIDATION.md states it).
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytestmark = [pytest.mark.comfyui, pytest.mark.realsize]

PROMPT = "a red circle in the center"
SAMPLING = dict(sample_seed=3, sample_steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", width=64, height=64)


def test_as_saved_file_validation_equals_the_stock_loader_at_real_width(comfyui, monkeypatch):
    import comfy.model_management
    import nodes
    import realsize_models
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T

    with torch.inference_mode():  # as ComfyUI's loaders and nodes run
        model, clip, vae = realsize_models.build_family("flux_dev", (1, 1), t5_layers=1)
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(2, 64, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, 64, 64, "center", False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        lora = T.HeadroomLoraConfig.execute("lora", 8, 8.0, "preset", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 2e-3, 0.0, "constant", 0, 100).args[0]
        run = T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=optimizer,
            run_name="as_saved_file", seed=0, batch_size=1, grad_accumulation=1, precision="auto", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=0).args[0]
        T.HeadroomTrainSteps.execute(run, 1)  # one AdamW step already gives the LoRA an effect
        validation_latents = {}
        for mode in ("unmerged", "as_saved_file"):
            T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1,
                                       lora_application=mode, **SAMPLING)
            path = run.run_dir.validation_dir / f"step_{run.step:08d}_latents.safetensors"
            validation_latents[mode] = load_file(str(path))["samples"]
        # Validation on its own placement (issue 28 item 3): the sampled model kept to a third of the base on the
        # device (ComfyUI's load fills no more), the rest cast per layer with the LoRA merged as it goes. On a CPU
        # nothing is planned (one device), so the share is set here; the load runs CPU to CPU.
        from headroom.nodes.bridge import comfy_bridge

        placed_bytes = []  # (moved out, left on the device) as the sampler's first step starts
        keep = comfy_bridge.keep_to_share
        monkeypatch.setattr(comfy_bridge, "keep_to_share",
                            lambda patcher, share: placed_bytes.append((keep(patcher, share), patcher.loaded_size())))
        share = run.placement.patcher.model_size() // 3
        monkeypatch.setattr(run, "_validation_device_share", lambda: share)
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=PROMPT, negative="", loss_timesteps=1,
                                   lora_application="as_saved_file", **SAMPLING)
        validation_latents["placed"] = load_file(str(path))["samples"]
        monkeypatch.undo()
        # at most the share on the device at each sampling's first step (here ComfyUI's cast buffers for the
        # LoRA-patched layers leave room for few of them), every other layer cast from host RAM
        assert placed_bytes and all(left <= share for _, left in placed_bytes)
        name = T.HeadroomSaveLora.execute(run, "tests", "", "fp32").args[0]

        positive = nodes.CLIPTextEncode().encode(clip, PROMPT)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = nodes.EmptyLatentImage().generate(64, 64, 1)[0]
        ksampler = dict(seed=3, steps=2, cfg=1.0, sampler_name="euler", scheduler="simple", positive=positive,
                        negative=negative, latent=empty)
        lora_model = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)[0]
        stock = nodes.common_ksampler(lora_model, **ksampler)[0]["samples"].float()
        comfy.model_management.unload_all_models()  # the patched clone gives the shared weights back
        base = nodes.common_ksampler(model, **ksampler)[0]["samples"].float()

    effect = (stock - base).norm().item()
    as_saved = (validation_latents["as_saved_file"] - stock).abs().max().item()
    unmerged = (validation_latents["unmerged"] - stock).norm().item() / effect
    print(f"\nFlux-dev width: LoRA effect |stock - base| = {effect:.4g}; as_saved_file vs stock max abs diff "
          f"{as_saved:.3g}; unmerged vs stock {100 * unmerged:.2f} % of the LoRA's effect")
    assert effect > 0.0, "the trained LoRA should change the sample"
    assert as_saved == 0.0
    assert torch.equal(validation_latents["as_saved_file"], stock)
    assert torch.equal(validation_latents["placed"], stock)  # the same latents with two thirds of the base moved out
