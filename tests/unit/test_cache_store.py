"""The cache engine without ComfyUI: datasets and their errors, content-addressed keys, hits without
encoder calls, checksums that catch corrupt / truncated shards, resume after a cancel, atomic
writes on a full disk, and the reading side (LatentCache / TextCache / bucket_batches).

The encoders here are small deterministic functions (this file tests the store, not an encoder);
tests/comfy/test_cache_nodes.py runs the same paths with ComfyUI's real VAE and CLIP.
"""
import dataclasses
import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.data.cache_store import (
    CacheStoreError, ShardStore, bucket_batches, cache_latents, cache_text, fingerprint_state_dict,
    fingerprint_value, text_key,
)
from headroom.training.data.dataset import (
    DatasetError, FileImage, dataset_from_folder, dataset_from_tensors, folder_signature, name_order, split_captions,
)
from headroom.training.data.synthetic import generate_shapes


class CountingVae:
    """pixels [1, H, W, 3] -> [1, 4, H/8, W/8]: a fixed function of the pixels, counting its calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, pixels):
        self.calls += 1
        x = pixels.movedim(-1, 1)
        x = torch.cat([x, x.mean(1, keepdim=True)], dim=1)
        return torch.nn.functional.avg_pool2d(x, 8)


class CountingTextEncoder:
    def __init__(self):
        self.calls = []

    def __call__(self, text):
        self.calls.append(text)
        seed = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(seed)
        return {"cross_attn": torch.randn(5, 8, generator=g), "pooled_output": torch.randn(8, generator=g)}


def write_folder(folder: Path, count=4, resolution=64, controls: Path | None = None, seed=0) -> list[str]:
    data = generate_shapes(count, resolution, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        pixels = (data.images[i].numpy() * 255).round().astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"img{i}.png")
        (folder / f"img{i}.txt").write_text(data.captions[i] + "\n", encoding="utf-8")
        if controls is not None:
            controls.mkdir(parents=True, exist_ok=True)
            mask = (data.control_images[i].numpy() * 255).astype(np.uint8)
            Image.fromarray(mask).save(controls / f"img{i}.png")
    return data.captions


def folder_dataset(folder, **overrides):
    options = dict(resolution=64, step=16, crop="center", flip=False, seed=0, skip_bad=False)
    options.update(overrides)
    control = options.pop("control_folder", None)
    return dataset_from_folder(folder, control, **options)


# --- datasets ----------------------------------------------------------------------------------------


def test_folder_dataset_is_a_lazy_description(tmp_path):
    captions = write_folder(tmp_path / "data", count=3)
    dataset = folder_dataset(tmp_path / "data")
    assert [item.caption for item in dataset.items] == captions
    assert [item.name for item in dataset.items] == ["img0.png", "img1.png", "img2.png"]
    assert all(isinstance(item.image.path, Path) for item in dataset.items)  # paths, not pixels
    assert dataset.items[0].image.size() == (64, 64)
    pixels = dataset.items[0].image.load()
    assert pixels.shape == (64, 64, 3) and pixels.dtype == torch.float32 and 0 <= pixels.min() <= pixels.max() <= 1


def test_items_and_frames_are_read_in_one_order_on_every_os_with_numbers_by_value(tmp_path):
    """sorted(Path) compares names without case on Windows and by code point on Linux: a shared workflow trained its
    images in another order per machine, and a clip's unpadded frames 1.png ... 10.png were read 1, 10, 2."""
    from pathlib import PurePosixPath, PureWindowsPath

    from headroom.training.data.video import FrameFolder

    names = ["img10.png", "b.png", "IMG_3.png", "img2.png", "A.png", "img_2.png", "Img2.png"]
    expected = ["A.png", "b.png", "Img2.png", "img2.png", "img10.png", "img_2.png", "IMG_3.png"]
    assert sorted(map(PureWindowsPath, names)) != sorted(map(PurePosixPath, names))  # the old per-OS orders
    for flavour in (PureWindowsPath, PurePosixPath):
        assert [p.name for p in sorted(map(flavour, names), key=name_order)] == expected

    folder = tmp_path / "data"
    folder.mkdir()
    for name in names:
        Image.new("RGB", (64, 64)).save(folder / name)
        (folder / name).with_suffix(".txt").write_text(name)
    assert [item.name for item in folder_dataset(folder).items] == expected

    clip = tmp_path / "clip"
    clip.mkdir()
    for frame in range(1, 12):
        Image.new("RGB", (16, 16), (frame, 0, 0)).save(clip / f"{frame}.png")
    frames = FrameFolder(clip)._frames()
    assert [image.path.name for image in frames] == [f"{frame}.png" for frame in range(1, 12)]


def test_exif_rotation_is_applied_to_size_and_pixels(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90: stored 64 wide x 32 high, shown 32 wide x 64 high
    Image.new("RGB", (64, 32), (255, 0, 0)).save(folder / "a.jpg", exif=exif)
    (folder / "a.txt").write_text("red")
    item = folder_dataset(folder).items[0]
    assert item.image.size() == (32, 64)
    assert item.image.load().shape == (64, 32, 3)


def _png_chunk(cid: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + cid + data + struct.pack(">I", zlib.crc32(cid + data))


def _rotated_png(path: Path, where: str) -> None:
    """A 64x32 PNG whose orientation 6 (shown 32x64) is in the chunk `where` names, placed as the named tools do."""
    exif = Image.Exif()
    exif[0x0112] = 6
    if where == "eXIf before the pixels":  # PIL, exiftool
        Image.new("RGB", (64, 32), (0, 255, 0)).save(path, exif=exif)
        return
    Image.new("RGB", (64, 32), (0, 255, 0)).save(path)
    if where == "eXIf after the pixels":  # allowed by the PNG spec's 3rd edition; libpng reads it there
        chunk = _png_chunk(b"eXIf", exif.tobytes(8)[6:])
    elif where == "XMP after the pixels":  # an editor's iTXt
        xmp = b'<x:xmpmeta><rdf:Description tiff:Orientation="6"/></x:xmpmeta>'
        chunk = _png_chunk(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + xmp)
    else:  # ImageMagick's "Raw profile type exif", compressed
        raw = exif.tobytes(8).hex()
        text = f"\nexif\n{len(raw) // 2:8d}\n{raw}\n".encode()
        chunk = _png_chunk(b"zTXt", b"Raw profile type exif\0\0" + zlib.compress(text))
    data = path.read_bytes()
    path.write_bytes(data[:-12] + chunk + data[-12:])  # before IEND, after the pixel data


@pytest.mark.parametrize("where", ["eXIf before the pixels", "eXIf after the pixels", "XMP after the pixels",
                                   "Raw profile after the pixels", "none"])
def test_a_pngs_rotation_is_read_wherever_it_is_without_decoding_it(tmp_path, monkeypatch, where):
    """PIL's PngImageFile.getexif decodes the whole image to find metadata after the pixel data (0.2 s for a 12 Mpx
    photo, each time a folder of PNGs was listed and cached): the size is read from the chunks alone, and is the
    size the image loads at (ComfyUI's Load Image rotation, exif_transpose after the decode)."""
    from PIL import PngImagePlugin

    path = tmp_path / "a.png"
    if where == "none":
        Image.new("RGB", (64, 32)).save(path)
    else:
        _rotated_png(path, where)
    image = FileImage(path)
    decode = PngImagePlugin.PngImageFile.load
    with monkeypatch.context() as patched:
        patched.setattr(PngImagePlugin.PngImageFile, "load", lambda self: pytest.fail("size() decoded the image"))
        size = image.size()
    assert PngImagePlugin.PngImageFile.load is decode
    assert size == ((64, 32) if where == "none" else (32, 64))
    height, width, _ = image.load().shape
    assert (width, height) == size


def test_reading_a_pngs_chunks_stops_at_a_hostile_or_cut_tail(tmp_path):
    """The chunk walk of FileImage.size ends at the file's end whatever a chunk claims (4 GiB of pixel data, a cut
    file, a name that is not a chunk's): the size from the header. A metadata chunk claiming more than the file holds
    is an OSError, as when the image loads: the caller names the file as unreadable."""
    path = tmp_path / "a.png"
    Image.new("RGB", (64, 32)).save(path)
    whole = path.read_bytes()
    for tail in (struct.pack(">I", 0xFFFFFFFF) + b"IDAT", struct.pack(">I", 5) + b"\0\1\2\3" + b"x" * 40, b""):
        path.write_bytes(whole[:-12] + tail)
        assert FileImage(path).size() == (64, 32)
    path.write_bytes(whole[:len(whole) // 2])
    assert FileImage(path).size() == (64, 32)
    path.write_bytes(whole[:-12] + struct.pack(">I", 0xFFFFFFFF) + b"eXIf")
    for read in (FileImage(path).size, FileImage(path).load):
        with pytest.raises(OSError, match="Truncated"):
            read()


@pytest.mark.parametrize("problem", ["missing_caption", "corrupt_image", "unsupported_file", "missing_control",
                                     "control_size"])
def test_folder_problems_name_the_file_and_fix_or_are_skipped(tmp_path, problem):
    folder, controls = tmp_path / "data", tmp_path / "control"
    write_folder(folder, count=3, controls=controls)
    if problem == "missing_caption":
        (folder / "img1.txt").unlink()
        culprit, fix = "img1.png", "write the caption"
    elif problem == "corrupt_image":
        (folder / "img1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
        culprit, fix = "img1.png", "re-export it or remove it"
    elif problem == "unsupported_file":
        (folder / "notes.psd").write_bytes(b"8BPS")
        culprit, fix = "notes.psd", "move it out"
    elif problem == "missing_control":
        (controls / "img1.png").unlink()
        culprit, fix = "img1.png", "add one"
    else:
        Image.new("RGB", (32, 32)).save(controls / "img1.png")
        culprit, fix = "img1.png", "resize the control image"
    with pytest.raises(DatasetError) as error:
        folder_dataset(folder, control_folder=controls)
    assert culprit in str(error.value) and fix in str(error.value) and "skip_bad" in str(error.value)

    dataset = folder_dataset(folder, control_folder=controls, skip_bad=True)
    expected = 3 if problem == "unsupported_file" else 2
    assert len(dataset) == expected
    assert len(dataset.warnings) == 1 and culprit in dataset.warnings[0]


def test_empty_folder_and_missing_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "orphan.txt").write_text("a caption without image")
    with pytest.raises(DatasetError, match="no usable images in .*empty") as error:
        folder_dataset(tmp_path / "empty")
    assert "orphan.txt: a caption with no image of the same name; add the image or remove the caption" in str(error.value)


def test_a_caption_with_no_image_is_a_warning_and_case_differences_are_not_orphans(tmp_path):
    folder = tmp_path / "data"
    write_folder(folder, count=2)
    (folder / "lonely.txt").write_text("its image was deleted")
    note = "data/lonely.txt: a caption with no image of the same name; add the image or remove the caption"
    dataset = folder_dataset(folder)  # a warning, not an error: without skip_bad too
    assert len(dataset) == 2 and len(dataset.notes) == 1 and dataset.notes[0].endswith(note)
    assert dataset.left_out == () and dataset.warnings == dataset.notes  # the caching reports list it too

    Image.new("RGB", (64, 64)).save(folder / "Upper.png")
    (folder / "upper.TXT").write_text("Windows and macOS read it as Upper.png's caption")
    dataset = folder_dataset(folder, skip_bad=True)
    assert len(dataset.notes) == 1 and dataset.notes[0].endswith(note)  # upper.TXT is not called an orphan
    assert len(dataset) == (3 if (folder / "Upper.txt").exists() else 2)  # Linux: Upper.png has no Upper.txt


def test_tensor_dataset_checks_counts_and_sizes():
    data = generate_shapes(3, 32, seed=1)
    captions = split_captions("\n".join(data.captions) + "\n")
    assert captions == data.captions
    dataset = dataset_from_tensors(data.images, captions, data.control_images, resolution=32, step=16)
    assert len(dataset) == 3 and dataset.has_control
    assert dataset.items[1].image.load().data_ptr() == data.images[1].data_ptr()  # a view, no copy
    with pytest.raises(DatasetError, match="3 images but 2 captions"):
        dataset_from_tensors(data.images, captions[:2], resolution=32, step=16)
    with pytest.raises(DatasetError, match="does not match images"):
        dataset_from_tensors(data.images, captions, data.control_images[:, :16], resolution=32, step=16)


def test_folder_signature_changes_when_a_caption_changes(tmp_path):
    write_folder(tmp_path / "data", count=2)
    before = folder_signature(tmp_path / "data")
    assert folder_signature(tmp_path / "data") == before
    (tmp_path / "data" / "img1.txt").write_text("a longer, edited caption")
    assert folder_signature(tmp_path / "data") != before


# --- fingerprints ------------------------------------------------------------------------------------


def test_fingerprint_sees_values_shapes_dtypes_and_names():
    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(64, 64, generator=g), "a.bias": torch.randn(64, generator=g)}
    base = fingerprint_state_dict(weights)
    assert fingerprint_state_dict({k: v.clone() for k, v in weights.items()}) == base
    finetuned = {k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    assert fingerprint_state_dict(finetuned) != base
    assert fingerprint_state_dict({k: v.half() for k, v in weights.items()}) != base
    assert fingerprint_state_dict({"b.weight": weights["a.weight"], "a.bias": weights["a.bias"]}) != base
    big = torch.zeros(1 << 22)  # only a strided sample of a big tensor is read
    assert fingerprint_state_dict({"w": big}) != fingerprint_state_dict({"w": big.reshape(1024, -1)})
    patches = {"a.weight": [(1.0, (torch.ones(4, 2), torch.ones(2, 4)), 1.0, None, None)]}
    stronger = {"a.weight": [(0.5, (torch.ones(4, 2), torch.ones(2, 4)), 1.0, None, None)]}
    assert fingerprint_value(patches) == fingerprint_value({"a.weight": [(1.0, (torch.ones(4, 2), torch.ones(2, 4)),
                                                                          1.0, None, None)]})
    assert fingerprint_value(patches) != fingerprint_value(stronger)


@pytest.mark.min_torch
def test_fingerprints_read_fp8_weights_on_every_torch_and_keep_their_values():
    """Every fp8 checkpoint's weights are float8; torch 2.8's CPU implements no indexing for float8, and the strided
    sample's gather raised there (every fp8 run failed at its start on the oldest declared torch). The sample is read
    through an integer view of the same bytes, so every fingerprint is the one earlier releases made (these digests
    are the old code's on torch 2.14): caches already on users' disks stay hits."""
    steps = torch.arange(1 << 21) % 89 - 44  # small integers: exact in every dtype below, the same on every torch
    weights = {
        "fp32": (steps[:5000] / 8).float(),
        "bf16_transposed": steps[:7000].to(torch.bfloat16).reshape(70, 100).t(),
        "fp16_big": (steps / 16).half().reshape(1024, -1),
        "fp8": (steps[:9000] / 4).to(torch.float8_e4m3fn).reshape(90, 100),
        "fp8_transposed": (steps[:(1 << 20)] / 4).to(torch.float8_e4m3fn).reshape(1024, 1024).t(),
        "fp8_e5m2": (steps[:3000] / 2).to(torch.float8_e5m2),
    }
    digests = {
        "fp32": "26cbd8f89b289bde6d7a234af5839628b13cb6379d67f3743ffc3a5e1837cec6",
        "bf16_transposed": "d9f439b3a3aaa916a9a26d2e8d362917e44a7589bd589bc87e123e373bc233a9",
        "fp16_big": "e793842ba52ff08e592d1c73ca937872bd9cc0f4b4429bf45f2f57858b524f43",
        "fp8": "5e7255d9eae8ef0afe4140c26fd4f9df9c34c3c5b444b2d28d5e3455db11dbf6",
        "fp8_transposed": "ff0f0839a55dc6a1af733d44396499f490427a0648858bafa9597c46e4ff1523",
        "fp8_e5m2": "2dc0bf4e90b36312036270ffdb7abd78ba00843f49761ccfd974828c860b9eb7",
    }
    assert {name: fingerprint_state_dict({name: weight}) for name, weight in weights.items()} == digests
    assert fingerprint_state_dict(weights) == "00f71db96a8008354aabfca57d4382727c8a73c96f8ba1a7849b9b3a7886fa92"


# --- latent caching ----------------------------------------------------------------------------------


def run_latents(dataset, root, vae=None, **kwargs):
    vae = vae or CountingVae()
    cache, report = cache_latents(dataset, ShardStore(root, shard_bytes=kwargs.pop("shard_bytes", 1 << 20)), vae,
                                  "fp-vae", {"dtype": "float32"}, **kwargs)
    return cache, report, vae


def test_second_run_is_all_hits_with_zero_encoder_calls(tmp_path):
    data = generate_shapes(6, 64, seed=2)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=64, step=16)
    first, report, vae = run_latents(dataset, tmp_path / "cache")
    assert vae.calls == 6 and report.misses == 6 and report.hits == 0
    again, report, vae = run_latents(dataset, tmp_path / "cache")
    assert vae.calls == 0 and report.hits == 6 and report.misses == 0
    assert len(again) == 6 and again.buckets == {(64, 64): list(range(6))}
    for i in range(6):
        expected = CountingVae()(data.images[i : i + 1])[0]
        assert torch.equal(again.latent(i), expected)
        assert torch.equal(again.latent(i), first.latent(i))
        assert again.text_key(i) == text_key(data.captions[i])
    assert again.latent_channels == 4 and again.control(0) is None
    assert "6 hits / 0 encoded" in report.summary()


def test_a_latent_cache_the_disk_cannot_hold_is_refused_after_its_first_item_which_is_kept(tmp_path, monkeypatch):
    """The items still to encode, sized as the first one scaled by their pixels, against the free space on the cache's
    disk: where they would not fit (beyond 10 % for the estimate), a DiskFullError after one item, not after hours of
    encoding; the item encoded is kept (queued again, it is a hit). Where they fit, nothing is said."""
    from headroom.training.data import cache_store
    from headroom.training.data.files import DiskFullError

    data = generate_shapes(6, 64, seed=2)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=64, step=16)
    sizing, _, _ = run_latents(dataset, tmp_path / "sizing")
    one = sizing.latent(0).numel() * sizing.latent(0).element_size()
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 4 * one)  # 5 still to encode, room for 4.4
    vae = CountingVae()
    with pytest.raises(DiskFullError, match=r"^disk full: Cache Latents \(Headroom\) needs about 5\.0 KiB more for "
                       r"the 5 item\(s\) still to encode \(1\.0 KiB for one of 64x64\), and 4\.0 KiB is free on the "
                       r"disk of .*cache\. Free space on that disk, then queue again; what was encoded so far is "
                       r"kept\.$"):
        run_latents(dataset, tmp_path / "cache", vae)
    assert vae.calls == 1
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 5 * one)
    cache, report, vae = run_latents(dataset, tmp_path / "cache")
    assert report.hits == 1 and report.misses == 5 and vae.calls == 5 and len(cache) == 6
    # sized by pixels: each item at 64 px too is a quarter of one at 128 (5 x 4 + 6 x 1 = 26 KiB still to encode)
    large = generate_shapes(6, 128, seed=2)
    both = dataset_from_tensors(large.images, large.captions, resolution=128, step=16)
    both = dataclasses.replace(both, extra_resolutions=(64,))
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 22 * one)
    with pytest.raises(DiskFullError, match=r"needs about 26\.0 KiB more for the 11 item\(s\) still to encode \(4\.0 "
                       r"KiB for one of 128x128\), and 22\.0 KiB is free"):
        run_latents(both, tmp_path / "both")
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 24 * one)  # 26 within the estimate's 10 %
    assert len(run_latents(both, tmp_path / "both")[0]) == 12


def test_flip_caches_mirrored_variants_and_controls_at_bucket_size(tmp_path):
    data = generate_shapes(2, (48, 80), seed=3)  # 80 wide, 48 high: the (80, 48) bucket at 64 / 16
    dataset = dataset_from_tensors(data.images, data.captions, data.control_images, resolution=64, step=16, flip=True)
    cache, report, vae = run_latents(dataset, tmp_path / "cache")
    assert len(cache) == 4 and report.buckets == 1 and list(cache.buckets) == [(80, 48)]
    plain, mirrored = cache.latent(0), cache.latent(1)
    assert torch.equal(plain, CountingVae()(data.images[0:1])[0])
    assert torch.equal(mirrored, CountingVae()(data.images[0:1].flip(2))[0])
    assert torch.equal(cache.control(0), data.control_images[0])
    assert torch.equal(cache.control(1), data.control_images[0].flip(1))
    assert cache.text_key(0) == cache.text_key(1)


def test_control_as_latents_goes_through_the_encoder(tmp_path):
    data = generate_shapes(2, 32, seed=4)
    dataset = dataset_from_tensors(data.images, data.captions, data.control_images, resolution=32, step=16)
    cache, _, vae = run_latents(dataset, tmp_path / "cache", control_encoding="latents")
    assert vae.calls == 4 and cache.control_kind == "latents"
    assert torch.equal(cache.control(1), CountingVae()(data.control_images[1:2])[0])
    # Pixels and latents are different entries: switching encodes again.
    _, report, _ = run_latents(dataset, tmp_path / "cache", control_encoding="pixels")
    assert report.misses == 2


def test_key_covers_encoder_crop_and_bucket_settings(tmp_path):
    write_folder(tmp_path / "data", count=2, resolution=(64, 96))  # 96 wide: the 80x48 bucket, 5 px to crop
    root = tmp_path / "cache"
    run_latents(folder_dataset(tmp_path / "data"), root)
    for change, misses in [(dict(crop="random", seed=1), 1), (dict(resolution=48), 2), (dict(flip=True), 2)]:
        _, report, _ = run_latents(folder_dataset(tmp_path / "data", **change), root)
        assert report.misses >= misses, change
    other_encoder = cache_latents(folder_dataset(tmp_path / "data"), ShardStore(root), CountingVae(), "fp-other",
                                  {"dtype": "float32"})[1]
    assert other_encoder.misses == 2
    other_options = cache_latents(folder_dataset(tmp_path / "data"), ShardStore(root), CountingVae(), "fp-vae",
                                  {"dtype": "bfloat16"})[1]
    assert other_options.misses == 2
    assert run_latents(folder_dataset(tmp_path / "data"), root)[1].misses == 0


def test_editing_one_caption_reencodes_only_that_text(tmp_path):
    write_folder(tmp_path / "data", count=4)
    root = tmp_path / "cache"
    dataset = folder_dataset(tmp_path / "data")
    encoder = CountingTextEncoder()
    cache_text([i.caption for i in dataset.items], ShardStore(root / "text"), encoder, "fp-te", {})
    run_latents(dataset, root / "latents")
    assert len(encoder.calls) == 5  # 4 captions + the empty prompt

    (tmp_path / "data" / "img2.txt").write_text("an edited caption")
    edited = folder_dataset(tmp_path / "data")
    encoder = CountingTextEncoder()
    text, report = cache_text([i.caption for i in edited.items], ShardStore(root / "text"), encoder, "fp-te", {})
    assert encoder.calls == ["an edited caption"] and report.misses == 1 and report.hits == 4
    _, latent_report, vae = run_latents(edited, root / "latents")
    assert vae.calls == 0 and latent_report.hits == 4  # latents do not depend on captions
    cond = text.conditioning(text_key("an edited caption"))
    assert torch.equal(cond["cross_attn"], CountingTextEncoder()("an edited caption")["cross_attn"])
    assert set(text.empty_conditioning()) == {"cross_attn", "pooled_output"}
    with pytest.raises(KeyError, match="different datasets"):
        text.conditioning(text_key("never cached"))


def test_a_text_cache_the_disk_cannot_hold_is_refused_after_its_first_text_sized_by_tokens(tmp_path, monkeypatch):
    """An unpadded encoder's entry grows with its tokens, and the first text encoded is the empty prompt: the texts
    still to encode are sized as the first scaled by their token counts, so four captions of 4 tokens are 16 times
    one empty prompt of 1, not 4 times; where they would not fit, a DiskFullError after one text, which is kept.
    Without a token count (captions encoded with reference images) each is sized as the first."""
    from headroom.training.data import cache_store
    from headroom.training.data.files import DiskFullError

    calls = []

    def tokens(text):
        return 1 + len(text.split())

    def encoder(text):  # 1 KiB per token: [tokens, 256] float32
        calls.append(text)
        return {"cross_attn": torch.full((tokens(text), 256), float(len(text)))}

    captions = ["a red circle", "a blue square", "two green triangles", "one small star"]
    def run(**kwargs):
        return cache_text(captions, ShardStore(tmp_path / "text"), encoder, "fp-te", {}, **kwargs)

    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 8 * 1024)
    with pytest.raises(DiskFullError, match=r"^disk full: Cache Text \(Headroom\) needs about 16\.0 KiB more for the 4 "
                       r"text\(s\) still to encode \(1\.0 KiB for one of 1 token\), and 8\.0 KiB is free on the disk "
                       r"of .*text\. Free space on that disk, then queue again; what was encoded so far is kept\.$"):
        run(text_tokens=tokens)
    assert calls == [""]
    with pytest.raises(DiskFullError, match=r"needs about 4\.0 KiB more for the 4 text\(s\) still to encode \(1\.0 KiB "
                       r"for the first\), and 2\.0 KiB is free"):
        monkeypatch.setattr(cache_store, "free_bytes", lambda path: 2 * 1024)
        cache_text(captions, ShardStore(tmp_path / "other"), encoder, "fp-te", {})
    monkeypatch.setattr(cache_store, "free_bytes", lambda path: 15 * 1024)  # 16 within the estimate's 10 %
    calls.clear()
    cache, report = run(text_tokens=tokens)
    assert report.hits == 1 and report.misses == 4 and calls == captions
    assert cache.conditioning(text_key("two green triangles"))["cross_attn"].shape == (4, 256)
    # Past TOKEN_COUNT_SAMPLE texts an even sample is counted: 2 of 4 here (5 and 4 tokens), scaled to the 4 (18 KiB;
    # all counted, 17)
    monkeypatch.setattr(cache_store, "TOKEN_COUNT_SAMPLE", 2)
    counted = []
    longer = ["a big red circle", "a blue square", "two green triangles", "one small star"]
    with pytest.raises(DiskFullError, match=r"needs about 18\.0 KiB more for the 4 text\(s\)"):
        cache_text(longer, ShardStore(tmp_path / "sampled"), encoder, "fp-te", {},
                   text_tokens=lambda text: counted.append(text) or tokens(text))
    assert counted == ["", "a big red circle", "two green triangles"]  # the first, then every other one


def test_captions_encoded_with_their_reference_images_are_cached_per_item(tmp_path):
    """Qwen-Image-Edit's text path: one entry per (caption, reference image), found through each latent item's
    reference key; the same caption with another reference is another entry; a second run encodes nothing; the empty
    prompt stays text only."""
    from headroom.training.data.cache_store import item_conditioning

    write_folder(tmp_path / "data", count=4, controls=tmp_path / "controls")
    for i in range(4):  # one instruction for every item: only the reference tells them apart
        (tmp_path / "data" / f"img{i}.txt").write_text("make it red")
    dataset = folder_dataset(tmp_path / "data", control_folder=tmp_path / "controls")
    calls = []

    def with_reference(text, image):
        calls.append(text)
        return {"cross_attn": torch.cat([CountingTextEncoder()(text)["cross_attn"], image.mean().reshape(1, 1).expand(1, 8)])}

    def run(encoder):
        return cache_text([i.caption for i in dataset.items], ShardStore(tmp_path / "text"), encoder, "fp-te", {},
                          references=[i.control for i in dataset.items], encode_with_reference=with_reference,
                          reference_encoding="TextEncodeQwenImageEdit")

    text, report = run(CountingTextEncoder())
    latents = run_latents(dataset, tmp_path / "latents", control_encoding="latents")[0]
    assert text.per_reference and report.misses == 5 and calls == ["make it red"] * 4
    conds = [item_conditioning(text, latents, i)["cross_attn"] for i in range(4)]
    assert all(c.shape == (6, 8) for c in conds) and len({c[-1, 0].item() for c in conds}) == 4
    assert torch.equal(text.empty_conditioning()["cross_attn"], CountingTextEncoder()("")["cross_attn"])
    calls.clear()
    again, report = run(CountingTextEncoder())
    assert calls == [] and report.hits == 5
    plain = cache_text([i.caption for i in dataset.items], ShardStore(tmp_path / "text"), CountingTextEncoder(),
                       "fp-te", {})[0]
    assert not plain.per_reference and item_conditioning(plain, latents, 0)["cross_attn"].shape == (5, 8)
    with pytest.raises(DatasetError, match="needs a control image for every item"):
        cache_text(["a"], ShardStore(tmp_path / "text"), CountingTextEncoder(), "fp-te", {}, references=[None],
                   encode_with_reference=with_reference, reference_encoding="TextEncodeQwenImageEdit")


def _shard_files(root):
    return sorted((Path(root) / "shards").glob("*.safetensors"))


def _corrupt_entry(root, key):
    """Flip bytes inside one entry's latent tensor, leaving the file's header and size intact."""
    manifest = json.loads((Path(root) / "manifest.json").read_text())
    shard = Path(root) / "shards" / manifest["entries"][key]["shard"]
    raw = shard.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    start, end = header[f"{key}/latent"]["data_offsets"]
    position = 8 + header_len + (start + end) // 2
    shard.write_bytes(raw[:position] + bytes(b ^ 0xFF for b in raw[position : position + 4]) + raw[position + 4 :])


def test_corrupt_entry_is_detected_and_only_it_is_rebuilt(tmp_path):
    data = generate_shapes(5, 32, seed=5)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    root = tmp_path / "cache"
    cache, _, _ = run_latents(dataset, root)
    expected = [cache.latent(i).clone() for i in range(5)]
    _corrupt_entry(root, cache._items[2][0])

    rebuilt, report, vae = run_latents(dataset, root)
    assert vae.calls == 1 and report.misses == 1 and report.hits == 4
    assert any("checksum" in warning for warning in report.warnings)
    assert all(torch.equal(rebuilt.latent(i), expected[i]) for i in range(5))
    assert run_latents(dataset, root)[2].calls == 0  # healthy again


def test_truncated_shard_is_detected_and_its_entries_rebuilt(tmp_path):
    data = generate_shapes(6, 32, seed=6)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    root = tmp_path / "cache"
    # 256 bytes per entry (4 x 4 x 4 float32) and 600-byte shards: three entries per shard.
    run_latents(dataset, root, shard_bytes=600)
    shards = _shard_files(root)
    assert len(shards) >= 2
    manifest = json.loads((root / "manifest.json").read_text())["entries"]
    in_first = sum(1 for entry in manifest.values() if entry["shard"] == shards[0].name)
    shards[0].write_bytes(shards[0].read_bytes()[:-100])

    cache, report, vae = run_latents(dataset, root, shard_bytes=600)
    assert vae.calls == in_first and report.hits == 6 - in_first
    assert any("unreadable shard" in warning for warning in report.warnings)
    manifest = json.loads((root / "manifest.json").read_text())["entries"]
    assert {entry["shard"] for entry in manifest.values()} == {p.name for p in _shard_files(root)}
    assert all(torch.equal(cache.latent(i), CountingVae()(data.images[i : i + 1])[0]) for i in range(6))


class Cancelled(BaseException):
    """Stands for ComfyUI's InterruptProcessingException (also a BaseException)."""


def test_cancel_keeps_finished_entries_and_the_next_run_resumes(tmp_path):
    data = generate_shapes(8, 32, seed=7)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    root = tmp_path / "cache"
    vae = CountingVae()

    def cancel_after_three():
        if vae.calls == 3:
            raise Cancelled()

    with pytest.raises(Cancelled):
        run_latents(dataset, root, vae=vae, check_interrupt=cancel_after_three)
    manifest = json.loads((root / "manifest.json").read_text())
    assert len(manifest["entries"]) == 3  # what was finished is listed and complete
    assert not list((root / "shards").glob("*.tmp"))

    cache, report, vae = run_latents(dataset, root)
    assert report.hits == 3 and vae.calls == 5 and len(cache) == 8


def test_disk_full_is_a_clear_error_and_leaves_the_cache_valid(tmp_path, monkeypatch):
    from faults import disk_full_for, leftovers
    from headroom.training.data.files import DiskFullError

    data = generate_shapes(4, 32, seed=8)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    root = tmp_path / "cache"
    run_latents(dataset_from_tensors(data.images[:2], data.captions[:2], resolution=32, step=16), root)
    manifest_before = (root / "manifest.json").read_bytes()

    disk_full_for(monkeypatch, ".safetensors")  # the next shard's write meets a full disk (a real ENOSPC)
    with pytest.raises(DiskFullError, match="disk full: a cache shard could not be written to .*shards") as error:
        run_latents(dataset, root)
    assert "Free space" in str(error.value) and "needs about" in str(error.value)
    assert (root / "manifest.json").read_bytes() == manifest_before
    assert not leftovers(root)
    monkeypatch.undo()
    _, report, vae = run_latents(dataset, root)
    assert report.hits == 2 and vae.calls == 2


def test_unwritable_cache_folder_is_a_clear_error(tmp_path):
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    with pytest.raises(CacheStoreError, match="is a file, not a folder"):
        ShardStore(tmp_path / "cache")
    store = ShardStore(tmp_path / "blocked" / "latents")
    (tmp_path / "blocked").mkdir()
    (tmp_path / "blocked" / "latents").write_text("")  # created between open and write
    with pytest.raises(CacheStoreError, match="not writable"):
        store.check_writable()


def test_unreadable_manifest_means_rebuild_not_crash(tmp_path):
    data = generate_shapes(2, 32, seed=9)
    dataset = dataset_from_tensors(data.images, data.captions, resolution=32, step=16)
    run_latents(dataset, tmp_path / "cache")
    (tmp_path / "cache" / "manifest.json").write_text("{ not json")
    _, report, vae = run_latents(dataset, tmp_path / "cache")
    assert vae.calls == 2 and report.misses == 2
    assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["format"] == "headroom-cache-manifest"


def test_images_that_fail_to_decode_are_skipped_or_named(tmp_path):
    write_folder(tmp_path / "data", count=3)
    lenient = folder_dataset(tmp_path / "data", skip_bad=True)
    strict = folder_dataset(tmp_path / "data")
    # Broken after the datasets were made (their header checks passed): the decode is what fails.
    raw = (tmp_path / "data" / "img1.png").read_bytes()
    (tmp_path / "data" / "img1.png").write_bytes(raw[: len(raw) // 2])
    cache, report, vae = run_latents(lenient, tmp_path / "cache")
    assert len(cache) == 2 and [cache.name(i) for i in range(2)] == ["img0.png", "img2.png"]
    assert any("img1.png" in warning and warning.startswith("skipped") for warning in report.warnings)
    with pytest.raises(DatasetError, match="img1.png.*skip_bad"):
        run_latents(strict, tmp_path / "cache")


# --- reading -----------------------------------------------------------------------------------------


def test_bucket_batches_stay_in_one_bucket_and_are_deterministic(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    sizes = [(32, 32)] * 5 + [(96, 32)] * 3  # (H, W): the 32x32 and the 16 wide x 64 high bucket at 32 / 16
    for i, size in enumerate(sizes):
        pixels = (generate_shapes(1, size, seed=i).images[0].numpy() * 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(f"item {i}")
    cache, _, _ = run_latents(folder_dataset(folder, resolution=32, step=16), tmp_path / "cache")
    assert cache.buckets == {(16, 64): [5, 6, 7], (32, 32): [0, 1, 2, 3, 4]}

    batches = bucket_batches(cache, batch_size=2, seed=1, epoch=0)
    assert sorted(i for batch in batches for i in batch) == list(range(8))
    assert all(len({cache.bucket(i) for i in batch}) == 1 for batch in batches)
    assert sorted(len(batch) for batch in batches) == [1, 1, 2, 2, 2]
    assert batches == bucket_batches(cache, batch_size=2, seed=1, epoch=0)
    assert batches != bucket_batches(cache, batch_size=2, seed=1, epoch=1)
    for batch in batches:
        width, height = cache.bucket(batch[0])
        assert cache.latent(batch[0]).shape == (4, height // 8, width // 8)
    with pytest.raises(ValueError, match="batch_size"):
        bucket_batches(cache, batch_size=0, seed=0, epoch=0)
