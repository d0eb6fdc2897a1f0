"""Aspect-ratio buckets: equal-area (width, height) sizes around a target resolution.

Each image goes to the bucket whose aspect ratio is nearest to its own, is resized just enough to
cover the bucket, then cropped to it (center, or at a seeded random offset) and optionally mirrored.
A `CropPlan` records every one of those choices, so the cache key can cover them exactly.

Written here rather than taken from a library: diffusers and torchvision have no bucketing, and the
trainers that do (kohya, SimpleTuner) are applications, not importable libraries.
"""
from __future__ import annotations

import functools
import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CROP_MODES = ("center", "random")
# Named in the cache key: changing how pixels are resized must invalidate cached latents.
RESIZE_METHOD = "torch-bicubic-antialias-clamp-v1"


def make_buckets(resolution: int, step: int, max_aspect: float = 4.0, sides: tuple[int, int] = (0, 0)
                 ) -> list[tuple[int, int]]:
    """(width, height) sizes with both sides multiples of `step`, area at most resolution**2 (the
    long side as large as the step allows), aspect ratio within 1/max_aspect .. max_aspect. `sides`: (shortest,
    longest) side a bucket may have, 0 for no limit (kohya's min_bucket_reso / max_bucket_reso): a long side over the
    longest is cut to it (that bucket then has less area, as kohya's), a short side under the shortest has no bucket.
    Empty when the limits leave none."""
    if step < 8 or step % 8:
        raise ValueError(f"bucket side step must be a positive multiple of 8, got {step}")
    if resolution < step or resolution % step:
        raise ValueError(
            f"resolution {resolution} must be a multiple of the side step {step} "
            f"(e.g. {max(step, resolution // step * step)})"
        )
    shortest, longest = sides
    area = resolution * resolution
    buckets = set()
    # Walk the short side up to the square; the long side is the largest step multiple that keeps
    # the area within budget. Mirroring each size makes portrait and landscape buckets match.
    short = max(step, shortest)
    while short * short <= area and (not longest or short <= longest):
        long = area // short // step * step
        if longest:
            long = min(long, longest)
        if long / short <= max_aspect:
            buckets.update({(short, long), (long, short)})
        short += step
    return sorted(buckets)


def check_bucket_sides(sides: tuple[int, int], step: int, resolutions: Sequence[int]) -> None:
    """Refuse bucket side limits that are not 0 or multiples of `step`, a shortest over the longest, or limits that
    leave one of `resolutions` no bucket; the message names the inputs (min_bucket_side, max_bucket_side)."""
    shortest, longest = sides
    for name, side in (("min_bucket_side", shortest), ("max_bucket_side", longest)):
        if side < 0 or side % step:
            raise ValueError(f"{name}={side}: give 0 (no limit) or a multiple of step {step} (e.g. "
                             f"{max(step, side // step * step)})")
    if shortest and longest and shortest > longest:
        raise ValueError(f"min_bucket_side={shortest} is over max_bucket_side={longest}: give a shortest side at most "
                         "the longest")
    for resolution in resolutions:
        if not make_buckets(resolution, step, sides=sides):
            raise ValueError(f"min_bucket_side={shortest} leaves resolution {resolution} no bucket (its square is "
                             f"{resolution} wide): give a min_bucket_side of at most {resolution}")


def nearest_bucket(width: int, height: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest (in log space, so 2:1 and 1:2 are equally far from 1:1)."""
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - aspect), -b[0] * b[1]))


@functools.lru_cache(maxsize=256)
def _buckets(resolution: int, step: int, sides: tuple[int, int] = (0, 0)) -> tuple[tuple[int, int], ...]:
    return tuple(make_buckets(resolution, step, sides=sides))


def bucket_for(width: int, height: int, resolution: int, step: int, upscale: bool = True,
               sides: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """The bucket an image of (`width`, `height`) trains in at `resolution`: the nearest in aspect ratio. With
    `upscale` off (kohya's bucket_no_upscale), an image smaller than that bucket takes the nearest bucket of the
    largest smaller resolution (a multiple of `step`) that it covers, so it is only ever scaled down; an image smaller
    than every bucket takes the smallest. `sides`: make_buckets' side limits."""
    if upscale:
        return nearest_bucket(width, height, _buckets(resolution, step, sides))
    bucket = None
    for smaller in range(resolution, step - 1, -step):
        candidates = _buckets(smaller, step, sides)
        if not candidates:  # below min_bucket_side: no smaller bucket exists
            break
        bucket = nearest_bucket(width, height, candidates)
        if bucket[0] <= width and bucket[1] <= height:
            break
    return bucket


# An image enlarged this much or more for its bucket is named (Cache Latents' notes, Preview Dataset's lines): a resize
# of a few percent is not visible; 1.25x is where enlarged detail starts to look soft.
ENLARGED_NOTE_FACTOR = 1.25


def upscale_factor(size: tuple[int, int], bucket: tuple[int, int]) -> float:
    """How much an image of `size` is enlarged to cover `bucket` (plan_crop's resize; <= 1: not enlarged)."""
    return max(bucket[0] / size[0], bucket[1] / size[1])


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes one bucket-sized training sample."""

    bucket: tuple[int, int]  # (width, height) of the result
    resized: tuple[int, int]  # (width, height) after resizing, before cropping
    offset: tuple[int, int]  # (x, y) of the crop's top-left corner in the resized image
    flip: bool  # mirrored left-right after cropping

    def key_params(self) -> dict:
        return {
            "bucket": list(self.bucket),
            "resized": list(self.resized),
            "offset": list(self.offset),
            "flip": self.flip,
            "resize_method": RESIZE_METHOD,
        }


def plan_crop(
    image_size: tuple[int, int], bucket: tuple[int, int], crop: str, seed: int, item_id: str, flip: bool
) -> CropPlan:
    """Plan resize + crop of an image of `image_size` (width, height) into `bucket`.

    A random crop draws its offset from (seed, item_id): the same item gets the same crop on every
    run, whatever its position in the dataset, so cached entries stay valid.
    """
    if crop not in CROP_MODES:
        raise ValueError(f"crop must be one of {CROP_MODES}, got {crop!r}")
    width, height = image_size
    bucket_w, bucket_h = bucket
    scale = max(bucket_w / width, bucket_h / height)  # cover the bucket; crop the overhang
    resized = (max(bucket_w, round(width * scale)), max(bucket_h, round(height * scale)))
    spare_x, spare_y = resized[0] - bucket_w, resized[1] - bucket_h
    if crop == "center":
        offset = (spare_x // 2, spare_y // 2)
    else:
        digest = hashlib.sha256(f"{seed}:{item_id}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        offset = (rng.randint(0, spare_x), rng.randint(0, spare_y))
    return CropPlan(bucket=bucket, resized=resized, offset=offset, flip=flip)


def apply_crop(pixels: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """pixels [H, W, 3] float 0..1 -> [bucket_h, bucket_w, 3] float32 0..1, as the plan says."""
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected pixels [H, W, 3], got shape {tuple(pixels.shape)}")
    image = pixels.to(torch.float32).movedim(-1, 0).unsqueeze(0)  # [1, 3, H, W] for interpolate
    if (image.shape[-1], image.shape[-2]) != plan.resized:
        image = F.interpolate(
            image, size=(plan.resized[1], plan.resized[0]), mode="bicubic", antialias=True, align_corners=False
        ).clamp_(0.0, 1.0)  # bicubic overshoots at edges
    x, y = plan.offset
    image = image[:, :, y : y + plan.bucket[1], x : x + plan.bucket[0]]
    if plan.flip:
        image = image.flip(-1)
    return image[0].movedim(0, -1).contiguous()
