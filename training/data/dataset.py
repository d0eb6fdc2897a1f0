"""A training dataset as a description: items with an image source, a caption and an optional control
image source. Pixels are loaded only when an item is cached (files) or are a view of a batch that
already exists (in-memory IMAGE), so a DATASET never holds a decoded copy of every image.

Everything that can be checked without decoding pixels is checked when the dataset is built, and each
problem names the file and the fix; with `skip_bad` the item is left out and listed in `left_out`. A caption with no
image of its name is a warning (`notes`), never an error.

Dataset files are untrusted: a file (or symlink) must resolve inside the folders datasets may be read from
(`roots`; the nodes pass ComfyUI's input folder and the server owner's HEADROOM_DATASET_ROOTS), captions are
read only up to CAPTION_MAX_BYTES, and an image whose header claims more than MAX_IMAGE_PIXELS (a decompression
bomb, or simply too large) is refused by its header, before any pixel is decoded. Large images are decoded
reduced to what their bucket needs (JPEG draft scaling, then an integer box reduce), never at full size in float.
"""
from __future__ import annotations

import codecs
import hashlib
import math
import os
import re
import struct
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, PngImagePlugin, UnidentifiedImageError, features

from .. import os_compat, public_module
from .buckets import CROP_MODES, check_bucket_sides
from .files import UntrustedFileError, display_path, relative_text, resolve_inside

MIN_RESOLUTION, MAX_RESOLUTION = 64, 4096  # the dataset nodes' resolution input's range
# `.jfif`: JPEGs as Windows browsers save them; `.avif` where this Pillow decodes it (11.3+ with libavif), else such
# files are reported as unsupported, naming the extensions that are.
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".jfif", ".webp", ".bmp", ".tif", ".tiff") + (
    (".avif",) if features.check("avif") else ())
CAPTION_EXTENSION = ".txt"
# Caption files by preference: `.txt`, else `.caption` (kohya sd-scripts' default caption_extension), so a dataset
# captioned for kohya reads as it is. An image with both reads its `.txt`.
CAPTION_EXTENSIONS = (CAPTION_EXTENSION, ".caption")
# A missing caption's other fix on the folder nodes: their trigger word captions files without one (default_caption)
MISSING_CAPTION_HINT = " (or set trigger_word: files without a caption file are then captioned with it alone)"
# Files other trainers keep beside the images, passed over rather than reported as unsupported: kohya sd-scripts'
# latent and text-encoder caches (`img.npz`, `img_1024x1024_sdxl.npz`, `img_te.npz`).
OTHER_TRAINERS_FILES = (".npz",)
_SWAPPED_EXIF_ORIENTATIONS = (5, 6, 7, 8)  # rotated by 90 degrees: width and height trade places
MAX_IMAGE_PIXELS = 12800 * 12800  # ~164 Mpx: below PIL's own bomb limit (2 x 89.5 Mpx), above any real photo
CAPTION_MAX_BYTES = 1 << 20
REDUCING_GAP = 2  # decode at least twice the size the bucket needs; the antialiased resize does the rest
# What Dataset From Folder does with images that have an alpha channel: `ignore` reads them as ComfyUI's Load Image
# does (the colours stored under transparent pixels, alpha dropped); `loss_mask` learns only their opaque pixels
# (kohya's alpha_mask); `white` / `black` put them on that background first.
TRANSPARENCY_MODES = ("ignore", "loss_mask", "white", "black")
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}


class DatasetError(ValueError):
    """A problem with the dataset's files or inputs; the message names the file and the fix."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


# The chunks of a PNG where PIL's getexif finds an orientation: eXIf, and text chunks ("Raw profile type exif", XMP)
_PNG_METADATA_CHUNKS = (b"eXIf", b"tEXt", b"zTXt", b"iTXt")


def _orientation(img: Image.Image) -> int | None:
    """The EXIF orientation `ImageOps.exif_transpose` applies once the image is loaded, read without decoding it.
    PIL's PngImageFile.getexif decodes the whole image when no eXIf chunk comes before the pixel data (metadata may
    follow it): 0.2 s for a 12 Mpx photo, each time a dataset of PNGs is listed or cached. So a PNG's metadata chunks,
    wherever they are, go through PIL's own chunk parser here with the pixel data skipped: PIL has no call for that."""
    if not isinstance(img, PngImagePlugin.PngImageFile):
        return img.getexif().get(ExifTags.Base.Orientation)
    fp = img.fp  # the file Image.open read the header from (no second open); its position is put back after
    resume_at = fp.tell()
    fp.seek(8)  # the 8-byte PNG signature, which Image.open checked
    stream = PngImagePlugin.PngStream(fp)
    try:
        while True:  # every pass moves on by at least a chunk's 12 header and CRC bytes: it ends at the file's end
            cid, pos, length = stream.read()
            if cid == b"IEND":
                break
            if cid in _PNG_METADATA_CHUNKS:
                stream.call(cid, pos, length)
            else:
                fp.seek(length, os.SEEK_CUR)
            fp.seek(4, os.SEEK_CUR)  # the chunk's CRC
    except (struct.error, SyntaxError, EOFError, UnicodeDecodeError):  # a truncated or odd tail: PIL's load stops
        pass                                                           # reading chunks there too
    finally:
        fp.seek(resume_at)
    img.info = {**img.info, **stream.im_info}
    return Image.Image.getexif(img).get(ExifTags.Base.Orientation)  # the base class's: from `info` alone


def _shown_size(img: Image.Image) -> tuple[int, int]:
    width, height = img.size
    return (height, width) if _orientation(img) in _SWAPPED_EXIF_ORIENTATIONS else (width, height)


def _has_alpha(img: Image.Image) -> bool:
    """Whether an opened image has transparency: an alpha channel, or a palette / colour marked transparent."""
    return img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info


class FileImage:
    """An image file, decoded on demand. It is read only where it resolves inside `roots` (default: its folder).
    `background` (RGB 0..255): transparent pixels are put on it when loaded (else the alpha channel is dropped, as
    ComfyUI's Load Image does)."""

    def __init__(self, path: Path, roots: tuple[Path, ...] | None = None,
                 background: tuple[int, int, int] | None = None):
        self.path = Path(path)
        self.roots = tuple(roots) if roots else (self.path.parent,)
        self.background = background

    def describe(self) -> str:
        return display_path(self.path)

    def _real(self) -> Path:
        real = resolve_inside(self.path, self.roots, "image")  # a symlink leading outside is refused
        if not real.is_file():  # a FIFO would block the reader, a device never end
            raise DatasetError(f"{self.describe()}: not a regular file (a broken symlink, a FIFO, a device?); replace "
                               "it with an image file")
        return real

    def _open(self) -> Image.Image:
        """The image opened lazily (header only), refused when it claims more than MAX_IMAGE_PIXELS."""
        with warnings.catch_warnings():  # our own limit applies; PIL's warning below its error would only be noise
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                img = Image.open(self._real())
            except Image.DecompressionBombError as error:
                raise DatasetError(f"{self.describe()}: {error}; downscale it") from None
        width, height = img.size
        if width * height > MAX_IMAGE_PIXELS:
            img.close()
            raise DatasetError(
                f"{self.describe()}: {width}x{height} pixels ({width * height / 1e6:.0f} Mpx) is more than the "
                f"{MAX_IMAGE_PIXELS / 1e6:.0f} Mpx an image may have (a decompression bomb, or far larger than "
                "training needs); downscale it"
            )
        return img

    def size(self) -> tuple[int, int]:
        """(width, height) as the image will be loaded (EXIF rotation applied); reads the header only."""
        with self._open() as img:
            return _shown_size(img)

    def check(self) -> None:
        """Raise if the file is not an image PIL can parse (header and, where cheap, structure)."""
        with self._open() as img:
            img.verify()

    def checked_size(self) -> tuple[int, int]:
        """check(), then size(), on one opening of the file (listing a folder opens each image once less)."""
        return self.checked_header()[0]

    def checked_header(self) -> tuple[tuple[int, int], bool]:
        """(size(), has_alpha()) after check(), on one opening of the file: each opening is a header parse here, and
        on Windows an antivirus scan too (has_alpha on its own was a quarter of listing 3,000 small PNGs)."""
        with self._open() as img:
            size, alpha = _shown_size(img), _has_alpha(img)
            img.verify()  # last: the image cannot be read after it
            return size, alpha

    def has_alpha(self) -> bool:
        """Whether the image has transparency (an alpha channel or a transparent palette entry); reads the header
        only, so an alpha channel that is opaque everywhere counts too."""
        with self._open() as img:
            return _has_alpha(img)

    def load(self, reduce: int = 1) -> torch.Tensor:
        """[H, W, 3] float32 0..1, EXIF rotation applied (as ComfyUI's LoadImage does); with `reduce` > 1 about
        1/reduce of the size per side, decoded small where the format allows (JPEG) and box-reduced otherwise,
        so a large image never exists at full size in float."""
        with self._open() as img:
            width = img.size[0]
            if reduce > 1 and img.format == "JPEG":
                img.draft("RGB", (math.ceil(img.size[0] / reduce), math.ceil(img.size[1] / reduce)))
            remaining = max(1, reduce // max(1, round(width / img.size[0])))  # what draft scaling did not do
            img = ImageOps.exif_transpose(img)
            if img.mode in ("I", "I;16", "I;16B", "I;16L"):  # 16-bit grey: convert("RGB") would clip at 255
                img = img.convert("I")
                if remaining > 1:
                    img = img.reduce(remaining)
                grey = np.asarray(img, dtype=np.float32) / 65535.0
                array = np.repeat(grey[..., None], 3, axis=-1)
            else:
                if self.background is not None and _has_alpha(img):
                    img = Image.alpha_composite(Image.new("RGBA", img.size, (*self.background, 255)),
                                                img.convert("RGBA"))
                img = img.convert("RGB")
                if remaining > 1:
                    img = img.reduce(remaining)
                array = np.asarray(img, dtype=np.float32) / 255.0
        return torch.from_numpy(array.copy())

    def load_alpha(self, reduce: int = 1) -> torch.Tensor:
        """The alpha channel as [H, W, 3] float32 0..1 (1: opaque), of the size `load(reduce)` gives; an image
        without transparency is opaque everywhere. (No JPEG draft scaling here: a JPEG has no alpha.)"""
        with self._open() as img:
            img = ImageOps.exif_transpose(img)
            alpha = img.convert("RGBA").getchannel("A") if _has_alpha(img) else Image.new("L", img.size, 255)
            if reduce > 1:
                alpha = alpha.reduce(reduce)
            array = np.asarray(alpha, dtype=np.float32) / 255.0
        return torch.from_numpy(np.repeat(array[..., None], 3, axis=-1))

    def digest(self) -> str:
        """sha256 of the file's bytes (and, for an image put on a background, of that background: other pixels)."""
        hasher = hashlib.sha256()
        with open(self._real(), "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                hasher.update(chunk)
        if self.background is None:
            return hasher.hexdigest()
        return hashlib.sha256(f"{hasher.hexdigest()} on {self.background}".encode()).hexdigest()


class AlphaMask:
    """The loss mask of an image with transparency: its alpha channel (opaque: learned, transparent: not; kohya's
    alpha_mask), times the item's mask file where it has one (learned where both allow)."""

    def __init__(self, image: FileImage, mask: FileImage | None = None):
        self.image = image
        self.mask = mask

    def describe(self) -> str:
        return f"the alpha channel of {self.image.describe()}" + (
            f" times mask {self.mask.describe()}" if self.mask is not None else "")

    def size(self) -> tuple[int, int]:
        return self.image.size()

    def check(self) -> None:
        self.image.check()

    def load(self, reduce: int = 1) -> torch.Tensor:
        alpha = self.image.load_alpha(reduce)
        return alpha if self.mask is None else alpha * self.mask.load(reduce)

    def digest(self) -> str:
        parts = ("alpha", self.image.digest(), self.mask.digest() if self.mask is not None else "")
        return hashlib.sha256(" ".join(parts).encode()).hexdigest()


def reduce_factor(size: tuple[int, int], resized: tuple[int, int]) -> int:
    """The integer factor an image of `size` may be decoded reduced by and still be REDUCING_GAP times the size it
    is resized to (1: decode at full size)."""
    return max(1, min(size[0] // max(resized[0], 1), size[1] // max(resized[1], 1)) // REDUCING_GAP)


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

    def load(self, reduce: int = 1) -> torch.Tensor:
        return self.pixels.to(torch.float32)  # already in memory: nothing to save by reducing

    def digest(self) -> str:
        pixels = self.pixels.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return hashlib.sha256(pixels.numpy().tobytes()).hexdigest()


ImageSource = FileImage | TensorImage | AlphaMask


@dataclass(frozen=True)
class DatasetItem:
    name: str  # shown in messages: a file name or "image 3"
    caption: str
    image: ImageSource  # or a clip: training/data/video.py (FileVideo, FrameFolder, TensorVideo)
    control: ImageSource | None = None
    mask: ImageSource | None = None  # loss mask: white is learned, black is not (grey: partly)
    repeats: int = 1  # times per epoch the item is trained on (its repeat folder's N: kohya's `N_name` folders)


@dataclass(frozen=True)
class RepeatFolder:
    """One of a dataset folder's kohya-style `<repeats>_<name>` subfolders, as read."""

    name: str  # the subfolder's name, e.g. "10_ohwx dog"
    repeats: int
    images: int
    named_captions: int = 0  # images without a caption file, captioned with the folder's name after `N_`


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
    # What a folder held that is not in `items`: the problem of each item skip_bad left out, and notes on files that
    # are no item (a caption with no image of its name); both are warnings, shown on the dataset node.
    left_out: tuple[str, ...] = field(default=())
    notes: tuple[str, ...] = field(default=())
    # A folder of kohya-style repeat folders (dataset_from_folder): each one read, in order; `unread_repeat_folders`:
    # such subfolders of a folder with images of its own, which are not read (a warning).
    repeat_folders: tuple[RepeatFolder, ...] = field(default=())
    unread_repeat_folders: tuple[str, ...] = field(default=())
    # Clips (training/data/video.py): every frame_stride-th frame, at most max_frames, cut to what the VAE takes.
    max_frames: int = 81
    frame_stride: int = 1
    # Other sizes every item is also cached and trained at (multi-resolution training): each its own buckets.
    extra_resolutions: tuple[int, ...] = field(default=())
    # Images with transparency (dataset_from_folder) and what was done with them (TRANSPARENCY_MODES).
    transparency: str = "ignore"
    alpha_images: int = 0
    # Images without a caption file captioned with dataset_from_folder's default_caption (the trigger word)
    default_captions: int = 0
    # False: an image smaller than its bucket trains in a smaller bucket instead of enlarged (kohya's
    # bucket_no_upscale; buckets.bucket_for)
    upscale: bool = True
    # (shortest, longest) side a bucket may have, 0: no limit (kohya's min_bucket_reso / max_bucket_reso;
    # buckets.make_buckets)
    bucket_sides: tuple[int, int] = (0, 0)

    def __post_init__(self):
        if not self.items:
            raise DatasetError("the dataset has no items")
        if self.transparency not in TRANSPARENCY_MODES:
            raise DatasetError(f"transparency must be one of {', '.join(TRANSPARENCY_MODES)}, got "
                               f"{self.transparency!r}")
        if self.crop not in CROP_MODES:
            raise DatasetError(f"crop must be one of {CROP_MODES}, got {self.crop!r}")
        for extra in self.extra_resolutions:
            if extra == self.resolution or self.extra_resolutions.count(extra) > 1:
                raise DatasetError(f"extra_resolutions: {extra} is given twice (resolution is {self.resolution}); "
                                   "give each size once")
            if not MIN_RESOLUTION <= extra <= MAX_RESOLUTION or extra % self.step:
                lowest = -(-max(MIN_RESOLUTION, self.step) // self.step) * self.step
                closest = min(max(extra // self.step * self.step, lowest), MAX_RESOLUTION // self.step * self.step)
                raise DatasetError(f"extra_resolutions: {extra} must be a multiple of step {self.step} from "
                                   f"{MIN_RESOLUTION} to {MAX_RESOLUTION} (e.g. {closest})")
        try:
            check_bucket_sides(self.bucket_sides, self.step, self.resolutions)
        except ValueError as error:
            raise DatasetError(str(error)) from None

    @property
    def resolutions(self) -> tuple[int, ...]:
        """Every size the items are cached at: `resolution`, then the extra ones."""
        return (self.resolution, *self.extra_resolutions)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def warnings(self) -> tuple[str, ...]:
        """Every warning, for the caching reports: the left-out items, the notes, then repeat folders not read."""
        unread = (unread_repeat_folders_warning(self.unread_repeat_folders),) if self.unread_repeat_folders else ()
        return tuple(f"skipped {problem}" for problem in self.left_out) + self.notes + unread

    @property
    def has_control(self) -> bool:
        return self.items[0].control is not None

    @property
    def has_masks(self) -> bool:
        return any(item.mask is not None for item in self.items)


_NUMBER = re.compile(r"([0-9]+)")


def name_order(path: Path) -> tuple:
    """The order a folder's entries are read in: numbers by value, letters without case, the exact name on a tie
    (img2.png before img10.png, IMG_3 between img_2 and img_4, as Explorer and Finder list them). The same on every
    OS: sorted(Path) compares names without case on Windows and by code point elsewhere, so one shared workflow
    trained its images in another order per machine, and a clip's frames 1.png ... 10.png were read 1, 10, 2."""
    parts = _NUMBER.split(path.name.casefold())  # text, number, text, ...: int and str never meet in a comparison
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts)), path.name


def _entries(folder: Path) -> list[Path]:
    """The visible entries of `folder` an item can come from: files and symlinks (a symlink is checked where it
    leads when it is read), not subfolders."""
    return [path for path in sorted(folder.iterdir(), key=name_order)
            if not os_compat.is_hidden(path) and (path.is_symlink() or not path.is_dir())]


def orphan_captions(entries: list[Path], stems: set[str], what: str = "image", add: str = "image") -> list[str]:
    """A note for each caption among `entries` whose stem is no item's (`stems`: every other entry's, so a caption
    beside an unsupported file, which is reported already, is not named twice). Without it a caption whose image was
    renamed, deleted or never copied was ignored silently, and nothing said that image was not trained on. Stems
    compare without case: on Windows and macOS photo.png reads Photo.txt as its caption."""
    known = {stem.casefold() for stem in stems}
    return [f"{display_path(path)}: a caption with no {what} of the same name; add the {add} or remove the caption"
            for path in entries if path.suffix.lower() in CAPTION_EXTENSIONS and path.stem.casefold() not in known]


def caption_file(base: Path, frame_folder: bool = False) -> Path:
    """The caption file of the image (or clip) at `base`: `<stem>.txt`, else `<stem>.caption` where only that
    exists; a frame folder's is `<folder name>.txt` (or `.caption`) beside it. The `.txt` path when neither exists
    (where a message says to write it)."""
    candidates = [base.parent / (base.name + extension) if frame_folder else base.with_suffix(extension)
                  for extension in CAPTION_EXTENSIONS]
    return next((path for path in candidates if os.path.lexists(path)), candidates[0])


def _images_in(folder: Path) -> "ByName":
    """stem -> path of every supported image directly in `folder` (hidden files ignored)."""
    return ByName({path.stem: path for path in _entries(folder) if path.suffix.lower() in IMAGE_EXTENSIONS})


class ByName:
    """The files of a control or mask folder by name stem, found for an image's stem: the same name, else the one name
    that differs from it only in case. Windows and macOS read photo.png and Photo.PNG as one name (a caption is found
    so), and a mask named IMG_001.png beside img_001.jpg would otherwise be left out of training without a word."""

    def __init__(self, found: dict):
        self.found = found
        self.folded: dict[str, list] = {}
        for name, value in found.items():
            self.folded.setdefault(name.casefold(), []).append(value)

    def get(self, stem: str):
        if stem in self.found:
            return self.found[stem]
        same = self.folded.get(stem.casefold(), [])
        return same[0] if len(same) == 1 else None

    def unmatched(self, stems: set[str], what: str, folder: Path, item: str = "image") -> list[str]:
        """A note per file here that no stem among `stems` finds (it is never used), like a caption with no image."""
        known = {stem.casefold() for stem in stems}
        return [f"{self._shown(name, folder)}: a {what} with no {item} of the same name in the dataset; rename it as "
                f"its {item.split()[0]}, or remove it" for name in self.found if name.casefold() not in known]

    def _shown(self, name: str, folder: Path) -> str:
        value = self.found[name]  # a path, or a clip's mask source (FileImage, a video, a frame folder)
        if hasattr(value, "describe"):
            return value.describe()
        return display_path(value if isinstance(value, Path) else Path(folder) / name)


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
    roots: tuple[Path, ...] | None = None,
    mask_folder: Path | None = None,
    transparency: str = "ignore",
    default_caption: str | None = None,
) -> Dataset:
    """Images in `folder` with same-name `.txt` (or `.caption`) captions; control images in `control_folder` and loss
    masks in `mask_folder` matched by file name stem (any supported extension) and of the same size as their image
    (an image without a mask is learned whole). Files are read only where they resolve inside `roots`
    (default: the dataset, control and mask folders). `transparency` (TRANSPARENCY_MODES): what is done with
    images that have an alpha channel. `default_caption` (the node's trigger word): the caption of an image without
    a caption file, else such an image is a problem.

    A folder without images of its own whose subfolders are named `<repeats>_<name>` (kohya's layout, e.g.
    `10_ohwx dog`, `1_style`) is read subfolder by subfolder: each item is trained on `repeats` times per epoch, an
    image without a caption file is captioned with the folder's name after `N_` (kohya's class tokens), and the
    control and mask folders, if given, have the same subfolders."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {display_path(folder)} does not exist or is not a folder")
    if control_folder is not None and not Path(control_folder).is_dir():
        raise DatasetError(f"control folder {display_path(control_folder)} does not exist or is not a folder")
    if mask_folder is not None and not Path(mask_folder).is_dir():
        raise DatasetError(f"mask folder {display_path(mask_folder)} does not exist or is not a folder")
    if transparency not in TRANSPARENCY_MODES:
        raise DatasetError(f"transparency must be one of {', '.join(TRANSPARENCY_MODES)}, got {transparency!r}")
    roots = tuple(roots) if roots else tuple(p for p in (folder, control_folder, mask_folder) if p is not None)

    concepts = repeat_folders_of(folder)
    headers: dict[Path, tuple[tuple[int, int], bool]] = {}  # each usable image's (size, transparency) when checked
    read, unread, default_captions = [], (), 0
    # Listed a second time only where there are repeat folders: a folder of its own images reads them, as before.
    if concepts and not any(path.suffix.lower() in IMAGE_EXTENSIONS for path in _entries(folder)):
        items, problems, notes = [], [], []
        for path, repeats in concepts:
            if repeats > MAX_REPEATS:
                raise DatasetError(f"{display_path(path)}: a repeat folder named for {repeats} repeats (kohya's "
                                   f"'<repeats>_<name>'; at most {MAX_REPEATS}): rename it, e.g. '10_"
                                   f"{path.name.partition('_')[2]}', or move it out of {display_path(folder)}")
            name_caption = path.name.partition("_")[2].strip()
            got, left, noted, named = _folder_items(
                path, _mirrored(control_folder, path.name, "control"), _mirrored(mask_folder, path.name, "mask"),
                roots, repeats=repeats, name_caption=name_caption, in_repeat_folder=True, headers=headers)
            items += got
            problems += left
            notes += noted
            read.append(RepeatFolder(path.name, repeats, len(got), named))
    else:
        items, problems, notes, default_captions = _folder_items(folder, control_folder, mask_folder, roots,
                                                                 name_caption=default_caption, headers=headers)
        unread = tuple(path.name for path, _ in concepts)

    if problems and not skip_bad:
        raise DatasetError(
            f"{len(problems)} problem(s) in dataset folder {display_path(folder)} (fix them, or enable skip_bad to "
            "leave those items out):\n- " + "\n- ".join(problems) + also_noted(notes)
        )
    if not items:
        raise DatasetError(
            f"no usable images in {display_path(folder)}: put images ({', '.join(IMAGE_EXTENSIONS)}) there, each "
            f"with a same-name {CAPTION_EXTENSION} caption file"
            + (" (or in subfolders named '<repeats>_<name>', kohya's layout)" if not concepts else "")
            + (" (skipped:\n- " + "\n- ".join(problems) + ")" if problems else "") + also_noted(notes)
        )
    items, alpha_images = _with_transparency(items, transparency, headers)
    return Dataset(
        items=tuple(items), resolution=resolution, step=step, crop=crop, flip=flip, seed=seed,
        skip_bad=skip_bad, left_out=tuple(problems), notes=tuple(notes), repeat_folders=tuple(read),
        unread_repeat_folders=unread, transparency=transparency, alpha_images=alpha_images,
        default_captions=default_captions,
    )


def _with_transparency(items: list[DatasetItem], transparency: str,
                       headers: dict[Path, tuple[tuple[int, int], bool]]) -> tuple[list[DatasetItem], int]:
    """(the items with `transparency` applied to those whose image has an alpha channel, how many have one). Items
    without transparency are unchanged whatever the mode, so their cache entries are shared between modes.
    `headers`: what each image's header said when it was checked (_check_item)."""
    done, alpha_images = [], 0
    for item in items:
        if not headers[item.image.path][1]:
            done.append(item)
            continue
        alpha_images += 1
        if transparency == "loss_mask":
            done.append(replace(item, mask=AlphaMask(item.image, item.mask)))
        elif transparency in BACKGROUNDS:
            done.append(replace(item, image=FileImage(item.image.path, item.image.roots, BACKGROUNDS[transparency])))
        else:
            done.append(item)
    return done, alpha_images


# kohya's concept folders: "<repeats>_<name>", repeats from 1 (a leading zero or 0 repeats is no repeat folder)
REPEAT_FOLDER = re.compile(r"([1-9][0-9]*)_(.*\S.*)")
MAX_REPEATS = 500  # more is more likely a name ("2024_trip") than repeats: refused, naming the folder


def repeat_folders_of(folder: Path) -> list[tuple[Path, int]]:
    """(subfolder, repeats) of each visible, not symlinked subfolder of `folder` named `<repeats>_<name>`, in the
    order folders are read (name_order)."""
    found = []
    for path in sorted(folder.iterdir(), key=name_order):
        match = REPEAT_FOLDER.fullmatch(path.name)
        if match and not os_compat.is_hidden(path) and not path.is_symlink() and path.is_dir():
            found.append((path, int(match.group(1))))
    return found


def unread_repeat_folders_warning(names: tuple[str, ...]) -> str:
    shown = ", ".join(repr(name) for name in names[:5]) + (", ..." if len(names) > 5 else "")
    return (f"subfolders {shown} look like kohya repeat folders but are not read: this folder has images of its own "
            "(repeat folders are read from a folder with none); move its images into a '1_<name>' subfolder to train "
            "them all")


def _mirrored(folder: Path | None, name: str, what: str) -> Path | None:
    """A repeat folder's counterpart in the control or mask folder, which must have the same subfolders."""
    if folder is None:
        return None
    counterpart = Path(folder) / name
    if counterpart.is_symlink() or not counterpart.is_dir():
        raise DatasetError(f"{what} folder {display_path(folder)} has no subfolder {name!r}: with repeat folders, give "
                           f"the {what} folder the same subfolders, each {what} image in the one of its image")
    return counterpart


def _folder_items(folder: Path, control_folder: Path | None, mask_folder: Path | None, roots: tuple[Path, ...],
                  repeats: int = 1, name_caption: str | None = None, in_repeat_folder: bool = False,
                  headers: dict | None = None) -> tuple[list, list[str], list[str], int]:
    """(items, problems, notes, images captioned with `name_caption`) of the images in one folder (not its
    subfolders). `name_caption`: the caption of an image without a caption file (a repeat folder's name, or the
    trigger word), else a missing caption is a problem. Items in a repeat folder are named with it. `headers`
    (image path -> (size, whether it has transparency)) gets each usable image's entry."""
    headers = {} if headers is None else headers
    controls = _images_in(Path(control_folder)) if control_folder is not None else ByName({})
    masks = _images_in(Path(mask_folder)) if mask_folder is not None else ByName({})

    items, problems, named = [], [], 0
    entries = [path for path in _entries(folder) if path.suffix.lower() not in OTHER_TRAINERS_FILES]
    notes = orphan_captions(entries, {path.stem for path in entries if path.suffix.lower() not in CAPTION_EXTENSIONS})
    stems = {path.stem for path in entries if path.suffix.lower() in IMAGE_EXTENSIONS}
    if control_folder is not None:
        notes += controls.unmatched(stems, "control image", control_folder)
    if mask_folder is not None:
        notes += masks.unmatched(stems, "mask", mask_folder)
    for path in entries:
        if path.suffix.lower() in CAPTION_EXTENSIONS:
            continue
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            problems.append(
                f"{display_path(path)}: unsupported file type {path.suffix!r} (supported: {', '.join(IMAGE_EXTENSIONS)}); "
                "move it out of the dataset folder"
            )
            continue
        without_caption = name_caption is not None and not os.path.lexists(caption_file(path))
        caption = (name_caption,) if without_caption else _read_caption(
            path, roots, missing_hint="" if in_repeat_folder else MISSING_CAPTION_HINT)
        problem = caption if not isinstance(caption, tuple) else _check_item(path, controls, control_folder, roots,
                                                                             headers)
        mask_path = masks.get(path.stem)
        if not problem and mask_path is not None:
            problem = _check_sibling(path, FileImage(mask_path, roots), "mask", roots, headers[path][0])
        if problem:
            problems.append(problem)
            continue
        control = FileImage(controls.get(path.stem), roots) if control_folder is not None else None
        mask = FileImage(mask_path, roots) if mask_path is not None else None
        name = f"{folder.name}/{path.name}" if in_repeat_folder else path.name
        items.append(DatasetItem(name=name, caption=caption[0], image=FileImage(path, roots), control=control,
                                 mask=mask, repeats=repeats))
        named += without_caption
    return items, problems, notes, named


def also_noted(notes: list[str]) -> str:
    """The notes (captions with no image) an error about the folder names too: fixed in the same pass."""
    return "\nAlso:\n- " + "\n- ".join(notes) if notes else ""


def _read_caption(image_path: Path, roots: tuple[Path, ...], caption_path: Path | None = None,
                  missing_hint: str = "") -> tuple[str] | str:
    """(the caption of an image,) or a message naming the problem and its fix (`missing_hint`: another fix of a
    missing caption file). `caption_path`: where it is when not beside the image under the same stem (a frame
    folder's `<folder name>.txt`)."""
    caption_path = caption_path or caption_file(image_path)
    # The caption's name in a message is made only for a message: display_path resolves every ComfyUI folder, which
    # made naming it 70 % of listing a 10,000-image folder.
    if not os.path.lexists(caption_path):
        return (f"{display_path(image_path)}: no caption file; write the caption into {display_path(caption_path)}"
                f"{missing_hint}")
    try:
        real = resolve_inside(caption_path, roots, "caption")
        if not real.is_file():
            return (f"{display_path(caption_path)}: the caption is not a regular file (a broken symlink or a folder?); "
                    "replace it")
        if real.stat().st_size > CAPTION_MAX_BYTES:
            return f"{display_path(caption_path)}: caption is larger than {CAPTION_MAX_BYTES >> 20} MiB; shorten it"
        # Several lines are alternative captions (caption_tags.caption_lines): kept one per line, blank lines and
        # indents dropped.
        text = caption_text(real.read_bytes())
        if "\x00" in text:  # UTF-16 without its byte order mark reads as UTF-8 with a NUL after every letter
            return (f"{display_path(caption_path)}: the caption holds NUL characters (UTF-16 text without its byte "
                    "order mark?); re-save it as UTF-8")
        return ("\n".join(line.strip() for line in text.splitlines() if line.strip()),)
    except UntrustedFileError as error:
        return str(error)
    except (OSError, UnicodeDecodeError) as error:
        return f"{display_path(caption_path)}: caption cannot be read as UTF-8 text ({error}); re-save it as UTF-8"


def caption_text(data: bytes) -> str:
    """A caption file's text: UTF-8, or the encoding its byte order mark names. Windows tools write marks: Notepad's
    "UTF-8 with BOM" (U+FEFF first, which would become part of the caption), its "Unicode" and Windows PowerShell
    5's `>` / Out-File (UTF-16 LE with a BOM, the default there). Without a mark: UTF-8 (UnicodeDecodeError
    otherwise; a legacy code page cannot be told from UTF-8 mistakes)."""
    for mark, encoding in ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
                           (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"),
                           (codecs.BOM_UTF8, "utf-8-sig")):
        if data.startswith(mark):
            return data.decode(encoding)
    return data.decode("utf-8")


def _check_item(path: Path, controls: ByName, control_folder: Path | None,
                roots: tuple[Path, ...], headers: dict | None = None) -> str | None:
    """A message naming the problem with this item and its fix, or None if it is usable. `headers[path]`: its
    (size, whether it has transparency), read from the same opening of its header."""
    image = FileImage(path, roots)
    try:
        size, alpha = image.checked_header()
        if headers is not None:
            headers[path] = size, alpha
    except DatasetError as error:
        return str(error)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as error:
        return f"{image.describe()}: unreadable or corrupt image ({_reason(error)}); re-export it or remove it"
    if control_folder is None:
        return None
    control = controls.get(path.stem)
    if control is None:
        return (f"{image.describe()}: no control image named {path.stem}.* in {display_path(control_folder)}; add one "
                "or remove the image")
    return _check_sibling(path, FileImage(control, roots), "control image", roots, size)


def _check_sibling(path: Path, sibling: FileImage, what: str, roots: tuple[Path, ...],
                   size: tuple[int, int] | None = None) -> str | None:
    """A control image or mask of the image at `path`: readable and of the image's size (or a message)."""
    try:
        size = size or FileImage(path, roots).size()
        sibling_size = sibling.checked_size()
    except DatasetError as error:
        return str(error)
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as error:
        return f"{sibling.describe()}: unreadable or corrupt {what} ({_reason(error)}); re-export it or remove it"
    if sibling_size != size:
        return (
            f"{sibling.describe()}: {what} is {sibling_size[0]}x{sibling_size[1]} but its image {path.name} is "
            f"{size[0]}x{size[1]}; resize the {what} to match"
        )
    return None


def _reason(error: BaseException) -> str:
    """An error's text without an absolute path PIL or the OS put into it."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = relative_text(str(error))
    return "unknown format" if isinstance(error, UnidentifiedImageError) else text


TRIGGER_PLACEHOLDER = "[trigger]"  # ai-toolkit's stand-in for the trigger word in captions


def with_trigger_word(dataset: Dataset, word: str) -> Dataset:
    """Every caption starting with `word` ("word, caption"; one that starts with it already is left as it is). A
    caption holding ai-toolkit's `[trigger]` placeholder gets `word` in its place instead, so datasets captioned for
    ai-toolkit train as they did there; without a word such captions are refused (the encoder would learn the
    literal '[trigger]'). The captions are what the text cache is keyed by, so a new trigger word encodes them
    again."""
    word = word.strip()
    if any(ord(c) < 32 for c in word):
        raise DatasetError(f"trigger_word {word[:60]!r} contains control characters (a newline?): give one line")
    if not word:
        placeholders = [item for item in dataset.items if TRIGGER_PLACEHOLDER in item.caption]
        if placeholders:
            raise DatasetError(
                f"{len(placeholders)} caption(s) hold ai-toolkit's {TRIGGER_PLACEHOLDER} placeholder (e.g. "
                f"{placeholders[0].name}: {placeholders[0].caption[:80]!r}) but trigger_word is empty: set "
                f"trigger_word to the word it stands for, or remove {TRIGGER_PLACEHOLDER} from the captions")
        return dataset

    def prefixed(caption: str) -> str:
        if "\n" in caption:  # alternative captions, one per line: each gets the word
            return "\n".join(prefixed(line) for line in caption.split("\n"))
        if TRIGGER_PLACEHOLDER in caption:
            return caption.replace(TRIGGER_PLACEHOLDER, word)
        if caption == word or caption.startswith((f"{word},", f"{word} ")):
            return caption
        return f"{word}, {caption}" if caption else word

    return replace(dataset, items=tuple(replace(item, caption=prefixed(item.caption)) for item in dataset.items))


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
    masks: torch.Tensor | None = None,
) -> Dataset:
    """Items from an IMAGE batch [N, H, W, 3] with one caption per image, an optional control batch and an
    optional MASK batch [N, H, W] (1: learned, 0: not)."""
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
    if masks is not None:
        if masks.ndim == 2:
            masks = masks.unsqueeze(0)  # ComfyUI passes a single mask as [H, W] in places
        if masks.ndim != 3 or masks.shape[0] not in (1, images.shape[0]) or masks.shape[1:] != images.shape[1:3]:
            raise DatasetError(
                f"masks batch {tuple(masks.shape)} does not fit images {tuple(images.shape[:3])}: give a MASK "
                "[N, H, W] (or one [1, H, W] for all) of the images' size"
            )
        masks = masks.expand(images.shape[0], -1, -1)
    items = tuple(
        DatasetItem(
            name=f"image {index}",
            caption=captions[index],
            image=TensorImage(images[index], f"image {index} of the IMAGE batch"),
            control=None if control_images is None
            else TensorImage(control_images[index], f"control image {index} of the control IMAGE batch"),
            mask=None if masks is None
            else TensorImage(masks[index].unsqueeze(-1).expand(-1, -1, 3), f"mask {index} of the MASK batch"),
        )
        for index in range(images.shape[0])
    )
    return Dataset(items=items, resolution=resolution, step=step, crop=crop, flip=flip, seed=seed)


def dataset_from_image_list(
    images: list[torch.Tensor],
    captions: list[str],
    control_images: list[torch.Tensor] | None = None,
    *,
    resolution: int,
    step: int,
    crop: str = "center",
    flip: bool = False,
    seed: int = 0,
    masks: list[torch.Tensor] | None = None,
) -> Dataset:
    """Items from a list of IMAGEs, as ComfyUI's own dataset nodes give them (Load Image-Text (from Folder), Resize
    Images, ...: one [1, H, W, 3] per image, sizes differing), each element's images in turn, with one caption per
    image; control images and masks ([H, W] or [B, H, W]) as lists of the same shape, or one mask for all."""
    def flat(batches, what: str) -> list[torch.Tensor]:
        out = []
        for position, batch in enumerate(batches):
            if batch.ndim == 2 and what == "masks":
                batch = batch.unsqueeze(0)  # a single mask [H, W]
            if batch.ndim != (3 if what == "masks" else 4) or (what != "masks" and batch.shape[-1] != 3):
                shape = "a MASK [B, H, W]" if what == "masks" else "an IMAGE [B, H, W, 3]"
                raise DatasetError(f"{what} list element {position} must be {shape}, got shape "
                                   f"{tuple(batch.shape)}")
            out += list(batch)
        return out

    pictures = flat(images, "images")
    if len(captions) != len(pictures):
        raise DatasetError(f"{len(pictures)} images but {len(captions)} captions; give one caption per image, in "
                           "the order of the images")
    controls = flat(control_images, "control_images") if control_images is not None else None
    if controls is not None and (len(controls) != len(pictures) or
                                 any(c.shape != p.shape for c, p in zip(controls, pictures))):
        raise DatasetError(f"control_images: {len(controls)} images for {len(pictures)} images, or of other sizes; "
                           "give one control image of its image's size per image")
    mask_list = flat(masks, "masks") if masks is not None else None
    if mask_list is not None:
        if len(mask_list) == 1:
            mask_list = mask_list * len(pictures)
        if len(mask_list) != len(pictures) or any(m.shape != p.shape[:2] for m, p in zip(mask_list, pictures)):
            raise DatasetError(f"masks: {len(mask_list)} masks for {len(pictures)} images, or of other sizes; give "
                               "one mask of its image's size per image (or one for all)")
    items = tuple(
        DatasetItem(
            name=f"image {index}",
            caption="\n".join(line.strip() for line in captions[index].splitlines() if line.strip()),
            image=TensorImage(picture, f"image {index} of the IMAGE list"),
            control=None if controls is None else TensorImage(controls[index], f"control image {index} of the list"),
            mask=None if mask_list is None
            else TensorImage(mask_list[index].unsqueeze(-1).expand(-1, -1, 3), f"mask {index} of the MASK list"),
        )
        for index, picture in enumerate(pictures)
    )
    if not items:
        raise DatasetError("the image list is empty")
    return Dataset(items=items, resolution=resolution, step=step, crop=crop, flip=flip, seed=seed)


def folder_signature(*folders: Path | None) -> str:
    """A cheap digest of the folders' listings (names, sizes, mtimes), their repeat folders' too (a folder without
    any gives what it gave before they existed): changes when any file changes."""
    hasher = hashlib.sha256()

    def listing(folder: Path) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.is_file():
                stat = entry.stat()
                hasher.update(f"{entry.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())

    for folder in folders:
        if folder is None or not Path(folder).is_dir():
            hasher.update(b"-")
            continue
        listing(folder)
        for subfolder, _ in repeat_folders_of(Path(folder)):
            hasher.update(f"{subfolder.name}/\n".encode())
            listing(subfolder)
    return hasher.hexdigest()
