"""What every model family must do, asked of every family with a tiny model (nodes/families/<family>.py `tiny`):
a new family file is tested here without touching this file.

- overfit: 4 images, the loss on them halves within 300 steps (the trainer learns through the family's model);
- round trip: cache -> train -> validate through stock samplers -> save -> the stock LoraLoader + KSampler reproduce
  the validation image (<= 1e-3), with zero "lora key not loaded", and the base weights unchanged.
"""
from __future__ import annotations

import logging

import pytest
import torch

pytestmark = pytest.mark.comfyui


def _tiny_families() -> list[str]:
    # Read from the registry without importing ComfyUI at collection time: module names are family names.
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[1] / "nodes" / "families"
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base") and not p.stem.startswith("_"))
    return [name for name in names if "\nTINY = TinyModel(" in (folder / f"{name}.py").read_text()]


TINY_FAMILIES = _tiny_families()


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and far faster than two on a busy machine
    yield
    torch.set_num_threads(previous)


def _data(family, count=4, resolution=32, seed=0):
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.tiny_models import build_tiny_models

    with torch.inference_mode():  # as ComfyUI runs nodes
        model, clip, vae = build_tiny_models(family, 0)
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(count, resolution, seed).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, resolution, resolution, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, latents, texts


def _init(model, latents, texts, run_name, rank, lr, targets, include_conv, schedule="constant", steps=1000):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", rank, float(rank), targets, include_conv, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", lr, 0.0, schedule, 0, steps).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=4, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]


def _overfit_targets(family: str) -> tuple[str, bool]:
    """UNet families train their preset with convolutions; the tiny DiTs' random frozen embedders and output layers
    are not the near-identity paths of trained models, so those train every layer."""
    from headroom.nodes import families

    preset = families.get(family).lora_preset
    return ("preset", True) if preset.conv is not None else ("all_layers", False)


def _base_weights(model):
    return {k: v.detach().clone() for k, v in model.model.diffusion_model.state_dict().items()}


def test_every_registry_family_is_listed_here(comfyui):
    from headroom.nodes import families, tiny_models

    assert list(tiny_models.FAMILIES) == [name for name in families.FAMILIES if name in TINY_FAMILIES]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_overfits_four_images(comfyui, family):
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _data(family)
    targets, include_conv = _overfit_targets(family)
    run = _init(model, latents, texts, f"conformance_overfit_{family}", 16, 1e-2, targets, include_conv, "cosine", 300)
    with torch.inference_mode():
        initial = run.loss_on(run.train_items)
        for target in range(100, 301, 50):  # stop as soon as the loss has halved
            T.HeadroomTrainSteps.execute(run, target)
            final = run.loss_on(run.train_items)
            if final <= 0.5 * initial:
                break
    print(f"{family}: {run.step} steps; loss {initial:.4f} -> {final:.4f} ({1 - final / initial:.0%} lower)")
    assert final <= 0.5 * initial


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_saved_lora_reproduces_validation_through_stock_nodes(comfyui, family, caplog):
    import comfy.model_management
    import nodes
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts = _data(family)
    base = _base_weights(model)
    run = _init(model, latents, texts, f"conformance_roundtrip_{family}", 8, 2e-2, "preset", False)
    prompt = "a red circle at the center"
    seed, steps, cfg, sampler, scheduler = 7, 4, 3.0, "euler", "simple"
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 20)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                            sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                            width=32, height=32, loss_timesteps=1).args[0]
        name = T.HeadroomSaveLora.execute(run, "headroom/conformance", "", "fp32").args[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        empty = {"samples": torch.zeros(1, *latents_shape(model, 32, 32))}
        stock = nodes.VAEDecode().decode(vae, nodes.common_ksampler(lora_model, seed, steps, cfg, sampler, scheduler,
                                                                     positive, negative, empty)[0])[0]
        plain = nodes.VAEDecode().decode(vae, nodes.common_ksampler(model, seed, steps, cfg, sampler, scheduler,
                                                                    positive, negative, empty)[0])[0]
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers), "a trained layer was not patched by the stock loader"
    difference = (images - stock).abs().max().item()
    print(f"{family}: validation image vs LoraLoader+KSampler: max abs diff {difference:.2e}; "
          f"{len(run.adapters.layers)} layers")
    assert difference <= 1e-3
    assert (plain - stock).abs().max().item() > 1e-3, "the LoRA should change the image"
    comfy.model_management.unload_all_models()  # a loaded LoraLoader clone holds patched weights until unloaded
    after = _base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"


def latents_shape(model, width: int, height: int) -> tuple[int, ...]:
    """An empty latent of the model's own format (channels and downscale), as the family's stock empty-latent node
    makes it."""
    latent_format = model.model.latent_format
    downscale = latent_format.spacial_downscale_ratio
    frames = (1,) if latent_format.latent_dimensions == 3 else ()  # video-VAE families (Wan 2.1 latents): one frame
    return (latent_format.latent_channels, *frames, height // downscale, width // downscale)
