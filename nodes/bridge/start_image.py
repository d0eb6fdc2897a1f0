"""Image-to-video start images (Wan I2V, HunyuanVideo 1.5): each clip's first frame is given to the model exactly as
the stock node (WanImageToVideo, HunyuanVideo15ImageToVideo) gives it to the sampler. The node itself makes the conditioning, at caching (each clip's
first frame, cached beside its latent so training never needs the VAE) and at validation (the start image through
the node, then the stock sampler); the training step passes the cached entries to the model's own `extra_conds`
(concat_cond), as the sampler passes the node's."""
from __future__ import annotations

import logging

import torch

from ...training.data.cache_store import START_CONDITIONING
from . import families

# Cache Latents' start_image choices: none, or the stock node whose start-image conditioning is cached.
START_IMAGE_NODES = ("none", "WanImageToVideo", "HunyuanVideo15ImageToVideo")
# Nodes whose models are text-to-video too: HunyuanVideo 1.5's T2V and I2V checkpoints are one architecture (65 input
# channels, the start image and mask left zero for text-to-video), so a cache without start images is plain T2V training.
TEXT_TO_VIDEO_TOO = ("HunyuanVideo15ImageToVideo",)


def start_image_node(model) -> str | None:
    """The stock start-image node of a MODEL's family ("WanImageToVideo" for Wan I2V, "HunyuanVideo15ImageToVideo" for
    HunyuanVideo 1.5), or None: no start image."""
    family = families.family_of(model)
    return family.start_image(model) if family is not None else None


def stock_start_conditioning(node: str, positive, negative, vae, width: int, height: int, frames: int,
                             image: torch.Tensor):
    """(positive, negative, latent) exactly as the stock node makes them for a start image [1, H, W, 3]. No
    clip_vision_output: HunyuanVideo 1.5 I2V's vision states stay out of the prompt, as the stock node leaves them
    when none is connected (Wan 2.2 I2V has no such input, Wan 2.1 I2V's is optional)."""
    from comfy_extras import nodes_hunyuan, nodes_wan

    stock = {"WanImageToVideo": nodes_wan.WanImageToVideo,
             "HunyuanVideo15ImageToVideo": nodes_hunyuan.HunyuanVideo15ImageToVideo}.get(node)
    if stock is None:
        raise ValueError(f"start_image={node!r}: choose one of {', '.join(START_IMAGE_NODES[1:])}")
    return stock.execute(positive, negative, vae, width, height, frames, 1, start_image=image).args


def start_encoder(node: str, vae):
    """frames [F, H, W, 3] -> the conditioning entries (START_CONDITIONING) the stock node adds to a prompt for the
    clip's first frame, batched [1, ...] as it makes them."""
    def encode(frames: torch.Tensor) -> dict[str, torch.Tensor]:
        positive, _, _ = stock_start_conditioning(node, [[torch.zeros(1, 1, 1), {}]], [], vae, frames.shape[2],
                                                  frames.shape[1], frames.shape[0], frames[:1])
        return {name: positive[0][1][name] for name in START_CONDITIONING}
    return encode


def item_start_extras(model, latent_cache, node_name: str):
    """The trainer's item_extras for a start-image MODEL: item -> its cached start-image conditioning (kept when
    caption dropout empties the prompt: the node conditions the negative prompt too); None for other models. A cache
    made without the model's start image trains without one (as the stock node without a start_image), said once."""
    node = start_image_node(model)
    if node is None:
        return None
    cached = getattr(latent_cache, "start_image", None)  # in-memory caches (tests, benchmarks) have none
    if cached is None:
        if node in TEXT_TO_VIDEO_TOO:  # a text-to-video run of a family whose models take both
            logging.info("%s: the LATENT_CACHE has no start images: training text-to-video (for image-to-video, set "
                         "Cache Latents' start_image to %s)", node_name, node)
            return None
        logging.warning("%s: this %s MODEL takes a start image (%s) but the LATENT_CACHE has none: it trains without "
                        "one, as %s without a start_image; to train image-to-video, set Cache Latents' start_image "
                        "to %s", node_name, type(model).__name__, node, node, node)
        return None
    if cached != node:
        raise ValueError(f"{node_name}: the LATENT_CACHE holds {cached} start images but this MODEL "
                         f"takes {node}'s: cache the latents with start_image {node}")
    return lambda item: {name: value.float() for name, value in latent_cache.start(item).items()}
