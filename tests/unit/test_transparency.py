"""Images with transparency on Dataset From Folder (training/data/dataset.py, `transparency`): which images have
an alpha channel; ignore reads them as Load Image does; loss_mask caches their alpha (times a mask file) as the loss
mask, with the image's crop, flip, EXIF rotation and decode reduction; white / black put them on that background.
Images without transparency are read alike in every mode, so their cache entries are shared. The node's text and a
run on ComfyUI's tiny model: tests/comfy/test_cache_nodes.py."""
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from headroom.training.data.cache_store import ShardStore, cache_latents
from headroom.training.data.dataset import AlphaMask, DatasetError, FileImage, dataset_from_folder
from test_cache_store import CountingVae


def cut_out(size=(48, 32)) -> np.ndarray:
    """RGBA [H, W, 4]: a red square (opaque) on transparent pixels storing green, a half-transparent bottom row band."""
    width, height = size
    pixels = np.zeros((height, width, 4), np.uint8)
    pixels[..., 1] = 200  # the colour under the transparent pixels: what `ignore` trains on
    pixels[8:24, 8:24] = (220, 10, 10, 255)
    pixels[-8:, :, 3] = 128
    return pixels


def write(folder: Path, name: str, pixels: np.ndarray, caption: str = "a cut-out", **save) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    Image.fromarray(pixels).save(path, **save)
    (folder / f"{path.stem}.txt").write_text(caption, encoding="utf-8")
    return path


def test_images_with_transparency_are_found_by_their_header(tmp_path):
    rgba = write(tmp_path, "rgba.png", cut_out())
    grey_alpha = write(tmp_path, "la.png", cut_out()[..., [0, 3]])  # LA
    opaque = write(tmp_path, "rgb.png", cut_out()[..., :3])
    palette = tmp_path / "palette.png"
    Image.fromarray(cut_out()[..., :3]).convert("P").save(palette, transparency=0)  # a transparent palette entry
    webp = write(tmp_path, "cut.webp", cut_out(), lossless=True)
    jpeg = write(tmp_path, "photo.jpg", cut_out()[..., :3])
    assert [FileImage(p).has_alpha() for p in (rgba, grey_alpha, palette, webp)] == [True] * 4
    assert [FileImage(p).has_alpha() for p in (opaque, jpeg)] == [False, False]


@pytest.mark.parametrize("repeat_folder", [False, True])
def test_listing_reads_each_images_transparency_from_its_one_opening(tmp_path, monkeypatch, repeat_folder):
    """Dataset From Folder opens each image once (its size, transparency and structure on one header read): an
    opening is a header parse, and on Windows an antivirus scan. What it finds is what has_alpha() says, in a
    repeat folder (kohya's layout) too."""
    folder = tmp_path / "set"
    images = folder / "3_ohwx" if repeat_folder else folder
    write(images, "rgba.png", cut_out())
    write(images, "la.png", cut_out()[..., [0, 3]])
    write(images, "rgb.png", cut_out()[..., :3])
    Image.fromarray(cut_out()[..., :3]).convert("P").save(images / "palette.png", transparency=0)
    (images / "palette.txt").write_text("a palette", encoding="utf-8")
    write(images, "photo.jpg", cut_out()[..., :3])
    masks = tmp_path / "masks" / "3_ohwx" if repeat_folder else tmp_path / "masks"
    masks.mkdir(parents=True)
    Image.fromarray(np.full((32, 48), 255, np.uint8)).save(masks / "rgb.png")  # a mask file: opened once itself
    opened = []
    real_open = FileImage._open
    monkeypatch.setattr(FileImage, "_open", lambda self: (opened.append(self.path.parent.name + "/" + self.path.name),
                                                          real_open(self))[1])
    dataset = dataset_from_folder(folder, resolution=32, step=16, transparency="loss_mask", mask_folder=masks.parent
                                  if repeat_folder else masks)
    names = ("la.png", "palette.png", "photo.jpg", "rgb.png", "rgba.png")
    assert sorted(opened) == sorted([f"{images.name}/{name}" for name in names] + [f"{masks.name}/rgb.png"])
    masked = {item.image.path.name for item in dataset.items if isinstance(item.mask, AlphaMask)}
    monkeypatch.undo()
    assert masked == {item.image.path.name for item in dataset.items if item.image.has_alpha()}
    assert masked == {"rgba.png", "la.png", "palette.png"} and dataset.alpha_images == 3


def test_ignore_drops_alpha_and_a_background_composites_exactly(tmp_path):
    pixels = cut_out()
    path = write(tmp_path, "cut.png", pixels)
    stored = torch.from_numpy(pixels[..., :3].astype(np.float32) / 255)
    torch.testing.assert_close(FileImage(path).load(), stored, rtol=0, atol=0)  # as Load Image reads it

    alpha = pixels[..., 3:].astype(np.float32) / 255
    for background in ((255, 255, 255), (0, 0, 0)):
        composite = pixels[..., :3] * alpha + np.array(background) * (1 - alpha)
        loaded = FileImage(path, background=background).load()
        # PIL composites in 8 bits: within one level of the exact blend
        assert (loaded * 255 - torch.from_numpy(composite.astype(np.float32))).abs().max() <= 1.0
    white = FileImage(path, background=(255, 255, 255)).load()
    assert white[0, 0].tolist() == [1.0, 1.0, 1.0] and white[12, 12].tolist() == stored[12, 12].tolist()

    torch.testing.assert_close(FileImage(path).load_alpha()[..., 0], torch.from_numpy(alpha[..., 0]))
    opaque = write(tmp_path, "rgb.png", pixels[..., :3])
    assert FileImage(opaque).load_alpha().min() == 1.0  # no transparency: opaque everywhere
    # Another background is other pixels: another digest (and so another cache entry); none keeps the file's hash
    digests = {FileImage(path).digest(), FileImage(path, background=(255, 255, 255)).digest(),
               FileImage(path, background=(0, 0, 0)).digest()}
    assert len(digests) == 3


def test_the_alpha_follows_exif_rotation_and_decode_reduction(tmp_path):
    pixels = cut_out((64, 32))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: 64x32 stored, 32x64 shown
    path = write(tmp_path, "rotated.png", pixels, exif=exif)
    image = FileImage(path)
    assert image.size() == (32, 64)
    for reduce in (1, 2, 4):
        assert image.load_alpha(reduce).shape == image.load(reduce).shape
    rotated = np.rot90(pixels[..., 3], k=-1)  # orientation 6: turned clockwise to show
    torch.testing.assert_close(image.load_alpha()[..., 0], torch.from_numpy(rotated.astype(np.float32) / 255))


def test_the_modes_on_a_folder_and_a_mask_file_multiplies_the_alpha(tmp_path):
    images, masks = tmp_path / "set", tmp_path / "set_masks"
    write(images, "cut.png", cut_out())
    write(images, "photo.png", cut_out()[..., :3])
    masks.mkdir()
    left = np.zeros((32, 48), np.uint8)
    left[:, :24] = 255
    Image.fromarray(left).save(masks / "cut.png")

    def read(transparency, **options):
        return dataset_from_folder(images, resolution=32, step=16, transparency=transparency, **options)

    ignored = read("ignore")
    assert ignored.alpha_images == 1 and ignored.transparency == "ignore"
    assert all(item.mask is None and item.image.background is None for item in ignored.items)

    masked = read("loss_mask")
    cut, photo = masked.items
    assert isinstance(cut.mask, AlphaMask) and cut.mask.mask is None and photo.mask is None
    assert "the alpha channel of" in cut.mask.describe() and cut.mask.describe().endswith("cut.png")
    torch.testing.assert_close(cut.mask.load()[..., 0], torch.from_numpy(cut_out()[..., 3] / 255).float())

    both = read("loss_mask", mask_folder=masks).items[0]
    assert " times mask " in both.mask.describe() and both.mask.describe().endswith("cut.png")
    expected = cut_out()[..., 3] / 255 * (left / 255)
    torch.testing.assert_close(both.mask.load()[..., 0], torch.from_numpy(expected).float())
    assert both.mask.digest() != cut.mask.digest()

    white = read("white")
    assert white.items[0].image.background == (255, 255, 255) and white.items[1].image.background is None
    assert white.items[1].image.digest() == ignored.items[1].image.digest()  # no transparency: the same image
    with pytest.raises(DatasetError, match=r"transparency must be one of ignore, loss_mask, white, black, got 'grey'"):
        read("grey")


def test_cached_alpha_masks_take_the_images_crop_and_flip_and_opaque_images_share_entries(tmp_path):
    images = tmp_path / "set"
    write(images, "cut.png", cut_out((80, 48)))  # the (80, 48) bucket at 64 / 16: no crop
    write(images, "photo.png", cut_out((80, 48))[..., :3])
    store = ShardStore(tmp_path / "cache")

    def cache(transparency):
        dataset = dataset_from_folder(images, resolution=64, step=16, flip=True, transparency=transparency)
        return cache_latents(dataset, store, CountingVae(), "vae", {})

    plain, _ = cache("ignore")
    assert not plain.has_masks
    masked, report = cache("loss_mask")
    assert report.misses == 2  # the cut-out and its mirror; the opaque photo's two entries are reused
    alpha = torch.from_numpy(cut_out((80, 48))[..., 3].astype(np.float32) / 255)
    expected = torch.nn.functional.avg_pool2d(alpha[None, None], 8)[0]
    torch.testing.assert_close(masked.mask(0), expected)
    torch.testing.assert_close(masked.mask(1), expected.flip(-1))
    assert masked.mask(2) is None and masked.mask(3) is None  # the opaque photo is learned whole
    torch.testing.assert_close(masked.latent(0), plain.latent(0))  # the same pixels, now with a mask

    white, report = cache("white")
    assert report.misses == 2 and not white.has_masks
    # The transparent green became white: the encoded colour changed only where the image was transparent
    changed = (white.latent(0) - plain.latent(0)).abs().amax(0)
    assert changed[0, 0] > 0.5 and changed[2, 2] == 0  # corner: transparent; (16..23, 16..23): inside the square
    torch.testing.assert_close(white.latent(2), plain.latent(2))


def test_jfif_and_avif_images_are_read(tmp_path):
    """Windows browsers save JPEGs as .jfif; AVIF (where Pillow decodes it) with its alpha: both read as any image."""
    from PIL import features

    pixels = cut_out()
    write(tmp_path, "photo.jfif", pixels[..., :3], quality=95, format="JPEG")
    names = ["photo.jfif"]
    if features.check("avif"):  # the venv's Pillow (13) has it; an older one reports .avif as unsupported
        write(tmp_path, "cut.avif", pixels, quality=100)
        names.insert(0, "cut.avif")
    dataset = dataset_from_folder(tmp_path, resolution=32, step=16, transparency="loss_mask")
    assert [item.name for item in dataset.items] == names
    assert dataset.alpha_images == len(names) - 1
    assert FileImage(tmp_path / "photo.jfif").load().shape == (32, 48, 3)
