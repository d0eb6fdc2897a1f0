"""Ideogram 4: ComfyUI's `comfy.model_base.Ideogram4` (`supported_models.Ideogram4`; comfy/ldm/ideogram4/model.py
Ideogram4Transformer2DModel, a NextDiT-style single-stream DiT: text and image tokens packed into one sequence
through `layers`, 4608 wide = 18 heads of 256, 3D interleaved MRoPE), text encoder Qwen3-VL-8B's language model
tapped at 13 layers (comfy/text_encoders/ideogram4.py: conditioning [B, seq, 13 * 4096 = 53248], which the DiT's
`llm_cond_norm` / `llm_cond_proj` fold to its width), the Flux.2 VAE's 128-channel latents at 16x (latent_formats.Flux2:
the DiT reads each latent pixel as one 2x2 x 32-channel token), flow matching (ModelType.FLOW, shift 1.0; the model
flips the timestep and negates its output itself, so ComfyUI's flow objective is the one to train).

LoRA preset: the attention (fused qkv, o) and SwiGLU feed-forward (w1, w2, w3) Linears of every transformer block
(`layers`). That is musubi-tuner's Ideogram 4 LoRA (networks/lora_ideogram4.py: IDEOGRAM4_TARGET_REPLACE_MODULES =
["Ideogram4TransformerBlock"] with include patterns `attention.(qkv|o)` / `feed_forward.w[123]` and everything else
excluded): the per-block `adaln_modulation` Linear stays frozen (musubi: training the adaLN projection destabilises,
as the other image architectures' modulation exclude), as do the input / text / timestep embedders and the final
layer. targets=all_linear adds the modulation.

Names: ComfyUI's LoRA key map has no diffusers names for Ideogram 4 (diffusers 0.42 has an Ideogram4Transformer2DModel,
but the stock LoraLoader would leave its names unloaded), so the diffusers format is refused; kohya = musubi-tuner's
names (its architecture "ideogram4", modelspec.architecture "Ideogram-4/lora").

No ControlNet: ComfyUI's ControlNetLoader has no Ideogram 4 type."""
from __future__ import annotations

import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.ideogram4

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel
from .flux2 import tiny_vae as _tiny_flux2_vae

# Qwen3-VL-8B's language model (ComfyUI's Qwen3_8B class) shrunk through ComfyUI's `qwen3vl_8b_model_config` option
# (comfy/text_encoders/llama.py Qwen3_8BConfig; head_dim 128 is fixed there). Ideogram 4 reads the inputs of layers
# 1, 4, ..., 34 and the last layer's output (IDEOGRAM4_TAP_LAYERS, index 36): the released depth, 36 layers, keeps
# every tap.
TINY_QWEN3VL_8B = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 36, "num_attention_heads": 2,
                   "num_key_value_heads": 1}
_TAPS = len(comfy.text_encoders.ideogram4.IDEOGRAM4_TAP_LAYERS)


class _TinyIdeogram4(comfy.supported_models.Ideogram4):
    """ComfyUI's Ideogram 4 config with its geometry small. ComfyUI's detection reads only in_channels and the block
    count from a checkpoint and sets the rest from the class's `unet_extra_config` (applied over any unet_config),
    so the tiny one overrides that dict: 256-wide heads as released (the interleaved MRoPE sections [24, 20, 20]
    need a head of 124 or more), 2 heads (width 512), FFN 1024, adaLN 64, the 13 taps at the tiny encoder's width."""

    unet_extra_config = dict(comfy.supported_models.Ideogram4.unet_extra_config, num_attention_heads=2,
                             attention_head_dim=256, intermediate_size=1024, adaln_dim=64,
                             llm_features_dim=_TAPS * TINY_QWEN3VL_8B["hidden_size"])


_TINY_DIT = {"image_model": "ideogram4", "in_channels": 128, "num_layers": 2}

TINY = TinyModel(
    model_config=lambda: _TinyIdeogram4(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.ideogram4.Ideogram4Tokenizer,
                                                               comfy.text_encoders.ideogram4.te()),
    text_encoder_options={"qwen3vl_8b_model_config": dict(TINY_QWEN3VL_8B)},
    latent_channels=128,
    tooltip="ideogram4: Ideogram 4 single-stream DiT (13 Qwen3-VL layers of text, Flux.2 128-channel latents)",
    vae=_tiny_flux2_vae,
)

FAMILY = Family(
    name="ideogram4",
    description="Ideogram 4 single-stream DiT (Qwen3-VL-8B encoder, Flux.2 VAE)",
    recognise=lambda model: type(model) is comfy.model_base.Ideogram4,
    lora_preset=TargetPreset("ideogram4", (r"^layers\.\d+\.(attention\.(qkv|o)|feed_forward\.w[123])$",)),
    # ComfyUI does not pad Ideogram 4 text (the chat template around the prompt); Ideogram prompts are long
    # descriptive captions (diffusers' pipeline allows 2048 tokens): the planner assumes 256.
    text_tokens=256,
    diffusers_component=None,  # ComfyUI's key map has no diffusers names for Ideogram 4
    # sd-scripts does not train Ideogram 4: musubi-tuner's names (its architecture id "ideogram4";
    # modelspec.architecture "Ideogram-4/lora", musubi_tuner/utils/sai_model_spec.py).
    kohya_base=("ideogram4", "Ideogram-4/lora"),
    latent_downscale=16,
    tiny=TINY,
    position=26,
)
