"""A LoRA on a ComfyUI CLIP's CLIP text encoders (CLIP-L, CLIP-G, OpenCLIP-H): the layers kohya's sd-scripts trains
with `network_train_unet_only` off, the captions encoded through them with gradients as CLIP Text Encode encodes
them, and the layers saved under the names the stock Load LoRA maps onto the CLIP (`text_encoders.<weight path>`).

The engine's part of text-encoder training (docs/ARCHITECTURE.md): a run that trains the text encoder encodes its
captions here at each step instead of reading the text cache. The adapters are peft's, as the diffusion model's
(training.core.adapters.AdapterSet), attached to the CLIP's shared module tree only while a caption is encoded, so
every other node keeps seeing the CLIP as loaded. T5 and the LLM encoders are not trained (as sd-scripts', whose
Flux / SD3 text-encoder LoRA is CLIP-L's and CLIP-G's only).
"""
from __future__ import annotations

import contextlib
import re

import torch

from ...training.core.adapters import AdapterConfig, AdapterSet
from .caching import flat_conditioning
from .comfy_model import make_trainable, replace_inference_tensors, restore_stock_forwards

# The attention and MLP Linears of every encoder layer of a CLIP text model in ComfyUI's module tree
# (comfy/clip_model.py under sd1_clip): sd-scripts' text-encoder targets (CLIPAttention, CLIPMLP). The final
# projection (text_projection) stays frozen, as there.
_CLIP_LAYER = re.compile(r"(?:.+\.)?clip_[lgh]\.transformer\.text_model\.encoder\.layers\.\d+\."
                         r"(?:self_attn\.(?:q|k|v|out)_proj|mlp\.fc[12])")

# What the saved keys start with: ComfyUI's key map names every CLIP weight `text_encoders.<its path>` (comfy/lora.py
# model_lora_keys_clip), so the stock loader maps the file on any CLIP that holds those layers.
SAVED_PREFIX = "text_encoders."


def text_encoder_layers(clip) -> list[str]:
    """The module paths (under `clip.cond_stage_model`) of the CLIP text encoders' layers a text-encoder LoRA trains,
    in the module tree's order. Raises ValueError naming the encoders where the CLIP has no CLIP text model."""
    root = clip.cond_stage_model
    paths = [name for name, module in root.named_modules()
             if isinstance(module, torch.nn.Linear) and _CLIP_LAYER.fullmatch(name)]
    if not paths:
        encoders = sorted({name.split(".", 1)[0] for name, _ in root.named_children()}) or [type(root).__name__]
        raise ValueError(f"this CLIP ({type(root).__name__}: {', '.join(encoders)}) has no CLIP text encoder to train: "
                         "text-encoder training trains CLIP-L / CLIP-G / OpenCLIP-H (SD1.5, SD2, SDXL, SD3, Flux's "
                         "CLIP-L), not T5 or LLM encoders")
    return paths


class TextEncoderLora:
    """LoRA layers of `config` (kinds lora / dora / loha / lokr) on the CLIP's text encoder layers
    (text_encoder_layers), made once, beside the CLIP's weights (its offload device: where ComfyUI keeps them)."""

    def __init__(self, clip, config: AdapterConfig):
        if config.kind not in ("lora", "dora", "loha", "lokr"):
            raise ValueError(f"kind {config.kind}: a text encoder trains a LoRA (kinds lora, dora, loha, lokr)")
        self.clip = clip
        self.root = clip.cond_stage_model
        self.paths = text_encoder_layers(clip)
        self.adapters = AdapterSet(self.root, self.paths, config)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.adapters.parameters()

    @contextlib.contextmanager
    def attached(self):
        """The adapters in the CLIP's module tree, on the device ComfyUI loads the CLIP to, for the duration; detached
        again (also on an error), so that the CLIP other nodes use is the CLIP as loaded."""
        self.clip.load_model()
        device = self.clip.patcher.load_device
        with torch.inference_mode(False):
            # ComfyUI's loaders make weights under inference mode, which autograd cannot save for backward (the
            # gradient of a layer's input reads its weight): given normal storage once, same values
            replace_inference_tensors(self.root, self.clip.patcher, key_prefix="")
            self.adapters.to(device)
            self.adapters.attach(self.root)
            make_trainable(self.root)  # ComfyUI's CLIPLayer adds its residuals in place, which autograd refuses
        try:
            yield self
        finally:
            restore_stock_forwards(self.root)
            self.adapters.detach()

    def encode(self, text: str) -> dict[str, torch.Tensor]:
        """The caption's conditioning as CLIP Text Encode gives it (tokenize, encode_from_tokens_scheduled), with
        gradients to the adapters: {"cross_attn": [T, D], "pooled_output": [D], ...} as the text cache holds it
        (TextCache.conditioning). Inside `attached`."""
        if self.adapters.attached_to is None:
            raise RuntimeError("TextEncoderLora.encode runs inside attached()")
        with torch.inference_mode(False), torch.enable_grad():
            conditioning = self.clip.encode_from_tokens_scheduled(self.clip.tokenize(text))
        return flat_conditioning(conditioning, "this CLIP", "remove them from the CLIP to train its text encoder")

    def comfy_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The layers under the names the stock Load LoRA maps onto the CLIP (`text_encoders.<path>.lora_up.weight`,
        `.lora_down.weight`, `.alpha`), in `dtype`."""
        return self.adapters.comfy_state_dict(prefix=SAVED_PREFIX, dtype=dtype)
