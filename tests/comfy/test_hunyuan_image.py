"""HunyuanImage 2.1 specifics on its tiny model: the narrow 32x VAE is ComfyUI's own layout, and byT5 glyph
conditioning (quoted prompt text) is cached and trained with, as the stock CLIPTextEncode gives it to the sampler."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def test_tiny_vae_is_comfyuis_released_layout_narrow(comfyui):
    import comfy.sd

    from headroom.nodes.bridge.families import hunyuan_image
    from headroom.nodes.bridge.tiny_models import build_tiny_vae

    vae = build_tiny_vae("hunyuan_image", 0)
    assert isinstance(vae, comfy.sd.VAE)
    assert (vae.latent_channels, vae.spacial_compression_encode(), vae.spacial_compression_decode()) == (64, 32, 32)
    # What comfy.sd.VAE's detection builds for a released file: the same tensor names, only narrower.
    released = dict(hunyuan_image._VAE_DDCONFIG, block_out_channels=[128, 256, 512, 512, 1024, 1024])
    with torch.device("meta"):
        full = hunyuan_image._vae_module(released)
    assert set(full.state_dict()) == set(vae.first_stage_model.state_dict())
    with torch.inference_mode():
        latent = vae.encode(torch.rand(1, 64, 96, 3))
        image = vae.decode(latent)
    assert latent.shape == (1, 64, 2, 3) and image.shape == (1, 64, 96, 3)
    assert torch.isfinite(image).all()


def test_quoted_text_is_cached_as_byt5_glyph_conditioning_and_trained_with(comfyui):
    """A caption with quoted text gets byT5 features (conditioning_byt5small -> the DiT's txt_byt5), others none:
    the cache keeps what CLIPTextEncode gives, and a batch mixing both trains (ComfyUI cannot concatenate them:
    the denoiser runs them as separate groups)."""
    import nodes

    from headroom.nodes import cache as cache_nodes, train_lora as T
    from headroom.nodes.bridge.comfy_model import model_inputs
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.cache_store import text_key

    captions = ['a sign that says "OPEN"', "a red circle", 'a poster reading "SALE 50%"', "a blue square"]
    with torch.inference_mode():
        model, clip, vae = build_tiny_models("hunyuan_image", 0)
        images = torch.rand(4, 64, 64, 3, generator=torch.Generator().manual_seed(0))
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, "\n".join(captions), 64, 64, "center", False,
                                                                0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        stock = nodes.CLIPTextEncode().encode(clip, captions[0])[0][0][1]["conditioning_byt5small"]
    cached = {caption: texts.conditioning(text_key(caption)) for caption in captions}
    assert [("conditioning_byt5small" in cached[c]) for c in captions] == [True, False, True, False]
    assert torch.equal(cached[captions[0]]["conditioning_byt5small"], stock[0])
    noise = torch.zeros(1, 64, 2, 2)
    assert "txt_byt5" in model_inputs(model.model, cached[captions[0]], noise, "cpu")
    assert "txt_byt5" not in model_inputs(model.model, cached[captions[1]], noise, "cpu")

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-2, 0.0, "constant", 0, 100).args[0]
        run = T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="hunyuan_image_byt5", seed=0, batch_size=4, grad_accumulation=1, precision="fp32",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]
        before = run.loss_on(run.train_items)
        T.HeadroomTrainSteps.execute(run, 20)
        after = run.loss_on(run.train_items)
    assert torch.isfinite(torch.tensor([before, after])).all() and after < before
