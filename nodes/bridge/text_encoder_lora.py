"""A LoRA on a ComfyUI CLIP's CLIP text encoders (CLIP-L, CLIP-G, OpenCLIP-H): the layers kohya's sd-scripts trains
with `network_train_unet_only` off, the captions encoded through them with gradients as CLIP Text Encode encodes
them, and the layers saved under the names the stock Load LoRA maps onto the CLIP (`text_encoders.<weight path>`).

Text-encoder training (Train LoRA's text_encoder_lr, nodes/bridge/run_lora.py): a run that trains the text encoder
encodes its captions here at each step (CaptionsThroughEncoder) instead of reading the text cache, and trains both
sets of layers as one (WithTextEncoder). The adapters are peft's, as the diffusion model's
(training.core.adapters.AdapterSet), attached to the CLIP's shared module tree only while the run trains or validates,
so every other node keeps seeing the CLIP as loaded. T5 and the LLM encoders are not trained (as sd-scripts', whose
Flux / SD3 text-encoder LoRA is CLIP-L's and CLIP-G's only); a Flux or SD3 run's steps take T5's part of each
caption from the text cache rather than running T5 (t5_from_cache).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re

import torch

import comfy.lora
import comfy.model_management
from comfy.text_encoders import flux, sd3_clip

from ...training.core.adapters import AdapterConfig, AdapterSet
from ...training.data.caption_tags import caption_variants
from ...training.memory import planner
from ...training.memory.text_encoder_training import TextEncoderTraining
from ...training.memory.time_model import device_synchronize
from . import lora_formats
from .caching import flat_conditioning
from .comfy_model import make_trainable, replace_inference_tensors, restore_stock_forwards

# The attention and MLP Linears of every encoder layer of a CLIP text model in ComfyUI's module tree
# (comfy/clip_model.py under sd1_clip): sd-scripts' text-encoder targets (CLIPAttention, CLIPMLP). The final
# projection (text_projection) stays frozen, as there.
_CLIP_LAYER = re.compile(r"(?:.+\.)?clip_[lgh]\.transformer\.text_model\.encoder\.layers\.\d+\."
                         r"(?:self_attn\.(?:q|k|v|out)_proj|mlp\.fc[12])")

# The kinds a text encoder trains (its layers are peft's LoRA-family layers; OFT and full fine-tuning are the
# diffusion model's own).
TEXT_ENCODER_KINDS = ("lora", "dora", "loha", "lokr")

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
        if config.kind not in TEXT_ENCODER_KINDS:
            raise ValueError(f"kind {config.kind}: a text encoder trains a LoRA "
                             f"(kinds {', '.join(TEXT_ENCODER_KINDS)})")
        self.clip = clip
        self.root = clip.cond_stage_model
        self.paths = text_encoder_layers(clip)
        with torch.inference_mode(False):  # nodes run in inference mode, whose tensors autograd cannot train
            self.adapters = AdapterSet(self.root, self.paths, config)
        self._measured: tuple[str, TextEncoderTraining] | None = None  # training_cost's last (caption, cost)
        # whether encode takes a frozen T5's part from the text cache (t5_from_cache): read the cache only then
        self.reads_t5_from_cache = _joins_t5(self.root)

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.adapters.parameters()

    @contextlib.contextmanager
    def attached(self):
        """The adapters in the CLIP's module tree, on the device ComfyUI loads the CLIP to, for the duration; detached
        again (also on an error), so that the CLIP other nodes use is the CLIP as loaded. Inside another `attached`
        (validation's prompts, then its model's attach), as it is."""
        if self.adapters.attached_to is self.root:
            yield self
            return
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

    def encode(self, text: str, cached: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The caption's conditioning as CLIP Text Encode gives it (tokenize, encode_from_tokens_scheduled), with
        gradients to the adapters: {"cross_attn": [T, D], "pooled_output": [D], ...} as the text cache holds it
        (TextCache.conditioning). `cached`: the text cache's conditioning of `text`, from which a frozen T5's part is
        taken instead of running T5 (t5_from_cache). Inside `attached`."""
        if self.adapters.attached_to is None:
            raise RuntimeError("TextEncoderLora.encode runs inside attached()")
        with torch.inference_mode(False), torch.enable_grad(), t5_from_cache(self.root, cached):
            conditioning = self.clip.encode_from_tokens_scheduled(self.clip.tokenize(text))
        return flat_conditioning(conditioning, "this CLIP", "remove them from the CLIP to train its text encoder")

    def training_cost(self, caption: str, cached: dict[str, torch.Tensor] | None = None) -> TextEncoderTraining:
        """What a training step holds on the device for the text encoder (the planner's TextEncoderTraining): the CLIP
        as loaded, and what `caption`'s encode (longest_caption's) keeps for backward, measured with the LoRA attached
        (planner.measure_activations: the CLIP's and the LoRA's own weights are not counted), and how long it takes.
        Measured once per caption; `cached`: its conditioning in the run's text cache, as the run's encodes take a
        frozen T5's part from it (encode)."""
        measured = self._measured
        if measured is None or measured[0] != caption:
            with self.attached():
                weights = [*self.root.parameters(), *self.root.buffers()]
                synchronize = device_synchronize(torch.device(self.clip.patcher.load_device))
                sample = planner.measure_activations(lambda: self.encode(caption, cached), [], weights,
                                                     synchronize=synchronize)
            self._measured = measured = (caption, TextEncoderTraining(
                self.clip.patcher.model_size(), sample.outside_saved, len(self.paths), sample.outside_forward_s))
        return measured[1]

    def comfy_state_dict(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The layers under the names the stock Load LoRA maps onto the CLIP (`text_encoders.<path>.lora_up.weight`,
        `.lora_down.weight`, `.alpha`), in `dtype`."""
        return self.adapters.comfy_state_dict(prefix=SAVED_PREFIX, dtype=dtype)

    def kohya_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (comfy_state_dict's) under sd-scripts' names, `lora_te_*` (SDXL: `lora_te1_*` CLIP-L, `lora_te2_*`
        CLIP-G), taken from ComfyUI's key map of the CLIP so the stock loader maps each back to its weight."""
        weights = {path + ".weight": path for path in self.paths}
        names = lora_formats.kohya_text_encoder_names(comfy.lora.model_lora_keys_clip(self.root, {}),
                                                      set(self.root.state_dict()), list(weights))
        return lora_formats.to_kohya(state, {weights[weight]: name for weight, name in names.items()},
                                     prefix=SAVED_PREFIX)

    def diffusers_state_dict(self, state: dict[str, torch.Tensor], dtype: torch.dtype
                             ) -> tuple[dict[str, torch.Tensor], dict]:
        """`state` (comfy_state_dict's, in fp32) under diffusers' names in `dtype`, alpha folded into up, PEFT's
        `lora_A` / `lora_B` (what diffusers' save_lora_weights writes for a text encoder), per pipeline component
        (`text_encoder`, SDXL's CLIP-G `text_encoder_2`), the names taken from ComfyUI's key map of the CLIP so the
        stock loader maps each back; and each component's PEFT LoraConfig fields, prefixed by it."""
        weights = {path + ".weight": path for path in self.paths}
        names = lora_formats.diffusers_text_encoder_names(comfy.lora.model_lora_keys_clip(self.root, {}),
                                                          set(self.root.state_dict()), list(weights))
        out, config = {}, {}
        for component in sorted({name.split(".", 1)[0] for name in names.values()}):
            layers = {weights[weight]: [(name, None)] for weight, name in names.items()
                      if name.split(".", 1)[0] == component}
            part = {key: value for key, value in state.items()  # <path>.lora_up.weight, <path>.alpha
                    if key[len(SAVED_PREFIX):].rsplit(".", 2 if key.endswith(".weight") else 1)[0] in layers}
            tensors, fields = lora_formats.to_diffusers(part, layers, None, dtype, prefix=SAVED_PREFIX,
                                                        component=component)
            # transformers 5 flattens CLIPTextModel (no `text_model.`): diffusers then strips that prefix from the
            # tensors' names but not from the config's target modules, which peft matches by their ends
            targets = f"{component}.target_modules"
            fields[targets] = sorted(module.removeprefix("text_model.") for module in fields[targets])
            out.update(tensors)
            config.update(fields)
        return out, config


class CaptionsThroughEncoder:
    """A text cache's captions encoded through a TextEncoderLora at each read, with gradients: what a run that trains
    the text encoder reads where other runs read the cache (the trainer's `conditioning`, `empty_conditioning`,
    `tag_orders`). Each cached key's texts are the ones Cache Text encoded for it (caption_tags.caption_variants with
    the cache's tag shuffling: the caption as written first, then its other tag orders, or alternative lines), so a
    draw picks the same text it would pick from the cache. Everything else is the cache's."""

    def __init__(self, text_cache, encoder: TextEncoderLora):
        if getattr(text_cache, "per_reference", False):
            raise ValueError("this text cache encodes each caption with its item's reference image "
                             f"({text_cache.reference_encoding}); a text encoder is trained on captions alone: cache "
                             "the text with reference_encoding none, or set text_encoder_lr to 0")
        self.text_cache, self.encoder = text_cache, encoder
        self._variants = cached_texts(text_cache)
        cached = set(text_cache.keys())
        for key, texts in self._variants.items():
            if key in cached and len(texts) != text_cache.tag_orders(key):
                raise ValueError(f"the text cache holds {text_cache.tag_orders(key)} encodings of caption "
                                 f"{texts[0][:60]!r} but its settings make {len(texts)}: run Cache Text again")

    def conditioning(self, key: str, order: int = 0) -> dict[str, torch.Tensor]:
        if key not in self._variants:
            return self.text_cache.conditioning(key)  # its KeyError: a caption of another dataset
        cached = self.text_cache.conditioning(key, order) if self.encoder.reads_t5_from_cache else None
        return self.encoder.encode(self._variants[key][order], cached)

    def empty_conditioning(self) -> dict[str, torch.Tensor]:
        return self.encoder.encode("", self.text_cache.empty_conditioning() if self.encoder.reads_t5_from_cache
                                   else None)

    def __getattr__(self, name):  # tag_orders, text_length, release_files, fingerprint, ...: the cache's
        if name == "text_cache":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.text_cache, name)


class WithTextEncoder:
    """A run's trained tensors when it trains the text encoder too: the diffusion model's adapters (`adapters`, an
    AdapterSet) and the text encoder's (`text_encoder`, a TextEncoderLora), as one Trainable. The text encoder's
    tensors come after the diffusion model's, their state under TEXT_ENCODER_KEYS; they train at `lr_scale` times
    the optimizer's learning rate (the node's text_encoder_lr)."""

    TEXT_ENCODER_KEYS = "text_encoder."

    def __init__(self, adapters: AdapterSet, text_encoder: TextEncoderLora, lr_scale: float = 1.0):
        self.adapters, self.text_encoder, self.lr_scale = adapters, text_encoder, lr_scale
        self.config = adapters.config

    @property
    def layers(self) -> dict:
        return {**self.adapters.layers, **{self.TEXT_ENCODER_KEYS + path: layer
                                          for path, layer in self.text_encoder.adapters.layers.items()}}

    def parameters(self) -> list[torch.nn.Parameter]:
        return [*self.adapters.parameters(), *self.text_encoder.parameters()]

    def learning_rate_scales(self, loraplus_lr_ratio: float = 1.0) -> list[float]:
        encoder = self.text_encoder.adapters.learning_rate_scales(loraplus_lr_ratio)
        return [*self.adapters.learning_rate_scales(loraplus_lr_ratio), *(scale * self.lr_scale for scale in encoder)]

    def cap_norms(self, max_norm: float) -> torch.Tensor:
        """AdapterSet.cap_norms over both sets' layers: [layers scaled, mean norm, largest norm]."""
        model, encoder = self.adapters.cap_norms(max_norm), self.text_encoder.adapters.cap_norms(max_norm)
        counts = (len(self.adapters.layers), len(self.text_encoder.adapters.layers))
        mean = (model[1] * counts[0] + encoder[1].to(model) * counts[1]) / sum(counts)
        return torch.stack([model[0] + encoder[0].to(model), mean, torch.maximum(model[2], encoder[2].to(model))])

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        encoder = self.text_encoder.adapters.state_dict(copy)
        return {**self.adapters.state_dict(copy), **{self.TEXT_ENCODER_KEYS + k: v for k, v in encoder.items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        prefix = self.TEXT_ENCODER_KEYS
        self.adapters.load_state_dict({k: v for k, v in state.items() if not k.startswith(prefix)})
        self.text_encoder.adapters.load_state_dict({k[len(prefix):]: v for k, v in state.items()
                                                    if k.startswith(prefix)})

    def train(self, mode: bool = True) -> None:
        self.adapters.train(mode)
        self.text_encoder.adapters.train(mode)


def with_text_encoder(trainable: planner.TrainableSpec, encoder: TextEncoderLora, caption: str | None = None,
                      cached: dict[str, torch.Tensor] | None = None) -> planner.TrainableSpec:
    """`trainable` (the diffusion model's) with the text encoder's LoRA tensors added, trained as the model's (host RAM,
    disk and the plan count them so); with `caption` (the run's longest), also what a step holds on the device for
    it (TextEncoderLora.training_cost; `cached`: its conditioning in the text cache), for a plan of the card."""
    shapes = trainable.shapes + tuple(tuple(p.shape) for p in encoder.parameters())
    cost = encoder.training_cost(caption, cached) if caption is not None else trainable.text_encoder
    return dataclasses.replace(trainable, shapes=shapes, text_encoder=cost)


@contextlib.contextmanager
def t5_from_cache(root, cached: dict[str, torch.Tensor] | None):
    """Inside it, the frozen T5-XXL of a Flux or SD3 CLIP (`root`, its cond_stage_model) gives its output for a
    caption from `cached`, the text cache's conditioning of that caption, instead of running: a run that trains
    CLIP-L / CLIP-G changes none of T5's part, which the cache holds as CLIP Text Encode made it (as sd-scripts
    caches T5's outputs while training CLIP-L). Flux's conditioning is T5's output and CLIP-L's pooled one; SD3's,
    the CLIP tokens' rows then T5's: T5's part is the cached rows after them, one per T5 token (an SD3 CLIP of
    t5_attention_mask also gives the cached mask; a cache without one: T5 runs). The rest of the encode (tokenize,
    the trained encoders, how ComfyUI joins them) is the stock CLIP's. Any other CLIP, no T5 or no `cached`: nothing
    changes. That ComfyUI still loads T5 with the CLIP is unchanged; what is saved is T5's forward at each step (a
    model's worth of weights read per caption, streamed where the CLIP is partly loaded)."""
    if cached is None or not _joins_t5(root) or (
            getattr(root, "t5_attention_mask", False) and "attention_mask" not in cached):  # a cache made without it
        yield
        return
    t5 = root.t5xxl
    rows = cached["cross_attn"]

    def from_cache(token_weight_pairs):
        tokens = sum(len(section) for section in token_weight_pairs)
        if tokens > rows.shape[0]:
            raise ValueError(f"the text cache holds {rows.shape[0]} rows for a caption whose T5 tokens alone are "
                             f"{tokens}: the cache was made with another text encoder; run Cache Text again")
        # where the stock T5 puts its output (comfy/sd1_clip.py): the intermediate device, the CPU unless --gpu-only
        device = comfy.model_management.intermediate_device()
        out = rows[rows.shape[0] - tokens:][None].to(device)
        if "attention_mask" in cached:  # as the stock T5 gives it: a third entry only with extras (sd1_clip)
            return out, None, {"attention_mask": cached["attention_mask"][None].to(device)}
        return out, None

    t5.encode_token_weights = from_cache  # an instance attribute over the class's method, removed below
    try:
        yield
    finally:
        del t5.encode_token_weights


def _joins_t5(root) -> bool:
    """Whether `root` (a CLIP's cond_stage_model) is a Flux or SD3 CLIP holding a T5-XXL (t5_from_cache)."""
    return isinstance(root, (flux.FluxClipModel, sd3_clip.SD3ClipModel)) and getattr(root, "t5xxl", None) is not None


def cached_texts(text_cache) -> dict[str, list[str]]:
    """Each cached caption's texts, as Cache Text encoded them (caption_tags.caption_variants with the cache's tag
    shuffling): {key: [the caption as written (its first line), its other tag orders or lines, ...]}."""
    shuffling = text_cache.tag_shuffling or {}
    return {key: caption_variants(caption, shuffling.get("shuffles", 0), shuffling.get("keep", 0),
                                  shuffling.get("dropout", 0.0))
            for key, caption in text_cache.captions.items()}


def longest_caption(text_cache, clip) -> tuple[str, dict[str, torch.Tensor] | None]:
    """The text a run training the text encoder encodes that is longest in `clip`'s tokens (what the planner measures
    its step with), and its conditioning in the cache (a step's encode takes a frozen T5's part from it): of every
    caption's texts (cached_texts: a caption of several lines is encoded a line at a time), the one with the most
    tokens over the CLIP's encoders, as its tokenizer splits it (a caption's characters say little: a word of another
    script can take a token a character, and CLIP adds a chunk of 77 per 75 tokens); ("", None) for none."""
    texts: dict[str, tuple[str, int]] = {}  # text -> (key, order) of its first cached encoding
    for key, variants in cached_texts(text_cache).items():
        for order, text in enumerate(variants):
            texts.setdefault(text, (key, order))
    if not texts:
        return "", None
    text = max(texts, key=lambda text: _token_count(clip.tokenize(text)))
    return text, text_cache.conditioning(*texts[text])


def _token_count(tokens: dict) -> int:
    """The tokens (padding included) of clip.tokenize's {encoder: [chunk: [(token, weight, ...), ...], ...]}."""
    return sum(len(chunk) for chunks in tokens.values() if isinstance(chunks, list) for chunk in chunks)
