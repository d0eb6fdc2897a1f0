"""ComfyUI's encoders (VAE, CLIP) as the caching and validation code uses them: their fingerprint (unpatched
weights + patches), unloading as the policy says, progress forwarding, ComfyUI's batch dimension and downscale."""
from __future__ import annotations

import hashlib

import torch

import comfy.model_management
import comfy.utils

from ...training.data.cache_store import fingerprint_state_dict, fingerprint_value


def _unpatched_state_dict(patcher) -> dict:
    """The encoder's own weights. While a patcher has LoRA-style patches applied, the module holds the
    patched weights and the originals sit in `patcher.backup`; the patches are fingerprinted apart."""
    state = patcher.model.state_dict()
    for key, saved in getattr(patcher, "backup", {}).items():
        if key in state:
            state[key] = saved.weight
    return state


def encoder_fingerprint(patcher) -> str:
    parts = [fingerprint_state_dict(_unpatched_state_dict(patcher))]
    if patcher.patches:
        parts.append(fingerprint_value(patcher.patches))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def unload_encoder(patcher, policy=None) -> None:
    """Take the encoder (and its clones) off the compute device through ComfyUI's own accounting, unless the
    policy keeps encoders loaded (then ComfyUI unloads them when it needs the room, as for stock nodes)."""
    if getattr(policy, "encoders", None) == "keep_loaded":
        return
    comfy.model_management.unload_model_and_clones(patcher)


def is_loaded(patcher) -> bool:
    return any(
        loaded.model is not None and loaded.model.clone_base_uuid == patcher.clone_base_uuid
        for loaded in comfy.model_management.current_loaded_models
    )


class ProgressForward:
    """Forwards (done, total) to a ComfyUI ProgressBar made once the total is known."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = comfy.utils.ProgressBar(total)
        self.bar.update_absolute(done, total)


def unbatch(tensor: torch.Tensor) -> torch.Tensor:
    # ComfyUI gives one prompt's conditioning tensors a leading batch dimension of 1.
    return tensor[0] if tensor.ndim >= 1 and tensor.shape[0] == 1 else tensor



def frame_step(vae) -> int | None:
    """Pixel frames per latent frame of a video VAE (Wan 2.1: 4), as its own decode ratio says; None for an image VAE."""
    if getattr(vae, "latent_dim", 2) != 3:
        return None
    return vae.temporal_compression_decode()


def spatial_downscale(vae) -> int:
    """Image px per latent px of a ComfyUI VAE (8; Flux.2: 16; 1 when it is not a plain number)."""
    ratio = vae.spacial_compression_encode()
    return ratio if isinstance(ratio, int) else 1
