"""Video clips as dataset sources: a video file (decoded with PyAV, what ComfyUI's own video loading reads), a folder of
frame images, or an in-memory [F, H, W, 3] batch. Like the image sources (dataset.py), a clip is a description:
frames are decoded only when it is cached, and only the frames a training clip uses.

Which frames a clip gives (`clip_frames`): every `stride`-th frame from the first, at most `max_frames`, cut to the
longest count the VAE takes (`frame_step` * k + 1: 4k + 1 for the Wan VAEs, which keep the first frame and then
encode groups of 4; any count for an image VAE given one frame). A clip is never padded.

Untrusted input: files are read only where they resolve inside the dataset roots; a stream whose header claims more
than MAX_IMAGE_PIXELS per frame, or more than MAX_CLIP_FRAMES frames in a frame folder, is refused before a frame is
decoded; decoding stops at the last frame used, whatever length the container claims, and a frame of another size than
the stream's header is refused.

A video's display rotation (the display matrix phones write for portrait video) is applied as ComfyUI's own video
loading applies it: frames are turned by it, and the clip's size is its size as shown.

A clip's frame rate (`frame_rate()`, frames per second of the frames it gives): a video's average rate, a frame
folder's given rate (Dataset From Videos' frame_rate), an in-memory clip's given one or None; divided by frame_stride
(`clip_frame_rate`). Models whose positions are in seconds (LTX-2) train at it.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from .. import os_compat
from .dataset import (CAPTION_EXTENSION, CAPTION_EXTENSIONS, IMAGE_EXTENSIONS, MAX_IMAGE_PIXELS, ByName, Dataset,
                      MISSING_CAPTION_HINT, DatasetError, DatasetItem, FileImage, TensorImage, _read_caption,
                      also_noted, caption_file, name_order, orphan_captions)
from .files import UntrustedFileError, display_path, resolve_inside

VIDEO_EXTENSIONS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v")
MAX_CLIP_FRAMES = 4096  # frames a training clip may use (81 is Wan's usual length); also the most a frame folder holds
MAX_FRAMES_DEFAULT = 81
# Pixels decoded for one clip at most (frames read, skipped ones too, x their size): ~4000 frames of 1080p. A long,
# large video with a wide stride is refused before decoding rather than keeping a worker busy for hours.
MAX_CLIP_DECODE_PIXELS = 8 * 10**9


def check_decode_budget(what: str, decoded_frames: int, size: tuple[int, int]) -> None:
    pixels = decoded_frames * size[0] * size[1]
    if pixels > MAX_CLIP_DECODE_PIXELS:
        raise DatasetError(f"{what}: taking these frames decodes {decoded_frames} frames of {size[0]}x{size[1]} "
                           f"({pixels / 1e9:.1f} Gpx), more than the {MAX_CLIP_DECODE_PIXELS / 1e9:.0f} Gpx a clip may "
                           "take; lower max_frames or frame_stride, or downscale / cut the video")


def clip_frames(available: int, max_frames: int, stride: int, frame_step: int) -> list[int]:
    """The frame indices a clip of `available` frames gives: every `stride`-th from 0, at most `max_frames`, cut to
    frame_step * k + 1 frames (frame_step 1: any count)."""
    if max_frames < 1 or stride < 1 or frame_step < 1:
        raise DatasetError(f"max_frames ({max_frames}), frame_stride ({stride}) and the VAE's frame step ({frame_step}) "
                           "must be at least 1")
    indices = list(range(0, available, stride))[:max_frames]
    if not indices:
        return []
    return indices[:(len(indices) - 1) // frame_step * frame_step + 1]


def clip_frame_rate(source, stride: int) -> float | None:
    """Frames per second of a clip taking every `stride`-th frame of `source` (None: the source has no known rate)."""
    rate = source.frame_rate() if is_video(source) else None
    return rate / stride if rate else None


def quarter_turns(rotation: float) -> int:
    """Counter-clockwise quarter turns of a frame's display matrix (PyAV's VideoFrame.rotation: a phone's portrait
    video is stored landscape with a rotation), rounded as ComfyUI's video loading rounds them (np.rot90's k)."""
    return int(rotation // 90) % 4 if rotation else 0


class FileVideo:
    """A video file's first video stream, decoded on demand through PyAV, turned as its display rotation says."""

    def __init__(self, path: Path, roots: tuple[Path, ...] | None = None):
        self.path = Path(path)
        self.roots = tuple(roots) if roots else (self.path.parent,)

    def describe(self) -> str:
        return display_path(self.path)

    def _open(self):
        import av  # ComfyUI's own video dependency; imported here so the engine imports without it

        real = resolve_inside(self.path, self.roots, "video")
        if not real.is_file():
            raise DatasetError(f"{self.describe()}: not a regular file (a broken symlink, a FIFO, a device?); replace "
                               "it with a video file")
        try:
            container = av.open(str(real), mode="r")
        except (av.error.FFmpegError, OSError, ValueError) as error:
            raise DatasetError(f"{self.describe()}: unreadable or corrupt video ({type(error).__name__}); re-export it "
                               "or remove it") from None
        if not container.streams.video:
            container.close()
            raise DatasetError(f"{self.describe()}: has no video stream; remove it from the dataset folder")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if width < 1 or height < 1 or width * height > MAX_IMAGE_PIXELS:
            container.close()
            raise DatasetError(f"{self.describe()}: frames of {width}x{height} pixels (more than the "
                               f"{MAX_IMAGE_PIXELS / 1e6:.0f} Mpx a frame may have, or none); downscale it")
        return container, stream

    def size(self) -> tuple[int, int]:
        """(width, height) as the video is shown: a 90 / 270 degree display rotation swaps the stored sides."""
        container, stream = self._open()
        with container:
            width, height = stream.codec_context.width, stream.codec_context.height
            turns = quarter_turns(self._first_frame(container, stream).rotation)
        return (height, width) if turns % 2 else (width, height)

    def _first_frame(self, container, stream):
        """The stream's first frame (its display rotation is side data of the frames)."""
        import av

        try:
            for frame in container.decode(stream):
                return frame
        except av.error.FFmpegError as error:
            raise DatasetError(f"{self.describe()}: cannot be decoded ({type(error).__name__}); re-export it or remove "
                               "it") from None
        raise DatasetError(f"{self.describe()}: has no frames; remove it")

    def check(self) -> None:
        container, _ = self._open()
        container.close()

    def frame_rate(self) -> float | None:
        """The stream's average frame rate from its header (None where the container gives none)."""
        container, stream = self._open()
        with container:
            rate = stream.average_rate or stream.guessed_rate
        return float(rate) if rate else None

    def frame_count(self, limit: int) -> int:
        """Frames in the stream, counted up to `limit` (the header's count, else its packets: nothing is decoded)."""
        container, stream = self._open()
        with container:
            if stream.frames > 0:
                return min(int(stream.frames), limit)
            count = 0
            for packet in container.demux(stream):
                if packet.size:
                    count += 1
                    if count >= limit:
                        break
            return count

    def load_frames(self, indices: list[int], reduce: int = 1) -> torch.Tensor:
        """[len(indices), H, W, 3] float32 0..1; decoding stops after the last index."""
        import av

        wanted, last = set(indices), max(indices)
        frames: dict[int, np.ndarray] = {}
        container, stream = self._open()
        width, height = stream.codec_context.width, stream.codec_context.height
        try:
            check_decode_budget(self.describe(), last + 1, (width, height))
        except DatasetError:
            container.close()
            raise
        size = {"width": max(1, width // reduce), "height": max(1, height // reduce)} if reduce > 1 else {}
        with container:
            try:
                for index, frame in enumerate(container.decode(stream)):
                    if (frame.width, frame.height) != (width, height):
                        raise DatasetError(f"{self.describe()}: frame {index} is {frame.width}x{frame.height} but the "
                                           f"stream says {width}x{height}; re-encode the video at one size")
                    if index in wanted:  # turned as the display rotation says, as ComfyUI's video loading does
                        pixels = frame.to_ndarray(format="rgb24", **size)
                        frames[index] = np.rot90(pixels, k=quarter_turns(frame.rotation))
                    if index >= last:
                        break
            except av.error.FFmpegError as error:
                raise DatasetError(f"{self.describe()}: cannot be decoded ({type(error).__name__}); re-export it or "
                                   "remove it") from None
        missing = [i for i in indices if i not in frames]
        if missing:
            raise DatasetError(f"{self.describe()}: ends before frame {missing[0]} (its header promised more); "
                               "re-export it")
        array = np.stack([frames[i] for i in indices]).astype(np.float32) / 255.0  # a copy: rot90's views end here
        return torch.from_numpy(array)

    def digest(self) -> str:
        hasher = hashlib.sha256()
        with open(resolve_inside(self.path, self.roots, "video"), "rb") as file:
            for chunk in iter(lambda: file.read(1 << 20), b""):
                hasher.update(chunk)
        return hasher.hexdigest()


class FrameFolder:
    """A clip as a folder of frame images, in name order with numbers by value (frame_1.png ... frame_10.png, as
    frame_0001.png ...); every frame of one size, shown at `rate` frames per second (frame images carry none)."""

    def __init__(self, folder: Path, roots: tuple[Path, ...] | None = None, rate: float | None = None):
        self.folder = Path(folder)
        self.roots = tuple(roots) if roots else (self.folder.parent,)
        self.rate = rate

    def frame_rate(self) -> float | None:
        return self.rate

    def describe(self) -> str:
        return display_path(self.folder)

    def _frames(self) -> list[FileImage]:
        real = resolve_inside(self.folder, self.roots, "frame folder")
        names = sorted((p for p in real.iterdir() if not os_compat.is_hidden(p) and p.suffix.lower() in IMAGE_EXTENSIONS),
                       key=name_order)
        if not names:
            raise DatasetError(f"{self.describe()}: a frame folder without frame images ({', '.join(IMAGE_EXTENSIONS)}); "
                               "put the clip's frames there or remove the folder")
        if len(names) > MAX_CLIP_FRAMES:
            raise DatasetError(f"{self.describe()}: {len(names)} frames, more than the {MAX_CLIP_FRAMES} a frame folder "
                               "may hold; split the clip")
        return [FileImage(self.folder / p.name, self.roots) for p in names]

    def size(self) -> tuple[int, int]:
        return self._frames()[0].size()

    def check(self) -> None:
        frames = self._frames()
        size = frames[0].size()
        for frame in frames:
            frame.check()
            if frame.size() != size:
                raise DatasetError(f"{frame.describe()}: {frame.size()[0]}x{frame.size()[1]} but the clip's first frame "
                                   f"is {size[0]}x{size[1]}; give every frame of a clip one size")

    def frame_count(self, limit: int) -> int:
        return min(len(self._frames()), limit)

    def load_frames(self, indices: list[int], reduce: int = 1) -> torch.Tensor:
        frames = self._frames()
        check_decode_budget(self.describe(), len(indices), frames[0].size())
        loaded = [frames[i].load(reduce) for i in indices]
        if any(f.shape != loaded[0].shape for f in loaded):
            raise DatasetError(f"{self.describe()}: frames of different sizes; give every frame of a clip one size")
        return torch.stack(loaded)

    def digest(self) -> str:
        hasher = hashlib.sha256()
        for frame in self._frames():
            hasher.update(f"{frame.path.name}\0{frame.digest()}\n".encode())
        return hasher.hexdigest()


class TensorVideo:
    """One clip [F, H, W, 3] held in memory (synthetic clips, a video batch from another node)."""

    def __init__(self, frames: torch.Tensor, label: str, rate: float | None = None):
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] < 1:
            raise DatasetError(f"{label}: a clip must be frames [F, H, W, 3], got shape {tuple(frames.shape)}")
        self.frames = frames
        self.label = label
        self.rate = rate

    def frame_rate(self) -> float | None:
        return self.rate

    def describe(self) -> str:
        return self.label

    def size(self) -> tuple[int, int]:
        return int(self.frames.shape[2]), int(self.frames.shape[1])

    def check(self) -> None:
        pass

    def frame_count(self, limit: int) -> int:
        return min(int(self.frames.shape[0]), limit)

    def load_frames(self, indices: list[int], reduce: int = 1) -> torch.Tensor:
        return self.frames[indices].to(torch.float32)

    def digest(self) -> str:
        pixels = self.frames.detach().to(device="cpu", dtype=torch.float32).contiguous()
        return hashlib.sha256(pixels.numpy().tobytes()).hexdigest()


VideoSource = FileVideo | FrameFolder | TensorVideo


def is_video(source) -> bool:
    return isinstance(source, (FileVideo, FrameFolder, TensorVideo))


def _check_source(source) -> str | None:
    try:
        source.check()
        source.size()
    except (DatasetError, UntrustedFileError) as error:
        return str(error)
    except (OSError, ValueError, SyntaxError) as error:
        return f"{source.describe()}: unreadable or corrupt ({type(error).__name__}); re-export it or remove it"
    return None


def _source_at(path: Path, roots: tuple[Path, ...], frame_rate: float | None = None):
    """The clip or image at `path` (a frame folder, shown at `frame_rate`; a video file; an image), or None for another
    kind of file."""
    if path.is_dir() and not path.is_symlink():
        return FrameFolder(path, roots, frame_rate)
    suffix = path.suffix.lower()
    if suffix in VIDEO_EXTENSIONS:
        return FileVideo(path, roots)
    return FileImage(path, roots) if suffix in IMAGE_EXTENSIONS else None


def _masks_in(folder: Path, roots: tuple[Path, ...]) -> ByName:
    """name stem -> mask source in a mask folder: an image (every frame), a video or a folder of frames; found by a
    clip's name as dataset.ByName finds it (the same name, else the one differing only in case)."""
    masks = {}
    for path in sorted(folder.iterdir(), key=name_order):
        source = None if os_compat.is_hidden(path) else _source_at(path, roots)
        if source is not None:
            masks[path.name if isinstance(source, FrameFolder) else path.stem] = source
    return ByName(masks)


def _check_mask_size(source, mask) -> str | None:
    problem = _check_source(mask)
    if problem is None and mask.size() != source.size():
        (mw, mh), (w, h) = mask.size(), source.size()
        problem = (f"{mask.describe()}: mask is {mw}x{mh} but its clip {source.describe()} is {w}x{h}; resize the "
                   "mask to match")
    return problem


def dataset_from_video_folder(folder: Path, *, resolution: int, step: int, crop: str = "center", flip: bool = False,
                              seed: int = 0, skip_bad: bool = False, roots: tuple[Path, ...] | None = None,
                              max_frames: int = MAX_FRAMES_DEFAULT, frame_stride: int = 1,
                              mask_folder: Path | None = None, frame_rate: float = 25.0,
                              default_caption: str | None = None) -> Dataset:
    """Clips in `folder`: video files (VIDEO_EXTENSIONS) and subfolders of frame images, each with a caption beside it
    (`clip.mp4` + `clip.txt`, `clip/` + `clip.txt`); images there are one-frame clips (`photo.png` + `photo.txt`).
    Loss masks in `mask_folder`, matched by name stem: an image (applied to every frame of its clip), or a video / frame
    folder with the clip's frames (the same frames are taken from it); of the clip's size. Cache Latents checks the
    frame counts. `frame_rate`: frames per second of the frame folders (video files carry their own).
    `default_caption` (the node's trigger word): the caption of a clip without a caption file, else a problem."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"dataset folder {display_path(folder)} does not exist or is not a folder")
    if mask_folder is not None and not Path(mask_folder).is_dir():
        raise DatasetError(f"mask folder {display_path(mask_folder)} does not exist or is not a folder")
    if not 1 <= max_frames <= MAX_CLIP_FRAMES:
        raise DatasetError(f"max_frames={max_frames}: give 1..{MAX_CLIP_FRAMES}")
    if frame_stride < 1:
        raise DatasetError(f"frame_stride={frame_stride}: give 1 or more")
    if not frame_rate > 0:
        raise DatasetError(f"frame_rate={frame_rate}: give the frame folders' frames per second (more than 0)")
    roots = tuple(roots) if roots else tuple(p for p in (folder, mask_folder) if p is not None)
    masks = _masks_in(Path(mask_folder), roots) if mask_folder is not None else ByName({})
    items, problems, default_captions = [], [], 0
    entries = [path for path in sorted(folder.iterdir(), key=name_order) if not os_compat.is_hidden(path)]
    # A frame folder's caption is `<folder name>.txt`, a file's `<stem>.txt` (or `.caption`: caption_file).
    frame_folder = {path: path.is_dir() and not path.is_symlink() for path in entries}
    names = {path.name if frame_folder[path] else path.stem for path in entries
             if path.suffix.lower() not in CAPTION_EXTENSIONS}
    notes = orphan_captions([path for path in entries if not frame_folder[path]], names, "clip or image", "clip")
    if mask_folder is not None:
        notes += masks.unmatched(names, "mask", mask_folder, "clip or image")
    for path in entries:
        suffix = path.suffix.lower()
        if suffix in CAPTION_EXTENSIONS:
            continue
        source = _source_at(path, roots, frame_rate)
        caption_path = caption_file(path, frame_folder=True) if isinstance(source, FrameFolder) else None
        if source is None:
            problems.append(f"{display_path(path)}: unsupported file type {suffix!r} (videos: {', '.join(VIDEO_EXTENSIONS)}; "
                            f"images: {', '.join(IMAGE_EXTENSIONS)}; or a folder of frames); move it out of the "
                            "dataset folder")
            continue
        stem = path.name if isinstance(source, FrameFolder) else path.stem
        mask = masks.get(stem)
        if default_caption is not None and not os.path.lexists(caption_path or caption_file(path)):
            caption, default_captions = (default_caption,), default_captions + 1
        else:
            caption = _read_caption(path, roots, caption_path, missing_hint=MISSING_CAPTION_HINT)
        problem = caption if not isinstance(caption, tuple) else _check_source(source)
        if not problem and mask is not None:
            problem = _check_mask_size(source, mask)
        if problem:
            problems.append(problem)
            continue
        items.append(DatasetItem(name=path.name, caption=caption[0], image=source, mask=mask))
    if problems and not skip_bad:
        raise DatasetError(f"{len(problems)} problem(s) in dataset folder {display_path(folder)} (fix them, or enable "
                           "skip_bad to leave those items out):\n- " + "\n- ".join(problems) + also_noted(notes))
    if not items:
        raise DatasetError(f"no usable clips in {display_path(folder)}: put videos ({', '.join(VIDEO_EXTENSIONS)}), "
                           f"folders of frames or images there, each with a same-name {CAPTION_EXTENSION} caption file"
                           + (" (skipped:\n- " + "\n- ".join(problems) + ")" if problems else "") + also_noted(notes))
    return Dataset(items=tuple(items), resolution=resolution, step=step, crop=crop, flip=flip, seed=seed,
                   skip_bad=skip_bad, left_out=tuple(problems), notes=tuple(notes),
                   max_frames=max_frames, frame_stride=frame_stride, default_captions=default_captions)


def _tensor_mask(mask: torch.Tensor | None, index: int):
    """A clip's in-memory loss mask: [H, W] (every frame) or [F, H, W] (one per frame), 1 learned, 0 not."""
    if mask is None:
        return None
    label = f"mask of clip {index}"
    if mask.ndim == 2:
        return TensorImage(mask[..., None].expand(-1, -1, 3), label)
    if mask.ndim == 3:
        return TensorVideo(mask[..., None].expand(-1, -1, -1, 3), label)
    raise DatasetError(f"{label}: give [H, W] (every frame) or [F, H, W] (one per frame), got shape "
                       f"{tuple(mask.shape)}")


def dataset_from_clips(clips: list[torch.Tensor], captions: list[str], *, resolution: int, step: int,
                       crop: str = "center", flip: bool = False, seed: int = 0, max_frames: int = MAX_FRAMES_DEFAULT,
                       frame_stride: int = 1, masks: list[torch.Tensor | None] | None = None,
                       frame_rate: float | None = None) -> Dataset:
    """Items from in-memory clips [F, H, W, 3] (synthetic clips, tests) with one caption each, and optional loss masks
    (one per clip, or None: `_tensor_mask`); `frame_rate`: their frames per second (None: unknown)."""
    if len(clips) != len(captions):
        raise DatasetError(f"{len(clips)} clips but {len(captions)} captions; give one caption per clip")
    masks = list(masks) if masks is not None else [None] * len(clips)
    if len(masks) != len(clips):
        raise DatasetError(f"{len(clips)} clips but {len(masks)} masks; give one mask (or None) per clip")
    items = tuple(DatasetItem(name=f"clip {i}", caption=caption, image=TensorVideo(clip, f"clip {i}", frame_rate),
                              mask=_tensor_mask(mask, i))
                  for i, (clip, caption, mask) in enumerate(zip(clips, captions, masks)))
    return Dataset(items=items, resolution=resolution, step=step, crop=crop, flip=flip, seed=seed,
                   max_frames=max_frames, frame_stride=frame_stride)
