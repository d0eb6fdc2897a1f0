"""Video-VAE latents for image training: Qwen-Image's Wan 2.1 VAE encodes an image to a one-frame latent
[C, 1, h, w] (ComfyUI's 5-D [B, C, T, H, W] with T = 1). Dataset -> HeadroomCacheLatents -> training batches (with loss
masks) -> validation -> decode must keep that shape where ComfyUI expects it and treat it as the image it is."""
from __future__ import annotations

import pytest
import torch

from headroom.training.data.cache_store import latent_mask
from headroom.training.data.dataset import DatasetError

pytestmark = pytest.mark.comfyui


def test_a_mask_follows_a_one_frame_latent():
    pixels = torch.zeros(32, 32, 3)
    pixels[:, 16:] = 1.0
    image = latent_mask(pixels, torch.zeros(16, 4, 4))
    frame = latent_mask(pixels, torch.zeros(16, 1, 4, 4))
    assert image.shape == (1, 4, 4) and frame.shape == (1, 1, 4, 4)
    torch.testing.assert_close(frame[:, 0], image)
    # One image mask for a clip: every latent frame; mask frames that do not make the latent's frames are refused.
    clip = latent_mask(pixels, torch.zeros(16, 2, 4, 4), 4)
    assert clip.shape == (1, 2, 4, 4) and torch.equal(clip[:, 0], image) and torch.equal(clip[:, 1], image)
    with pytest.raises(DatasetError, match=r"m.mp4: 3 mask frames do not make the 2 latent frame\(s\) of its clip"):
        latent_mask(pixels.expand(3, -1, -1, -1), torch.zeros(16, 2, 4, 4), 4, "m.mp4")
    with pytest.raises(DatasetError, match=r"loss masks need image latents \[C, h, w\] or video latents"):
        latent_mask(pixels, torch.zeros(16, 4))


def test_one_frame_latents_from_cache_to_decoded_validation(comfyui):
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from test_train_lora_nodes import _init

    images = torch.rand(2, 32, 32, 3, generator=torch.Generator().manual_seed(0))
    masks = torch.zeros(2, 32, 32)
    masks[:, :, 16:] = 1.0  # learn the right half only
    with torch.inference_mode():
        model, clip, vae = build_tiny_models("qwen_image", 0)
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, "a\nb", 32, 32, "center", False, 0,
                                                                masks=masks).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    assert model.model.latent_format.latent_dimensions == 3
    assert latents.latent_channels == 16 and latents.latent(0).shape == (16, 1, 4, 4)
    assert latents.mask(0).shape == (1, 1, 4, 4) and latents.mask(0)[..., :2].sum() == 0

    run = _init(model, latents, texts, "video_latents", rank=4, include_conv=False, lr=1e-2, batch_size=2)
    trainer = run.trainer
    x0 = trainer._latents([0, 1])
    mask = trainer._masks([0, 1])
    assert x0.shape == (2, 16, 1, 4, 4) and mask.shape == (2, 1, 1, 4, 4)
    # The masked loss of 5-D latents ignores the masked-out half, as it does for image latents.
    sigma = torch.tensor([0.5, 0.5])
    x0_hat = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1)).to(x0)
    changed = x0_hat.clone()
    changed[..., :2] += 5.0
    loss = trainer.objective.loss(x0_hat, x0, sigma, mask=mask)
    torch.testing.assert_close(trainer.objective.loss(changed, x0, sigma, mask=mask), loss)
    assert trainer.objective.loss(changed, x0, sigma) > trainer.objective.loss(x0_hat, x0, sigma)

    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 3)
        assert torch.isfinite(torch.tensor(run.loss_on(run.train_items)))
        decoded = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a", negative="", sample_seed=0,
                                             sample_steps=2, cfg=1.0, sampler_name="euler", scheduler="simple",
                                             width=32, height=48, loss_timesteps=1).args[0]
    assert decoded.shape == (1, 48, 32, 3)  # frames as images, as VAEDecode gives them
