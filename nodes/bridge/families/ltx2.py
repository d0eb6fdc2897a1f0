"""LTX-2 (Lightricks' audio-video model) trained as a VIDEO LoRA: `comfy.model_base.LTXAV`, ComfyUI's LTXAVModel
(comfy/ldm/lightricks/av_model.py: 48 blocks, each a video stream 4096 wide and an audio stream 2048 wide with
audio <-> video cross-attention), text encoder Gemma 3 12B (comfy/text_encoders/lt.py LTXAVTEModel: every hidden
layer, projected to 3840 features; the DiT's own embeddings connectors turn them into video and audio context), the
LTX video VAE (latent_formats.LTXAV: 128 channels, 32x spatial, 8x temporal: clips of 8k+1 frames), flow matching
(shift 2.37).

What is trained: the video stream's self-attention (attn1), text cross-attention (attn2; q, k, v, out) and
feed-forward of every block: the video modules LTX-2's own trainer (ltx-trainer) names for a video-only LoRA
(`attn1.to_k`, `attn2.to_k`, ...; its audio-video LoRAs add `audio_attn*` and the cross-modal ones). What is not:
the audio stream, the audio <-> video cross-attention, the connectors, the embedders and the output layers stay
frozen, and training runs the video-only path ComfyUI itself takes for a silent generation: a plain video latent
(the stock EmptyLTXVLatentVideo's) reaches the model as one stream (the sampler's `latent_shapes` of one shape),
LTXAVModel gives the audio stream zero tokens, so its blocks skip the audio half and the audio -> video
cross-attention. A LoRA trained here changes video generation; with an audio latent packed in (LTXVConcatAVLatent)
the audio branch runs as the base model's.

LTX-Video (model_base.LTXV: video only, T5 encoder) is another class and not this family; LTX-2.3-style files (the
same class with text projected before the connectors: a dual video / audio text projection) are not recognised either
(not checked here): they train as unlisted models. ComfyUI's LoRA key map
has no diffusers (LTX2VideoTransformer3DModel) names for LTX-2: files are written in the comfyui or kohya format."""
from __future__ import annotations

import json
import os

import comfy.clip_model
import comfy.ldm.lightricks.vae.causal_video_autoencoder
import comfy.model_base
import comfy.sd
import comfy.sd1_clip
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.llama
import comfy.text_encoders.lt
import comfy.text_encoders.spiece_tokenizer
import torch

from ....training.core.adapters import TargetPreset
from .base import Family, TinyModel

# Gemma 3 12B's language model shrunk through its model option (LTXAVTEModel builds it without a model name:
# `_model_config`). The vocabulary stays Gemma's (262208 ids: the start / pad / end-of-turn ids the tokenizer
# settings name are Gemma's).
TINY_GEMMA3 = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1}


class _TinyGemma3Config(comfy.text_encoders.llama.Gemma3_12B_Config):
    # Class attributes the model option cannot set: 16-wide heads (256 released) and a one-layer SigLIP (27 layers,
    # 0.4 B parameters released; image prompts only).
    head_dim = 16
    mm_tokens_per_image = 4
    vision_config = {"num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "image_size": 56,
                     "intermediate_size": 64, "model_type": "siglip_vision_model", "num_attention_heads": 2,
                     "num_hidden_layers": 1, "patch_size": 14}


class _TinyGemma3(comfy.text_encoders.llama.Gemma3_12B):
    """ComfyUI's Gemma 3 12B module (the same parts, in the same order) over the tiny config."""

    def __init__(self, config_dict, dtype, device, operations):
        torch.nn.Module.__init__(self)
        config = _TinyGemma3Config(**config_dict)
        self.num_layers = config.num_hidden_layers
        self.model = comfy.text_encoders.llama.Llama2_(config, device=device, dtype=dtype, ops=operations)
        self.multi_modal_projector = comfy.text_encoders.llama.Gemma3MultiModalProjector(config, dtype, device,
                                                                                        operations)
        self.vision_model = comfy.clip_model.CLIPVision(config.vision_config, dtype, device, operations)
        self.dtype = dtype
        self.image_size = config.vision_config["image_size"]


class _TinyGemma3Model(comfy.text_encoders.lt.Gemma3_12BModel):
    """ComfyUI's Gemma3_12BModel (every hidden layer, attention masks, start id 2, pad id 0) over `_TinyGemma3`;
    given to ComfyUI's ltxav_te as its text_encoder_model."""

    def __init__(self, device="cpu", layer="all", layer_idx=None, dtype=None, attention_mask=True, model_options={}):
        self.dtypes = {dtype}
        comfy.sd1_clip.SDClipModel.__init__(
            self, device=device, layer=layer, layer_idx=layer_idx, textmodel_json_config={}, dtype=dtype,
            special_tokens={"start": 2, "pad": 0}, layer_norm_hidden_state=False, model_class=_TinyGemma3,
            enable_attention_masks=attention_mask, return_attention_masks=attention_mask, model_options=model_options)


# The text projection's width: the DiT's caption_channels (3840 released).
_CAPTION_CHANNELS = 64


class _TinyGemma3Tokenizer(comfy.text_encoders.lt.Gemma3_Tokenizer, comfy.sd1_clip.SDTokenizer):
    """ComfyUI's Gemma 3 12B tokenizer settings (Gemma3_12BTokenizer: start token, no end token, left-padded to 1024
    tokens, its chat template) over a sentencepiece model ComfyUI ships (the Pile T5's). ComfyUI reads Gemma's own
    sentencepiece model out of the text encoder's weights file (`spiece_model`), which random tiny weights have none
    of."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):
        path = os.path.join(os.path.dirname(os.path.realpath(comfy.text_encoders.lt.__file__)), "t5_pile_tokenizer",
                            "tokenizer.model")
        special_tokens = {"<image_soft_token>": 262144, "<end_of_turn>": 106}
        super().__init__(path, pad_with_end=False, embedding_size=TINY_GEMMA3["hidden_size"],
                         embedding_key="gemma3_12b", tokenizer_class=comfy.text_encoders.spiece_tokenizer.SPieceTokenizer,
                         has_end_token=False, pad_to_max_length=False, max_length=99999999, min_length=1024,
                         pad_left=True, disable_weights=True,
                         tokenizer_args={"add_bos": True, "add_eos": False, "special_tokens": special_tokens},
                         tokenizer_data=tokenizer_data)


class _TinyLTXAVTokenizer(comfy.sd1_clip.SD1Tokenizer):
    def __init__(self, embedding_directory=None, tokenizer_data={}):
        super().__init__(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data, name="gemma3_12b",
                         tokenizer=_TinyGemma3Tokenizer)


# The LTX video VAE (causal_video_autoencoder.VideoVAE) narrow: 16 channels instead of 128+, the released
# downscale (4x4 patches, three 2x2x2 compressions: 32x spatial, 8x temporal), pixel norm, no decode-timestep noise
# (it draws unseeded noise). ComfyUI builds this VAE from the `config` a file's metadata carries (its VAELoader).
_VAE_CONFIG = {"_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3,
               "latent_channels": 128, "encoder_base_channels": 16, "decoder_base_channels": 16,
               "blocks": [["res_x", 1], ["compress_all", 1], ["compress_all", 1], ["compress_all", 1], ["res_x", 1]],
               "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
               "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False}


def _tiny_vae():
    module = comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE(config=dict(_VAE_CONFIG))
    # The per-channel latent statistics are buffers a checkpoint fills: identity here.
    module.per_channel_statistics.get_buffer("std-of-means").fill_(1.0)
    module.per_channel_statistics.get_buffer("mean-of-means").fill_(0.0)
    return module, dict(_VAE_CONFIG)


def _vae_from_metadata(sd=None, config=None, **kwargs):
    """comfy.sd.VAE as the stock VAELoader makes it from a file whose metadata carries the VAE's config."""
    return comfy.sd.VAE(sd=sd, metadata={"config": json.dumps({"vae": config})})


# comfy/model_detection.py fixes 32 heads (head width = width / 32) and reads the text width from attn2; the rest
# comes from the file's metadata config. The tiny one: 32 heads of 4 (128 wide), the audio stream 2 heads of 16,
# the connectors 2 heads of 32 (= caption_channels, the tiny text projection's width), 2 blocks.
_TINY_DIT = {
    "image_model": "ltxav", "in_channels": 128, "audio_in_channels": 128, "num_attention_heads": 32,
    "attention_head_dim": 4, "cross_attention_dim": 128, "audio_num_attention_heads": 2, "audio_attention_head_dim": 16,
    "audio_cross_attention_dim": 32, "caption_channels": _CAPTION_CHANNELS, "num_layers": 2,
    "connector_num_attention_heads": 2, "connector_attention_head_dim": 32, "use_keyframes_abs_pos_embedding": False,
}

TINY = TinyModel(
    model_config=lambda: comfy.supported_models.LTXAV(dict(_TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(
        _TinyLTXAVTokenizer, comfy.text_encoders.lt.ltxav_te(text_encoder_model=_TinyGemma3Model,
                                                            video_projection_dim=_CAPTION_CHANNELS)),
    text_encoder_options={"_model_config": dict(TINY_GEMMA3)},
    latent_channels=128,
    tooltip="ltx2: LTX-2 audio-video DiT trained on its video stream (Gemma 3 text, 128-channel 32x / 8x video latents)",
    vae=_tiny_vae,
    vae_class=_vae_from_metadata,
)

def _recognise(model) -> bool:
    # LTX-2 (2.0): the connectors take the Gemma projection as it is. LTX-2.3's files (caption_proj_before_connector,
    # a dual video / audio text projection, prompt AdaLN) are the same class with another text path this family has
    # not been checked on: they train as unlisted models (targets all_linear).
    diffusion_model = getattr(model, "diffusion_model", None)
    return type(model) is comfy.model_base.LTXAV and not getattr(diffusion_model, "caption_proj_before_connector", True)


FAMILY = Family(
    name="ltx2",
    description="LTX-2 audio-video DiT, video LoRA (Gemma 3 encoder, LTX video VAE)",
    recognise=_recognise,
    # The video stream's attention (self, text cross) and feed-forward of every block (to_q / to_k / to_v / to_out.0,
    # ff.net.0.proj / ff.net.2). audio_attn*, audio_ff, audio_to_video_attn and video_to_audio_attn are other names,
    # so they stay frozen.
    lora_preset=TargetPreset("ltx2", (r"^transformer_blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)$",
                                      r"^transformer_blocks\.\d+\.ff\.net\.(0\.proj|2)$")),
    text_tokens=1024,  # the DiT's connectors fill the prompt's tokens up to 1024 with learned registers
    diffusers_component=None,  # ComfyUI's LoRA key map has no diffusers names for LTX-2
    # No sd-scripts base-model names are known for LTX-2 here: none written (as flux2's).
    kohya_base=("", ""),
    latent_downscale=32,
    frame_step=8,  # the VAE keeps the first frame, then encodes groups of 8
    frame_rate=25.0,  # LTXAV.extra_conds' default; LTXVConditioning sets another (temporal positions are in seconds)
    # Its blocks add into their (video, audio) streams in place (vx.addcmul_ after an RMS norm saved vx).
    inplace_blocks=lambda model: type(model) is comfy.model_base.LTXAV,
    tiny=TINY,
    position=32,
)
