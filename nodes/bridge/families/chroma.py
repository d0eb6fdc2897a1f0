"""Chroma (Chroma1-HD / -Base, lodestones): a pruned Flux.1-schnell DiT (`comfy.model_base.Chroma`, a subclass of
ComfyUI's Flux class) whose per-block modulations come from one shared `distilled_guidance_layer` instead of each
block's own, conditioned on T5-XXL alone (no CLIP-L pooled vector); Flux's 16-channel latents. Its blocks are Flux's
(they add into their inputs in place). ChromaRadiance (pixel space) is not this family.

The flux family claimed Chroma models before this family existed; runs stored so resume as they are
(nodes/bridge/comfy_bridge.py CONFIG_RENAMED): the preset trains the same layers."""
from __future__ import annotations

import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.pixart_t5

from ....training.core.adapters import TargetPreset
from .base import TINY_T5, Family, TinyModel


def _is_chroma(model) -> bool:
    return isinstance(model, comfy.model_base.Chroma) and not isinstance(model, comfy.model_base.ChromaRadiance)


# Flux's head geometry (one 128-wide head, RoPE axes [16, 56, 56]) as in nodes/bridge/families/flux.py. Chroma's `in_channels`
# are the patchified channels (16 x 2 x 2, as comfy/model_detection.py sets them); its modulation approximator keeps
# its real input (in_dim 64: timestep, guidance and modulation-index embeddings) and writes `hidden_size`-wide
# modulations, with a small hidden width and depth here (released: 5120 wide, 5 layers).
_TINY_DIT = {
    "image_model": "chroma", "in_channels": 64, "out_channels": 64, "patch_size": 2,
    "context_in_dim": TINY_T5["d_model"], "hidden_size": 128, "mlp_ratio": 4.0, "num_heads": 1, "depth": 1,
    "depth_single_blocks": 2, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True, "in_dim": 64,
    "out_dim": 128, "hidden_dim": 64, "n_layers": 2, "txt_ids_dims": [], "vec_in_dim": None,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.Chroma(dict(_TINY_DIT)),
    # ComfyUI's Chroma text encoder: PixArt's T5-XXL wrapper (supported_models.Chroma.clip_target).
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.pixart_t5.PixArtTokenizer,
                                                               comfy.text_encoders.pixart_t5.pixart_te()),
    text_encoder_options={"t5xxl_model_config": dict(TINY_T5)},
    latent_channels=16,
    tooltip="chroma: Flux-style DiT, T5 only, shared modulation approximator",
)

FAMILY = Family(
    name="chroma",
    description="Chroma DiT (pruned Flux.1-schnell, T5 only)",
    recognise=_is_chroma,
    # Flux's preset: attention and MLP of both streams of the double blocks, both linears of the single blocks
    # (Chroma's blocks have no modulation layers of their own).
    lora_preset=TargetPreset("chroma", (r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])$",
                                        r"^single_blocks\.\d+\.(linear1|linear2)$")),
    # ComfyUI's Chroma tokenizer does not pad: a caption is as long as it is; 256 tokens is a long one.
    text_tokens=256,
    diffusers_component="transformer",  # diffusers' ChromaTransformer2DModel: Flux's module names
    # sd-scripts (flux_train_network.py --model_type chroma): ss_base_model_version "chroma",
    # modelspec.architecture "chroma" (library/sai_model_spec.py ARCH_FLUX_1_CHROMA) + "/lora".
    kohya_base=("chroma", "chroma/lora"),
    inplace_blocks=_is_chroma,  # Flux's DoubleStreamBlock / SingleStreamBlock
    tiny=TINY,
    position=5,
)
