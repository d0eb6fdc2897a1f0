"""A training dataset as a description: items with an image source, a caption and an optional control
image source. Pixels are loaded only when an item is cached (files) or are a view of a batch that
already exists (in-memory IMAGE), so a DATASET never holds a decoded copy of every image.

Everything that can be checked without decoding pixels is checked when the dataset is built, and each
problem names the file and the fix; with `skip_bad` the item is left out and listed in `warnings`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from . import public_module
from .buckets import CROP_MODES

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
CAPTION_EXTENSION = ".txt"
_SWAPPED_EXIF_ORIENTATIONS = (5, 6, 7, 8)  # rotated by 90 degrees: width and height trade places


class DatasetError(ValueError):
    """A problem with the dataset's files or inputs; the message names the file and the fix."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


class FileImage:
    """An image file, decoded on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def describe(self) -> str:
        return str(self.path)

    def size(self) -> tuple[int, int]:
        """(width, height) as the image will be loaded (EXIF rotation applied); reads the header only."""
        with Image.open(self.path) as img:
            width, height = img.size
            if img.getexif().get(0x0112) in _SWAPPED_EXIF_ORIENTATIONS:
                return height, width
            return width, height

    def check(self) -> None:
        """Raise if the file is not an image PIL can parse (header and, where cheap, structure)."""
        with Image.open(self.path) as img:
            img.verify()

    def load(self) -> torch.Tensor:
        """[H, W, 3] float32 0..1, EXIF rotation applied (as ComfyUI's LoadImage does)."""
        with Image.open(self.path) as img:
            img = ImageOps.exif_transpose(img)
            if img.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit grey: convert("RGB") would clip at 255
                grey = np.asarray(img, dtype=np.float32) / 65535.0
                array = np.repeat(grey[..., None], 3, axis=-1)
            else:
                array = np.asarray(img.convert("RGB"), dtype=np.float32) / 255.0
        return torch.from_numpy(array.copy())

    def digest(self) -> str:
        """sha256 of the file's bytes."""
        hasher = hashlib.sha256()
        with open(self.path, "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                hasher.update(chunk)
        return hasher.hexdigest()


class TensorImage:
    """One image of an in-memory IMAGE batch (a view, not a copy)."""

    def __init__(self, pixels: torch.Tensor, label: str):
        self.pixels = pixels
        self.label = label

    def describe(self) -> str:
        return self.label

    def size(self) -> tuple[int, int]:
        return int(self.pixels.shape[1]), int(self.pixels.shape[0])

    def check(self) -> None:
        pass  # validated as a whole batch when the dataset was built

    def load(self) -> torch.Tensor:
        return self.pixels.to(torch.float32)

    def digest(self) -> str:
        pixels = self.pixels.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return hashlib.sha256(pixels.numpy().tobytes()).hexdigest()


ImageSource = FileImage | TensorImage


@dataclass(frozen=True)
class DatasetItem:
    name: str  # shown in messages: a file name or "image 3"
    caption: str
    image: ImageSource
    control: ImageSource | None = None


@dataclass(frozen=True)
class Dataset:
    """What to cache and how: the items plus the bucketing choices that apply to all of them."""

    items: tuple[DatasetItem, ...]
    resolution: int
    step: int
    crop: str = "center"
    flip: bool = False
    seed: int = 0
    skip_bad: bool = False
    warnings: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if not self.items:
            raise DatasetError("the dataset has no items")
        if self.crop not in CROP_MODES:
            raise DatasetError(f"crop must be one of {CROP_MODES}, got {self.crop!r}")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def has_control(self) -> bool:
        return self.items[0].control is not None


def _images_in(folder: Path) -> dict[str, Path]:
    """stem -> path of every supported image directly in `folder` (hidden files ignored)."""
    return {
        path.stem: path
        for path in sorted(folder.iterdir())
        if path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_EXTENSIONS
    }


def dataset_from_folder(
    folder: Path,
    control_folder: Path | None = None,
    *,
    resolution: int,
    step: int,
    crop: str = "center",
    flip: bool = False,
    seed: int = 0,
    skip_bad: bool = False,
) -> Dataset:
    """Images in `folder` with same-name `.txt` captions; control images in `control_folder` matched by
    file name stem (any supported extension) and of the same size as their image."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {folder} does not exist or is not a folder")
    if control_folder is not None and not Path(control_folder).is_dir():
        raise DatasetError(f"control folder {control_folder} does not exist or is not a folder")
    controls = _images_in(Path(control_folder)) if control_folder is not None else {}

    items, problems = [], []
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix.lower() == CAPTION_EXTENSION:
            continue
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            problems.append(
                f"{path}: unsupported file type {path.suffix!r} (supported: {', '.join(IMAGE_EXTENSIONS)}); "
                "move it out of the dataset folder"
            )
            continue
        problem = _check_item(path, controls, control_folder)
        if problem:
            problems.append(problem)
            continue
        caption = path.with_suffix(CAPTION_EXTENSION).read_text(encoding="utf-8").strip()
        control = FileImage(controls[path.stem]) if control_folder is not None else None
        items.append(DatasetItem(name=path.name, caption=caption, image=FileImage(path), control=control))

    if problems and not skip_bad:
        raise DatasetError(
            f"{len(problems)} problem(s) in dataset folder {folder} (fix them, or enable skip_bad to leave "
            "those items out):\n- " + "\n- ".join(problems)
        )
    if not items:
        raise DatasetError(
            f"no usable images in {folder}: put images ({', '.join(IMAGE_EXTENSIONS)}) there, each with a "
            f"same-name {CAPTION_EXTENSION} caption file"
            + (" (skipped:\n- " + "\n- ".join(problems) + ")" if problems else "")
        )
    return Dataset(
        items=tuple(items), resolution=resolution, step=step, crop=crop, flip=flip, seed=seed,
        skip_bad=skip_bad, warnings=tuple(f"skipped {problem}" for problem in problems),
    )


def _check_item(path: Path, controls: dict[str, Path], control_folder: Path | None) -> str | None:
    """A message naming the problem with this item and its fix, or None if it is usable."""
    caption_path = path.with_suffix(CAPTION_EXTENSION)
    if not caption_path.is_file():
        return f"{path}: no caption file; write the caption into {caption_path}"
    try:
        caption_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        return f"{caption_path}: caption cannot be read as UTF-8 text ({error}); re-save it as UTF-8"
    image = FileImage(path)
    try:
        image.check()
        size = image.size()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as error:
        return f"{path}: unreadable or corrupt image ({error}); re-export it or remove it"
    if control_folder is None:
        return None
    if path.stem not in controls:
        return f"{path}: no control image named {path.stem}.* in {control_folder}; add one or remove the image"
    control = FileImage(controls[path.stem])
    try:
        control.check()
        control_size = control.size()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as error:
        return f"{control.path}: unreadable or corrupt control image ({error}); re-export it or remove it"
    if control_size != size:
        return (
            f"{control.path}: control image is {control_size[0]}x{control_size[1]} but its image {path.name} is "
            f"{size[0]}x{size[1]}; resize the control image to match"
        )
    return None


def split_captions(captions: str) -> list[str]:
    """One caption per line; a trailing newline does not make an extra (empty) caption."""
    text = captions.replace("\r\n", "\n").rstrip("\n")
    return [line.strip() for line in text.split("\n")] if text else []


def dataset_from_tensors(
    images: torch.Tensor,
    captions: list[str],
    control_images: torch.Tensor | None = None,
    *,
    resolution: int,
    step: int,
    crop: str = "center",
    flip: bool = False,
    seed: int = 0,
) -> Dataset:
    """Items from an IMAGE batch [N, H, W, 3] with one caption per image and an optional control batch."""
    if images.ndim != 4 or images.shape[-1] != 3:
        raise DatasetError(f"images must be an IMAGE batch [N, H, W, 3], got shape {tuple(images.shape)}")
    if len(captions) != images.shape[0]:
        raise DatasetError(
            f"{images.shape[0]} images but {len(captions)} captions; give exactly one caption per line, "
            "in the order of the images"
        )
    if control_images is not None:
        if control_images.ndim != 4 or control_images.shape[-1] != 3:
            raise DatasetError(
                f"control_images must be an IMAGE batch [N, H, W, 3], got shape {tuple(control_images.shape)}"
            )
        if control_images.shape[:3] != images.shape[:3]:
            raise DatasetError(
                f"control_images batch {tuple(control_images.shape[:3])} does not match images "
                f"{tuple(images.shape[:3])} (count, height, width); give one control image of the same size "
                "per image"
            )
    items = tuple(
        DatasetItem(
            name=f"image {index}",
            caption=captions[index],
            image=TensorImage(images[index], f"image {index} of the IMAGE batch"),
            control=None if control_images is None
            else TensorImage(control_images[index], f"control image {index} of the control IMAGE batch"),
        )
        for index in range(images.shape[0])
    )
    return Dataset(items=items, resolution=resolution, step=step, crop=crop, flip=flip, seed=seed)


def folder_signature(*folders: Path | None) -> str:
    """A cheap digest of the folders' listings (names, sizes, mtimes): changes when any file changes."""
    hasher = hashlib.sha256()
    for folder in folders:
        if folder is None or not Path(folder).is_dir():
            hasher.update(b"-")
            continue
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file():
                stat = entry.stat()
                hasher.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return hasher.hexdigest()
