"""HunyuanImage 2.1: `comfy.model_base.HunyuanImage21`, ComfyUI's HunyuanVideo DiT (comfy/ldm/hunyuan_video/model.py)
in its image configuration (2-D patches of 1x1 on 64-channel latents, RoPE axes [64, 64], no pooled vector), text
encoders Qwen2.5-VL-7B (hidden layer -3, comfy/text_encoders/hunyuan_image.py) and byT5-small (glyph text: only the
quoted parts of a prompt, `txt_byt5` through the DiT's `byt5_in` mapper), its own 32x VAE (latent_formats.
HunyuanImage21: 64 channels, 32 image px per latent px), flow matching (shift 5).

The refiner (HunyuanImage21Refiner: 3-D video latents, concat conditioning) is another model class and not this
family. ComfyUI has no diffusers names for this model's LoRAs (comfy/lora.py maps diffusers-pipe names for
HunyuanVideo only): files are written in the comfyui or kohya format."""
from __future__ import annotations

import contextlib
import logging

import comfy.ldm.hunyuan_video.model
import comfy.ldm.models.autoencoder
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.hunyuan_image
import comfy.text_encoders.qwen_vl
import torch

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

# Qwen2.5-VL-7B's language model shrunk through ComfyUI's `qwen25_7b_model_config` option; HunyuanImage reads hidden
# layer -3 (ComfyUI asserts |-3| < the layer count), so four layers.
TINY_QWEN25_7B = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
                  "num_key_value_heads": 1}
# byT5-small: ComfyUI builds it without a model name (hunyuan_image.ByT5SmallModel), so its size option is
# `_model_config`. Its width stays 1472: the DiT's byt5_in mapper reads 1472 features whatever its config.
TINY_BYT5 = {"num_layers": 1, "d_ff": 64, "num_heads": 1, "d_kv": 16}


class _TinyVisionQwen25VLModel(comfy.text_encoders.hunyuan_image.Qwen25_7BVLIModel):
    """HunyuanImage's Qwen2.5-VL text model with the vision tower built small (ComfyUI builds it at its released size,
    0.67 B parameters, whatever the config); given through ComfyUI's `qwen25_7b_class` model option."""

    def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
        super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
        self.transformer.visual = comfy.text_encoders.qwen_vl.Qwen2VLVisionTransformer(
            hidden_size=32, output_hidden_size=TINY_QWEN25_7B["hidden_size"], intermediate_size=64, num_heads=2,
            num_layers=1, device=device, dtype=dtype, ops=self.operations)


# The VAE's encoder / decoder (comfy/ldm/hunyuan_video/vae.py) narrow: the released widths are [128, 256, 512, 512,
# 1024, 1024]; six stages keep the 32x downscale (five 2x steps), the last width stays a multiple of 2 x 64 latent
# channels (the encoder's skip averages channel groups onto them, the decoder's repeats them).
_VAE_DDCONFIG = {"block_out_channels": [32, 32, 64, 64, 128, 128], "in_channels": 3, "out_channels": 3,
                 "num_res_blocks": 2, "ffactor_spatial": 32, "downsample_match_channel": True,
                 "upsample_match_channel": True, "z_channels": 64}


def _vae_module(ddconfig: dict) -> torch.nn.Module:
    """The module ComfyUI's VAE detection builds for a HunyuanImage 2.1 state dict (comfy/sd.py), at `ddconfig`."""
    return comfy.ldm.models.autoencoder.AutoencodingEngine(
        regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
        encoder_config={"target": "comfy.ldm.hunyuan_video.vae.Encoder", "params": ddconfig},
        decoder_config={"target": "comfy.ldm.hunyuan_video.vae.Decoder", "params": ddconfig})


class _NoVaeDetected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "No VAE weights detected" not in record.getMessage()


@contextlib.contextmanager
def _without_no_vae_warning():
    log_filter = _NoVaeDetected()
    logging.getLogger().addFilter(log_filter)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(log_filter)


def load_narrow_vae(vae: comfy.sd.VAE, sd: dict) -> None:
    """comfy.sd.VAE's own last steps for a module built here (its device, dtype, patcher, weights), shared by the narrow
    VAEs of the tiny models whose VAE ComfyUI detects only at released widths (this family, hunyuan_video15)."""
    vae.device = comfy.model_management.vae_device()
    vae.vae_dtype = comfy.model_management.vae_dtype(vae.device, vae.working_dtypes)
    vae.first_stage_model.to(vae.vae_dtype)
    comfy.model_management.archive_model_dtypes(vae.first_stage_model)
    vae.output_device = comfy.model_management.intermediate_device()
    vae.patcher = comfy.model_patcher.CoreModelPatcher(
        vae.first_stage_model, load_device=vae.device, offload_device=comfy.model_management.vae_offload_device())
    vae.first_stage_model.load_state_dict(sd, strict=True, assign=vae.patcher.is_dynamic())
    vae.model_size()


class _NarrowHunyuanImageVAE(comfy.sd.VAE):
    """comfy.sd.VAE holding the HunyuanImage 2.1 VAE narrow. ComfyUI builds this VAE only at the released widths
    (its detection keys on a 64-channel `decoder.conv_in`, then fixes every width), so the module is built here from
    `config["ddconfig"]` with the settings that detection branch gives (64 channels, 32x both ways, fp16 / bf16 /
    fp32); device, dtype, patcher and the weight loading are comfy.sd.VAE's own steps."""

    def __init__(self, sd=None, config=None, **kwargs):
        with _without_no_vae_warning():  # an empty state dict: comfy.sd.VAE sets its defaults and builds nothing
            super().__init__(sd={})
        self.first_stage_model = _vae_module(config["ddconfig"]).eval()
        self.latent_channels = config["ddconfig"]["z_channels"]
        self.downscale_ratio = self.upscale_ratio = 32
        self.working_dtypes = [torch.float16, torch.bfloat16, torch.float32]
        dtype_size = comfy.model_management.dtype_size
        self.memory_used_encode = lambda shape, dtype: (700 * shape[2] * shape[3]) * dtype_size(dtype)
        self.memory_used_decode = lambda shape, dtype: (700 * shape[2] * shape[3] * 32 * 32) * dtype_size(dtype)
        load_narrow_vae(self, sd)


def _tiny_vae():
    return _vae_module(_VAE_DDCONFIG), {"ddconfig": _VAE_DDCONFIG}


# The geometry comfy/model_detection.py fixes for every HunyuanVideo-class checkpoint (128-wide heads, mlp_ratio 4,
# theta 256, qkv biases; 2-D patches: RoPE axes [64, 64]) with one head; HunyuanImage 2.1's 64 latent channels in
# 1x1 patches, the byT5 mapper, no guidance input (the base model; the distilled one has one), no meanflow.
_TINY_DIT = {
    "image_model": "hunyuan_video", "in_channels": 64, "out_channels": 64, "patch_size": [1, 1], "vec_in_dim": None,
    "axes_dim": [64, 64], "meanflow": False, "context_in_dim": TINY_QWEN25_7B["hidden_size"], "hidden_size": 128,
    "mlp_ratio": 4.0, "num_heads": 1, "depth": 1, "depth_single_blocks": 1, "theta": 256, "qkv_bias": True,
    "byt5": True, "guidance_embed": False, "use_cond_type_embedding": False, "vision_in_dim": None,
    "meanflow_sum": False,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.HunyuanImage21(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.hunyuan_image.HunyuanImageTokenizer,
                                                               comfy.text_encoders.hunyuan_image.te()),
    text_encoder_options={"qwen25_7b_model_config": dict(TINY_QWEN25_7B), "qwen25_7b_class": _TinyVisionQwen25VLModel,
                          "_model_config": dict(TINY_BYT5)},
    latent_channels=64,
    tooltip="hunyuan_image: HunyuanImage 2.1 DiT (Qwen2.5-VL + byT5 text, 64-channel 32x latents: use 64 px or more)",
    vae=_tiny_vae,
    vae_class=_NarrowHunyuanImageVAE,
)

FAMILY = Family(
    name="hunyuan_image",
    description="HunyuanImage 2.1 DiT (Qwen2.5-VL + byT5, 32x VAE)",
    recognise=lambda model: type(model) is comfy.model_base.HunyuanImage21,
    # Attention (fused qkv, out projection) and MLP of both streams of the double blocks, both linears of the single
    # blocks (fused qkv + MLP in; attention + MLP out): the Flux-style layers; modulation, the text refiner and the
    # byT5 mapper stay frozen.
    lora_preset=TargetPreset("hunyuan_image", (r"^double_blocks\.\d+\.(img|txt)_(attn\.(qkv|proj)|mlp\.[02])$",
                                               r"^single_blocks\.\d+\.(linear1|linear2)$")),
    text_tokens=128,  # the prompt's own tokens (the encoder drops the template)
    diffusers_component=None,  # ComfyUI's LoRA key map has no diffusers names for HunyuanImage21
    # No sd-scripts id is established for it: the model's own name (as hidream).
    kohya_base=("hunyuan_image_2_1", "HunyuanImage-2.1/lora"),
    latent_downscale=32,
    # Its blocks are Flux's (comfy.ldm.flux.layers), which add into their inputs in place; so are those of every
    # model of the HunyuanVideo DiT class (HunyuanVideo 1.0 / 1.5, the refiner), family or not.
    inplace_blocks=lambda model: isinstance(model.diffusion_model, comfy.ldm.hunyuan_video.model.HunyuanVideo),
    tiny=TINY,
    position=23,
)
