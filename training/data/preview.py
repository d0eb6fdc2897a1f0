"""What caching will encode, shown before it does: each item's crop at its bucket (the size, crop and decode
reduction Cache Latents uses), its loss mask and caption, for Preview Dataset (nodes/data.py). kohya's
`--debug_dataset` does this for its trainer; here it is a node, so a wrong crop, a mask that hides the subject or a
caption without its trigger word is seen before any encoding or step is paid for.

Only the items shown are decoded. Crops are scaled down to fit PREVIEW_SIDE and put on a common canvas (an IMAGE
batch has one size); the buckets' own sizes are in the text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .buckets import ENLARGED_NOTE_FACTOR, apply_crop, bucket_for, plan_crop, upscale_factor
from .dataset import Dataset, DatasetError, reduce_factor
from .video import is_video

PREVIEW_SIDE = 512  # the canvas's longest side at most: 64 previews stay ~200 MB as float32
MAX_PREVIEWS = 64
CANVAS_GREY = 0.5  # around a crop smaller than the canvas (another bucket's shape)
MASKED_OUT_BRIGHTNESS = 0.25  # what a mask leaves out is shown this dark


@dataclass(frozen=True)
class ItemPreview:
    index: int
    name: str
    caption: str
    bucket: tuple[int, int]  # (width, height) at the dataset's resolution
    repeats: int
    pixels: torch.Tensor | None  # [bucket_h, bucket_w, 3] float32 0..1, as Cache Latents crops it; None: unreadable
    mask: torch.Tensor | None  # [bucket_h, bucket_w] 0..1 (1: learned), or None: learned whole
    problem: str = ""  # why `pixels` is None
    enlarged: float = 1.0  # how much the image is enlarged to fill its bucket (buckets.upscale_factor; <= 1: not)


def preview_items(dataset: Dataset, start: int, count: int) -> list[ItemPreview]:
    """Items start .. start + count - 1 (those that exist) at `dataset.resolution`, unflipped, as Cache Latents
    crops them (a clip: its first frame). An item that cannot be read is returned with its problem, not raised:
    Cache Latents reports it (or skip_bad leaves it out) the same way."""
    previews = []
    for index in range(start, min(start + count, len(dataset))):
        item = dataset.items[index]
        try:
            size = item.image.size()
            bucket = bucket_for(*size, dataset.resolution, dataset.step, dataset.upscale, dataset.bucket_sides)
            # The crop Cache Latents plans: a random crop is seeded by the image's digest, as there
            plan = plan_crop(size, bucket, dataset.crop, dataset.seed, item.image.digest(), False)
            reduce = reduce_factor(size, plan.resized)
            pixels = apply_crop(_first_frame(item.image, reduce), plan)
            mask = apply_crop(_first_frame(item.mask, reduce), plan).mean(-1) if item.mask is not None else None
        except (DatasetError, OSError, ValueError, SyntaxError) as error:
            previews.append(ItemPreview(index, item.name, item.caption, (0, 0), item.repeats, None, None,
                                        str(error) or type(error).__name__))
            continue
        previews.append(ItemPreview(index, item.name, item.caption, bucket, item.repeats, pixels, mask,
                                    enlarged=upscale_factor(size, bucket)))
    return previews


def _first_frame(source, reduce: int) -> torch.Tensor:
    return source.load_frames([0], reduce)[0] if is_video(source) else source.load(reduce)


def preview_batch(previews: list[ItemPreview], show_masks: bool = True) -> torch.Tensor:
    """[N, H, W, 3]: each readable preview scaled by one factor (the largest bucket fits PREVIEW_SIDE) and centred
    on a grey canvas of the largest bucket's size; with `show_masks`, what a mask leaves out is darkened."""
    shown = [p for p in previews if p.pixels is not None]
    if not shown:
        raise DatasetError("no item shown could be read")
    width = max(p.bucket[0] for p in shown)
    height = max(p.bucket[1] for p in shown)
    scale = min(1.0, PREVIEW_SIDE / max(width, height))
    canvas_w, canvas_h = max(1, round(width * scale)), max(1, round(height * scale))
    batch = torch.full((len(shown), canvas_h, canvas_w, 3), CANVAS_GREY)
    for slot, preview in enumerate(shown):
        pixels = preview.pixels
        if show_masks and preview.mask is not None:
            pixels = pixels * (MASKED_OUT_BRIGHTNESS + (1 - MASKED_OUT_BRIGHTNESS) * preview.mask[..., None])
        w, h = max(1, round(preview.bucket[0] * scale)), max(1, round(preview.bucket[1] * scale))
        if (w, h) != preview.bucket:
            pixels = F.interpolate(pixels.movedim(-1, 0)[None], size=(h, w), mode="bilinear", antialias=True,
                                   align_corners=False)[0].movedim(0, -1).clamp_(0.0, 1.0)
        top, left = (canvas_h - h) // 2, (canvas_w - w) // 2
        batch[slot, top:top + h, left:left + w] = pixels
    return batch


def preview_lines(previews: list[ItemPreview], caption_chars: int = 160) -> list[str]:
    """One line per preview: index, name, bucket (repeats, mask), caption (cut at `caption_chars`); or its
    problem."""
    lines = []
    for p in previews:
        if p.pixels is None:
            lines.append(f"{p.index}: {p.name}: not shown: {p.problem}")
            continue
        extras = "".join([f", x{p.repeats} per epoch" if p.repeats > 1 else "",
                          f", mask: {p.mask.mean().item():.0%} learned" if p.mask is not None else "",
                          f", enlarged {p.enlarged:.2f}x" if p.enlarged >= ENLARGED_NOTE_FACTOR else ""])
        caption = p.caption.replace("\n", " | ")  # alternative captions, one picked per step
        caption = caption if len(caption) <= caption_chars else caption[:caption_chars - 3] + "..."
        lines.append(f"{p.index}: {p.name} ({p.bucket[0]}x{p.bucket[1]}{extras}): {caption or '(empty caption)'}")
    return lines
