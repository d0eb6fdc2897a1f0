"""The dataset and caching nodes on a real ComfyUI (in-process, CPU) with the tiny SD1.5 / SD3 / Flux
models: cached values equal stock VAEEncode / CLIPTextEncode, re-runs load no encoder, an edited
caption re-encodes one item, corrupt shards are rebuilt, a cancel resumes, encoders are unloaded,
and dataset folders stay inside the allowed roots.

Encoder calls are counted by wrapping the VAE / CLIP object's method in the test; the production
code is not changed for it. Nodes run inside torch.inference_mode(), as ComfyUI runs them.
"""
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytestmark = pytest.mark.comfyui

FAMILIES = ["sd15", "sd3", "flux"]



def counted(monkeypatch, obj, method_name):
    """Wrap obj.method_name so its calls are recorded; returns the list of call arguments."""
    calls = []
    original = getattr(obj, method_name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(obj, method_name, wrapper)
    return calls


def synthetic_dataset(count=4, resolution=64, step=16, controls=False, **options):
    from headroom.nodes.cache import HeadroomDatasetFromImages
    from headroom.training.data.synthetic import generate_shapes

    data = generate_shapes(count, resolution, seed=0)
    kwargs = dict(resolution=64, step=step, crop="center", flip=False, seed=0)
    kwargs.update(options)
    dataset = HeadroomDatasetFromImages.execute(
        data.images, "\n".join(data.captions), control_images=data.control_images if controls else None, **kwargs
    )[0]
    return data, dataset


def cache_both(dataset, vae, clip, **latent_options):
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomCacheText

    with torch.inference_mode():
        latents, latent_summary = HeadroomCacheLatents.execute(dataset, vae, **latent_options)
        text, text_summary = HeadroomCacheText.execute(dataset, clip)
    return latents, text, latent_summary, text_summary


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_values_equal_stock_vae_encode_and_clip_text_encode(cache_dir, family):
    import nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, vae = build_tiny_models(family, seed=0)
    data, dataset = synthetic_dataset(count=3)
    latents, text, _, _ = cache_both(dataset, vae, clip)
    assert len(latents) == 3 and latents.latent_channels == vae.latent_channels

    # Tolerance: none (bitwise). The cache runs the very same ComfyUI call on the same pixels on the same
    # device; a 64 x 64 image in the 64 x 64 bucket is neither resized nor cropped.
    with torch.inference_mode():
        for i in range(3):
            stock = nodes.VAEEncode().encode(vae, data.images[i : i + 1])[0]["samples"]
            assert torch.equal(latents.latent(i), stock[0])
        for caption, key in [(data.captions[1], latents.text_key(1)), ("", None)]:
            (cond, extras), = nodes.CLIPTextEncode().encode(clip, caption)[0]
            cached = text.conditioning(key) if key else text.empty_conditioning()
            assert torch.equal(cached["cross_attn"], cond[0])
            tensor_extras = {name for name, value in extras.items() if isinstance(value, torch.Tensor)}
            assert "pooled_output" in tensor_extras and set(cached) == {"cross_attn"} | tensor_extras
            for name in tensor_extras:
                assert torch.equal(cached[name], extras[name][0]), name


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_clip_skip_is_the_stock_clip_set_last_layer_before_cache_text(cache_dir, family):
    """kohya's clip_skip 2 (docs/COMING_FROM.md): the stock CLIP Set Last Layer node at -2 on the CLIP given to Cache
    Text. Its captions are cached as CLIPTextEncode encodes them with that CLIP: for SD1.5 apart from the last layer's
    (the layer is part of the cache key, so the two are two entries); SDXL's encoders already stop at the penultimate
    layer, so -2 changes nothing there (as in sd-scripts, where clip_skip does not apply to SDXL)."""
    import nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    from headroom.nodes.cache import HeadroomCacheText
    from headroom.training.data.cache_store import text_key

    _, clip, _ = build_tiny_models(family, seed=0)
    data, dataset = synthetic_dataset(count=2)

    with torch.inference_mode():
        skipped = nodes.CLIPSetLastLayer().set_last_layer(clip, -2)[0]
        last, _ = HeadroomCacheText.execute(dataset, clip)
        second, _ = HeadroomCacheText.execute(dataset, skipped)
        key = text_key(data.captions[0])
        (cond, extras), = nodes.CLIPTextEncode().encode(skipped, data.captions[0])[0]
    assert torch.equal(second.conditioning(key)["cross_attn"], cond[0])
    assert torch.equal(second.conditioning(key)["pooled_output"], extras["pooled_output"][0])
    same = torch.equal(second.conditioning(key)["cross_attn"], last.conditioning(key)["cross_attn"])
    assert same == (family == "sdxl")


def test_a_caption_longer_than_77_tokens_is_cached_whole_and_trains_beside_short_ones(cache_dir):
    """kohya's max_token_length 150 / 225 has no counterpart here because none is needed (docs/COMING_FROM.md): a
    long caption is cached as CLIPTextEncode encodes it, 75 tokens a chunk, and a batch mixing it with short
    captions trains (ComfyUI's cond_cat repeats the shorter ones, as its sampler does)."""
    import nodes
    from headroom.nodes import cache as cache_nodes, train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_shapes
    from test_train_lora_nodes import _init

    model, clip, vae = build_tiny_models("sd15", seed=0)
    data = generate_shapes(2, 32, seed=0)
    captions = [", ".join(f"tag{i}" for i in range(60)), "a red square"]  # 60 tags: past 225 tokens, 4 chunks
    with torch.inference_mode():
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(data.images, "\n".join(captions), 32, 32, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        (cond, _), = nodes.CLIPTextEncode().encode(clip, captions[0])[0]
    long = texts.conditioning(latents.text_key(0))["cross_attn"]
    assert long.shape[0] == cond.shape[1] > 77 and long.shape[0] % 77 == 0 and torch.equal(long, cond[0])
    assert texts.conditioning(latents.text_key(1))["cross_attn"].shape[0] == 77
    run = _init(model, latents, texts, "long_caption", rank=4, batch_size=2)
    with torch.inference_mode():
        loss = T.HeadroomTrainSteps.execute(run, 2).args[1]
    assert run.step == 2 and math.isfinite(loss)
    # A plan counts the longest caption's text (read from the shards' headers), whichever item comes first
    from headroom.nodes.bridge import planning

    with torch.inference_mode():
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(data.images.flip(0), "\n".join(captions[::-1]), 32,
                                                                32, "center", False, 0).args[0]
        reversed_latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        reversed_texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    assert reversed_texts.conditioning(reversed_latents.text_key(0))["cross_attn"].shape[0] == 77
    for cached in ((latents, texts), (reversed_latents, reversed_texts)):
        assert planning.cache_run_shape(model, *cached, 2, "test").text_tokens == long.shape[0]


def test_a_16x_vae_caches_its_own_latent_size_and_refuses_buckets_it_would_crop(cache_dir):
    """Flux.2's VAE is 16x (128 channels): cached latents are what stock VAEEncode gives, and a bucket side that is a
    multiple of 8 but not of 16 is refused before any encoding (the VAE would crop it silently)."""
    import nodes
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomDatasetFromImages
    from headroom.nodes.bridge.tiny_models import build_tiny_vae
    from headroom.training.data.dataset import DatasetError
    from headroom.training.data.synthetic import generate_shapes

    vae = build_tiny_vae("flux2", seed=0)
    data, dataset = synthetic_dataset(count=2, step=16)
    with torch.inference_mode():
        latents = HeadroomCacheLatents.execute(dataset, vae)[0]
        stock = nodes.VAEEncode().encode(vae, data.images[:1])[0]["samples"]
    assert tuple(latents.latent(0).shape) == (128, 4, 4) and torch.equal(latents.latent(0), stock[0])
    images = generate_shapes(2, 72, seed=0)
    odd = HeadroomDatasetFromImages.execute(images.images, "\n".join(images.captions), resolution=72, step=8,
                                            crop="center", flip=False, seed=0)[0]
    with torch.inference_mode(), pytest.raises(DatasetError, match=r"bucket size\(s\) 72x72 are not multiples of this "
                                                                   r"VAE's 16x downscale.*multiple of 16"):
        HeadroomCacheLatents.execute(odd, vae)


def test_rerun_hits_the_cache_without_loading_or_calling_encoders(cache_dir, monkeypatch):
    import comfy.model_management as mm
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, vae = build_tiny_models("sd15", seed=0)
    _, dataset = synthetic_dataset(count=4)
    first_latents, first_text, summary, _ = cache_both(dataset, vae, clip)
    assert "0 hits / 4 encoded" in summary

    vae_calls = counted(monkeypatch, vae, "encode")
    clip_calls = counted(monkeypatch, clip, "encode_from_tokens_scheduled")
    loads = counted(monkeypatch, mm, "load_models_gpu")
    latents, text, latent_summary, text_summary = cache_both(dataset, vae, clip)
    assert vae_calls == [] and clip_calls == [] and loads == []
    assert "4 hits / 0 encoded" in latent_summary and "5 hits / 0 encoded" in text_summary  # + empty prompt
    for i in range(4):
        assert torch.equal(latents.latent(i), first_latents.latent(i))
        assert torch.equal(text.conditioning(latents.text_key(i))["cross_attn"],
                           first_text.conditioning(latents.text_key(i))["cross_attn"])


def test_encoders_leave_the_compute_device_when_caching_ends(cache_dir, monkeypatch):
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, vae = build_tiny_models("sd15", seed=0)
    _, dataset = synthetic_dataset(count=2)
    loaded_while_encoding = []
    original_encode = vae.encode
    monkeypatch.setattr(vae, "encode", lambda pixels: (loaded_while_encoding.append(is_loaded(vae.patcher)),
                                                         original_encode(pixels))[1])
    assert is_loaded(clip.patcher)  # ComfyUI loads a CLIP when it builds it
    cache_both(dataset, vae, clip)
    assert loaded_while_encoding[-1]  # the check below can see a loaded model...
    assert not is_loaded(vae.patcher) and not is_loaded(clip.patcher)  # ...and none is left


def test_caching_nodes_refuse_something_that_is_no_policy(cache_dir):
    """The caching nodes use the policy's encoders setting (test_train_lora_nodes: keep_loaded / unload_after_use);
    anything else on the policy input is named before an encoder loads or a cache is written."""
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomCacheText
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, vae = build_tiny_models("sd15", seed=0)
    _, dataset = synthetic_dataset(count=2)
    with pytest.raises(ValueError,
                       match=r"^Cache Latents \(Headroom\): policy must come from an Offload Policy \(Headroom\) or "):
        HeadroomCacheLatents.execute(dataset, vae, policy={"encoders": "keep_loaded"})
    with pytest.raises(ValueError,
                       match=r"^Cache Text \(Headroom\): policy must come from an Offload Policy \(Headroom\) or "):
        HeadroomCacheText.execute(dataset, clip, policy="keep_loaded")
    assert not any(cache_dir.rglob("*.safetensors"))


def test_editing_one_caption_reencodes_exactly_that_item(cache_dir, monkeypatch, tmp_path):
    import folder_paths
    from headroom.nodes.cache import HeadroomDatasetFromFolder
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_shapes

    name = f"captions_{tmp_path.name}"
    folder = Path(folder_paths.get_input_directory()) / name
    folder.mkdir()
    data = generate_shapes(4, 64, seed=1)
    for i in range(4):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(data.captions[i])
    inputs = dict(folder=name, resolution=64, step=64, crop="center", flip=False, seed=0, skip_bad=False)

    _, clip, vae = build_tiny_models("sd15", seed=0)
    before = HeadroomDatasetFromFolder.fingerprint_inputs(**inputs)
    cache_both(HeadroomDatasetFromFolder.execute(**inputs)[0], vae, clip)

    (folder / "2.txt").write_text("an edited caption")
    assert HeadroomDatasetFromFolder.fingerprint_inputs(**inputs) != before  # ComfyUI will run the node again
    vae_calls = counted(monkeypatch, vae, "encode")
    clip_calls = counted(monkeypatch, clip, "tokenize")
    latents, text, latent_summary, text_summary = cache_both(HeadroomDatasetFromFolder.execute(**inputs)[0], vae, clip)
    assert clip_calls == [("an edited caption",)] and "4 hits / 1 encoded" in text_summary
    assert vae_calls == [] and "4 hits / 0 encoded" in latent_summary  # latents do not depend on captions
    assert latents.name(2) == "2.png" and text.conditioning(latents.text_key(2))["cross_attn"].shape == (77, 32)


def test_corrupt_shard_is_detected_and_rebuilt(cache_dir, monkeypatch):
    import nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, vae = build_tiny_models("sd15", seed=0)
    data, dataset = synthetic_dataset(count=4)
    latents, _, _, _ = cache_both(dataset, vae, clip)

    manifest = json.loads((cache_dir / "latents" / "manifest.json").read_text())["entries"]
    shard = cache_dir / "latents" / "shards" / next(iter(manifest.values()))["shard"]
    raw = bytearray(shard.read_bytes())
    raw[-40:-36] = bytes(b ^ 0xFF for b in raw[-40:-36])  # inside the last tensor's data
    shard.write_bytes(bytes(raw))

    vae_calls = counted(monkeypatch, vae, "encode")
    latents, _, summary, _ = cache_both(dataset, vae, clip)
    assert len(vae_calls) == 1 and "3 hits / 1 encoded" in summary and "checksum" in summary
    with torch.inference_mode():
        for i in range(4):
            assert torch.equal(latents.latent(i), nodes.VAEEncode().encode(vae, data.images[i : i + 1])[0]["samples"][0])


def test_cancel_mid_caching_then_resume(cache_dir, monkeypatch):
    import comfy.model_management as mm
    import comfy.utils
    import nodes
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.nodes.cache import HeadroomCacheLatents
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, _, vae = build_tiny_models("sd15", seed=0)
    data, dataset = synthetic_dataset(count=6)
    done_before_cancel = 2
    original_encode = vae.encode
    calls = []

    def encode_then_cancel(pixels):
        calls.append(pixels)
        latents = original_encode(pixels)
        if len(calls) == done_before_cancel:
            mm.interrupt_current_processing(True)  # what the UI's cancel button / POST /interrupt does
        return latents

    progress = []
    previous_hook = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: progress.append((value, total)))
    try:
        monkeypatch.setattr(vae, "encode", encode_then_cancel)
        with torch.inference_mode(), pytest.raises(mm.InterruptProcessingException):
            HeadroomCacheLatents.execute(dataset, vae)
        assert not is_loaded(vae.patcher)  # unloaded on cancel too
        entries = json.loads((cache_dir / "latents" / "manifest.json").read_text())["entries"]
        assert len(entries) == done_before_cancel

        calls.clear()
        monkeypatch.setattr(vae, "encode", lambda pixels: (calls.append(pixels), original_encode(pixels))[1])
        with torch.inference_mode():
            latents, summary = HeadroomCacheLatents.execute(dataset, vae)
    finally:
        comfy.utils.set_progress_bar_global_hook(previous_hook)
    assert len(calls) == 6 - done_before_cancel and f"{done_before_cancel} hits / 4 encoded" in summary
    assert progress[-1] == (6, 6)
    with torch.inference_mode():
        for i in range(6):
            assert torch.equal(latents.latent(i), nodes.VAEEncode().encode(vae, data.images[i : i + 1])[0]["samples"][0])


def test_folder_dataset_with_control_images_cached_as_pixels_or_latents(cache_dir, tmp_path):
    import folder_paths
    import nodes
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomDatasetFromFolder
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.buckets import apply_crop, plan_crop
    from headroom.training.data.synthetic import generate_shapes

    root = Path(folder_paths.get_input_directory()) / f"control_{tmp_path.name}"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    data = generate_shapes(2, (64, 96), seed=2)  # 96 wide x 64 high: the 80 x 48 bucket at 64 / 16
    for i in range(2):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(root / "images" / f"{i}.png")
        Image.fromarray((data.control_images[i].numpy() * 255).astype(np.uint8)).save(root / "masks" / f"{i}.png")
        (root / "images" / f"{i}.txt").write_text(data.captions[i])
    dataset = HeadroomDatasetFromFolder.execute(folder=f"{root.name}/images", control_folder="masks", resolution=64,
                                                step=16, crop="center", flip=True, seed=0, skip_bad=False)[0]
    _, _, vae = build_tiny_models("sd3", seed=0)
    with torch.inference_mode():
        pixels, _ = HeadroomCacheLatents.execute(dataset, vae)
        as_latents, _ = HeadroomCacheLatents.execute(dataset, vae, control_encoding="latents")
        assert len(pixels) == 4 and list(pixels.buckets) == [(80, 48)]
        assert pixels.control(0).shape == (48, 80, 3) and torch.equal(pixels.control(1), pixels.control(0).flip(1))
        mask = torch.from_numpy(np.asarray(Image.open(root / "masks" / "0.png"), dtype=np.float32) / 255)
        assert torch.equal(pixels.control(0), apply_crop(mask, plan_crop((96, 64), (80, 48), "center", 0, "", False)))
        stock = nodes.VAEEncode().encode(vae, pixels.control(0)[None])[0]["samples"][0]
        assert as_latents.control(0).shape == (16, 6, 10) and torch.equal(as_latents.control(0), stock)


def test_dataset_folders_must_stay_inside_allowed_roots(comfyui, tmp_path, monkeypatch):
    import folder_paths
    from headroom.nodes.cache import HeadroomDatasetFromFolder

    outside = tmp_path / "outside"
    outside.mkdir()
    Image.new("RGB", (64, 64)).save(outside / "a.png")
    (outside / "a.txt").write_text("a caption")
    link = Path(folder_paths.get_input_directory()) / f"link_{tmp_path.name}"
    link.symlink_to(outside, target_is_directory=True)
    options = dict(resolution=64, step=64, crop="center", flip=False, seed=0, skip_bad=False)
    monkeypatch.delenv("HEADROOM_DATASET_ROOTS", raising=False)

    for folder in [str(outside), "../" * 8 + str(outside).lstrip("/"), link.name]:
        with pytest.raises(ValueError, match="outside the folders this server reads datasets from") as error:
            HeadroomDatasetFromFolder.execute(folder=folder, **options)
        assert "HEADROOM_DATASET_ROOTS" in str(error.value)
    with pytest.raises(ValueError, match="outside"):  # the control folder is checked the same way
        HeadroomDatasetFromFolder.execute(folder=link.name, control_folder=str(outside), **options)

    monkeypatch.setenv("HEADROOM_DATASET_ROOTS", os.pathsep.join(["relative/ignored", str(tmp_path)]))
    for folder in [str(outside), link.name]:
        dataset = HeadroomDatasetFromFolder.execute(folder=folder, **options)[0]
        assert [item.caption for item in dataset.items] == ["a caption"]


def test_bad_inputs_give_clear_errors(cache_dir, comfyui, tmp_path):
    import folder_paths
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.nodes.cache import HeadroomCacheLatents, HeadroomDatasetFromFolder, HeadroomDatasetFromImages
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.cache_store import CacheStoreError
    from headroom.training.data.dataset import DatasetError

    images = torch.rand(3, 64, 64, 3)
    with pytest.raises(DatasetError, match="3 images but 2 captions"):
        HeadroomDatasetFromImages.execute(images, "one\ntwo\n", resolution=64, step=64, crop="center", flip=False, seed=0)
    with pytest.raises(DatasetError, match="same size"):
        HeadroomDatasetFromImages.execute(images, "a\nb\nc", control_images=torch.rand(3, 32, 32, 3), resolution=64,
                                          step=64, crop="center", flip=False, seed=0)
    empty = Path(folder_paths.get_input_directory()) / f"empty_{tmp_path.name}"
    empty.mkdir()
    with pytest.raises(DatasetError, match="no usable images"):
        HeadroomDatasetFromFolder.execute(folder=empty.name, resolution=64, step=64, crop="center", flip=False, seed=0,
                                          skip_bad=False)

    _, dataset = synthetic_dataset(count=1)
    _, _, vae = build_tiny_models("sd15", seed=0)
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.write_text("not a folder")
    with torch.inference_mode(), pytest.raises(CacheStoreError, match="not writable") as error:
        HeadroomCacheLatents.execute(dataset, vae)
    assert "extra_model_paths.yaml" in str(error.value)
    assert not is_loaded(vae.patcher)


def test_a_latent_cache_the_disk_cannot_hold_stops_after_one_item_and_says_how_to_move_it(cache_dir, comfyui,
                                                                                          monkeypatch):
    """Cache Latents with control images (cached as pixels) on a disk with room for one item: refused after the first,
    which stays cached, with the way to put the cache on another disk; the VAE is unloaded as after any error."""
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.cache import HeadroomCacheLatents
    from headroom.training.data import cache_store
    from headroom.training.data.files import DiskFullError

    _, dataset = synthetic_dataset(count=3, controls=True)
    _, _, vae = build_tiny_models("sd15", seed=0)
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 64 * 64 * 3 * 4)  # one control image's fp32 pixels
    refused = (r"^disk full: Cache Latents \(Headroom\) needs about .* more for the 2 item\(s\) still to encode .* for "
               r"one of 64x64.* what was encoded so far is kept\. To keep the cache on another disk, add "
               r"`headroom_cache: ")
    with torch.inference_mode(), pytest.raises(DiskFullError, match=refused):
        HeadroomCacheLatents.execute(dataset, vae)
    assert not is_loaded(vae.patcher)
    monkeypatch.undo()
    with torch.inference_mode():
        summary = HeadroomCacheLatents.execute(dataset, vae).args[1]
    assert "1 hits / 2 encoded" in summary, summary


def test_a_text_cache_the_disk_cannot_hold_is_sized_by_the_clips_tokens_and_stops_after_one_text(cache_dir, comfyui,
                                                                                                 monkeypatch):
    """Cache Text sizes the texts still to encode by the CLIP tokenizer's counts: the empty prompt first (77 tokens),
    then a caption of 60 tags (4 chunks, 308 tokens) and a short one (77): five empty prompts' worth, refused on a disk
    with room for three (counted as texts, two would have passed), with the way to move the cache; the CLIP unloaded;
    the empty prompt stays cached."""
    import nodes
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data import cache_store
    from headroom.training.data.files import DiskFullError, format_bytes
    from headroom.training.data.synthetic import generate_shapes

    _, clip, _ = build_tiny_models("sd15", seed=0)
    data = generate_shapes(2, 32, seed=0)
    captions = [", ".join(f"tag{i}" for i in range(60)), "a red square"]
    with torch.inference_mode():
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(data.images, "\n".join(captions), 32, 32, "center",
                                                                False, 0).args[0]
        (cond, extras), = nodes.CLIPTextEncode().encode(clip, "")[0]
    empty = cond.nbytes + extras["pooled_output"].nbytes
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 3 * empty)
    refused = (r"^disk full: Cache Text \(Headroom\) needs about .* more for the 2 text\(s\) still to encode "
               r"\(.* for one of 77 tokens\), .* what was encoded so far is kept\. To keep the cache on another disk, "
               r"add "
               r"`headroom_cache: ")
    with torch.inference_mode(), pytest.raises(DiskFullError, match=refused) as error:
        cache_nodes.HeadroomCacheText.execute(dataset, clip)
    assert f"needs about {format_bytes(5 * empty)} more" in str(error.value)
    assert not is_loaded(clip.patcher)
    monkeypatch.undo()
    with torch.inference_mode():
        summary = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[1]
    assert "1 hits / 2 encoded" in summary, summary


def test_cache_folder_is_registered_and_extra_model_paths_can_move_it(comfyui, tmp_path):
    import folder_paths
    import utils.extra_config
    from headroom.nodes.bridge import cache_folders

    saved = folder_paths.folder_names_and_paths.pop("headroom_cache")
    try:
        # ComfyUI reads extra_model_paths.yaml before it imports custom nodes; then our module registers.
        config = tmp_path / "extra_model_paths.yaml"
        config.write_text(f"headroom:\n  headroom_cache: {tmp_path / 'big_disk'}\n")
        utils.extra_config.load_extra_path_config(str(config))
        cache_folders.register_cache_folder()
        assert cache_folders.cache_root() == tmp_path / "big_disk"
        folder_paths.folder_names_and_paths.pop("headroom_cache")
        cache_folders.register_cache_folder()  # without the yaml entry: <models>/headroom_cache
        assert cache_folders.cache_root() == Path(folder_paths.models_dir) / "headroom_cache"
    finally:
        folder_paths.folder_names_and_paths["headroom_cache"] = saved


def test_node_schemas(headroom_nodes):
    from headroom.nodes import cache

    schemas = {node.define_schema().node_id: node.define_schema() for node in cache.NODES}
    assert set(schemas) == {"HeadroomDatasetFromFolder", "HeadroomDatasetFromVideos", "HeadroomDatasetFromImages",
                            "HeadroomCacheLatents", "HeadroomCacheText"}
    assert {node_id: schema.category for node_id, schema in schemas.items()} == {
        "HeadroomDatasetFromFolder": "Headroom/data", "HeadroomDatasetFromVideos": "Headroom/data",
        "HeadroomDatasetFromImages": "Headroom/data",
        "HeadroomCacheLatents": "Headroom/cache", "HeadroomCacheText": "Headroom/cache"}
    outputs = {node_id: [output.io_type for output in schema.outputs] for node_id, schema in schemas.items()}
    assert outputs["HeadroomCacheLatents"] == ["LATENT_CACHE", "STRING"]
    assert outputs["HeadroomCacheText"] == ["TEXT_CACHE", "STRING"]
    assert outputs["HeadroomDatasetFromFolder"] == ["DATASET"]
    policy = [i for i in schemas["HeadroomCacheLatents"].inputs if i.id == "policy"][0]
    assert policy.io_type == "OFFLOAD_POLICY" and policy.optional


def test_fingerprint_sees_lora_patches_but_not_whether_they_are_applied(comfyui):
    import comfy.model_management as mm
    import nodes
    from headroom.nodes.bridge.encoders import encoder_fingerprint, unload_encoder
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    _, clip, _ = build_tiny_models("sd15", seed=0)
    plain = encoder_fingerprint(clip.patcher)
    weights = clip.patcher.model.state_dict()
    key = next(k for k, v in weights.items() if k.endswith(".weight") and v.ndim == 2)
    original = weights[key].clone()
    patched = clip.clone()
    assert patched.add_patches({key: ("diff", (torch.full_like(original, 0.01),))}) == [key]
    with_patch = encoder_fingerprint(patched.patcher)
    assert with_patch != plain

    unload_encoder(clip.patcher)
    with torch.inference_mode():
        nodes.CLIPTextEncode().encode(patched, "a prompt")  # loads the clone: patched weights in the shared module
    assert any(lm.model is patched.patcher for lm in mm.current_loaded_models)
    assert not torch.equal(clip.patcher.model.state_dict()[key], original)  # the module now holds patched weights
    assert encoder_fingerprint(patched.patcher) == with_patch and encoder_fingerprint(clip.patcher) == plain
    unload_encoder(patched.patcher)


def test_graph_through_comfyui_executor_reruns_only_what_an_edited_caption_changes(cache_dir, monkeypatch, tmp_path):
    """Through ComfyUI's own PromptExecutor: the folder node's fingerprint makes ComfyUI re-run it after
    a caption edit, and the caching nodes then encode just that caption; the encoders end unloaded."""
    import copy

    import comfy.sd
    import folder_paths
    from comfy_harness import new_executor, register_nodes
    from headroom.nodes import cache, tiny
    from headroom.nodes.bridge.encoders import is_loaded
    from headroom.training.data.synthetic import generate_shapes

    register_nodes(monkeypatch, cache.NODES, tiny.NODES)
    folder = Path(folder_paths.get_input_directory()) / f"graph_{tmp_path.name}"
    folder.mkdir()
    data = generate_shapes(3, 64, seed=3)
    for i in range(3):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(data.captions[i])

    patchers, vae_calls, clip_encodes = [], [], []
    original_encode, original_tokenize = comfy.sd.VAE.encode, comfy.sd.CLIP.tokenize
    original_clip_encode = comfy.sd.CLIP.encode_from_tokens_scheduled

    def vae_encode(self, pixels):
        vae_calls.append(pixels.shape)
        patchers.append(self.patcher)
        return original_encode(self, pixels)

    def clip_tokenize(self, text, *args, **kwargs):
        clip_calls.append(text)
        patchers.append(self.patcher)
        return original_tokenize(self, text, *args, **kwargs)

    def clip_encode(self, tokens, *args, **kwargs):
        clip_encodes.append(tokens)
        return original_clip_encode(self, tokens, *args, **kwargs)

    clip_calls = []
    monkeypatch.setattr(comfy.sd.VAE, "encode", vae_encode)
    monkeypatch.setattr(comfy.sd.CLIP, "tokenize", clip_tokenize)
    monkeypatch.setattr(comfy.sd.CLIP, "encode_from_tokens_scheduled", clip_encode)

    executor = new_executor()
    prompt = {
        "1": {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd15", "seed": 0}},
        "2": {"class_type": "HeadroomDatasetFromFolder",
              "inputs": {"folder": folder.name, "control_folder": "", "resolution": 64, "step": 64, "crop": "center",
                         "flip": False, "seed": 0, "skip_bad": False}},
        "3": {"class_type": "HeadroomCacheLatents", "inputs": {"dataset": ["2", 0], "vae": ["1", 2],
                                                               "control_encoding": "pixels"}},
        "4": {"class_type": "HeadroomCacheText", "inputs": {"dataset": ["2", 0], "clip": ["1", 1]}},
    }

    def run(name):
        vae_calls.clear()
        clip_calls.clear()
        clip_encodes.clear()
        # The caching nodes are not output nodes: run them as named outputs, as a graph whose sinks they are.
        executor.execute(copy.deepcopy(prompt), name, {}, ["3", "4"])
        assert executor.success, executor.status_messages
        return next(msg["nodes"] for event, msg in executor.status_messages if event == "execution_cached")

    assert run("first") == []
    # Each text encoded once (tokenized once more where the first sizes the rest against the disk)
    assert len(vae_calls) == 3 and len(clip_encodes) == 4 and sorted(set(clip_calls)) == sorted(["", *data.captions])
    (folder / "1.txt").write_text("an edited caption")
    assert run("edited") == ["1"]  # only the model node is reused; the dataset node ran again
    assert vae_calls == [] and len(clip_encodes) == 1 and clip_calls == ["an edited caption"]
    assert patchers and not any(is_loaded(patcher) for patcher in patchers)


def test_tag_shuffling_caches_each_order_as_clip_text_encode_and_a_run_keeps_its_orders(cache_dir, comfyui):
    """Cache Text's tag_shuffles: every cached tag order of a caption is exactly stock CLIP Text Encode of that text,
    the caption as written first; Train Steps trains on the shuffled cache; a run started with shuffled captions does
    not resume on captions cached as written (the run folder names the setting)."""
    import nodes
    from headroom.nodes import cache as cache_nodes, train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.caption_tags import tag_orders
    from headroom.training.data.synthetic import generate_shapes
    from test_train_lora_nodes import _init

    model, clip, vae = build_tiny_models("sd15", seed=0)
    data = generate_shapes(3, 32, seed=0)
    captions = ["ohwx, red hair, smiling, outdoors", "ohwx, blue hair, indoors", "a photo in sentences"]
    with torch.inference_mode():
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(data.images, "\n".join(captions), 32, 32, "center",
                                                                False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        shuffled, summary = cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=4, keep_tags=1).args
        plain = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        assert "tag shuffling: 2 of 3 captions cached in 8 tag orders in all (keep_tags 1)" in summary
        for index, caption in enumerate(captions):
            key = latents.text_key(index)
            orders = tag_orders(caption, 4, 1)
            assert shuffled.tag_orders(key) == len(orders) == [5, 2, 1][index]
            for order, text in enumerate(orders):
                (cond, extras), = nodes.CLIPTextEncode().encode(clip, text)[0]
                assert torch.equal(shuffled.conditioning(key, order)["cross_attn"], cond[0]), text
            assert torch.equal(plain.conditioning(key)["cross_attn"], shuffled.conditioning(key)["cross_attn"])
        with pytest.raises(ValueError, match=r"Cache Text \(Headroom\): tag_shuffles=17: give a whole number from 0 "
                                             r"to 16"):
            cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=17)

        run = _init(model, latents, shuffled, "tags", batch_size=3)
        T.HeadroomTrainSteps.execute(run, 2)
        with pytest.raises(ValueError, match=r"tag_shuffling: stored \{'keep': 1, 'shuffles': 4\}, now None"):
            _init(model, latents, plain, "tags", batch_size=3)
        run = _init(model, latents, shuffled, "tags", batch_size=3)  # the same orders: it resumes
        T.HeadroomTrainSteps.execute(run, 3)

        # tag_dropout: orders leaving tags out, each exactly CLIP Text Encode of its text; a run resumes only on the
        # same rate; without shuffled orders there is nothing to leave tags out of.
        dropped, summary = cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=4, keep_tags=1,
                                                                 tag_dropout=0.3).args
        assert "(keep_tags 1, tag_dropout 0.3)" in summary
        key = latents.text_key(0)
        for order, text in enumerate(tag_orders(captions[0], 4, 1, dropout=0.3)):
            (cond, extras), = nodes.CLIPTextEncode().encode(clip, text)[0]
            assert torch.equal(dropped.conditioning(key, order)["cross_attn"], cond[0]), text
        with pytest.raises(ValueError, match=r"tag_shuffling.dropout: stored None, now 0.3"):
            _init(model, latents, dropped, "tags", batch_size=3)
        with pytest.raises(ValueError, match=r"Cache Text \(Headroom\): tag_dropout=0.2 leaves tags out of the "
                                             r"shuffled orders, and tag_shuffles is 0"):
            cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_dropout=0.2)
        with pytest.raises(ValueError, match=r"Cache Text \(Headroom\): tag_dropout=nan is not a finite number"):
            cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=4, tag_dropout=float("nan"))
        from dataclasses import replace

        pasted = replace(dataset, items=(replace(dataset.items[0], caption="\n".join(map(str, range(40)))),))
        with pytest.raises(ValueError, match=r"^Cache Text \(Headroom\): caption '0'... has 40 lines"):
            cache_nodes.HeadroomCacheText.execute(pasted, clip)


def test_repeat_folders_through_the_nodes_train_each_item_as_often_as_its_folder_says(cache_dir, comfyui, tmp_path):
    """Dataset From Folder on kohya's layout in ComfyUI's input directory (`img/10_ohwx dog`, `img/1_style`): the node
    lists the repeat folders; its fingerprint sees a file changed inside one; a run's epoch trains every item as
    often as it repeats, and a run resumes only on the same repeats. A dataset without repeat folders keeps the data
    fingerprint earlier versions stored."""
    import hashlib
    import json as json_module

    import folder_paths
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.comfy_model import data_fingerprint
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_lora import HeadroomTrainSteps
    from test_train_lora_nodes import _init

    def write(folder: Path, names: list[str], captioned: bool = True, seed: int = 0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        for name in names:
            Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(folder / f"{name}.png")
            if captioned:
                (folder / f"{name}.txt").write_text(f"a photo of {name}", encoding="utf-8")

    root = Path(folder_paths.get_input_directory()) / f"kohya_{tmp_path.name}"
    write(root / "img" / "3_ohwx dog", ["a", "b"], captioned=False)
    write(root / "img" / "1_style", ["c"], seed=1)
    folder = f"{root.name}/img"
    inputs = dict(resolution=32, step=32, crop="center", flip=False, seed=0, skip_bad=False)
    model, clip, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        output = cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder, **inputs)
        dataset = output.args[0]
        assert output.ui["text"] == ["3 images in 2 repeat folder(s), 7 per epoch:\n- 1_style: 1 x 1\n"
                                     "- 3_ohwx dog: 2 x 3 (2 without a caption file, captioned 'ohwx dog')"]
        signature = cache_nodes.HeadroomDatasetFromFolder.fingerprint_inputs(folder=folder, **inputs)
        (root / "img" / "3_ohwx dog" / "a.txt").write_text("ohwx dog, sitting", encoding="utf-8")
        assert cache_nodes.HeadroomDatasetFromFolder.fingerprint_inputs(folder=folder, **inputs) != signature
        dataset = cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder, **inputs).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        assert [latents.repeats(i) for i in range(3)] == [1, 3, 3]

        run = _init(model, latents, texts, "repeats", batch_size=1)
        assert run.trainer._batches.per_epoch == 7  # 1 + 2 x 3 batches of one
        HeadroomTrainSteps.execute(run, 7)
        assert run.trainer.step == 7
        epoch = [run.trainer.batch_items(m)[0] for m in range(7)]  # what those 7 steps trained on
        assert sorted(epoch) == [0, 1, 1, 1, 2, 2, 2]

        (root / "img" / "3_ohwx dog").rename(root / "img" / "5_ohwx dog")
        dataset = cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder, **inputs).args[0]
        five = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        with pytest.raises(ValueError, match=r"run 'repeats' already exists .*different configuration \(data: "):
            _init(model, five, texts, "repeats", batch_size=1)

    # Without repeat folders the fingerprint is the one earlier versions computed: their runs resume.
    _, plain = synthetic_dataset(count=2)
    with torch.inference_mode():
        plain_latents = cache_nodes.HeadroomCacheLatents.execute(plain, vae).args[0]
    bucket_of = {i: list(bucket) for bucket, indices in plain_latents.buckets.items() for i in indices}
    earlier = [[plain_latents.text_key(i), bucket_of[i]] for i in range(len(plain_latents))]
    assert data_fingerprint(plain_latents) == hashlib.sha256(json_module.dumps(earlier).encode()).hexdigest()


def test_transparency_through_the_folder_node(cache_dir, comfyui, tmp_path):
    """Dataset From Folder's transparency on cut-outs in ComfyUI's input directory: the node says how many images have
    an alpha channel and what is done with them (at the default too, with the fix); loss_mask caches their alpha as
    the loss mask and a tiny SD1.5 run trains on it; a mode with no image to act on warns that nothing changes."""
    import folder_paths
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_lora import HeadroomTrainSteps
    from test_train_lora_nodes import _init

    root = Path(folder_paths.get_input_directory()) / f"cutouts_{tmp_path.name}"
    root.mkdir()
    rng = np.random.default_rng(0)
    for index in range(3):
        pixels = rng.integers(0, 255, (32, 32, 4), dtype=np.uint8)
        pixels[..., 3] = 0
        pixels[8:24, 8:24, 3] = 255
        Image.fromarray(pixels if index else pixels[..., :3]).save(root / f"{index}.png")  # 0.png: opaque
        (root / f"{index}.txt").write_text(f"a cut-out {index}", encoding="utf-8")
    inputs = dict(folder=root.name, resolution=32, step=32, crop="center", flip=False, seed=0, skip_bad=False)
    node = cache_nodes.HeadroomDatasetFromFolder
    assert node.execute(**inputs).ui["text"] == [
        "Note: 2 of 3 images have an alpha channel; transparency is ignore, so their transparent pixels train as the "
        "colours stored under them (as Load Image reads them). Set transparency to loss_mask to learn only their "
        "opaque pixels, or to white / black to put them on that background."]
    assert node.execute(**inputs, transparency="white").ui["text"] == [
        "2 of 3 images have an alpha channel: put on a white background (transparency: white)."]
    output = node.execute(**inputs, transparency="loss_mask")
    assert output.ui["text"] == ["2 of 3 images have an alpha channel: only their opaque pixels are learned "
                                 "(transparency: loss_mask)."]
    assert node.fingerprint_inputs(**inputs, transparency="loss_mask") != node.fingerprint_inputs(**inputs)
    model, clip, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        latents = cache_nodes.HeadroomCacheLatents.execute(output.args[0], vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(output.args[0], clip).args[0]
        assert [latents.mask(i) is not None for i in range(3)] == [False, True, True]
        assert latents.mask(1)[0, 0, 0] == 0 and latents.mask(1)[0, 2, 2] == 1  # 8x smaller: cells of 8 pixels
        run = _init(model, latents, texts, "cutouts", batch_size=3)
        HeadroomTrainSteps.execute(run, 2)
        assert run.trainer.step == 2

    for index in (1, 2):
        Image.open(root / f"{index}.png").convert("RGB").save(root / f"{index}.png")
    assert node.execute(**inputs, transparency="loss_mask").ui["text"] == [
        "Warning: transparency is loss_mask, but no image has an alpha channel: nothing changes."]


def test_preview_dataset_shows_the_crops_and_captions_the_run_will_train_on(comfyui, tmp_path):
    """Preview Dataset on Dataset From Folder (trigger word, cut-outs as loss masks): the IMAGE batch, one caption
    line per item as it will be encoded, the images saved where the editor shows a node's previews (ComfyUI's temp
    folder) and the text on the node; start past the end is refused, naming the node."""
    import folder_paths
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.data import HeadroomPreviewDataset

    root = Path(folder_paths.get_input_directory()) / f"preview_{tmp_path.name}"
    root.mkdir()
    rng = np.random.default_rng(0)
    for index, (width, height) in enumerate([(96, 48), (48, 96), (64, 64)]):
        pixels = rng.integers(0, 255, (height, width, 4), dtype=np.uint8)
        pixels[..., 3] = 255 if index else 0  # 0.png: transparent everywhere (nothing learned)
        Image.fromarray(pixels).save(root / f"{index}.png")
        (root / f"{index}.txt").write_text(f"[trigger] number {index}", encoding="utf-8")
    dataset = cache_nodes.HeadroomDatasetFromFolder.execute(
        folder=root.name, resolution=64, step=16, crop="center", flip=True, seed=0, skip_bad=False,
        trigger_word="ohwx", transparency="loss_mask").args[0]
    output = HeadroomPreviewDataset.execute(dataset, count=2, start=1)
    images, captions = output.args
    assert images.shape[0] == 2 and images.shape[-1] == 3 and images.dtype == torch.float32
    lines = captions.splitlines()
    assert len(lines) == 2 and lines[0].startswith("1: 1.png (") and lines[0].endswith(
        ", mask: 100% learned): ohwx number 1")
    ui = output.ui
    assert len(ui["images"]) == 2 and all(entry["type"] == "temp" for entry in ui["images"])
    assert all((Path(folder_paths.get_temp_directory()) / entry["subfolder"] / entry["filename"]).is_file()
               for entry in ui["images"])
    assert ui["text"] == [f"items 1-2 of 3, at resolution 64:\n{captions}"]
    first = HeadroomPreviewDataset.execute(dataset, count=1, start=0).args
    assert first[1].endswith(", mask: 0% learned): ohwx number 0") and first[0].max() <= 0.25  # all darkened
    with pytest.raises(ValueError, match=r"Preview Dataset \(Headroom\): start=3 is past the dataset's last item "
                                         r"\(3 items: give 0 to 2\)"):
        HeadroomPreviewDataset.execute(dataset, count=4, start=3)


def test_a_folder_without_captions_trains_on_its_trigger_word(comfyui, tmp_path):
    """Dataset From Folder on images without caption files: with a trigger word each is captioned with it (the node
    says how many); without one, the error names the image and both fixes."""
    import folder_paths
    from headroom.nodes import cache as cache_nodes

    root = Path(folder_paths.get_input_directory()) / f"uncaptioned_{tmp_path.name}"
    root.mkdir()
    for index in range(3):
        Image.fromarray(np.full((32, 32, 3), 40 * index, np.uint8)).save(root / f"{index}.png")
    (root / "0.txt").write_text("a grey square", encoding="utf-8")
    inputs = dict(folder=root.name, resolution=32, step=32, crop="center", flip=False, seed=0, skip_bad=False)
    output = cache_nodes.HeadroomDatasetFromFolder.execute(**inputs, trigger_word="sks_style")
    assert [item.caption for item in output.args[0].items] == ["sks_style, a grey square", "sks_style", "sks_style"]
    assert output.ui["text"] == ["2 of 3 images have no caption file: captioned with the trigger word alone."]
    with pytest.raises(ValueError, match=r"(?s)Dataset From Folder \(Headroom\): 2 problem\(s\) .*1.png: no caption "
                                         r"file; write the caption into .*1\.txt \(or set trigger_word"):
        cache_nodes.HeadroomDatasetFromFolder.execute(**inputs)


def test_extra_resolutions_through_the_nodes(cache_dir, comfyui, tmp_path):
    """The dataset nodes' extra_resolutions: sizes parsed and checked with the node named; the folder node says the
    sizes; a tiny SD1.5 run trains on batches of each size, never mixed."""
    import folder_paths
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_lora import HeadroomTrainSteps
    from headroom.training.data.dataset import DatasetError
    from headroom.training.data.synthetic import generate_shapes
    from test_train_lora_nodes import _init

    data = generate_shapes(3, 96, seed=0)
    options = dict(resolution=64, step=32, crop="center", flip=False, seed=0)
    images_node = cache_nodes.HeadroomDatasetFromImages
    for text, message in [("96; x", r"extra_resolutions='96; x': give up to 4 sizes as whole numbers"),
                          ("96 128 160 192 224", r"extra_resolutions=.96 128 160 192 224.: give up to 4 sizes"),
                          ("96, \u00b2", r"extra_resolutions=.96, \u00b2.: give up to 4 sizes"),  # a digit to isdigit
                          ("9" * 5000, r"extra_resolutions=.9{80}.: give up to 4 sizes"),
                          ("80", r"extra_resolutions: 80 must be a multiple of step 32 from 64 to 4096 \(e.g. 64\)")]:
        with pytest.raises((ValueError, DatasetError), match=r"^Dataset From Images \(Headroom\): " + message):
            images_node.execute(data.images, "\n".join(data.captions), extra_resolutions=text, **options)
    model, clip, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        dataset = images_node.execute(data.images, "\n".join(data.captions), extra_resolutions=" 96, ", **options).args[0]
        assert dataset.resolutions == (64, 96)
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        assert set(latents.buckets) == {(64, 64), (96, 96)} and len(latents) == 6
        run = _init(model, latents, texts, "sizes", batch_size=3)
        HeadroomTrainSteps.execute(run, 2)
        batches = [run.trainer.batch_items(m) for m in range(2)]
        assert sorted(sorted(batch) for batch in batches) == [[0, 2, 4], [1, 3, 5]]  # one size per batch

    folder = Path(folder_paths.get_input_directory()) / f"sizes_{tmp_path.name}"
    folder.mkdir()
    for i in range(2):
        Image.fromarray((data.images[i].numpy() * 255).astype(np.uint8)).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(data.captions[i], encoding="utf-8")
    output = cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder.name, skip_bad=False,
                                                           extra_resolutions="96", **options)
    assert output.ui["text"] == ["2 images, each cached and trained at 2 sizes (64, 96)."]

    # upscale_small_images: at the extra 128 px the 96 px images are enlarged 1.33x, and Cache Latents names them; off,
    # they are cached in the 96 px bucket they fill
    with torch.inference_mode():
        for upscale, buckets in ((True, {(64, 64), (128, 128)}), (False, {(64, 64), (96, 96)})):
            dataset = images_node.execute(data.images, "\n".join(data.captions), extra_resolutions="128",
                                          upscale_small_images=upscale, **options).args[0]
            latents, summary = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args
            assert set(latents.buckets) == buckets
            assert ("3 image(s) smaller than their bucket, enlarged 1.25x or more (most: " in summary) == upscale
    dataset = cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder.name, skip_bad=False,
                                                            upscale_small_images=False, **options).args[0]
    assert dataset.upscale is False


def test_bucket_side_limits_through_the_nodes(cache_dir, comfyui, tmp_path):
    """min_bucket_side / max_bucket_side on the dataset nodes: wide (4:1) images cache in the bucket the limits leave
    them (max: the long side cut, min: a less extreme shape), at every size of the dataset; bad limits refused naming
    the node; the folder and video nodes take them too."""
    import folder_paths
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.dataset import DatasetError

    wide = torch.rand(2, 64, 256, 3, generator=torch.Generator().manual_seed(0))
    options = dict(resolution=64, step=16, crop="center", flip=False, seed=0)
    images_node = cache_nodes.HeadroomDatasetFromImages
    _, _, vae = build_tiny_models("sd15", seed=0)
    with torch.inference_mode():
        # (0, 96): both sizes' nearest bucket is 96 x 32 (one item each); (48, 0): 64 px has no 4:1 bucket left
        for sides, buckets in (((0, 0), {(128, 32), (256, 64)}), ((0, 96), {(96, 32)}),
                               ((48, 0), {(80, 48), (256, 64)})):
            dataset = images_node.execute(wide, "a\nb", extra_resolutions="128", min_bucket_side=sides[0],
                                          max_bucket_side=sides[1], **options).args[0]
            assert dataset.bucket_sides == sides
            latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
            assert set(latents.buckets) == buckets, sides
    for sides, message in (((0, 100), r"max_bucket_side=100: give 0 \(no limit\) or a multiple of step 16"),
                           ((96, 64), r"min_bucket_side=96 is over max_bucket_side=64"),
                           ((80, 0), r"min_bucket_side=80 leaves resolution 64 no bucket")):
        with pytest.raises(DatasetError, match=r"^Dataset From Images \(Headroom\): " + message):
            images_node.execute(wide, "a\nb", min_bucket_side=sides[0], max_bucket_side=sides[1], **options)
    folder = Path(folder_paths.get_input_directory()) / f"sides_{tmp_path.name}"
    folder.mkdir()
    Image.fromarray((wide[0].numpy() * 255).astype(np.uint8)).save(folder / "wide.png")
    (folder / "wide.txt").write_text("a wide image", encoding="utf-8")
    for node in (cache_nodes.HeadroomDatasetFromFolder, cache_nodes.HeadroomDatasetFromVideos):
        dataset = node.execute(folder=folder.name, skip_bad=False, max_bucket_side=96, **options).args[0]
        assert dataset.bucket_sides == (0, 96)
    with pytest.raises(DatasetError, match=r"^Dataset From Folder \(Headroom\): min_bucket_side=96 is over"):
        cache_nodes.HeadroomDatasetFromFolder.execute(folder=folder.name, skip_bad=False, min_bucket_side=96,
                                                      max_bucket_side=64, **options)
