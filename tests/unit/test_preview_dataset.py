"""Preview Dataset's engine (training/data/preview.py): each preview is exactly the crop Cache Latents encodes (random
crops, decode reduction, EXIF rotation, masks from files and alpha), the batch puts every bucket shape on one
canvas, and an unreadable item is named, not raised. The node in ComfyUI: tests/comfy/test_cache_nodes.py."""
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.data.cache_store import ShardStore, cache_latents
from headroom.training.data.dataset import DatasetError, dataset_from_folder
from headroom.training.data.preview import (CANVAS_GREY, MASKED_OUT_BRIGHTNESS, PREVIEW_SIDE, preview_batch,
                                            preview_items, preview_lines)
from test_cache_store import CountingVae


class RecordingVae(CountingVae):
    """CountingVae that keeps the pixels it was given: what Cache Latents encodes."""

    def __init__(self):
        super().__init__()
        self.samples = []

    def __call__(self, pixels):
        self.samples.append(pixels[0].clone())
        return super().__call__(pixels)


def write(folder: Path, name: str, size: tuple[int, int], caption: str, alpha: bool = False, seed: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (size[1], size[0], 4 if alpha else 3), dtype=np.uint8)
    if alpha:
        pixels[..., 3] = 0
        pixels[: size[1] // 2, :, 3] = 255  # the top half opaque
    Image.fromarray(pixels).save(folder / name)
    (folder / f"{Path(name).stem}.txt").write_text(caption, encoding="utf-8")


def test_each_preview_is_the_crop_cache_latents_encodes(tmp_path):
    images, masks = tmp_path / "set", tmp_path / "masks"
    write(images, "wide.png", (150, 70), "ohwx, a wide one")
    write(images, "tall.jpg", (60, 170), "a tall one", seed=1)
    write(images, "large.png", (400, 300), "decoded reduced", seed=2)  # reduce_factor > 1 at resolution 64
    write(images, "cut.png", (90, 90), "a cut-out", alpha=True, seed=3)
    masks.mkdir()
    Image.fromarray(np.tile(np.linspace(0, 255, 150, dtype=np.uint8), (70, 1))).save(masks / "wide.png")
    dataset = dataset_from_folder(images, resolution=64, step=16, crop="random", seed=7, mask_folder=masks,
                                  transparency="loss_mask")
    previews = preview_items(dataset, 0, 16)
    vae = RecordingVae()
    cache, _ = cache_latents(dataset, ShardStore(tmp_path / "cache"), vae, "vae", {})
    assert [p.name for p in previews] == [item.name for item in dataset.items]
    for index, preview in enumerate(previews):
        encoded = vae.samples[index]
        assert torch.equal(preview.pixels, encoded), preview.name  # the same crop, bit for bit
        assert tuple(reversed(encoded.shape[:2])) == preview.bucket
        has_mask = cache.mask(index) is not None
        assert (preview.mask is not None) == has_mask, preview.name
        if has_mask:  # the mask the cache averages per latent cell
            pooled = torch.nn.functional.avg_pool2d(preview.mask[None, None], 8)[0]
            torch.testing.assert_close(pooled, cache.mask(index))

    lines = preview_lines(previews)
    assert lines[0].startswith("0: cut.png (") and ", mask: 50% learned): a cut-out" in lines[0]
    assert any(line.startswith("3: wide.png (") and ": ohwx, a wide one" in line for line in lines)
    assert preview_items(dataset, 2, 16)[0].index == 2 and len(preview_items(dataset, 2, 1)) == 1


def test_the_batch_puts_every_bucket_on_one_canvas_and_darkens_what_masks_leave_out(tmp_path):
    images = tmp_path / "set"
    write(images, "a.png", (128, 64), "wide")
    write(images, "b.png", (64, 128), "tall", seed=1)
    write(images, "c.png", (64, 64), "square, half opaque", alpha=True, seed=2)
    dataset = dataset_from_folder(images, resolution=64, step=16, transparency="loss_mask")
    previews = preview_items(dataset, 0, 3)
    buckets = [p.bucket for p in previews]
    width, height = max(b[0] for b in buckets), max(b[1] for b in buckets)
    batch = preview_batch(previews)
    assert batch.shape == (3, height, width, 3) and max(width, height) <= PREVIEW_SIDE
    wide = previews[0]
    top = (height - wide.bucket[1]) // 2
    assert torch.equal(batch[0, top:top + wide.bucket[1], :wide.bucket[0]], wide.pixels)  # unscaled: fits already
    assert batch[0, 0].eq(CANVAS_GREY).all()  # above the wide crop: the canvas
    cut = previews[2]
    plain = preview_batch(previews, show_masks=False)
    top, left = (height - cut.bucket[1]) // 2, (width - cut.bucket[0]) // 2
    inside = (2, slice(top, top + cut.bucket[1]), slice(left, left + cut.bucket[0]))
    torch.testing.assert_close(plain[inside], cut.pixels)
    torch.testing.assert_close(batch[inside], cut.pixels * (MASKED_OUT_BRIGHTNESS + (1 - MASKED_OUT_BRIGHTNESS) *
                                                            cut.mask[..., None]))
    assert cut.mask[0].eq(1).all() and cut.mask[-1].eq(0).all()  # the top half opaque: learned

    big = dataset_from_folder(images, resolution=2048, step=64)  # buckets past PREVIEW_SIDE: scaled to fit
    assert max(preview_batch(preview_items(big, 0, 3)).shape[1:3]) == PREVIEW_SIDE


def test_an_unreadable_item_is_named_and_the_others_shown(tmp_path):
    images = tmp_path / "set"
    write(images, "good.png", (64, 64), "fine")
    write(images, "bad.png", (64, 64), "broken", seed=1)
    dataset = dataset_from_folder(images, resolution=64, step=16)
    (images / "bad.png").write_bytes(b"not a png any more")
    previews = preview_items(dataset, 0, 2)
    assert previews[0].pixels is None and previews[1].pixels is not None
    assert preview_lines(previews)[0].startswith("0: bad.png: not shown: ")
    assert preview_batch(previews).shape[0] == 1
    with pytest.raises(DatasetError, match="no item shown could be read"):
        preview_batch(previews[:1])


@pytest.mark.parametrize("upscale", [True, False])
def test_small_images_are_enlarged_and_named_or_trained_in_smaller_buckets(tmp_path, upscale):
    """A 40 px image at resolution 64: enlarged 1.6x to its bucket and named in Cache Latents' notes, or (upscale off)
    cached in the 32 px bucket it covers; the larger image's bucket is the same either way, and the preview is the
    encoded crop in both."""
    from dataclasses import replace

    images = tmp_path / "set"
    write(images, "small.png", (40, 40), "a small one")
    write(images, "large.png", (200, 100), "a large one", seed=1)
    dataset = dataset_from_folder(images, resolution=64, step=16)
    dataset = dataset if upscale else replace(dataset, upscale=False)
    vae = RecordingVae()
    cache, report = cache_latents(dataset, ShardStore(tmp_path / "cache"), vae, "vae", {})
    previews = preview_items(dataset, 0, 2)
    assert [p.name for p in previews] == ["large.png", "small.png"]
    assert [p.bucket for p in previews] == [(80, 48), (64, 64) if upscale else (32, 32)]
    assert [cache.bucket(i) for i in range(2)] == [p.bucket for p in previews]
    for index, preview in enumerate(previews):
        assert torch.equal(preview.pixels, vae.samples[index]), preview.name
    assert preview_lines(previews)[1] == ("1: small.png (64x64, enlarged 1.60x): a small one" if upscale
                                          else "1: small.png (32x32): a small one")
    enlarged = [note for note in report.notes if "smaller than their bucket" in note]
    assert enlarged == ([("1 image(s) smaller than their bucket, enlarged 1.25x or more (most: small.png, 1.60x); "
                          "enlarged images teach softness: turn upscale_small_images off on the dataset node to "
                          "train them in smaller buckets, or lower resolution")] if upscale else [])
