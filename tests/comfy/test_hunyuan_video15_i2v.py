"""Image-to-video LoRAs on the tiny HunyuanVideo 1.5 (nodes/bridge/families/hunyuan_video15.py: T2V and I2V are one
architecture, 65 input channels = the noise, a 32-channel start latent and a mask): each clip's first frame is its start
image, cached through the stock HunyuanVideo15ImageToVideo node beside the clip's latent (Cache Latents' start_image);
the training step gives the model exactly that node's conditioning (no clip_vision_output, as the node without one);
validation samples from a start image through the node and the stock sampler, and the stock LoraLoader +
HunyuanVideo15ImageToVideo + KSampler reproduce the validation clip. A cache without start images trains text-to-video."""
from __future__ import annotations

import logging
import types

import pytest
import torch
from family_checks import cached_clips, check_start_image_round_trip, init_run, overfit

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

SIZE, FRAMES = 32, 5  # 2 latent frames of 2 x 2 (16x spatial, 4x temporal)
NODE = "HunyuanVideo15ImageToVideo"



def _i2v_data(start_image=NODE, count=4, seed=0):
    """(model, clip, vae, moving-shape clips, latent cache, text cache) of the tiny HunyuanVideo 1.5."""
    return cached_clips("hunyuan_video15", SIZE, FRAMES, start_image, count, seed)


def _stock_node(positive, negative, vae, start):
    from comfy_extras.nodes_hunyuan import HunyuanVideo15ImageToVideo

    return HunyuanVideo15ImageToVideo.execute(positive, negative, vae, SIZE, SIZE, FRAMES, 1, start_image=start).args


def test_the_training_step_gives_the_model_what_hunyuan_video15_image_to_video_gives_it(cache_dir, tmp_path):
    """The cached start conditioning is HunyuanVideo15ImageToVideo's for the clip's first frame (bitwise), and the model
    input the training step builds from it (c_concat: start latent + mask) is the one the sampler builds from the
    node's; no vision states (clip_fea), as the node gives none without a clip_vision_output."""
    from headroom.nodes.bridge import families

    import nodes

    model, clip, vae, clips, latents, texts = _i2v_data()
    assert families.family_name(model.model) == "hunyuan_video15"
    assert families.get("hunyuan_video15").start_image(model.model) == NODE
    with torch.inference_mode():
        positive = nodes.CLIPTextEncode().encode(clip, clips.captions[0])[0]
        stock, _, latent = _stock_node(positive, [], vae, clips.clips[0][:1])
    assert latents.start_image == NODE and torch.equal(latents.start_frame(0), clips.clips[0][0])
    cached = latents.start(0)
    assert torch.equal(cached["concat_latent_image"], stock[0][1]["concat_latent_image"][0])
    assert torch.equal(cached["concat_mask"], stock[0][1]["concat_mask"][0])
    assert cached["concat_latent_image"].shape == latents.latent(0).shape == (32, 2, 2, 2)
    assert cached["concat_latent_image"][:, 0].abs().sum() > 0 and not cached["concat_latent_image"][:, 1].any()

    run = init_run(model, latents, texts, f"hv15_i2v_inputs_{tmp_path.name}", 4, 1e-3, "preset", False)
    noise = torch.randn(1, *latents.latent(0).shape, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        conds = run.trainer.denoiser._item_conds(noise, run.trainer._conds([0]))[0]
        sampler = model.model.extra_conds(noise=noise, device=noise.device, cross_attn=stock[0][0], **stock[0][1])
    trained = conds["c_concat"].cond
    expected = sampler["c_concat"].process_cond(batch_size=1, area=None).cond
    assert trained.shape == (1, 33, 2, 2, 2)  # the start latent (32 channels) + the mask (first latent frame 1, then 0)
    assert torch.equal(trained, expected)
    assert torch.equal(trained[0, 32, 0], torch.ones(2, 2)) and torch.equal(trained[0, 32, 1], torch.zeros(2, 2))
    assert "clip_fea" not in conds and "clip_fea" not in sampler
    assert torch.equal(latent["samples"], torch.zeros(1, 32, 2, 2, 2))


def test_four_clips_overfit_from_their_start_frames(cache_dir, tmp_path):
    model, _, _, _, latents, texts = _i2v_data()
    run = init_run(model, latents, texts, f"hv15_i2v_overfit_{tmp_path.name}", 16, 1e-2, "all_layers", False,
                   "cosine", 300)
    initial, final = overfit(run)
    print(f"hunyuan_video15 i2v clips: {run.step} steps; loss {initial:.4f} -> {final:.4f} "
          f"({1 - final / initial:.0%} lower)")
    assert final <= 0.5 * initial


def test_the_validation_clip_is_stock_lora_loader_hunyuan_video15_image_to_video_and_ksampler(cache_dir, tmp_path,
                                                                                              caplog):
    """Train, validate (start image: the first clip's first frame, by default), save; the stock LoraLoader +
    CLIPTextEncode + HunyuanVideo15ImageToVideo (that frame as start_image) + KSampler + VAEDecode give the same
    frames."""
    check_start_image_round_trip(_i2v_data(), _stock_node, f"hv15_i2v_roundtrip_{tmp_path.name}", "hunyuan_video15 i2v",
                                 NODE, SIZE, FRAMES, caplog)


def test_a_cache_without_start_images_trains_text_to_video(cache_dir, tmp_path, caplog):
    """T2V and I2V checkpoints are one architecture: without start images the run is text-to-video (start latent and
    mask zero, as the stock sampler without the node), said at info level, not warned; another node's start images
    are refused naming the fix."""
    from headroom.nodes.bridge.start_image import item_start_extras

    model, _, _, _, latents, texts = _i2v_data(start_image="none", count=2, seed=1)
    assert latents.start(0) is None and latents.start_frame(0) is None
    with caplog.at_level(logging.INFO):
        run = init_run(model, latents, texts, f"hv15_t2v_{tmp_path.name}", 4, 1e-3, "preset", False)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "start image" in r.getMessage()]
    assert "the LATENT_CACHE has no start images: training text-to-video" in caplog.text
    with torch.inference_mode():
        conds = run.trainer.denoiser._item_conds(torch.zeros(1, 32, 2, 2, 2), run.trainer._conds([0]))[0]
    assert torch.equal(conds["c_concat"].cond, torch.zeros(1, 33, 2, 2, 2))

    wan_cache = types.SimpleNamespace(start_image="WanImageToVideo")
    with pytest.raises(ValueError, match=r"Train LoRA: Init \(Headroom\): the LATENT_CACHE holds WanImageToVideo start "
                                         r"images but this MODEL takes HunyuanVideo15ImageToVideo's: cache the latents with "
                                         r"start_image HunyuanVideo15ImageToVideo"):
        item_start_extras(model.model, wan_cache, "Train LoRA: Init (Headroom)")
