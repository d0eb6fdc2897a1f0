"""Video validation: clip lengths a family's model takes, the empty latent its stock node makes, and the saved clips
(an animated WEBP per prompt, as ComfyUI's SaveAnimatedWEBP writes it; validation.py writes their frame grid PNG).

Frame rates: a family whose model reads the clip's frame rate (Family.frame_rate: LTX-2, whose temporal positions are
in seconds) trains each item at its cached clip's rate (a video's rate / frame_stride) and validates at the first
cached clip's (or a given) rate through the stock LTXVConditioning node, as a workflow sets it; a clip without a known
rate gets the model's default. Items of different rates in one batch are run as separate forwards (ComfyUI's constant
conds do not concatenate: ComfyDenoiser.grouped_forward)."""
from __future__ import annotations

import pathlib
from io import BytesIO

import numpy as np
import torch
from PIL import Image

from ...training.data.files import write_bytes
from . import families
from .comfy_model import FRAME_RATE

VALIDATION_FPS = 16  # Wan's frame rate


def check_frames(node: str, model, frames: int) -> int:
    """The latent frame count of a `frames`-frame clip of this MODEL (1 for images), or a ValueError naming the fix."""
    if frames == 1:
        return 1
    family = families.family_of(model)
    step = family.frame_step if family is not None else None
    if step is None:
        raise ValueError(f"{node}: frames={frames}, but this MODEL ({type(model).__name__}) makes images, not clips; "
                         "set frames to 1")
    if frames < 1 or (frames - 1) % step:
        lower = max(1, (frames - 1) // step * step + 1)
        raise ValueError(f"{node}: frames={frames}: {family.name} clips have {step}k+1 frames; use {lower} or "
                         f"{lower + step}")
    return (frames - 1) // step + 1


def model_frame_rate(model) -> float | None:
    """The frame rate a MODEL assumes without one (its family's), or None: it takes no frame rate."""
    family = families.family_of(model)
    return family.frame_rate if family is not None else None


def item_frame_rate_extras(model, latent_cache):
    """The trainer's item_extras for a MODEL that reads frame rates: item -> {"frame_rate": its clip's rate} (nothing
    for a clip of unknown rate: the model's default); None for other models, or caches without rates (in-memory
    caches, clips of unknown rate)."""
    read = getattr(latent_cache, "frame_rate", None)
    if model_frame_rate(model) is None or read is None:
        return None
    rates = [read(i) for i in range(len(latent_cache))]
    if all(rate is None for rate in rates):
        return None
    return lambda item: {FRAME_RATE: rates[item]} if rates[item] is not None else {}


def validation_frame_rate(node: str, model, latent_cache, given: float = 0.0) -> float | None:
    """The frame rate a validation clip is sampled at (through LTXVConditioning): `given` (> 0), else the first cached
    clip's that has one; None where the model takes none or neither is known (the model's default, with no node). A rate given for
    a model that takes none: a ValueError naming the node."""
    default = model_frame_rate(model)
    if default is None:
        if given:
            raise ValueError(f"{node}: frame_rate={given} given, but this MODEL ({type(model).__name__}) takes no frame "
                             "rate (LTX-2 does); set frame_rate to 0")
        return None
    if given:
        return float(given)
    read = getattr(latent_cache, "frame_rate", None)
    rates = (read(i) for i in range(len(latent_cache))) if read is not None else ()  # stops at the first known
    return next((rate for rate in rates if rate is not None), None)


def stock_frame_rate_conditioning(positive, negative, frame_rate: float):
    """(positive, negative) with the rate set exactly as the stock LTXVConditioning node sets it."""
    from comfy_extras import nodes_lt

    return nodes_lt.LTXVConditioning.execute(positive, negative, frame_rate).args


def empty_video_latent(latent_frames: int, width: int, height: int, device) -> torch.Tensor:
    """As the stock EmptyHunyuanLatentVideo (what Wan workflows start from) makes it: 16 channels, 8x downscale;
    comfy.sample.fix_empty_latent_channels then fits it to the model's format."""
    return torch.zeros([1, 16, latent_frames, height // 8, width // 8], device=device)


def stock_pixels(images: torch.Tensor) -> np.ndarray:
    """IMAGE values as 8-bit pixels exactly as the stock save nodes make them (SaveImage, SaveAnimatedWEBP:
    truncated, not rounded), so a validation file equals theirs for the same images."""
    return np.ascontiguousarray(np.clip(255.0 * images.float().cpu().numpy(), 0, 255).astype(np.uint8))


def _pil_frames(clip: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(frame) for frame in stock_pixels(clip[..., :3])]


def webp_bytes(clip: torch.Tensor, fps: float = VALIDATION_FPS) -> bytes:
    """[F, H, W, 3] -> an animated lossless WEBP, as SaveAnimatedWEBP writes one (PIL, one duration per frame)."""
    frames = _pil_frames(clip)
    buffer = BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=int(1000.0 / fps),
                   lossless=True, quality=80, method=4)
    return buffer.getvalue()


def save_clips(grid_path: pathlib.Path, images: torch.Tensor, frames: int, what: str,
               fps: float = VALIDATION_FPS) -> list[pathlib.Path]:
    """One animated WEBP per prompt next to the grid PNG, at `fps`: <grid stem>_<prompt index>.webp (temp file, then
    renamed)."""
    paths = []
    for index, clip in enumerate(images.reshape(-1, frames, *images.shape[1:])):
        path = grid_path.with_name(f"{grid_path.stem}_{index}.webp")
        write_bytes(path, webp_bytes(clip, fps), f"validation clip {index} of {what}")
        paths.append(path)
    return paths
