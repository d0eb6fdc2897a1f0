"""Image-to-video LoRAs on the tiny Wan I2V (nodes/bridge/families/wan21.py `wan21_i2v`, ComfyUI's WAN21_I2V: 36 input
channels): each clip's first frame is its start image, cached through the stock WanImageToVideo node beside the clip's
latent (Cache Latents' start_image); the training step gives the model exactly that node's conditioning; validation
samples from a start image through the node and the stock sampler, and the stock LoraLoader + WanImageToVideo +
KSampler reproduce the validation clip."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import base_weights, init_run, overfit, train_all_in_one, validate_samples, validation_samples
from PIL import Image

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

SIZE, FRAMES = 32, 5  # 2 latent frames of 4 x 4


@pytest.fixture
def cache_dir(comfyui, tmp_path):
    import folder_paths

    path = str(tmp_path / "headroom_cache")
    folder_paths.add_model_folder_path("headroom_cache", path, is_default=True)
    yield Path(path)
    folder_paths.folder_names_and_paths["headroom_cache"][0].remove(path)


def _i2v_data(start_image="WanImageToVideo", count=4, seed=0):
    """(model, clip, vae, moving-shape clips, latent cache, text cache) of the tiny Wan I2V."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("wan21_i2v", 0)
    clips = generate_moving_shapes(count, SIZE, FRAMES, seed)
    dataset = dataset_from_clips(list(clips.clips), clips.captions, resolution=SIZE, step=16)
    with torch.inference_mode():
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, start_image=start_image).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, clips, latents, texts


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
    import comfy.model_management
    from headroom.nodes import train_lora as T

    import nodes

    model, clip, vae, clips, latents, texts = _i2v_data()
    base = base_weights(model)
    run = init_run(model, latents, texts, f"i2v_roundtrip_{tmp_path.name}", 8, 2e-2, "preset", False)
    prompt, seed, steps, cfg, sampler, scheduler = "a red circle moving right", 7, 4, 3.0, "euler", "simple"
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 20)
        images = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                            sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                            width=SIZE, height=SIZE, loss_timesteps=1, frames=FRAMES,
                                            compare_base=True).args[0]
        name = T.HeadroomSaveLora.execute(run, "headroom/i2v", "", "fp32").args[0]

    def stock(model_patcher, start):
        positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
        negative = nodes.CLIPTextEncode().encode(clip, "")[0]
        positive, negative, latent = _wan_i2v_node(positive, negative, vae, start)
        return nodes.VAEDecode().decode(vae, nodes.common_ksampler(model_patcher, seed, steps, cfg, sampler, scheduler,
                                                                    positive, negative, latent)[0])[0]

    caplog.clear()
    with caplog.at_level(logging.WARNING), torch.inference_mode():
        lora_model, _ = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)
        with_lora = stock(lora_model, clips.clips[0][:1])
        other_start = stock(lora_model, clips.clips[1][:1])
        plain = stock(model, clips.clips[0][:1])
    assert "lora key not loaded" not in caplog.text, caplog.text
    assert len(lora_model.patches) == len(run.adapters.layers)
    assert images.shape == with_lora.shape == (FRAMES, SIZE, SIZE, 3)
    difference = (images - with_lora).abs().max().item()
    print(f"wan21_i2v clip: validation vs LoraLoader+WanImageToVideo+KSampler: max abs diff {difference:.2e}; "
          f"{len(run.adapters.layers)} layers")
    assert difference <= 1e-3
    assert (plain - with_lora).abs().max().item() > 1e-3, "the LoRA should change the clip"
    assert (other_start - with_lora).abs().max().item() > 1e-3, "the start image should change the clip"
    # compare_base: the base row is the MODEL alone from the same start image (8-bit PNG).
    before_after = next(run.run_dir.validation_dir.glob("step_*_before_after.png"))
    grid = torch.from_numpy(np.asarray(Image.open(before_after).convert("RGB"), dtype=np.float32) / 255.0)
    torch.testing.assert_close(grid[:SIZE], torch.cat(list(plain), dim=1), atol=1 / 255 + 1e-6, rtol=0)

    # A start image given to Validate is the one the clips start from.
    with torch.inference_mode():
        given = T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=prompt, negative="", sample_seed=seed,
                                           sample_steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                                           width=SIZE, height=SIZE, loss_timesteps=1, frames=FRAMES,
                                           start_image=clips.clips[1][:1]).args[0]
    assert (given - other_start).abs().max().item() <= 1e-3
    comfy.model_management.unload_all_models()
    after = base_weights(model)
    assert all(torch.equal(base[k], after[k]) for k in base), "the shared MODEL's weights changed"


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
    with torch.inference_mode(), pytest.raises(ValueError, match=r"HeadroomValidate: start_image given, but this MODEL "
                                                                 r"\(WAN21\) takes no start image .*disconnect start_image"):
        T.HeadroomValidate.execute(t2v_run, clip=t2v_clip, vae=t2v_vae, prompts="x", negative="", sample_seed=0,
                                   sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", width=SIZE,
                                   height=SIZE, loss_timesteps=1, frames=FRAMES, start_image=clips.clips[0][:1])
