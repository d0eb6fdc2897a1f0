"""HunyuanVideo 1.5 (text-to-video and image-to-video): `comfy.model_base.HunyuanVideo15`, ComfyUI's HunyuanVideo DiT
(comfy/ldm/hunyuan_video/model.py) in its 1.5 configuration (3-D 1x1x1 patches on 32-channel latents, RoPE axes
[16, 56, 56], a cond-type embedding, the SigLIP `vision_in` mapper, byT5 glyph text; 8.3B: 2048 wide, 54 double
blocks, no single blocks), text encoders Qwen2.5-VL-7B + byT5-small (comfy/text_encoders/hunyuan_image.py with the
video prompt template), its own VAE (latent_formats.HunyuanVideo15: 32 channels, 16x spatial, 4x temporal: clips of
4k+1 frames), flow matching (shift 7).

The DiT takes 65 input channels: the noise, a 32-channel image latent and a mask. Text-to-video leaves the image and
the mask zero (model_base.HunyuanVideo15.concat_cond). Image-to-video checkpoints are the same class, config and
channels (nothing but their weights tells them apart), so every model of the family takes a start image: with Cache
Latents' start_image set to HunyuanVideo15ImageToVideo each clip's first frame is given to the model exactly as that
stock node gives it (`concat_latent_image` + `concat_mask`, cached with the clip); without, it trains text-to-video.
No vision states: the node's `clip_vision_output` (SigLIP features for `vision_in`) is optional and left empty, as
the node leaves the prompt when none is connected. The super-resolution model (HunyuanVideo15_SR_Distilled) is not
this family.

ComfyUI maps diffusion-pipe names (`transformer.double_blocks.0.img_attn_qkv`) for the HunyuanVideo classes but no
diffusers (HunyuanVideo15Transformer3DModel) names: files are written in the comfyui or kohya format."""
from __future__ import annotations

import comfy.ldm.hunyuan_video.model
import comfy.ldm.models.autoencoder
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.hunyuan_image
import comfy.text_encoders.hunyuan_video
import torch

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel
from .hunyuan_image import (TINY_BYT5, TINY_QWEN25_7B, _TinyVisionQwen25VLModel, _without_no_vae_warning,
                            load_narrow_vae)

# The VAE's encoder / decoder (comfy/ldm/hunyuan_video/vae_refiner.py, causal 3-D convolutions) narrow: the released
# widths are [128, 256, 512, 1024, 1024]; five stages keep the 16x spatial / 4x temporal downscale, the last width
# stays a multiple of 2 x 32 latent channels (the encoder's skip averages channel groups onto them, the decoder's
# repeats them) and every down / up step's width a multiple of its 2x2(x2) pixel shuffle.
_VAE_DDCONFIG = {"block_out_channels": [32, 32, 64, 64, 64], "in_channels": 3, "out_channels": 3,
                 "num_res_blocks": 2, "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
                 "upsample_match_channel": True, "z_channels": 32}


def _vae_module(ddconfig: dict) -> torch.nn.Module:
    """The module ComfyUI's VAE detection builds for a HunyuanVideo 1.5 state dict (comfy/sd.py), at `ddconfig`."""
    return comfy.ldm.models.autoencoder.AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.EmptyRegularizer"},
        encoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Encoder", "params": ddconfig},
        decoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Decoder", "params": ddconfig})


class _NarrowHunyuanVideo15VAE(comfy.sd.VAE):
    """comfy.sd.VAE holding the HunyuanVideo 1.5 VAE narrow. ComfyUI builds this VAE only at the released widths (its
    detection keys on a 32-channel `decoder.conv_in.conv`, then fixes every width), so the module is built here from
    `config["ddconfig"]` with the settings that detection branch gives (32 channels, 16x spatial, 4x temporal with the
    first frame alone, fp16 / bf16 / fp32); device, dtype, patcher and weight loading are comfy.sd.VAE's own steps."""

    def __init__(self, sd=None, config=None, **kwargs):
        with _without_no_vae_warning():  # an empty state dict: comfy.sd.VAE sets its defaults and builds nothing
            super().__init__(sd={})
        self.first_stage_model = _vae_module(config["ddconfig"]).eval()
        self.latent_channels = config["ddconfig"]["z_channels"]
        self.upscale_ratio = (lambda a: max(0, a * 4 - 3), 16, 16)
        self.upscale_index_formula = (4, 16, 16)
        self.downscale_ratio = (lambda a: max(0, (a + 3) // 4), 16, 16)
        self.downscale_index_formula = (4, 16, 16)
        self.latent_dim = 3
        self.not_video = False
        self.working_dtypes = [torch.float16, torch.bfloat16, torch.float32]
        dtype_size = comfy.model_management.dtype_size
        self.memory_used_encode = lambda shape, dtype: (1400 * 9 * shape[-2] * shape[-1]) * dtype_size(dtype)
        self.memory_used_decode = lambda shape, dtype: (3600 * 4 * shape[-2] * shape[-1] * 16 * 16) * dtype_size(dtype)
        load_narrow_vae(self, sd)


def _tiny_vae():
    return _vae_module(_VAE_DDCONFIG), {"ddconfig": _VAE_DDCONFIG}


# The geometry comfy/model_detection.py fixes for every HunyuanVideo-class checkpoint (128-wide heads, mlp_ratio 4,
# theta 256, qkv biases) and HunyuanVideo 1.5's own keys (65 input channels, 3-D patches, cond-type embedding,
# a vision input, byT5; no guidance input, no meanflow) with one head, one block of each kind. The vision input
# (SigLIP's 1152 features in the released model, for image-to-video only) is 32 wide here: training gives it nothing.
_TINY_DIT = {
    "image_model": "hunyuan_video", "in_channels": 65, "out_channels": 32, "patch_size": [1, 1, 1], "vec_in_dim": None,
    "axes_dim": [16, 56, 56], "meanflow": False, "context_in_dim": TINY_QWEN25_7B["hidden_size"], "hidden_size": 128,
    "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "theta": 256, "qkv_bias": True,
    "byt5": True, "guidance_embed": False, "use_cond_type_embedding": True, "vision_in_dim": 32,
    "meanflow_sum": True,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.HunyuanVideo15(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(
        comfy.text_encoders.hunyuan_video.HunyuanVideo15Tokenizer, comfy.text_encoders.hunyuan_image.te()),
    text_encoder_options={"qwen25_7b_model_config": dict(TINY_QWEN25_7B), "qwen25_7b_class": _TinyVisionQwen25VLModel,
                          "_model_config": dict(TINY_BYT5)},
    latent_channels=32,
    tooltip="hunyuan_video15: HunyuanVideo 1.5 DiT (Qwen2.5-VL + byT5 text, 32-channel 16x / 4x video latents)",
    vae=_tiny_vae,
    vae_class=_NarrowHunyuanVideo15VAE,
)

FAMILY = Family(
    name="hunyuan_video15",
    description="HunyuanVideo 1.5 DiT (Qwen2.5-VL + byT5, 16x / 4x video VAE)",
    recognise=lambda model: type(model) is comfy.model_base.HunyuanVideo15,
    # Attention (fused qkv, out projection) and MLP of both streams of the double blocks, both linears of the single
    # blocks (the released model has none): musubi-tuner's HunyuanVideo LoRA layers less the modulation; the text
    # refiner, the byT5 / vision mappers and the embedders stay frozen.
    lora_preset=TargetPreset("hunyuan_video15", (r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])$",
                                                 r"^single_blocks\.\d+\.(linear1|linear2)$")),
    text_tokens=256,  # the prompt's own tokens (the encoder drops the template)
    diffusers_component=None,  # ComfyUI's LoRA key map has no diffusers names for HunyuanVideo 1.5
    # musubi-tuner's metadata (dataset/architectures.py: "hunyuan_video_1_5"; utils/sai_model_spec.py:
    # "hunyuan-video-1.5").
    kohya_base=("hunyuan_video_1_5", "hunyuan-video-1.5/lora"),
    latent_downscale=16,
    frame_step=4,  # the VAE keeps the first frame, then encodes groups of 4
    # The blocks are Flux's (comfy.ldm.flux.layers), which add into their inputs in place.
    inplace_blocks=lambda model: isinstance(model.diffusion_model, comfy.ldm.hunyuan_video.model.HunyuanVideo),
    # T2V and I2V are one architecture: a start image when the cache holds one (nodes/bridge/start_image.py).
    start_image=lambda model: "HunyuanVideo15ImageToVideo",
    tiny=TINY,
    position=31,
)
