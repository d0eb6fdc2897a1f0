"""Wan 2.1 text-to-video: ComfyUI's `comfy.model_base.WAN21` (comfy/ldm/wan/model.py WanModel, a DiT with self- and
cross-attention per block) configured as `supported_models.WAN21_T2V` (1.3B: 1536 wide, 30 blocks; 14B: 5120 wide,
40 blocks), text encoder UMT5-XXL (comfy/text_encoders/wan.py), the Wan 2.1 VAE: 16-channel video latents
[B, C, T, H, W] (latent_formats.Wan21), T = 1 + (frames - 1) / 4, flow matching (shift 8).

Wan 2.2 A14B's two experts (high noise / low noise) are this same module and config (ComfyUI loads each as a
WAN21_T2V), so they are recognised here too, and so is image-to-video (Wan 2.1 I2V, Wan 2.2 A14B I2V's experts:
`supported_models.WAN21_I2V`, 36 input channels = the noisy latent, a 4-channel mask and the start image's latent).
An I2V model trains on each clip's first frame as its start image, given to the model exactly as the stock
WanImageToVideo node gives it (`concat_latent_image` + `concat_mask`, cached with the clip: Cache Latents'
start_image); no CLIP-vision input (Wan 2.2 I2V has none; Wan 2.1 I2V's `clip_vision_output` is optional and left
empty). Other models of the same class are not: FLF2V, Fun, Camera, VACE, HuMo, S2V, Animate and the causal / Wan 2.2
5B classes take inputs this trainer does not give; they train as unlisted models (targets all_linear) with their
extra inputs left empty."""
from __future__ import annotations

import os

import comfy.ldm.wan.model
import comfy.model_base
import comfy.sd1_clip
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.wan
from transformers import T5TokenizerFast

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel
from .qwen_image import _tiny_wan_vae

# UMT5-XXL shrunk through ComfyUI's `umt5xxl_model_config` option (comfy/text_encoders/umt5_config_xxl.json: gated
# GELU, a relative position bias per layer). The vocabulary is T5's (32128 ids, what the tokenizer below gives).
TINY_UMT5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 2, "d_kv": 16, "vocab_size": 32128}


class _TinyUMT5Tokenizer(comfy.sd1_clip.SDTokenizer):
    """ComfyUI's UMT5 tokenizer settings (no start token, pads to 512 tokens with id 0, end id 1) over ComfyUI's shipped
    T5 tokenizer. ComfyUI reads the real UMT5 sentencepiece model out of the text encoder's weights file
    (`spiece_model`), which random tiny weights have none of."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):
        path = os.path.join(os.path.dirname(os.path.realpath(comfy.text_encoders.wan.__file__)), "t5_tokenizer")
        super().__init__(path, embedding_directory=embedding_directory, pad_with_end=False, embedding_size=TINY_UMT5["d_model"],
                         embedding_key="umt5xxl", tokenizer_class=T5TokenizerFast, has_start_token=False,
                         pad_to_max_length=False, max_length=99999999, min_length=512, pad_token=0,
                         tokenizer_data=tokenizer_data)


class _TinyWanTokenizer(comfy.sd1_clip.SD1Tokenizer):
    def __init__(self, embedding_directory=None, tokenizer_data={}):
        super().__init__(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data, clip_name="umt5xxl",
                         tokenizer=_TinyUMT5Tokenizer)


# comfy/model_detection.py derives the head count as dim // 128, patch (1, 2, 2), frequency width 256, qk and cross-
# attention norms; the text width stays the class default (4096, UMT5-XXL's). The tiny one keeps that geometry with
# one 128-wide head, a 32-wide text input (the tiny encoder's) and 2 blocks.
_TINY_DIT = {
    "image_model": "wan2.1", "model_type": "t2v", "dim": 128, "ffn_dim": 256, "num_heads": 1, "num_layers": 2,
    "in_dim": 16, "out_dim": 16, "text_dim": TINY_UMT5["d_model"], "patch_size": (1, 2, 2), "freq_dim": 256,
    "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.WAN21_T2V(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(_TinyWanTokenizer, comfy.text_encoders.wan.te()),
    text_encoder_options={"umt5xxl_model_config": dict(TINY_UMT5)},
    latent_channels=16,
    tooltip="wan21: Wan 2.1 text-to-video DiT with a UMT5 text encoder and the Wan 2.1 video VAE (5-D latents)",
    vae=_tiny_wan_vae,
)


# Image-to-video: the same DiT taking the noisy latent, WanImageToVideo's 4-channel mask and the start image's latent
# (WAN21_I2V: in_dim 36); no CLIP-vision projection (Wan 2.2 I2V has none, Wan 2.1 I2V's input is left empty).
_TINY_I2V_DIT = dict(_TINY_DIT, model_type="i2v", in_dim=2 * 16 + 4)

TINY_VARIANTS = {
    "wan21_i2v": TinyModel(
        model_config=lambda: comfy.supported_models.WAN21_I2V(dict(_TINY_I2V_DIT)),
        clip_target=TINY.clip_target,
        text_encoder_options={"umt5xxl_model_config": dict(TINY_UMT5)},
        latent_channels=16,
        tooltip="wan21_i2v: Wan 2.1 / 2.2 A14B image-to-video DiT (36 input channels: latent, mask, start image)",
        vae=_tiny_wan_vae,
    ),
}


def _image_to_video(model) -> bool:
    """An I2V model: the latent + mask + start-latent input channels. Wan 2.1 I2V loads as WAN21_I2V (its CLIP-vision
    projection `img_emb` makes it "i2v"); Wan 2.2 A14B I2V has no img_emb, so ComfyUI loads it as WAN21_T2V with 36
    input channels, and its concat_cond builds the same mask + start latent input either way."""
    return model.diffusion_model.patch_embedding.weight.shape[1] == 2 * model.latent_format.latent_channels + 4


def _recognise(model) -> bool:
    # Text-to-video (as many input channels as the latent) and image-to-video; not the other variants of the class.
    diffusion_model = getattr(model, "diffusion_model", None)
    if type(model) is not comfy.model_base.WAN21 or type(diffusion_model) is not comfy.ldm.wan.model.WanModel:
        return False
    plain = not model.image_to_video and diffusion_model.patch_embedding.weight.shape[1] == model.latent_format.latent_channels
    return plain or _image_to_video(model)


FAMILY = Family(
    name="wan21",
    description="Wan 2.1 / 2.2 A14B text-to-video DiT (UMT5 encoder, Wan 2.1 VAE)",
    recognise=_recognise,
    # Self- and cross-attention projections and the feed-forward of every block, as musubi-tuner's Wan LoRAs (its
    # default leaves out the embedders, the head and the norms; the modulation is a parameter, not a layer).
    lora_preset=TargetPreset("wan21", (r"^blocks\.\d+\.((self_attn|cross_attn)\.(q|k|v|o)|ffn\.(0|2))$",)),
    text_tokens=512,  # UMT5 prompts pad to 512 tokens
    # ComfyUI's key map has no diffusers (WanTransformer3DModel) names for Wan: that format is refused with the ones
    # that load (comfyui, and kohya = musubi-tuner's `lora_unet_blocks_0_self_attn_q`).
    diffusers_component=None,
    # musubi-tuner's metadata (networks/lora_wan.py: architecture "wan"; utils/sai_model_spec.py: "wan2.1/lora").
    kohya_base=("wan", "wan2.1/lora"),
    frame_step=4,  # the Wan 2.1 VAE keeps the first frame, then encodes groups of 4
    start_image=lambda model: "WanImageToVideo" if _image_to_video(model) else None,
    tiny=TINY,
    tiny_variants=TINY_VARIANTS,
    position=30,
)
