"""Video validation: clip lengths a family's model takes, the empty latent its stock node makes, and the saved clips
(an animated WEBP per prompt, as ComfyUI's SaveAnimatedWEBP writes it, and a frame grid PNG)."""
from __future__ import annotations

import pathlib
from io import BytesIO

import numpy as np
import torch
from PIL import Image

from ...training.data.files import write_bytes
from . import families

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


def empty_video_latent(latent_frames: int, width: int, height: int, device) -> torch.Tensor:
    """As the stock EmptyHunyuanLatentVideo (what Wan workflows start from) makes it: 16 channels, 8x downscale;
    comfy.sample.fix_empty_latent_channels then fits it to the model's format."""
    return torch.zeros([1, 16, latent_frames, height // 8, width // 8], device=device)


def _pil_frames(clip: torch.Tensor) -> list[Image.Image]:
    pixels = (clip[..., :3].clamp(0, 1) * 255).round().to(torch.uint8).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(frame)) for frame in pixels]


def webp_bytes(clip: torch.Tensor, fps: int = VALIDATION_FPS) -> bytes:
    """[F, H, W, 3] -> an animated lossless WEBP, as SaveAnimatedWEBP writes one (PIL, one duration per frame)."""
    frames = _pil_frames(clip)
    buffer = BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=int(1000.0 / fps),
                   lossless=True, quality=80, method=4)
    return buffer.getvalue()


def frame_grid(images: torch.Tensor, frames: int) -> torch.Tensor:
    """[N * F, H, W, C] (each prompt's frames in order) -> [N * H, F * W, 3]: a row of frames per prompt."""
    clips = images[..., :3].reshape(-1, frames, *images.shape[1:3], 3)
    return torch.cat([torch.cat(list(clip), dim=1) for clip in clips], dim=0)


def save_clips(grid_path: pathlib.Path, images: torch.Tensor, frames: int, what: str) -> list[pathlib.Path]:
    """One animated WEBP per prompt next to the grid PNG: <grid stem>_<prompt index>.webp (temp file, then renamed)."""
    paths = []
    for index, clip in enumerate(images.reshape(-1, frames, *images.shape[1:])):
        path = grid_path.with_name(f"{grid_path.stem}_{index}.webp")
        write_bytes(path, webp_bytes(clip), f"validation clip {index} of {what}")
        paths.append(path)
    return paths
