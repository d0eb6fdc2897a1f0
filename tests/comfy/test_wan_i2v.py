"""Image-to-video LoRAs on the tiny Wan I2V (nodes/bridge/families/wan21.py `wan21_i2v`, ComfyUI's WAN21_I2V: 36 input
channels): each clip's first frame is its start image, cached through the stock WanImageToVideo node beside the clip's
latent (Cache Latents' start_image); the training step gives the model exactly that node's conditioning; validation
samples from a start image through the node and the stock sampler, and the stock LoraLoader + WanImageToVideo +
KSampler reproduce the validation clip."""
from __future__ import annotations

import logging

import pytest
import torch
from family_checks import (cached_clips, check_start_image_round_trip, init_run, overfit, train_all_in_one,
                           validate_samples, validation_samples)

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

SIZE, FRAMES = 32, 5  # 2 latent frames of 4 x 4



def _i2v_data(start_image="WanImageToVideo", count=4, seed=0):
    """(model, clip, vae, moving-shape clips, latent cache, text cache) of the tiny Wan I2V."""
    return cached_clips("wan21_i2v", SIZE, FRAMES, start_image, count, seed)


def _wan_i2v_node(positive, negative, vae, start):
    from comfy_extras.nodes_wan import WanImageToVideo

    return WanImageToVideo.execute(positive, negative, vae, SIZE, SIZE, FRAMES, 1, start_image=start).args


def test_the_training_step_gives_the_model_what_wan_image_to_video_gives_it(cache_dir, tmp_path):
    """The cached start conditioning is WanImageToVideo's for the clip's first frame (bitwise), and the model input the
    training step builds from it (c_concat: mask + start latent) is the one the sampler builds from the node's."""
    from headroom.nodes.bridge import families

    import nodes

    model, clip, vae, clips, latents, texts = _i2v_data()
    assert families.family_name(model.model) == "wan21" and model.model.diffusion_model.patch_embedding.weight.shape[1] == 36
    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, clips.captions[0])[0]
        stock, _, latent = _wan_i2v_node(positive, [], vae, clips.clips[0][:1])
    assert torch.equal(latents.start_frame(0), clips.clips[0][0])
    cached = latents.start(0)
    assert torch.equal(cached["concat_latent_image"], stock[0][1]["concat_latent_image"][0])
    assert torch.equal(cached["concat_mask"], stock[0][1]["concat_mask"][0])
    assert cached["concat_latent_image"].shape == latents.latent(0).shape == (16, 2, 4, 4)

    run = init_run(model, latents, texts, f"i2v_inputs_{tmp_path.name}", 4, 1e-3, "preset", False)
    noise = torch.randn(1, *latents.latent(0).shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        trained = run.trainer.denoiser._item_conds(noise, run.trainer._conds([0]))[0]["c_concat"].cond
        sampler = model.model.extra_conds(noise=noise, device=noise.device, cross_attn=positive[0][0],
                                          **{k: v for k, v in stock[0][1].items() if k.startswith("concat_")})
    expected = sampler["c_concat"].process_cond(batch_size=1, area=None).cond
    assert trained.shape == (1, 20, 2, 4, 4)  # 4 mask channels (first latent frame 1, the rest 0) + the start latent
    assert torch.equal(trained, expected)
    assert torch.equal(trained[0, :4, 0], torch.ones(4, 4, 4)) and torch.equal(trained[0, :4, 1], torch.zeros(4, 4, 4))
    assert torch.equal(latent["samples"], torch.zeros(1, 16, 2, 4, 4))


def test_four_clips_overfit_from_their_start_frames(cache_dir, tmp_path):
    model, _, _, _, latents, texts = _i2v_data()
    run = init_run(model, latents, texts, f"i2v_overfit_{tmp_path.name}", 16, 1e-2, "all_layers", False, "cosine", 300)
    initial, final = overfit(run)
    print(f"wan21_i2v clips: {run.step} steps; loss {initial:.4f} -> {final:.4f} ({1 - final / initial:.0%} lower)")
    assert final <= 0.5 * initial


def test_the_validation_clip_is_stock_lora_loader_wan_image_to_video_and_ksampler(cache_dir, tmp_path, caplog):
    """Train, validate (start image: the first clip's first frame, by default), save; the stock LoraLoader +
    CLIPTextEncode + WanImageToVideo (that frame as start_image) + KSampler + VAEDecode give the same frames."""
    check_start_image_round_trip(_i2v_data(), _wan_i2v_node, f"i2v_roundtrip_{tmp_path.name}", "wan21_i2v",
                                 "WanImageToVideo", SIZE, FRAMES, caplog)


def test_the_all_in_one_node_validates_from_its_start_image(cache_dir, tmp_path):
    """The all-in-one Train LoRA node's start_image reaches its validation as Validate's does: its clip is Validate's
    from that start image, not the one from the default (the first clip's first frame)."""
    model, clip, vae, clips, latents, texts = _i2v_data()
    start = clips.clips[1][:1]
    run = train_all_in_one(model, latents, texts, clip, vae, f"i2v_all_in_one_{tmp_path.name}", 4, SIZE, FRAMES,
                           start_image=start)
    trained = validation_samples(run)
    given = validate_samples(run, clip, vae, SIZE, FRAMES, start_image=start)
    default = validate_samples(run, clip, vae, SIZE, FRAMES)
    print(f"wan21_i2v all-in-one: vs Validate(start_image) max abs diff {(trained - given).abs().max().item():.2e}; "
          f"vs the default start {(trained - default).abs().max().item():.2e}")
    assert run.step == 4 and trained.shape == (1, 16, 2, 4, 4)
    assert torch.equal(trained, given)
    assert (trained - default).abs().max().item() > 1e-3, "the start image should change the clip"


def test_start_images_are_refused_where_they_do_not_apply(cache_dir, tmp_path, caplog):
    """A start image for a text-to-video model is refused naming the node; an I2V model on a cache without start images
    trains without one (as WanImageToVideo without a start_image gives it none) and says how to cache them."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _, clips, latents, texts = _i2v_data(start_image="none", count=2, seed=1)
    assert latents.start(0) is None and latents.start_frame(0) is None
    with caplog.at_level(logging.WARNING):
        run = init_run(model, latents, texts, f"i2v_no_start_{tmp_path.name}", 4, 1e-3, "preset", False)
    assert "the LATENT_CACHE has none: it trains without one" in caplog.text
    assert "set Cache Latents' start_image to WanImageToVideo" in caplog.text
    with torch.inference_mode():
        conds = run.trainer.denoiser._item_conds(torch.zeros(1, 16, 2, 4, 4), run.trainer._conds([0]))[0]
    assert torch.equal(conds["c_concat"].cond, torch.zeros(1, 20, 2, 4, 4))

    # Prior images have no start image: refused naming the inputs.
    _, _, _, _, started, started_texts = _i2v_data(count=2, seed=1)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"prior images with start images \(image-to-video\): "
                                                                 r".*disconnect prior_latent_cache / prior_text_cache"):
        T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=started, text_cache=started_texts, lora_config=run.config.adapter,
            optimizer_config=run.config.optimizer, run_name=f"i2v_prior_{tmp_path.name}", seed=0, batch_size=2,
            grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform",
            loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False,
            checkpoint_depth=1, holdout=0, prior_latent_cache=latents, prior_text_cache=texts, prior_ratio=0.5)

    with torch.inference_mode():
        t2v, t2v_clip, t2v_vae = build_tiny_models("wan21", 0)
    t2v_run = init_run(t2v, started, started_texts, f"t2v_start_{tmp_path.name}", 4, 1e-3, "preset", False)
    with torch.inference_mode(), pytest.raises(ValueError, match=r"Validate LoRA \(Headroom\): start_image given, but this MODEL "
                                                                 r"\(WAN21\) takes no start image .*disconnect start_image"):
        T.HeadroomValidate.execute(t2v_run, clip=t2v_clip, vae=t2v_vae, prompts="x", negative="", sample_seed=0,
                                   sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", width=SIZE,
                                   height=SIZE, loss_timesteps=1, frames=FRAMES, start_image=clips.clips[0][:1])
