"""Video LoRA training on the tiny Wan 2.1 (nodes/families/wan21.py): clip datasets (video files, frame folders, images
as one-frame clips) -> 5-D latent caches cut to the VAE's 4k+1 frames -> training (overfit on moving shapes) ->
validation clips through stock samplers (animated WEBP + frame grid) -> the stock LoraLoader + KSampler with the stock
empty video latent reproduce every frame."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from family_checks import (check_stock_round_trip, image_size, init_run, overfit, train_all_in_one, validate_samples,
                           validation_samples)

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]



def _input_folder(name: str) -> Path:
    import folder_paths

    folder = Path(folder_paths.get_input_directory()) / name
    folder.mkdir(parents=True)
    return folder


def _write_frames(folder: Path, clip: torch.Tensor) -> None:
    folder.mkdir()
    for index, frame in enumerate(clip):
        Image.fromarray((frame.numpy() * 255).round().astype(np.uint8)).save(folder / f"frame_{index:04d}.png")


def _write_video(path: Path, clip: torch.Tensor, fps: int = 16) -> None:
    """An H.264 MP4 (lossy) through PyAV, as a camera or editor would write one."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = clip.shape[2], clip.shape[1], "yuv420p"
        for frame in clip:
            image = av.VideoFrame.from_ndarray((frame.numpy() * 255).round().astype(np.uint8), format="rgb24")
            container.mux(stream.encode(image))
        container.mux(stream.encode())


def _tiny_wan():
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        return build_tiny_models("wan21", 0)


def _cache(dataset, vae, clip):
    from headroom.nodes import cache as cache_nodes

    with torch.inference_mode():
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return latents, texts


def test_clip_frames_follow_the_vae_rule():
    from headroom.training.data.video import clip_frames

    assert clip_frames(81, 81, 1, 4) == list(range(81))
    assert clip_frames(80, 81, 1, 4) == list(range(77))  # cut to 4k+1, never padded
    assert clip_frames(30, 81, 2, 4) == list(range(0, 26, 2))  # every 2nd frame: 15 -> 13
    assert clip_frames(100, 17, 1, 4) == list(range(17))
    assert clip_frames(3, 81, 1, 4) == [0]
    assert clip_frames(7, 81, 1, 1) == list(range(7))
    assert clip_frames(0, 81, 1, 4) == []


def test_moving_shapes_are_deterministic_and_move():
    from headroom.training.data.synthetic import generate_moving_shapes

    a, b = generate_moving_shapes(3, 32, 5, 0), generate_moving_shapes(3, 32, 5, 0)
    assert a.clips.shape == (3, 5, 32, 32, 3) and torch.equal(a.clips, b.clips) and a.captions == b.captions
    assert all(" moving " in caption for caption in a.captions)
    assert all(not torch.equal(clip[0], clip[-1]) for clip in a.clips)


def test_video_folder_caches_5d_latents_in_frame_buckets(cache_dir, tmp_path):
    """Frame folder (5 frames -> 2 latent frames), MP4 (9 -> 3), a 3-frame folder (cut to 1) and an image (1) in one
    folder; clips are batched by (width, height, frames)."""
    from headroom.nodes import cache as cache_nodes
    from headroom.training.data.synthetic import generate_moving_shapes

    clips = generate_moving_shapes(4, 32, 9, 0)
    folder = _input_folder(f"clips_{tmp_path.name}")
    _write_frames(folder / "a_frames", clips.clips[0, :5])
    _write_video(folder / "b_video.mp4", clips.clips[1])
    _write_frames(folder / "c_short", clips.clips[2, :3])
    Image.fromarray((clips.clips[3, 0].numpy() * 255).astype(np.uint8)).save(folder / "d_image.png")
    # Captions as .txt, or as kohya's .caption (a frame folder's beside it: a_frames.caption)
    for name, caption, extension in zip(("a_frames", "b_video", "c_short", "d_image"), clips.captions,
                                        (".caption", ".txt", ".txt", ".caption")):
        (folder / f"{name}{extension}").write_text(caption)

    model, clip, vae = _tiny_wan()
    with torch.inference_mode():
        dataset = cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0, False,
                                                                max_frames=81, frame_stride=1).args[0]
    assert [item.caption for item in dataset.items] == list(clips.captions) and dataset.notes == ()
    # A clip without a caption file: captioned with the trigger word alone, the node says so; without one, the fix
    (folder / "c_short.txt").unlink()
    with torch.inference_mode():
        output = cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0, False,
                                                               trigger_word="sks_motion")
        with pytest.raises(ValueError, match=r"(?s)c_short: no caption file; write the caption into .*c_short\.txt "
                                             r"\(or set trigger_word"):
            cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0, False)
    assert output.args[0].items[2].caption == "sks_motion" and output.ui["text"] == [
        "1 of 4 clips have no caption file: captioned with the trigger word alone."]
    (folder / "c_short.txt").write_text(clips.captions[2])
    latents, texts = _cache(dataset, vae, clip)
    shapes = {latents.name(i): tuple(latents.latent(i).shape) for i in range(len(latents))}
    assert shapes == {"a_frames": (16, 2, 4, 4), "b_video.mp4": (16, 3, 4, 4), "c_short": (16, 1, 4, 4),
                      "d_image.png": (16, 1, 4, 4)}
    assert sorted(latents.buckets) == [(32, 32), (32, 32, 5), (32, 32, 9)]
    # The frame folder's latents are exactly stock VAE Encode of its frames (as Load Image reads the PNGs).
    frames = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255.0)
                          for p in sorted((folder / "a_frames").iterdir())])
    with torch.inference_mode():
        stock = vae.encode(frames)
    torch.testing.assert_close(latents.latent(0), stock[0])

    # frame_stride 2 and max_frames 5: the MP4's frames 0, 2, 4, 6, 8 -> 2 latent frames; a new cache entry.
    with torch.inference_mode():
        strided = cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0, False,
                                                                max_frames=5, frame_stride=2).args[0]
        cached, summary = cache_nodes.HeadroomCacheLatents.execute(strided, vae).args
    assert cached.latent(1).shape == (16, 2, 4, 4)
    print(summary)


def test_clip_datasets_refuse_bad_input_naming_the_file(cache_dir, tmp_path, monkeypatch):
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_vae
    from headroom.training.data import video
    from headroom.training.data.dataset import DatasetError
    from headroom.training.data.synthetic import generate_moving_shapes

    clips = generate_moving_shapes(1, 32, 5, 0)
    folder = _input_folder(f"bad_clips_{tmp_path.name}")
    (folder / "broken.mp4").write_bytes(b"not a video at all")
    (folder / "broken.txt").write_text("x")

    def build(**kwargs):
        with torch.inference_mode():
            return cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0,
                                                                 kwargs.pop("skip_bad", False), **kwargs).args[0]

    with pytest.raises(DatasetError, match=r"broken\.mp4: unreadable or corrupt video .*re-export it or remove it"):
        build()
    (folder / "broken.mp4").unlink()
    (folder / "broken.txt").unlink()

    # A caption missing, a file of another kind.
    _write_frames(folder / "clip", clips.clips[0])
    (folder / "notes.doc").write_text("x")
    with pytest.raises(DatasetError, match=r"(?s)clip: no caption file; write the caption into .*clip\.txt.*"
                                           r"notes\.doc: unsupported file type '\.doc'"):
        build()
    (folder / "notes.doc").unlink()
    (folder / "clip.txt").write_text("a clip")

    # A frame folder claiming more frames than a clip may have: refused before any frame is decoded.
    monkeypatch.setattr(video, "MAX_CLIP_FRAMES", 4)
    with pytest.raises(DatasetError, match=r"clip: 5 frames, more than the 4 a frame folder may hold; split the clip"):
        build(max_frames=4)
    monkeypatch.undo()

    # A frame of another size; a symlinked frame leading outside the dataset roots.
    Image.new("RGB", (16, 16)).save(folder / "clip" / "frame_0009.png")
    with pytest.raises(DatasetError, match=r"frame_0009\.png: 16x16 but the clip's first frame is 32x32"):
        build()
    (folder / "clip" / "frame_0009.png").unlink()
    outside = tmp_path / "secret.png"
    Image.new("RGB", (32, 32)).save(outside)
    os.symlink(outside, folder / "clip" / "frame_0010.png")
    with pytest.raises(Exception, match=r"leads outside .*refused"):
        build()
    (folder / "clip" / "frame_0010.png").unlink()

    # A clip whose frames would decode more pixels than a clip may take: refused before decoding.
    dataset = build()
    monkeypatch.setattr(video, "MAX_CLIP_DECODE_PIXELS", 4 * 32 * 32)
    with torch.inference_mode(), pytest.raises(DatasetError, match=r"clip: taking these frames decodes 5 frames of "
                                                                   r"32x32 .*lower max_frames or frame_stride"):
        cache_nodes.HeadroomCacheLatents.execute(dataset, build_tiny_vae("wan21", 0))
    monkeypatch.undo()

    # An image VAE cannot encode a clip of more than one frame: the fix is named.
    with torch.inference_mode(), pytest.raises(DatasetError, match=r"a clip of 5 frames, but this VAE encodes single "
                                                                   r"images; .*set max_frames to 1"):
        cache_nodes.HeadroomCacheLatents.execute(dataset, build_tiny_vae("sd15", 0))


# Clips of 2 latent frames: 5 frames for the 4x temporal VAEs, 9 for LTX-2's 8x one (at 64 px: two latent pixels).
@pytest.mark.parametrize("family, frames, latent_shape", [("wan21", 5, (16, 2, 4, 4)), ("hunyuan_video15", 5, (32, 2, 2, 2)),
                                                          ("ltx2", 9, (128, 2, 2, 2))])
def test_four_clips_overfit_and_the_validation_clip_is_the_stock_loaders(cache_dir, caplog, tmp_path, family, frames,
                                                                         latent_shape):
    """4 synthetic clips of 2 latent frames: the loss halves within 300 steps; then a validation clip through stock samplers equals LoraLoader + KSampler on the stock empty video latent, frame by frame, and
    is saved as an animated WEBP and a frame grid."""
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.validation_grid import grid_cells

    with torch.inference_mode():
        model, clip, vae = build_tiny_models(family, 0)
    size = image_size(model)
    clips = generate_moving_shapes(4, size, frames, 0)
    dataset = dataset_from_clips(list(clips.clips), clips.captions, resolution=size, step=16)
    latents, texts = _cache(dataset, vae, clip)
    assert all(latents.latent(i).shape == latent_shape for i in range(4))

    run = init_run(model, latents, texts, f"video_overfit_{tmp_path.name}", 16, 1e-2, "all_layers", False, "cosine", 300)
    initial, final = overfit(run)
    print(f"{family} clips: {run.step} steps; loss {initial:.4f} -> {final:.4f} ({1 - final / initial:.0%} lower)")
    assert final <= 0.5 * initial

    roundtrip = init_run(model, latents, texts, f"video_roundtrip_{tmp_path.name}", 8, 2e-2, "preset", False)
    check_stock_round_trip(roundtrip, model, clip, vae, caplog, label=f"{family} clip", frames=frames)
    folder = roundtrip.run_dir.validation_dir
    webp = sorted(folder.glob("step_*_0.webp"))
    assert len(webp) == 1
    with Image.open(webp[0]) as animation:
        assert animation.is_animated and animation.n_frames == frames and animation.size == (size, size)
    grid = sorted(p for p in folder.glob("step_*.png") if "before" not in p.name)
    assert grid_cells(grid[-1]).shape == (1, frames, size, size, 3)  # one row of frames per prompt
    assert not list(folder.glob(".*hrtmp*"))  # written to temp files, then renamed


def test_validation_frames_are_checked_against_the_family(comfyui, cache_dir):
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher
    from headroom.nodes.bridge.video import check_frames

    wan = build_tiny_model_patcher("wan21", 0).model
    node = "Validate LoRA (Headroom)"
    assert check_frames(node, wan, 1) == 1 and check_frames(node, wan, 81) == 21
    with pytest.raises(ValueError, match=r"Validate LoRA \(Headroom\): frames=6: wan21 clips have 4k\+1 frames; use 5 or 9"):
        check_frames(node, wan, 6)
    with pytest.raises(ValueError, match=r"Validate LoRA \(Headroom\): frames=5, but this MODEL \(QwenImage\) makes images"):
        check_frames(node, build_tiny_model_patcher("qwen_image", 0).model, 5)


def _init_settings(**overrides):
    settings = dict(seed=0, batch_size=2, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                    timestep_sampling="shifted", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                    gradient_checkpointing=False, checkpoint_depth=1, holdout=0)
    settings.update(overrides)
    return settings


def test_a_wan22_expert_trains_its_own_noise_range(cache_dir, tmp_path):
    """Wan 2.2 A14B's high-noise expert (a WAN21_T2V model in ComfyUI) trains noise levels 0.875..1 only: every sampled
    sigma and the validation loss's fixed ones lie there; the range is part of the run (stored, kept on resume)."""
    import json

    from headroom.nodes import train_lora as T
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    model, clip, vae = _tiny_wan()
    clips = generate_moving_shapes(2, 32, 5, 1)
    latents, texts = _cache(dataset_from_clips(list(clips.clips), clips.captions, resolution=32, step=16), vae, clip)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]

        def start(**overrides):
            return T.HeadroomTrainLoraInit.execute(model=model, latent_cache=latents, text_cache=texts, lora_config=lora,
                                                   optimizer_config=opt, run_name=f"wan22_high_{tmp_path.name}",
                                                   **_init_settings(**overrides)).args[0]

        run = start(noise_min=0.875, noise_max=1.0)
        sigmas = run.trainer.objective.sample_sigma(4096, torch.Generator().manual_seed(0))
        assert sigmas.min() >= 0.875 and sigmas.max() <= 1.0
        assert run.trainer.objective.fixed_times(4).min() > 0.875
        T.HeadroomTrainSteps.execute(run, 2)
        stored = json.loads((run.run_dir.path / "config.json").read_text())["session"]["train"]["objective"]
        assert (stored["noise_min"], stored["noise_max"]) == (0.875, 1.0)
        with pytest.raises(ValueError, match=r"noise_min=0.9, noise_max=0.5: need 0 <= noise_min < noise_max <= 1"):
            T.HeadroomTrainLoraInit.execute(model=model, latent_cache=latents, text_cache=texts, lora_config=lora,
                                            optimizer_config=opt, run_name=f"wan22_bad_{tmp_path.name}",
                                            **_init_settings(noise_min=0.9, noise_max=0.5))


def test_clips_are_refused_for_an_image_model(cache_dir, tmp_path):
    """Qwen-Image shares the Wan 2.1 VAE, so clips cache for it too; training an image model on them is refused."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips
    from test_train_lora_nodes import _init

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("qwen_image", 0)
    clips = generate_moving_shapes(2, 32, 5, 2)
    latents, texts = _cache(dataset_from_clips(list(clips.clips), clips.captions, resolution=32, step=16), vae, clip)
    with pytest.raises(ValueError, match=r"the LATENT_CACHE holds clips of up to 5 frames but this model \(QwenImage\) "
                                         r"trains on images: cache the dataset with max_frames 1"):
        _init(model, latents, texts, f"qwen_clips_{tmp_path.name}")


@pytest.mark.parametrize("family, clip_frames, wrong, hint", [("wan21", 17, 16, "4k\\+1 frames; use 13 or 17"),
                                                               ("ltx2", 17, 16, "8k\\+1 frames; use 9 or 17")])
def test_the_memory_plan_counts_frames(comfyui, family, clip_frames, wrong, hint):
    """HeadroomMemoryPlan on a tiny video model: a 17-frame clip (Wan: 5 latent frames, LTX-2: 3) needs more for the
    training step than an image of the same size; frames the family does not take are refused."""
    import json

    from headroom.nodes import memory
    from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher
    from headroom.training.memory import planner

    model = build_tiny_model_patcher(family, 0)

    def plan(frames):
        with torch.inference_mode():
            return json.loads(memory.HeadroomMemoryPlan.execute(model, "estimate", 1, 256, 256, 4, "preset", "AdamW",
                                                               "fp32", 0, frames=frames).args[1])

    one, clip = plan(1), plan(clip_frames)
    step = lambda p: next(phase for phase in p["phases"] if phase["phase"].startswith("train"))  # noqa: E731
    print(f"{family} tiny, 256x256: {step(one)['phase']} {step(one)['total_bytes'] / 2**20:.1f} MiB (1 frame) -> "
          f"{step(clip)['total_bytes'] / 2**20:.1f} MiB ({clip_frames} frames)")
    assert step(clip)["total_bytes"] > step(one)["total_bytes"]
    with pytest.raises(ValueError, match=rf"Memory Plan \(Headroom\): frames={wrong}: {family} clips have {hint}"):
        plan(wrong)
    assert planner.RunShape(1, 64, 64, latent_frames=5).latent_area(
        type("D", (), {"latent_downscale": 8})()) == 5 * 64


def test_mask_folder_gives_clips_their_masks(cache_dir, tmp_path):
    """Dataset From Videos' mask_folder: a frame folder of masks for a frame-folder clip (one mask per frame, reduced to
    the latent frames by the VAE's rule), one image for an MP4 clip (every frame); masks whose size or frame count do
    not match their clip are refused naming the file."""
    import torch.nn.functional as F

    from headroom.nodes import cache as cache_nodes
    from headroom.training.data.dataset import DatasetError
    from headroom.training.data.synthetic import generate_moving_shapes

    clips = generate_moving_shapes(3, 32, 9, 3)
    folder = _input_folder(f"masked_clips_{tmp_path.name}")
    masks = folder.parent / f"{folder.name}_masks"
    masks.mkdir()
    _write_frames(folder / "a_frames", clips.clips[0, :5])
    _write_video(folder / "b_video.mp4", clips.clips[1])
    _write_frames(folder / "c_unmasked", clips.clips[2, :5])
    for name, caption in zip(("a_frames", "b_video", "c_unmasked"), clips.captions):
        (folder / f"{name}.txt").write_text(caption)
    grey = torch.rand(5, 32, 32, generator=torch.Generator().manual_seed(0))
    _write_frames(masks / "a_frames", grey[..., None].expand(-1, -1, -1, 3))
    Image.fromarray(np.tile(np.arange(32, dtype=np.uint8)[None] * 8, (32, 1))).save(masks / "b_video.png")

    def build():
        with torch.inference_mode():
            return cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, 32, 16, "center", False, 0, False,
                                                                 max_frames=81, frame_stride=1,
                                                                 mask_folder=masks.name).args[0]

    _, _, vae = _tiny_wan()
    with torch.inference_mode():
        latents = cache_nodes.HeadroomCacheLatents.execute(build(), vae).args[0]
    pool = lambda m: F.avg_pool2d(m[None, None], 8)[0, 0]  # noqa: E731
    as_read = torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB"), dtype=np.float32) / 255.0).mean(-1)
                           for p in sorted((masks / "a_frames").iterdir())])  # the PNGs as decoded
    torch.testing.assert_close(latents.mask(0), torch.stack([pool(as_read[0]), pool(as_read[1:5].mean(0))])[None])
    ramp = torch.arange(32, dtype=torch.float32).mul(8).div(255).expand(32, 32)
    assert latents.latent(1).shape == (16, 3, 4, 4)
    torch.testing.assert_close(latents.mask(1), pool(ramp).expand(1, 3, 4, 4))
    assert latents.mask(2) is None

    # Four mask frames for a five-frame clip; a mask video shorter than its clip; a mask of another size.
    (masks / "a_frames" / "frame_0004.png").unlink()
    with torch.inference_mode(), pytest.raises(DatasetError, match=r"a_frames: 4 mask frames but its clip .*a_frames "
                                                                   r"has 5 .*give the mask one frame per frame"):
        cache_nodes.HeadroomCacheLatents.execute(build(), vae)
    shutil.rmtree(masks / "a_frames")
    (masks / "b_video.png").unlink()
    _write_video(masks / "b_video.mp4", clips.clips[1, :7])
    with torch.inference_mode(), pytest.raises(DatasetError, match=r"b_video.mp4: 7 mask frames but its clip "
                                                                   r".*b_video.mp4 has 9"):
        cache_nodes.HeadroomCacheLatents.execute(build(), vae)
    Image.new("L", (16, 32)).save(masks / "c_unmasked.png")
    with pytest.raises(DatasetError, match=r"c_unmasked.png: mask is 16x32 but its clip .*c_unmasked is 32x32; resize "
                                           r"the mask to match"):
        build()


def test_a_masked_clip_learns_only_what_its_mask_keeps(cache_dir, tmp_path, monkeypatch):
    """Two clips masked per frame: latent frame 0 keeps the right half, latent frame 1 (frames 1-4) the whole frame.
    The gradient of the training loss with respect to the model's prediction is exactly zero on the masked-out half of
    frame 0 and nowhere else, and training lowers the loss of what the mask keeps."""
    import comfy.model_management

    from headroom.nodes import train_lora as T
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    model, clip, vae = _tiny_wan()
    clips = generate_moving_shapes(2, 32, 5, 4)
    mask = torch.ones(5, 32, 32)
    mask[0, :, :16] = 0.0
    latents, texts = _cache(dataset_from_clips(list(clips.clips), clips.captions, resolution=32, step=16,
                                               masks=[mask, mask]), vae, clip)
    assert torch.equal(latents.mask(0)[0, 0], torch.tensor([[0.0, 0.0, 1.0, 1.0]] * 4))
    assert torch.equal(latents.mask(0)[0, 1], torch.ones(4, 4))

    run = init_run(model, latents, texts, f"masked_clip_{tmp_path.name}", 8, 1e-2, "all_layers", False)
    trainer, outputs = run.trainer, []
    predict = trainer.denoiser.predict

    def keep_output(*args, **kwargs):
        outputs.append(predict(*args, **kwargs))
        outputs[-1].retain_grad()
        return outputs[-1]

    monkeypatch.setattr(trainer.denoiser, "predict", keep_output)
    monkeypatch.setattr(comfy.model_management, "in_training", True)  # as TrainingRun.train_to sets it
    with run.attached(), torch.inference_mode(False):
        loss, _ = trainer._micro_step_loss(0)
        loss.backward()
    trainer.optimizer.zero_grad(set_to_none=True)
    monkeypatch.undo()
    grad = outputs[0].grad  # [2, 16, 2, 4, 4]: 2 clips, 2 latent frames of 4 x 4
    assert grad.shape == (2, 16, 2, 4, 4)
    assert torch.all(grad[:, :, 0, :, :2] == 0)  # the masked-out half of latent frame 0
    assert torch.all(grad[:, :, 0, :, 2:] != 0) and torch.all(grad[:, :, 1] != 0)

    with torch.inference_mode():
        before = run.loss_on(run.train_items)
        T.HeadroomTrainSteps.execute(run, 100)
        after = run.loss_on(run.train_items)
    print(f"masked clips: loss {before:.4f} -> {after:.4f} in 100 steps")
    assert after < 0.8 * before


def test_the_memory_plan_counts_frames_for_the_vae(comfyui):
    """With the VAE connected, caching's encode and validation's decode are ComfyUI's own estimates for the whole clip
    (memory_used_encode of [1, 3, 17, H, W], memory_used_decode of [1, 16, 5, h, w]), named so in the report; a budget
    that one frame fits and 17 do not is reported as not fitting."""
    import json

    from headroom.nodes import memory
    from headroom.nodes.bridge.tiny_models import build_tiny_models, build_tiny_vae
    from headroom.training.memory.policy import OffloadPolicy

    with torch.inference_mode():
        model, _, vae = build_tiny_models("wan21", 0)

    def plan(frames, policy=None):
        with torch.inference_mode():
            text, plan_json, _ = memory.HeadroomMemoryPlan.execute(model, "estimate", 1, 256, 256, 4, "preset", "AdamW",
                                                                   "fp32", 0, policy=policy, vae=vae,
                                                                   frames=frames).args
        phases = {phase["phase"]: phase for phase in json.loads(plan_json)["phases"]}
        return text, json.loads(plan_json), phases

    _, fitting, one = plan(1)
    text, _, clip = plan(17)
    encode = {n: vae.memory_used_encode([1, 3, n, 256, 256], vae.vae_dtype) for n in (1, 17)}
    decode = {n: vae.memory_used_decode([1, 16, n, 32, 32], vae.vae_dtype) for n in (1, 5)}
    assert encode[17] > encode[1] and decode[5] > decode[1]  # the Wan 2.1 VAE's estimate steps up past 4 frames
    assert one["caching (VAE encode)"]["items"]["encode working set"] == encode[1]
    assert clip["caching (VAE encode)"]["items"]["encode working set (a 17-frame clip)"] == encode[17]
    assert clip["caching (VAE encode)"]["total_bytes"] - one["caching (VAE encode)"]["total_bytes"] == \
        encode[17] - encode[1]
    assert one["validation decode"]["items"]["decode working set"] == decode[1]
    assert clip["validation decode"]["items"]["decode working set (a 17-frame clip)"] == decode[5]
    assert "encode working set (a 17-frame clip)" in text
    print(f"wan21 tiny VAE, 256x256: encode {encode[1] / 2**20:.0f} -> {encode[17] / 2**20:.0f} MiB, decode "
          f"{decode[1] / 2**20:.0f} -> {decode[5] / 2**20:.0f} MiB (1 -> 17 frames)")

    # A budget between the two peaks: one frame fits, a 17-frame clip does not (its VAE phases are over it).
    budget = (fitting["peak_bytes"] + max(encode[17], decode[5])) / 2 / 2**30
    policy = OffloadPolicy(vram_budget_gb=budget, vae_tiled_decode="off")
    text_one, plan_one, _ = plan(1, policy)
    text_clip, plan_clip, _ = plan(17, policy)
    assert plan_one["fits"] and "- fits" in text_one
    assert not plan_clip["fits"] and "DOES NOT FIT" in text_clip
    assert plan_clip["peak_phase"] in ("caching (VAE encode)", "validation decode")

    # An image VAE cannot encode the clip the plan is for.
    with pytest.raises(ValueError, match=r"Memory Plan \(Headroom\): frames=17, but this VAE .* encodes images; connect the "
                                         r"video model's VAE"):
        memory.HeadroomMemoryPlan.execute(model, "estimate", 1, 256, 256, 4, "preset", "AdamW", "fp32", 0,
                                          vae=build_tiny_vae("sd15", 0), frames=17)


def test_a_rotated_video_is_read_as_shown(cache_dir, tmp_path):
    """An MP4 stored 32 wide x 16 high with a 90 degree display rotation (as phones write portrait video): its size is
    16 x 32 and its frames are turned as ComfyUI's own video loading turns them (the stored left columns at the
    bottom)."""
    import av
    from comfy_api.latest import InputImpl

    from headroom.training.data.video import FileVideo

    path = tmp_path / "portrait.mp4"
    stored = torch.zeros(5, 16, 32, 3)
    stored[:, :, :8] = 1.0  # the stored frame's left quarter
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 16, "yuv420p"
        stream.set_display_rotation(90)
        for frame in stored:
            image = av.VideoFrame.from_ndarray((frame.numpy() * 255).astype(np.uint8), format="rgb24")
            container.mux(stream.encode(image))
        container.mux(stream.encode())

    video = FileVideo(path)
    assert video.size() == (16, 32)
    frames = video.load_frames([0, 3])
    assert frames.shape == (2, 32, 16, 3)
    assert frames[:, 26:].mean() > 0.9 and frames[:, :22].mean() < 0.1  # the bright quarter is at the bottom
    stock = InputImpl.VideoFromFile(str(path)).get_components().images  # ComfyUI's Load Video
    torch.testing.assert_close(frames, stock[[0, 3]].float(), atol=0.05, rtol=0)


def test_ltx2_trains_and_validates_at_the_clips_own_frame_rate(cache_dir, caplog, tmp_path):
    """A 24 fps MP4 taken with frame_stride 2 is a 12 fps clip: cached with rate 12, the tiny LTX-2 receives
    frame_rate 12 in every training forward, and its validation clip equals the stock LoraLoader + LTXVConditioning
    (frame_rate 12) + KSampler chain; the animated WEBP plays at 12 fps."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("ltx2", 0)
    size = image_size(model)
    clips = generate_moving_shapes(2, size, 18, 0)
    folder = _input_folder(f"ltx2_rate_{tmp_path.name}")
    for index, (frames, caption) in enumerate(zip(clips.clips, clips.captions)):
        _write_video(folder / f"clip{index}.mp4", frames, fps=24)
        (folder / f"clip{index}.txt").write_text(caption)
    dataset = cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, size, 16, "center", False, 0, False,
                                                            max_frames=9, frame_stride=2).args[0]
    latents, texts = _cache(dataset, vae, clip)
    assert [latents.frame_rate(i) for i in range(2)] == [12.0, 12.0]
    assert all(latents.latent(i).shape == (128, 2, 2, 2) for i in range(2))  # 9 frames: every other of 18

    seen = []
    hook = model.model.diffusion_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("frame_rate")), with_kwargs=True)
    try:
        run = init_run(model, latents, texts, f"ltx2_rate_{tmp_path.name}", 8, 2e-2, "preset", False)
        from headroom.nodes import train_lora as T

        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(run, 2)
    finally:
        hook.remove()
    assert seen and set(seen) == {12.0}, seen

    check_stock_round_trip(run, model, clip, vae, caplog, label="ltx2 at 12 fps", frames=9, frame_rate=12.0)
    webp = sorted(run.run_dir.validation_dir.glob("step_*_0.webp"))[-1]
    with Image.open(webp) as animation:
        animation.load()  # PIL reads a frame's duration with the frame
        assert animation.is_animated and animation.info["duration"] == int(1000 / 12)


def test_the_frame_rate_changes_ltx2s_loss_and_none_is_its_default(cache_dir, tmp_path):
    """The same clips at 12 and 25 fps (in-memory clips: the same cache entries, keys without the rate) give the tiny
    LTX-2 different losses; clips of unknown rate train at the model's default 25. Another family (Wan) takes no
    rate: its loss is the same whatever the clips' rate, and a validation rate given to it is refused."""
    from headroom.nodes.bridge import video
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    for family, frames in (("ltx2", 9), ("wan21", 5)):
        with torch.inference_mode():
            model, clip, vae = build_tiny_models(family, 0)
        size = image_size(model)
        clips = generate_moving_shapes(2, size, frames, 0)
        losses, keys = {}, {}
        for rate in (12.0, 25.0, None):
            dataset = dataset_from_clips(list(clips.clips), clips.captions, resolution=size, step=16, frame_rate=rate)
            latents, texts = _cache(dataset, vae, clip)
            assert latents.frame_rate(0) == rate
            if family == "ltx2":  # validation: the first clip's rate, a given one, or none (the model's default)
                assert video.validation_frame_rate("Validate LoRA (Headroom)", model.model, latents) == rate
                assert video.validation_frame_rate("Validate LoRA (Headroom)", model.model, latents, 30.0) == 30.0
            keys[rate] = [item[0] for item in latents._items]
            run = init_run(model, latents, texts, f"{family}_rate_{rate}_{tmp_path.name}", 8, 1e-2, "preset", False)
            with torch.inference_mode():
                losses[rate] = run.loss_on(run.train_items)
        print(f"{family}: loss at 12 fps {losses[12.0]:.6f}, 25 fps {losses[25.0]:.6f}, unknown {losses[None]:.6f}")
        assert keys[12.0] == keys[25.0] == keys[None]
        if family == "ltx2":
            assert abs(losses[12.0] - losses[25.0]) > 1e-6 * losses[25.0]
            assert losses[25.0] == losses[None]
        else:
            assert losses[12.0] == losses[25.0] == losses[None]
            with pytest.raises(ValueError, match=r"Validate LoRA \(Headroom\): frame_rate=12.0 given, but this MODEL \(WAN21\) "
                                                 r"takes no frame rate"):
                video.validation_frame_rate("Validate LoRA (Headroom)", model.model, latents, 12.0)


def test_the_all_in_one_node_validates_ltx2_at_its_frame_rate(cache_dir, tmp_path):
    """The all-in-one Train LoRA node's frame_rate reaches its validation as Validate's does: on clips of unknown rate
    (the model's default 25), its clip at frame_rate 12 is Validate's at 12, not at 25."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes
    from headroom.training.data.video import dataset_from_clips

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("ltx2", 0)
    size = image_size(model)
    clips = generate_moving_shapes(2, size, 9, 0)
    latents, texts = _cache(dataset_from_clips(list(clips.clips), clips.captions, resolution=size, step=16), vae, clip)
    assert latents.frame_rate(0) is None
    run = train_all_in_one(model, latents, texts, clip, vae, f"ltx2_all_in_one_{tmp_path.name}", 2, size, 9,
                           frame_rate=12.0)
    trained = validation_samples(run)
    at_12 = validate_samples(run, clip, vae, size, 9, frame_rate=12.0)
    at_25 = validate_samples(run, clip, vae, size, 9, frame_rate=25.0)
    print(f"ltx2 all-in-one at 12 fps: vs Validate at 12 max abs diff {(trained - at_12).abs().max().item():.2e}; "
          f"vs at 25 {(trained - at_25).abs().max().item():.2e}")
    assert run.step == 2
    assert torch.equal(trained, at_12)
    assert (trained - at_25).abs().max().item() > 1e-4, "the frame rate should change the clip"


def test_a_batch_mixing_frame_rates_runs_one_forward_per_rate(cache_dir, tmp_path):
    """A 24 fps MP4 and a frame folder (Dataset From Videos' frame_rate, default 25) in one bucket and one batch: the
    tiny LTX-2 gets each clip at its own rate, one forward per rate (ComfyUI's constant conds do not concatenate)."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_moving_shapes

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("ltx2", 0)
    size = image_size(model)
    clips = generate_moving_shapes(2, size, 9, 0)
    folder = _input_folder(f"ltx2_mixed_{tmp_path.name}")
    _write_video(folder / "a_video.mp4", clips.clips[0], fps=24)
    _write_frames(folder / "b_frames", clips.clips[1])
    for name, caption in zip(("a_video", "b_frames"), clips.captions):
        (folder / f"{name}.txt").write_text(caption)
    dataset = cache_nodes.HeadroomDatasetFromVideos.execute(folder.name, size, 16, "center", False, 0, False,
                                                            max_frames=9).args[0]
    latents, texts = _cache(dataset, vae, clip)
    assert [latents.frame_rate(i) for i in range(2)] == [24.0, 25.0] and len(latents.buckets) == 1

    seen = []
    hook = model.model.diffusion_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["context"].shape[0], kwargs.get("frame_rate"))), with_kwargs=True)
    try:
        run = init_run(model, latents, texts, f"ltx2_mixed_{tmp_path.name}", 8, 1e-2, "preset", False)
        with torch.inference_mode():
            T.HeadroomTrainSteps.execute(run, 1)
    finally:
        hook.remove()
    assert sorted(seen) == [(1, 24.0), (1, 25.0)], seen
