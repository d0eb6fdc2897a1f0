"""What a LoRA run trains: adapters on a clone of the MODEL (`LoraTraining`, the strategy of a `TrainingRun` in
nodes/bridge/comfy_bridge.py), and how it is saved, applied, sampled and described.

Adapters go onto a *clone* of the MODEL through ModelPatcher injections: ComfyUI attaches them when it loads the
clone and takes them off when it unloads it (or loads another clone of the same weights), so the module other nodes
share never keeps an adapter and its weights are never written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json

import torch

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.sd
import comfy.utils

from ...training.core.adapters import AdapterConfig, AdapterSet, layer_alphas, layer_ranks
from ...training.memory.lowbit import is_quantized_layer, is_quantized_tensor
from ...training.memory.trained_weights_on_host import trained_weights_device
from ...training.core.lora_extract import extract_from_differences
from ...training.data.caption_tags import tag_frequency
from ...training.data.files import save_safetensors
from ...training.core.optimizers import OptimizerConfig
from ...training.core.trainer import TrainConfig
from ...training.memory import planner, sharded_weights
from . import families, lora_formats, video
from .comfy_bridge import TrainingRun, config_json
from .comfy_model import (REFERENCE_LATENTS, ComfyDenoiser, check_caches, data_fingerprint, model_blocks,
                          training_blocks, training_code_paths)
from .lora_formats import read_lora_layers
from .start_image import item_start_extras
from .text_encoder_lora import CaptionsThroughEncoder, TextEncoderLora, WithTextEncoder

INJECTION_KEY = "headroom_adapter"
# How validation applies a LoRA run's adapter: what the stock loader makes of the saved file, or computed beside the
# frozen weights (LoraTraining.sampling_model).
LORA_APPLICATIONS = ("as_saved_file", "unmerged")
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What a LoRA run passes the model as its reference (edit models: ReferenceLatent's reference_latents).
# "control latents": every item's cached control image, cached as VAE latents.
REFERENCES = ("none", "control latents")


# --- adapters on a clone ----------------------------------------------------------------------------------
def card_block_paths(diffusion_model: torch.nn.Module, paths: list[str], policy) -> list[str]:
    """The trained layers (of `paths`) in the blocks whose trained weights the policy keeps on the card with
    trained_weights host (trained_weights_card_blocks, indices in training_blocks' forward order)."""
    indices = policy.trained_card_blocks if policy.trained_weights == "host" else frozenset()
    if not indices:
        return []
    named = training_blocks(diffusion_model)
    beyond = sorted(i for i in indices if i >= len(named))
    if beyond:
        raise ValueError(f"trained_weights_card_blocks: block {beyond[0]} does not exist: this model has {len(named)} "
                         f"blocks (0-{len(named) - 1}); clear the field or let the card's plan fill it in")
    prefixes = tuple(named[i][0] + "." for i in sorted(indices))
    return [path for path in paths if (path + ".").startswith(prefixes)]


def attach_with_injection(patcher, adapters: AdapterSet, home=None) -> None:
    """Make ComfyUI attach `adapters` whenever it loads `patcher` (a clone), and detach on unload. `home`: where the
    trained weights live (default the load device; host RAM: memory/trained_weights_on_host.py)."""

    def inject(mp):
        root = mp.model.diffusion_model
        # The load device, where ComfyUI computes (weights of a partially loaded model are cast there too).
        adapters.to(mp.load_device if home is None else home)
        if adapters.attached_to is not root:
            adapters.detach()
            adapters.attach(root)

    def eject(mp):
        adapters.detach()

    patcher.set_injections(INJECTION_KEY, [comfy.patcher_extension.PatcherInjection(inject=inject, eject=eject)])


def comfy_patches(patcher, adapters: AdapterSet, dtype: torch.dtype = torch.float32) -> dict:
    """The adapter as ComfyUI weight patches, through the stock LoRA loading path, its tensors in `dtype` (as a file
    saved in it holds them: the stock loader computes in fp32 from what the file holds)."""
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    return comfy.lora.load_lora(adapters.comfy_state_dict(dtype=dtype), key_map, log_missing=True)


def patched_base_reader(patcher):
    """A full fine-tune's base (adapters.FullLayer `read_base`): each layer's weight and bias in fp32 as ComfyUI
    computes them once it loads `patcher`, whether or not it is loaded now: the stored tensor (the original when a
    load patched it in place: the backup ComfyUI keeps) with the MODEL's own patches applied (a Load LoRA before the
    run), in ComfyUI's own arithmetic (comfy.lora.calculate_weight, fp32). The same every time it is read, so the run
    starts from it and saves W' - W against it."""

    def read(path: str, module: torch.nn.Module, device):
        out = []
        for name in ("weight", "bias"):
            if getattr(module, name, None) is None:
                out.append(None)
                continue
            key = f"diffusion_model.{path}.{name}"
            backup = patcher.backup.get(key)
            stored = backup.weight if backup is not None else getattr(module, name)  # the module: attached or not
            if is_quantized_tensor(stored):  # ComfyUI's low-bit
                stored = stored.dequantize()
            tensor = stored.detach().to(device=device, dtype=torch.float32, copy=True)
            patches = patcher.patches.get(key)
            if patches:
                tensor = comfy.lora.calculate_weight(patches, tensor, key, intermediate_dtype=torch.float32)
            out.append(tensor)
        return out[0], out[1]

    return read


class AsSavedWeight:
    """A ComfyUI weight wrapper that gives a layer the weight the stock LoraLoader bakes from the saved file, made
    when the layer runs and dropped after it.

    Why by hand: stock ComfyUI bakes the patches into every weight at load (ModelPatcher.patch_weight_to_device),
    which holds a second copy of all patched weights while the clone is loaded (the originals as its backup): the
    validation that was meant to share the training weights would need twice their memory. This repeats the same
    arithmetic one layer at a time: the weight in ComfyUI's LoRA compute dtype, comfy.lora.calculate_weight, then
    rounded to the dtype the weight is stored in (comfy.float.stochastic_rounding, seeded by the key as stock does),
    then to the dtype the layer computes in. Bit for bit what stock gives wherever the compute dtype holds the stored
    dtype exactly (bf16 / fp16 / fp8 stored, fp32 or bf16 compute: every CPU and the usual GPU set-ups).
    """

    def __init__(self, key: str, patches: list, stored_dtype: torch.dtype):
        self.key, self.patches, self.stored_dtype = key, patches, stored_dtype
        self.seed = comfy.utils.string_to_seed(key)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        # `weight` is already this forward's own copy (ComfyUI casts with copy=True for layers with weight functions)
        merged = weight.to(comfy.model_management.lora_compute_dtype(weight.device))
        merged = comfy.lora.calculate_weight(self.patches, merged, self.key)
        return comfy.float.stochastic_rounding(merged, self.stored_dtype, seed=self.seed).to(weight.dtype)


def as_saved_file_model(model, adapters: AdapterSet, strength: float = 1.0, saved_dtype: str = "fp32"):
    """A clone of `model` that samples as if the stock LoraLoader had loaded the adapter's file saved in `saved_dtype`
    (Save LoRA's dtype) at `strength`,
    without baking it into a second copy of the weights: one AsSavedWeight per patched weight (ComfyUI's own
    weight-wrapper hook, installed on the layers when ComfyUI loads the clone).

    Layers holding ComfyUI's quantized weights (a scaled fp8 / int8 / nvfp4 file) get the patches themselves, baked
    by ComfyUI's own load (ModelPatcher.patch_weight_to_device: dequantized, comfy.lora.calculate_weight, then
    requantized with stochastic rounding seeded by the key): a weight wrapper there would turn the layer's quantized
    product (its input quantized too) into a plain one, which stock never computes, so only stock's own path gives
    stock's result. That holds one requantized copy of those layers' weights (their storage size) while the clone
    is loaded."""
    clone = model.clone()
    patches = comfy_patches(clone, adapters, SAVE_DTYPES[saved_dtype])
    quantized = {k: v for k, v in patches.items() if _on_quantized_layer(clone.model, k if isinstance(k, str) else k[0])}
    clone.add_patches(quantized, strength)
    patched = model.clone()  # never loaded: only collects the patches as the stock loader lays them out
    patched.patches = {}
    patched.add_patches({k: v for k, v in patches.items() if k not in quantized}, strength)
    for key, patches in patched.patches.items():
        stored, _, _ = comfy.model_patcher.get_key_weight(clone.model, key)
        clone.add_weight_wrapper(key, AsSavedWeight(key, patches, stored.dtype))
    return clone


def _on_quantized_layer(model, key: str) -> bool:
    """Whether the weight key ("diffusion_model.<path>.weight" / ".bias") belongs to a layer whose weight is
    ComfyUI's QuantizedTensor."""
    return is_quantized_layer(comfy.utils.get_attr(model, key.rpartition(".")[0]))


# The most frequent tags a saved file lists: sentence captions make one "tag" per caption, and a file's metadata is
# read with its header by every loader (kohya writes them all).
MAX_SAVED_TAGS = 1000


def caption_tag_metadata(run) -> dict[str, str]:
    """kohya's ss_tag_frequency ({run name: {tag: images whose caption holds it}}: what Civitai and LoRA managers show
    as a LoRA's trained words, the trigger word first) and ss_num_train_images (with repeats) over the run's training
    images, each image once (its sizes and mirror are one image), the MAX_SAVED_TAGS most frequent; {} where the
    text cache holds no captions."""
    captions = getattr(run.text_cache, "captions", None)
    if not captions:
        return {}
    images: dict[str, int] = {}
    for index in run.train_items:
        images.setdefault(run.latent_cache.name(index), index)
    texts = [captions.get(run.latent_cache.text_key(index)) for index in images.values()]
    if not texts or None in texts:
        return {}
    counts = dict(list(tag_frequency(texts).items())[:MAX_SAVED_TAGS])
    return {"ss_tag_frequency": json.dumps({run.run_dir.name: counts}),
            "ss_num_train_images": str(sum(run.latent_cache.repeats(index) for index in images.values()))}


# --- the LoRA run ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoraRunConfig:
    """A LoRA run's configuration, as its run folder stores it (config.json "session")."""
    family: str | None
    adapter: AdapterConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    holdout: int  # last N cached items held out for the validation loss (0: validate on the training items)
    reference: str = "none"  # REFERENCES: what each item passes as reference_latents (edit models)
    # The learning rate of the CLIP's text encoders where the run trains them too (text_encoder_lora); None: it does not
    text_encoder_lr: float | None = None

    def to_json(self) -> dict:
        return config_json(self)


class LoraTraining:
    """A TrainingRun's strategy for LoRA runs: the adapter set on the training clone (`adapters`), trained on the
    run's items and, when given, prior (regularisation) images (`prior`: their latent and text caches)."""

    trains = "lora"

    def __init__(self, prior: tuple | None = None, clip=None):
        self.prior = prior
        self.clip = clip  # the CLIP whose text encoders the run trains too (config.text_encoder_lr); None: it does not
        self.adapters: AdapterSet | None = None  # built by `build`
        self.text_encoder: TextEncoderLora | None = None  # built by `build` when the run trains the text encoder
        self.continued_text_encoder_layers: int | None = None  # of init_lora's, where it continues the text encoder

    def caches(self) -> tuple:
        """The caches the run reads beside its own: the prior images' (comfy_bridge.TrainingRun.attached releases
        their files after each call)."""
        return self.prior or ()

    def identity(self, run) -> dict:
        """What beyond the configuration makes the run: its start images (image-to-video caches), its prior images'
        caches and data."""
        start = getattr(run.latent_cache, "start_image", None)
        identity = {"start_image": start} if start is not None else {}  # runs without one keep their identity
        if self.prior is None:
            return identity
        check_caches(run.source_model.model, *self.prior)
        return {**identity, "prior_latent_cache": getattr(self.prior[0], "fingerprint", None),
                "prior_text_cache": getattr(self.prior[1], "fingerprint", None),
                "prior_tag_shuffling": getattr(self.prior[1], "tag_shuffling", None),
                "prior_data": data_fingerprint(self.prior[0])}

    def for_other_ranks(self) -> dict:
        """What the worker ranks of a multi-device run open it with beyond rank 0's inputs: nothing (the adapters'
        seeded initialisation on the same base is the same on every rank)."""
        return {}

    def build(self, run) -> tuple:
        """(denoiser, trainable, Trainer options): the adapters on the run's training clone."""
        config, patcher = run.config, run.placement.patcher
        diffusion_model = patcher.model.diffusion_model
        with run.placement.low_bit_storage():  # the adapters are built on the low-bit layers they will wrap
            paths = families.lora_targets(diffusion_model, config.family, config.adapter,
                                          [n for n, _ in model_blocks(diffusion_model)])
            # The compute device, or host RAM (trained_weights host: each layer crosses to the card when it runs, but
            # those of the blocks the policy keeps on the card).
            home = trained_weights_device(run.policy, patcher.load_device)
            self.adapters = AdapterSet(diffusion_model, paths, config.adapter, device=home,
                                       base_reader=patched_base_reader(patcher),
                                       on_card=card_block_paths(diffusion_model, paths, run.policy),
                                       card_device=patcher.load_device)
        trains_encoder = config.text_encoder_lr is not None
        continued = {}  # init_lora's text-encoder layers (with text_encoder_lr)
        if config.adapter.init_lora:  # a resumed run's checkpoint replaces these (Trainer.resume)
            layers, continued = read_lora_layers(run.source_model, config.adapter.init_lora, config.adapter.kind,
                                                 self.clip if trains_encoder else None)
            self.adapters.start_from(layers, f"LoRA file {config.adapter.init_lora}")
        # Where the trained weights live (the compute device; host RAM for trained_weights host) from the start, so
        # resumed optimizer state lands there too.
        self.adapters.to(home)
        attach_with_injection(patcher, self.adapters, home)
        options = {"prior": self.prior}
        trainable = self.adapters
        if trains_encoder:
            # The CLIP's text encoders trained too: their LoRA beside the CLIP's weights, and the captions encoded
            # through it at each step where other runs read the text cache (the same texts, draws and dropout)
            self.text_encoder = TextEncoderLora(self.clip, config.adapter)
            if config.adapter.init_lora:  # the file's text-encoder layers continued; those it lacks start anew
                self.text_encoder.adapters.start_from(continued, f"LoRA file {config.adapter.init_lora}'s text "
                                                                 "encoder")
                self.continued_text_encoder_layers = len(continued)
            # on the device the CLIP computes on from the start, so resumed optimizer state lands there too
            self.text_encoder.adapters.to(self.clip.patcher.load_device)
            trainable = WithTextEncoder(self.adapters, self.text_encoder,
                                        config.text_encoder_lr / config.optimizer.lr)
            options["text_cache"] = CaptionsThroughEncoder(run.text_cache, self.text_encoder)
            if self.prior is not None:
                options["prior"] = (self.prior[0], CaptionsThroughEncoder(self.prior[1], self.text_encoder))
        latent_cache = run.latent_cache
        extras = []
        if config.reference == "control latents":
            # Every item's cached control latents as its one reference, as ReferenceLatent appends a VAE Encode
            # output; kept when caption dropout empties the prompt (trainer's item_extras).
            extras.append(lambda item: {REFERENCE_LATENTS: [latent_cache.control(item).float()]})
        # image-to-video: start frames. Errors here go up to the node that opens the run, which puts its name first.
        start = item_start_extras(patcher.model, latent_cache, f"run '{run.run_dir.name}'")
        if start is not None:
            if self.prior is not None:
                raise ValueError("prior images with start images (image-to-video): prior images have no start image; "
                                 "disconnect prior_latent_cache / prior_text_cache")
            extras.append(start)
        rates = video.item_frame_rate_extras(patcher.model, latent_cache)  # LTX-2: each clip at its own frame rate
        if rates is not None:
            if self.prior is not None:
                raise ValueError("prior images with clips at their own frame rates (LTX-2) are not supported; "
                                 "disconnect prior_latent_cache / prior_text_cache")
            extras.append(rates)
        if extras:
            options["item_extras"] = lambda item: {k: v for extra in extras for k, v in extra(item).items()}
        return ComfyDenoiser(patcher), trainable, options

    # --- on the device --------------------------------------------------------------------------------------
    def patchers(self, run) -> list:
        """The training clone, and the CLIP where the run trains its text encoders (loaded with it, as ComfyUI loads
        both for a prompt)."""
        return [run.placement.patcher, *([self.clip.patcher] if self.text_encoder is not None else [])]

    def device_extra_bytes(self, trainer) -> int:
        """What the run adds on the device beyond the MODEL's weights (for ComfyUI's memory accounting): the
        trainable weights, their gradients (none kept with fused backward) and the optimizer's state where it lives
        on the device (the planner's model of it; sharded over the ranks: this rank's share)."""
        weights = sum(sharded_weights.local_bytes(p) for p in trainer.params)  # FSDP2: this rank's shards
        gradients = 0 if trainer.policy.fused_backward else weights
        if trainer.policy.trained_weights == "host":  # one layer at a time crosses to the card: only those kept there
            crossing = {id(p) for p in self.adapters.parameters_in_host_ram()}
            weights = sum(p.numel() * p.element_size() for p in trainer.params if id(p) not in crossing)
        spec = dataclasses.replace(planner.TrainableSpec.from_parameters(trainer.params, trainer.optimizer_config.name),
                                   state_ranks=trainer.state_ranks, weight_ranks=trainer.weight_ranks)
        state = 0 if trainer.policy.optimizer_state in ("cpu", "streamed") else spec.optimizer_share_bytes()
        return weights + gradients + state

    def unread_base_layers(self) -> list:
        """The base layers a training step never reads (a full fine-tune's: adapters.AdapterSet.unread_base_layers),
        whose weights the run leaves in host RAM."""
        return self.adapters.unread_base_layers()

    @contextlib.contextmanager
    def attach(self, run):
        """The adapters attached to the loaded clone. Outside this block they are ejected again, even though the
        clone may stay loaded: the module tree other nodes share (stock LoraLoader, KSampler on the MODEL) is then
        exactly ComfyUI's."""
        patcher = run.placement.patcher
        patcher.inject_model()  # a no-op when the load just injected; needed when the clone stayed loaded
        if self.adapters.attached_to is not patcher.model.diffusion_model:
            raise RuntimeError(f"run '{run.run_dir.name}': ComfyUI did not attach the adapter to the loaded model")
        try:
            with self.text_encoder.attached() if self.text_encoder is not None else contextlib.nullcontext():
                yield
        finally:
            patcher.eject_model()

    def check_detached(self, run) -> None:
        if self.adapters.attached_to is not None:
            raise RuntimeError(f"run '{run.run_dir.name}': the adapter is still attached; cannot sample the base "
                               "model")

    # --- sampling -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sampling_model(self, run, lora_application: str = "unmerged", saved_dtype: str = "fp32"):
        """The ModelPatcher validation samples with. "unmerged": the training clone with the adapter attached (its
        low-bit base too), computing the LoRA next to the frozen weights. "as_saved_file": what the stock LoraLoader
        makes of the file saved in `saved_dtype` (Save LoRA's dtype): a clone of the run's MODEL with the adapter as
        ComfyUI weight patches, baked into the weights in their own dtype (comfy.lora + stochastic rounding) when
        ComfyUI loads the clone. Either way the optimizer state is parked as the policy says."""
        if lora_application not in LORA_APPLICATIONS:
            raise ValueError(f"lora_application={lora_application!r}: choose one of {', '.join(LORA_APPLICATIONS)}")
        if lora_application == "unmerged":
            with run.validating(), training_code_paths():
                yield run.placement.patcher
            return
        with run.trainer.parked_for_validation():
            model = as_saved_file_model(run.source_model, self.adapters, saved_dtype=saved_dtype)
            try:
                yield model
            finally:  # the patched weights leave memory now, not when gc finds the clone
                comfy.model_management.unload_model_and_clones(model, unload_additional_models=False)

    def sampling_conditioning(self, run, positive, negative, vae=None):
        """A LoRA adds nothing to the prompts."""
        return positive, negative

    @contextlib.contextmanager
    def prompt_clip(self, run, clip, lora_application: str = "as_saved_file", saved_dtype: str = "fp32"):
        """The CLIP validation encodes its prompts with: `clip` itself, or where the run trains the text encoder,
        `clip` with it: "unmerged" (and `clip` the run's own) the LoRA attached beside the CLIP's weights, else what
        the stock Load LoRA makes of the saved file's text-encoder layers (a clone of `clip` with them as weight
        patches, baked in when ComfyUI loads it)."""
        if self.text_encoder is None:
            yield clip
            return
        if lora_application == "unmerged" and clip.cond_stage_model is self.clip.cond_stage_model:
            with self.text_encoder.attached():
                yield clip
            return
        patched = self.patched_clip(run, clip, 1.0, saved_dtype)
        try:
            yield patched
        finally:  # the patched weights leave memory now, not when gc finds the clone
            comfy.model_management.unload_model_and_clones(patched.patcher, unload_additional_models=False)

    # --- apply, save, describe ------------------------------------------------------------------------------
    def patched_model(self, run, model=None, strength: float = 1.0, saved_dtype: str = "fp32"):
        """A clone of `model` (default: the MODEL the run trains) with the current adapter as weight patches, as a
        file saved in `saved_dtype` holds them (what Load LoRA of that file gives)."""
        model = model if model is not None else run.source_model
        clone = model.clone()
        clone.add_patches(comfy_patches(clone, self.adapters, SAVE_DTYPES[saved_dtype]), strength)
        return clone

    def patched_clip(self, run, clip, strength: float = 1.0, saved_dtype: str = "fp32"):
        """`clip` with the text-encoder layers a file saved in `saved_dtype` holds, as weight patches at `strength`:
        what the stock Load LoRA of that file gives with strength_clip (its own loader,
        comfy.sd.load_lora_for_models); `clip` itself where the run does not train the text encoder (or it is
        None)."""
        if self.text_encoder is None or clip is None:
            return clip
        return comfy.sd.load_lora_for_models(None, clip, self.text_encoder.comfy_state_dict(SAVE_DTYPES[saved_dtype]),
                                             0.0, strength)[1]

    def metadata(self, run) -> dict[str, str]:
        config = run.config
        return {
            "headroom.format": "comfyui-lora", "headroom.base_fingerprint": run.fingerprint,
            "headroom.family": str(config.family), "headroom.kind": config.adapter.kind,
            "headroom.rank": str(config.adapter.rank), "headroom.alpha": str(config.adapter.alpha),
            "headroom.steps": str(run.step), "headroom.run": run.run_dir.name,
            "headroom.config": json.dumps(config.to_json(), sort_keys=True),
        }

    def save(self, run, path, dtype: str = "fp32", file_format: str = "comfyui", weights: str = "auto",
             caption_tags: bool = True) -> None:
        """Write the adapter to `path` (atomically) in `file_format`'s key names (nodes/bridge/lora_formats.py), of the
        trained weights or their EMA (`weights`), in `dtype`; with `caption_tags`, the training captions' tag counts
        (caption_tag_metadata) in every format."""
        family, adapter = run.config.family, run.config.adapter
        if file_format == "kohya":  # refused before any work
            lora_formats.check_kohya_kind(adapter.kind)
        if file_format == "diffusers":
            lora_formats.check_diffusers_kind(adapter.kind)
            names = lora_formats.diffusers_names(run.source_model, self.adapters.layers, family)
        with run.weights(weights) as used:  # diffusers: fp32 here, cast after alpha is folded in
            state = self.adapters.comfy_state_dict(
                dtype=torch.float32 if file_format == "diffusers" else SAVE_DTYPES[dtype])
            encoder = {} if self.text_encoder is None else self.text_encoder.comfy_state_dict(
                torch.float32 if file_format == "diffusers" else SAVE_DTYPES[dtype])
        metadata = {**self.metadata(run), "headroom.weights": used,
                    **(caption_tag_metadata(run) if caption_tags else {})}
        if file_format == "diffusers":
            state, config = lora_formats.to_diffusers(state, names, family, SAVE_DTYPES[dtype])
            if encoder:  # text_encoder(_2).* beside the model's component, each with its LoraConfig
                encoder, encoder_config = self.text_encoder.diffusers_state_dict(encoder, SAVE_DTYPES[dtype])
                config.update(encoder_config)
            metadata.update(lora_formats.diffusers_metadata(config))
            metadata["headroom.format"] = "diffusers"
        if file_format == "kohya":
            names = lora_formats.kohya_names(run.source_model, self.adapters.layers, family)
            state = lora_formats.to_kohya(state, names)
            buckets = list(run.latent_cache.buckets)
            metadata.update(lora_formats.kohya_metadata(
                family, adapter.kind, adapter.rank, adapter.alpha, run.step, path.name[: -len(".safetensors")],
                max(buckets, key=lambda b: b[0] * b[1]) if buckets else None, model=run.source_model,
                network_args=lora_formats.kohya_conv_args(adapter.kind, self._spatial_convolutions(adapter))))
            metadata.update(lora_formats.kohya_training_metadata(run.config.optimizer, run.config.train))
            metadata["headroom.format"] = "kohya"
            if encoder:
                encoder = self.text_encoder.kohya_state_dict(encoder)
                metadata["ss_text_encoder_lr"] = str(run.config.text_encoder_lr)
        state.update(encoder)
        save_safetensors(path, state, f"LoRA {path.name}", metadata=metadata)

    def _spatial_convolutions(self, adapter) -> list[tuple[int, float]]:
        """(rank, alpha) of each trained convolution whose kernel is larger than 1x1 (kohya's LoCon conv_dim layers)."""
        ranks, alphas = layer_ranks(self.adapters.layers, adapter), layer_alphas(self.adapters.layers, adapter)
        return [(ranks[path], alphas[path]) for path, layer in self.adapters.layers.items()
                if isinstance(base := getattr(layer, "base_layer", layer), torch.nn.Conv2d)
                and tuple(base.kernel_size) != (1, 1)]

    def save_extracted(self, run, path, rank: int, energy: float, dtype: str = "fp32", weights: str = "auto",
                       caption_tags: bool = True) -> str:
        """Write a LoRA extracted from a full fine-tune's differences (training/core/lora_extract.py: truncated SVD per
        weight by `rank` / `energy`, biases whole) to `path` (atomically) in ComfyUI's LoRA keys, with the captions'
        tag counts as `save` writes them (`caption_tags`); returns what it kept."""
        adapter = run.config.adapter
        if adapter.kind != "full":
            raise ValueError(f"a LoRA is extracted from a full fine-tune (LoRA Config kind full); this run trains "
                             f"kind {adapter.kind}: save it with Save LoRA")
        with run.weights(weights) as used:
            state, kept = extract_from_differences(self.adapters.differences(), rank=rank, energy=energy,
                                                   dtype=SAVE_DTYPES[dtype])
        metadata = {**self.metadata(run), "headroom.kind": "lora", "headroom.extracted_from": "full",
                    "headroom.rank": str(rank) if rank > 0 else "by energy", "headroom.extracted": kept.summary(),
                    "headroom.weights": used, **(caption_tag_metadata(run) if caption_tags else {})}
        save_safetensors(path, state, f"LoRA {path.name}", metadata=metadata)
        return kept.summary()

    def save_bytes(self, run, dtype: str = "fp32") -> int:
        """About what an all-in-one node's save (`save` in `dtype`, the comfyui format) writes: the trained tensors in
        that dtype (a full fine-tune's differences are as many), before any save is on disk to say
        (model_files.saves_room_note)."""
        size = torch.empty((), dtype=SAVE_DTYPES[dtype]).element_size()
        encoder = self.text_encoder.parameters() if self.text_encoder is not None else []
        return size * sum(p.numel() for p in [*self.adapters.parameters(), *encoder])

    def note(self, run) -> str:
        """The text encoder a run trains too, said on its Init node: which encoders, how many layers, at what
        rate."""
        if self.text_encoder is None:
            return ""
        encoders = sorted({path.split(".", 1)[0] for path in self.text_encoder.paths})
        note = (f"text encoder trained too: {len(self.text_encoder.paths)} layers of {', '.join(encoders)} at "
                f"learning rate {run.config.text_encoder_lr:g}")
        continued = self.continued_text_encoder_layers
        if continued is not None:
            note += (f", {continued} of them continued from init_lora" if continued else
                     "; init_lora holds no text-encoder layers: they start anew")
        return note

    def describe(self, run) -> str:
        adapter = run.config.adapter
        if adapter.kind == "full":
            return "full fine-tune"
        by = [name for name in ("layer_ranks", "layer_alphas") if getattr(adapter, name)]
        other = f" (other {' and '.join(n.removeprefix('layer_') for n in by)} by {' and '.join(by)})" if by else ""
        encoder = f" + text encoder ({len(self.text_encoder.paths)} layers)" if self.text_encoder is not None else ""
        return f"{adapter.kind} r{adapter.rank}{other}{encoder}"


def open_lora_run(model, latent_cache, text_cache, config: LoraRunConfig, run_root, run_name: str, policy=None,
                  prior: tuple | None = None, clip=None) -> TrainingRun:
    """Build (or resume from its run folder) a LoRA run on `model` (and, with config.text_encoder_lr, on `clip`'s
    text encoders)."""
    return TrainingRun(model, latent_cache, text_cache, config, LoraTraining(prior, clip), run_root, run_name,
                       policy=policy)
