"""HiDream-I1 (full / dev / fast): a double- and single-stream DiT with mixture-of-experts feed-forwards
(`comfy.model_base.HiDream`), conditioned on four text encoders at once: CLIP-L + CLIP-G pooled (the `y` vector),
T5-XXL, and every hidden layer of Llama-3.1-8B (`conditioning_llama3`, one layer per block); Flux's 16-channel
latents, flow. (HiDream-O1, pixel space, is another model class and not this family.)

Its tiny model needs a Llama-3 tokenizer: ComfyUI's (comfy/text_encoders/llama_tokenizer) reads a tokenizer.json its
checkout does not ship (a download) and takes no other path or class through `tokenizer_data`. The tiny model's
tokenizer is ComfyUI's HiDreamTokenizer with the Llama part on a character-level vocabulary written here (with byte
fallback, and Llama-3's special tokens at their real ids: <|begin_of_text|> 128000, <|eot_id|> 128009), loaded by the
same transformers class ComfyUI uses; the text encoder is ComfyUI's own (HiDreamTEModel), shrunk through its options."""
from __future__ import annotations

import atexit
import functools
import json
import pathlib
import shutil
import tempfile

import comfy.model_base
import comfy.sd1_clip
import comfy.sdxl_clip
import comfy.supported_models
import comfy.supported_models_base
import comfy.text_encoders.hidream
import comfy.text_encoders.hunyuan_video
import comfy.text_encoders.sd3_clip

from ....training.core.adapters import TargetPreset
from .base import TINY_CLIP_G, TINY_CLIP_L, TINY_T5, Family, TinyModel

# HiDream's head geometry (128 wide, RoPE axes [64, 32, 32], as comfy/model_detection.py fixes it) with one head; one
# double- and one single-stream block, each reading one Llama layer (llama_layers: which hidden state per block).
TINY_DIT = {
    "image_model": "hidream", "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 1,
    "num_single_layers": 1, "attention_head_dim": 128, "num_attention_heads": 1, "axes_dims_rope": [64, 32, 32],
    "caption_channels": [TINY_T5["d_model"], 32], "text_emb_dim": TINY_CLIP_L["projection_dim"] + TINY_CLIP_G["projection_dim"],
    "num_routed_experts": 4, "num_activated_experts": 2, "max_resolution": [128, 128], "llama_layers": [0, 1],
}

# Llama-3.1-8B's decoder shrunk through ComfyUI's `llama_model_config` option (head width 128 is fixed there); the tiny
# DiT reads both its layers (llama_layers [0, 1]).
TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 1,
              "num_key_value_heads": 1}
_LLAMA3_SPECIAL = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009}


@functools.lru_cache(maxsize=1)
def tiny_llama3_tokenizer_folder() -> str:
    """A folder holding a Llama-3-style tokenizer (tokenizer.json + tokenizer_config.json) for transformers'
    LlamaTokenizerFast, the class ComfyUI loads it with: a BPE with no merges over "▁", the printable ASCII characters
    and the 256 byte-fallback tokens (every text encodes), Llama-3's special tokens at their ids, <|begin_of_text|>
    first. Written once per process to a temporary folder, removed at exit.

    Built with the `tokenizers` library, not by LlamaTokenizerFast(vocab=..., merges=...): that constructor is
    transformers 5's, and ComfyUI runs on transformers 4 too (4.50.3 on; the Windows portable build of early 2026 ships
    4.57.1), where it asks for a sentencepiece file. The tokenizer.json is the one transformers 5 writes for it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {f"<0x{byte:02X}>": byte for byte in range(256)}
    vocab["▁"] = 256
    vocab.update({chr(code): 257 + i for i, code in enumerate(range(33, 127))})
    vocab.update(_LLAMA3_SPECIAL)
    bos, eos = "<|begin_of_text|>", "<|eot_id|>"
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=True))
    # SentencePiece's word boundary: "▁" before the first word and for every space; decoded back to spaces
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(  # <|begin_of_text|> first, no end token (Llama-3's)
        single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, _LLAMA3_SPECIAL[bos])])
    tokenizer.add_special_tokens([AddedToken(bos, normalized=False), AddedToken(eos, normalized=False)])
    folder = pathlib.Path(tempfile.mkdtemp(prefix="headroom-tiny-llama3-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    settings = {"tokenizer_class": "LlamaTokenizer", "bos_token": bos, "eos_token": eos, "unk_token": None,
                "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2), encoding="utf-8")
    return str(folder)


class _TinyLlama3Tokenizer(comfy.text_encoders.hunyuan_video.LLAMA3Tokenizer):
    """ComfyUI's LLAMA3Tokenizer settings (comfy/text_encoders/hunyuan_video.py) on the tiny vocabulary's folder."""

    def __init__(self, embedding_directory=None, tokenizer_data={}, min_length=256, pad_token=128258):
        from transformers import LlamaTokenizerFast

        comfy.sd1_clip.SDTokenizer.__init__(
            self, tiny_llama3_tokenizer_folder(), embedding_directory=embedding_directory, pad_with_end=False,
            embedding_size=4096, embedding_key="llama", tokenizer_class=LlamaTokenizerFast, has_start_token=True,
            has_end_token=False, pad_to_max_length=False, max_length=99999999, pad_token=pad_token,
            min_length=min_length, tokenizer_data=tokenizer_data)


class _TinyHiDreamTokenizer(comfy.text_encoders.hidream.HiDreamTokenizer):
    """ComfyUI's HiDreamTokenizer (its four tokenizers and their lengths) with the Llama one on the tiny vocabulary."""

    def __init__(self, embedding_directory=None, tokenizer_data={}):
        self.clip_l = comfy.sd1_clip.SDTokenizer(embedding_directory=embedding_directory, tokenizer_data=tokenizer_data)
        self.clip_g = comfy.sdxl_clip.SDXLClipGTokenizer(embedding_directory=embedding_directory,
                                                         tokenizer_data=tokenizer_data)
        self.t5xxl = comfy.text_encoders.sd3_clip.T5XXLTokenizer(embedding_directory=embedding_directory, min_length=128,
                                                                 max_length=128, tokenizer_data=tokenizer_data)
        self.llama = _TinyLlama3Tokenizer(embedding_directory=embedding_directory, min_length=128, pad_token=128009,
                                          tokenizer_data=tokenizer_data)


TINY = TinyModel(
    model_config=lambda: comfy.supported_models.HiDream(dict(TINY_DIT)),
    clip_target=lambda: comfy.supported_models_base.ClipTarget(_TinyHiDreamTokenizer,
                                                               comfy.text_encoders.hidream.hidream_clip()),
    text_encoder_options={"clip_l_model_config": dict(TINY_CLIP_L), "clip_g_model_config": dict(TINY_CLIP_G),
                          "t5xxl_model_config": dict(TINY_T5), "llama_model_config": dict(TINY_LLAMA)},
    latent_channels=16,
    tooltip="hidream: HiDream-I1 MoE DiT (CLIP-L + CLIP-G + T5 + Llama-3 text on a character-level tiny vocabulary)",
)

def _calibration_cond_shapes(model, text_tokens: int) -> dict[str, tuple[int, ...]]:
    """What HiDream's text encoder caches: T5 [tokens, T5 width], CLIP-L + CLIP-G pooled, and the hidden states of
    every Llama layer the blocks read (`llama_layers` index them) [layers, tokens, Llama width]."""
    config = model.model_config.unet_config
    t5_width, llama_width = config["caption_channels"]
    return {"cross_attn": (text_tokens, t5_width), "pooled_output": (config["text_emb_dim"],),
            "conditioning_llama3": (max(config["llama_layers"]) + 1, text_tokens, llama_width)}


FAMILY = Family(
    name="hidream",
    description="HiDream-I1 MoE DiT",
    recognise=lambda model: isinstance(model, comfy.model_base.HiDream),
    # The attention projections of both streams (image and text: `_t`), and the feed-forwards every token passes: the
    # shared expert of the image stream and the text stream's; the routed experts (each sees only the tokens routed
    # to it) stay frozen.
    lora_preset=TargetPreset("hidream", (
        r"^(double|single)_stream_blocks\.\d+\.block\.attn1\.to_(q|k|v|out)(_t)?$",
        r"^(double|single)_stream_blocks\.\d+\.block\.(ff_i\.shared_experts|ff_t)\.w[123]$")),
    text_tokens=128,  # ComfyUI's HiDream tokenizer pads T5 and Llama to 128 tokens
    diffusers_component="transformer",  # diffusers' HiDreamImageTransformer2DModel: ComfyUI's module names
    # sd-scripts and musubi-tuner do not train HiDream (no ss_base_model_version / modelspec id established there):
    # the model's own name.
    kohya_base=("hidream_i1", "hidream-i1/lora"),
    calibration_cond_shapes=_calibration_cond_shapes,
    tiny=TINY,
    position=22,
)
