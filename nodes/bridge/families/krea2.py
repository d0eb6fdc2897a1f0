"""Krea 2 (K2): ComfyUI's `comfy.model_base.Krea2` (`supported_models.Krea2`; comfy/ldm/krea2/model.py
SingleStreamDiT, a single-stream MMDiT: text and image tokens in one sequence through `blocks`), text encoder
Qwen3-VL-4B tapped at 12 layers (comfy/text_encoders/krea2.py: conditioning [B, seq, 12 * 2560], which the DiT's own
`txtfusion` adapter folds back to one stream), the Wan 2.1 VAE as Qwen-Image uses it: 16-channel video latents
[B, C, T, H, W] with T = 1 for images (latent_formats.Wan21), flow matching (shift 1.15).

LoRA preset: every Linear of the main blocks (attention wq / wk / wv, its sigmoid gate, wo; SwiGLU gate / up /
down). musubi-tuner's Krea 2 LoRA wraps every Linear of the DiT (`KREA2_TARGET_REPLACE_MODULES = None`: also the
input / timestep / text embedders, the text-fusion blocks and the final layer) and names the per-block attention the
subset to keep for prompt adherence; the preset takes the blocks as the other DiT families' presets do (Z-Image,
Qwen-Image): the blocks hold nearly all the weights, and the embedders / final layer are where a LoRA moves a
model's input and output statistics. The blocks' modulation is a parameter, not a Linear, so the preset is what
targets=all_linear picks here too. ComfyUI maps the block Linears under their own names and diffusers' names
(to_q / to_k / to_v / to_gate / to_out.0, ff.gate / up / down: comfy.utils.krea2_to_diffusers).

No ControlNet: ComfyUI's ControlNetLoader has no Krea 2 type."""
from __future__ import annotations

import comfy.model_base
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.krea2
import comfy.text_encoders.qwen3vl

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel
from .qwen_image import _tiny_wan_vae

# Qwen3-VL-4B's language model shrunk through ComfyUI's `qwen3vl_4b_model_config` option (comfy/text_encoders/llama.py
# Qwen3VL_4BConfig; head_dim 128 and the M-RoPE sections are fixed there). Krea 2 reads hidden states 2, 5, ..., 35
# (comfy/text_encoders/krea2.py KREA2_TAP_LAYERS, before those layers): the released depth, 36 layers, keeps every tap.
TINY_QWEN3VL_4B = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 36, "num_attention_heads": 2,
                   "num_key_value_heads": 1}


class _TinyVisionKrea2ClipModel(comfy.text_encoders.krea2.Krea2Qwen3VLClipModel):
    """ComfyUI's Krea 2 Qwen3-VL text model with its vision tower built small. ComfyUI builds that tower at its released
    size whatever the config (1024 wide, 24 blocks, no model option), which a CPU tiny model cannot carry; it only
    encodes images given to the text-encode node, which the tiny model's prompts never are. Given to comfy.sd.CLIP
    through ComfyUI's own `qwen3vl_4b_class` model option."""

    def __init__(self, device="cpu", dtype=None, model_options={}, **kwargs):
        super().__init__(device=device, dtype=dtype, model_options=model_options, **kwargs)
        config = {**comfy.text_encoders.qwen3vl.QWEN3VL_VISION_COMMON, "hidden_size": 32, "num_heads": 2,
                  "intermediate_size": 64, "depth": 2, "deepstack_visual_indexes": [0],
                  "out_hidden_size": TINY_QWEN3VL_4B["hidden_size"]}
        self.transformer.visual = comfy.text_encoders.qwen3vl.Qwen3VLVisionModel(config, device=device, dtype=dtype,
                                                                                ops=self.operations)


# ComfyUI's Krea 2 detection (comfy/model_detection.py) fixes 128-wide heads (heads and kv heads read from wq / wk),
# patch 2, and leaves the text-fusion heads to the class default (20: 128 wide at 2560); RoPE axes follow from the head
# width ([32, 48, 48] at 128). The tiny one keeps the 128-wide heads with grouped KV (2 heads, 1 KV head: width 256),
# 2 blocks, the 12-layer text stack at the tiny encoder's width with 2 text heads.
_TINY_DIT = {
    "image_model": "krea2", "features": 256, "channels": 16, "patch": 2, "layers": 2, "heads": 2, "kvheads": 1,
    "txtlayers": 12, "txtdim": TINY_QWEN3VL_4B["hidden_size"], "txtheads": 2, "txtkvheads": 2,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.Krea2(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(comfy.text_encoders.krea2.Krea2Tokenizer,
                                                               comfy.text_encoders.krea2.te()),
    text_encoder_options={"qwen3vl_4b_model_config": dict(TINY_QWEN3VL_4B),
                          "qwen3vl_4b_class": _TinyVisionKrea2ClipModel},
    latent_channels=16,
    tooltip="krea2: Krea 2 single-stream DiT with a Qwen3-VL text encoder and the Wan 2.1 VAE (5-D latents)",
    vae=_tiny_wan_vae,
)

FAMILY = Family(
    name="krea2",
    description="Krea 2 single-stream DiT (Qwen3-VL encoder, Wan 2.1 VAE)",
    recognise=lambda model: type(model) is comfy.model_base.Krea2,
    lora_preset=TargetPreset("krea2", (r"^blocks\.\d+\.(attn\.(wq|wk|wv|gate|wo)|mlp\.(gate|up|down))$",)),
    text_tokens=128,  # the system prompt and the user opening are cut off by the encoder: the prompt's own tokens
    diffusers_component="transformer",
    # sd-scripts does not train Krea 2: musubi-tuner's names (its architecture id "krea2"; modelspec.architecture
    # "Krea-2/lora" after its "<arch>/lora" convention).
    kohya_base=("krea2", "Krea-2/lora"),
    tiny=TINY,
    position=24,
)
