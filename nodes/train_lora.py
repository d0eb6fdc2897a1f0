"""LoRA training nodes: configure, train to a step, validate, save, apply; and an all-in-one node.

Modular graph:  LoraConfig + OptimizerConfig + MODEL + caches -> TrainLoraInit -> TrainSteps(N)
                -> Validate / SaveLora / ApplyTrainedLora
TrainSteps trains the run *to* step N: queueing it again with the same N does no work, a higher N
continues. Init with the name of an existing run resumes it from its run directory (after a restart too).
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

import folder_paths
from comfy_api.latest import io, ui

from ..training.core.adapters import FULL_PRECISIONS, KINDS, TARGET_MODES, AdapterConfig
from ..training.checks import check_finite, named
from ..training.core.optimizers import (LORAPLUS_MAX, OPTIMIZERS, SCALE_WEIGHT_NORMS_MAX, SCHEDULES,
                                        MissingPackageError, OptimizerConfig, check_available)
from ..training.core.run_dir import RunFolderError, check_name, check_subfolder
from ..training.memory import sharded_optimizer
from .bridge import lora_formats
from .bridge.comfy_bridge import (TrainingRun, check_run_kind, node_id, node_name, release_cache_files, run_and_step,
                                  said_by, send_node_text)
from .bridge.comfy_model import (check_caches, check_quantized_kind, check_reference_cache, check_trainable,
                                 missing_inputs_note, model_family)
from .bridge.model_files import (MERGE_DTYPES, MERGE_FORMATS, MERGE_NONE, RESIZE_DTYPES, check_disk_room,
                                 make_room_for_step_save, prune_step_saves, runs_root, save_extracted_lora, save_lora,
                                 save_resized_lora, saves_room_note, saves_to_come, step_save_name)
from .bridge.inspect_lora import file_fingerprint, inspect_lora
from .bridge.merge_loras import save_merged_lora
from .bridge.planning import check_host_ram, lora_trainable, plan_for_card
from .bridge.rank_workers import open_on_devices, parse_devices
from .bridge.run_lora import REFERENCES, SAVE_DTYPES, LoraRunConfig, open_lora_run
from .bridge.run_settings import effective_batch, resolve_policy, run_fingerprint, train_config
from .bridge.sample_prompts import parse_prompts
from .bridge.text_encoder_lora import (TEXT_ENCODER_KINDS, TextEncoderLora, longest_caption, text_encoder_layers,
                                       with_text_encoder)
from .bridge.validation import validate, validation_grids, validation_history
from .inputs import (DEFAULT_CHECKPOINT_MINUTES, added_train_inputs, checkpoint_inputs, compare_base_input,
                     devices_input, extra_noise_inputs, frame_rate_input, frames_input, keep_saves_input,
                     layer_names_input, lora_config_input, masked_out_weight_input,
                     model_and_caches, noise_range_inputs, optimizer_config_input,
                     policy_input, prior_inputs, reference_images_input, reference_input, run_name_input,
                     save_dtype_input, schedule_inputs, start_image_input, text_encoder_inputs, training_settings,
                     validation_inputs, validation_names, weights_input)
from .io_types import LoraConfigType, OptimizerConfigType, TrainingRunType

CATEGORY = "Headroom/training"
HISTORY_KEY = "headroom_history"  # the training nodes' UI output js/headroom_live.js redraws the chart from
VALIDATION_KEY = "headroom_validation"  # HeadroomValidate's UI output: the chart of the same run takes its images
SAVED_KEY = "headroom_saved"  # files a node wrote for the user; workflows/headroom_run.py prints them


def saved_file(kind: str, folder: str, name: str) -> dict:
    """A `headroom_saved` UI entry: `name` relative to ComfyUI's `folder` ("loras", "controlnet": a models/
    folder; "output")."""
    return {"kind": kind, "folder": folder, "name": name}


def saved_text(run: TrainingRun, kind: str, folder: str, name: str) -> str:
    """What a save node shows on itself: the run and step saved, and where the file went, relative to ComfyUI's
    models/ folder."""
    return f"{run_and_step(run)}: {kind} saved to models/{folder}/{name}"


def opened_text(run: TrainingRun) -> str:
    """What an Init node shows on itself: the run it opened, at which step, and its notes (precision, the policy
    fitted to the card, the batch), one a line."""
    how = "resumed from its last checkpoint" if run.resumed else "started"
    return "\n".join([f"{run_and_step(run)}: {how}", *run.notes])


def validated_text(run: TrainingRun, loss: float, sampled: bool) -> str:
    """What Validate shows on itself: the run and step validated, the validation loss and, when it `sampled` images,
    the grid's file under output/ (the images themselves show as ComfyUI's image preview)."""
    text = f"{run_and_step(run)}: validation loss {loss:.4g}"
    if sampled:
        text += f"; grid saved to output/{run.last_validation['grid']}"
    return text


def shown_images(run: TrainingRun, previews) -> dict:
    """The images a validating node shows on itself: the before/after grid when the validation made one (the base
    MODEL's samples over the run's: what training changed, in one picture), else the samples."""
    if previews is None:
        return {}
    before_after = run.last_validation.get("before_after")
    if before_after is None:
        return previews.as_dict()
    subfolder, _, filename = before_after.rpartition("/")
    return {"images": [{"filename": filename, "subfolder": subfolder, "type": "output"}]}


# --- configuration nodes ------------------------------------------------------------------------------------
class HeadroomLoraConfig(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomLoraConfig",
            display_name="LoRA Config (Headroom)",
            category=CATEGORY,
            description="What to train: adapter kind, rank, alpha and which layers; kind full trains the layers' "
            "own weights (a full fine-tune).",
            inputs=[
                io.Combo.Input("kind", options=list(KINDS), default="lora",
                               tooltip="lora; dora (weight-decomposed); loha (Hadamard); lokr (Kronecker); oft "
                               "(orthogonal finetuning: rotates each layer's output features in blocks, ComfyUI's "
                               "OFT format); full (full fine-tune: trains the targeted layers' weights themselves, "
                               "as the run's own copy (the shared model is unchanged), saved as the difference to the "
                               "base, a file Load LoRA applies; "
                               "rank, alpha and dropout do not apply; all_layers trains every layer)."),
                io.Int.Input("rank", default=16, min=1, max=1024,
                             tooltip="Size of the low-rank update: higher learns more detail and takes more memory "
                             "and file size; 4-32 is usual. oft: the block size of the rotations (at least 2; it must "
                             "divide every trained layer's output features; 16-64 is usual), as ComfyUI's trainer "
                             "reads rank."),
                io.Float.Input("alpha", default=16.0, min=0.01, max=4096.0, step=0.01,
                               tooltip="Scale is alpha / rank; alpha = rank means scale 1. oft: the constraint, the "
                               "largest norm of each layer's rotation generator (ComfyUI's trainer uses 1; smaller "
                               "stays closer to the base model)."),
                io.Combo.Input("targets", options=list(TARGET_MODES), default="preset",
                               tooltip="preset: the model family's attention/MLP layers (SD1.5, SDXL, SD3, Flux); "
                               "all_linear: every linear layer inside the model's blocks (any model); all_layers: "
                               "every linear and conv layer of the model, embedders and output layer too."),
                io.Boolean.Input("include_conv", default=False,
                                 tooltip="Also train the UNet block convolutions (SD1.5 / SDXL presets, all_linear)."),
                io.Float.Input("dropout", default=0.0, min=0.0, max=0.9, step=0.01,
                               tooltip="Dropout on the adapter's input while training (0: none; kind oft has none)."),
                io.Int.Input("init_seed", default=0, min=0, max=0xFFFFFFFF,
                             tooltip="Seed of the adapter's initial weights."),
                io.Combo.Input("init_lora", options=["none", *folder_paths.get_filename_list("loras")], default="none",
                               optional=True,
                               tooltip="Continue training this LoRA file instead of starting from zero (any file "
                               "Load LoRA reads: ComfyUI, kohya, diffusers names). Plain LoRA files with kind lora and "
                               "the file's rank, or OFT files with kind oft and the file's block size and alpha; its "
                               "text-encoder layers are dropped."),
                io.Combo.Input("full_precision", options=list(FULL_PRECISIONS), default="fp32", optional=True,
                               advanced=True,
                               tooltip="kind full only: the trained weights in fp32 (exact), or bf16_stochastic: "
                               "bf16 updated with stochastic rounding, half the memory of the weights and their "
                               "gradients (needs fused_backward on in the Offload Policy)."),
                layer_names_input("layers",
                                  "Train only some of the layers targets selects: parts of ComfyUI's layer "
                                  "names, separated by commas, spaces or lines; ! before one leaves its layers out. "
                                  "Empty: all of them. Wildcards as in file names: * any text, ? one character. E.g. "
                                  "Flux single blocks only: single_blocks; blocks 10-19: single_blocks.1?. (end a "
                                  "number with a dot: blocks.1 also matches blocks.10); every linear layer but the "
                                  "modulation ones (targets all_linear): !mod. The names are ComfyUI's "
                                  "(double_blocks.0.img_attn.qkv, input_blocks.4.1...), not diffusers': a pattern "
                                  "matching no layer is refused, the message showing the names."),
                layer_names_input("layer_lr_scales",
                                  "Learning rates per layer, as multiples of the Optimizer Config's: "
                                  "pattern=scale pairs (patterns as in layers), separated by commas, spaces or lines; "
                                  "a layer takes the first that matches it, 1 where none does. E.g. "
                                  "input_blocks=0.5 output_blocks=1.5 (kohya's block learning-rate weights), "
                                  "double_blocks=2. Not with Prodigy (one step size for all)."),
                layer_names_input("layer_ranks",
                                  "Ranks per layer: pattern=rank pairs (patterns as in layers), separated by "
                                  "commas, spaces or lines; a layer takes the first that matches it, rank where none "
                                  "does. A layer's scale is its alpha (alpha, or layer_alphas') / its rank (kohya's "
                                  "block_dims, peft's rank_pattern). E.g. single_blocks=8 input_blocks=4. Kinds lora, "
                                  "dora, loha, lokr."),
                layer_names_input("layer_alphas",
                                  "Alphas per layer: pattern=alpha pairs (patterns as in layers), separated by "
                                  "commas, spaces or lines; a layer takes the first that matches it, alpha where none "
                                  "does, so its scale is its alpha / its rank (kohya's conv_alpha and block_alphas, "
                                  "peft's alpha_pattern). E.g. with layer_ranks in_layers=8 out_layers=8: in_layers=4 "
                                  "out_layers=4. Each layer's alpha is saved with it. Kinds lora, dora, loha, lokr."),
            ],
            outputs=[LoraConfigType.Output("lora_config",
                                           tooltip="What to train, for a Train LoRA (Init) node's lora_config.")],
        )

    @classmethod
    def execute(cls, kind, rank, alpha, targets, include_conv, dropout, init_seed, init_lora="none",
                full_precision="fp32", layers="", layer_lr_scales="", layer_ranks="", layer_alphas=""
                ) -> io.NodeOutput:
        name = node_name(cls)
        check_finite(name, alpha=alpha, dropout=dropout)
        config = AdapterConfig(kind=kind, rank=rank, alpha=alpha, targets=targets, include_conv=include_conv,
                               dropout=dropout, init_seed=init_seed, init_lora=None if init_lora == "none" else init_lora,
                               full_precision=full_precision, layers=layers or "",
                               layer_lr_scales=layer_lr_scales or "", layer_ranks=layer_ranks or "",
                               layer_alphas=layer_alphas or "")
        _checked(name, config.validate)
        return io.NodeOutput(config)


LEARNING_RATE_MAX = 10.0
_LEARNING_RATE_HINT = ("set it above 0: about 1e-4 for a LoRA with AdamW, 1.0 for Prodigy (the editor rounds a rate to "
                       "the decimals it shows, so one smaller than its last decimal becomes 0)")


def learning_rate_problem(node: str, lr: float) -> str | None:
    """What is wrong with learning rate `lr` and what to set, naming `node`; None when it trains. A rate of 0 runs
    and saves a LoRA that changes nothing, a negative one trains away from the data: both refused, never clamped."""
    if not math.isfinite(lr):
        return f"{node}: learning_rate={lr} is not a finite number; give a number (e.g. its default 1e-4)"
    if lr == 0:
        return (f"{node}: learning_rate 0 trains nothing (the run would save weights that change nothing); "
                f"{_LEARNING_RATE_HINT}")
    if lr < 0:
        return f"{node}: learning_rate {lr:g} is negative (it would train away from the data); {_LEARNING_RATE_HINT}"
    if lr > LEARNING_RATE_MAX:
        return (f"{node}: learning_rate {lr:g} is above {LEARNING_RATE_MAX:g}, far past any optimizer's useful "
                "rate; about 1e-4 for a LoRA with AdamW, 1.0 for Prodigy")
    return None


class HeadroomOptimizerConfig(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomOptimizerConfig",
            display_name="Optimizer Config (Headroom)",
            category=CATEGORY,
            description="Optimizer and learning-rate schedule.",
            inputs=[
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                               tooltip="AdamW (torch); AdamW8bit / PagedAdamW8bit / Lion8bit (less memory; need the pip "
                               "package bitsandbytes); Adafactor; CAME (needs came-pytorch); Prodigy (needs prodigyopt; "
                               "set lr 1.0: it finds the step size)."),
                # min 0, not 1e-8: the editor clamps to min silently (a 0 became 1e-8 and trained a LoRA that
                # changes nothing), so 0 reaches validate_inputs, which refuses it by name. step 1e-8: the editor
                # shows and rounds to the step's decimals, so rates down to 1e-8 show as they are, not as 0.000000.
                io.Float.Input("learning_rate", default=1e-4, min=0.0, max=LEARNING_RATE_MAX, step=1e-8,
                               tooltip="Learning rate after warm-up (the schedule scales it from there): about 1e-4 "
                               "for a LoRA with AdamW; 1.0 for Prodigy. Must be above 0."),
                io.Float.Input("weight_decay", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Decoupled weight decay of the trained weights (0: none)."),
                io.Combo.Input("schedule", options=list(SCHEDULES), default="constant",
                               tooltip="How the learning rate changes after warm-up over schedule_steps "
                               "(transformers' schedules): constant keeps it."),
                io.Int.Input("warmup_steps", default=0, min=0, max=100000,
                             tooltip="Steps over which the learning rate rises linearly from 0 (0: no warm-up)."),
                io.Int.Input("schedule_steps", default=1000, min=1, max=1000000,
                             tooltip="Length of decaying schedules (linear, cosine...), usually the planned steps."),
                io.Float.Input("loraplus_lr_ratio", advanced=True, default=1.0, min=1.0, max=LORAPLUS_MAX, step=0.5,
                               optional=True,
                               tooltip="LoRA+ (kohya's loraplus_lr_ratio): a LoRA's up matrices learn at this many "
                               "times the learning rate, which makes it learn faster at the same rate for the rest. "
                               "1: off. The paper suggests 16; start around 4. LoRA and DoRA runs; not with Prodigy."),
                io.Float.Input("scale_weight_norms", advanced=True, default=0.0, min=0.0, max=SCALE_WEIGHT_NORMS_MAX,
                               step=0.01, optional=True,
                               tooltip="Max-norm regularisation (kohya's scale_weight_norms): after each step, a "
                               "layer whose LoRA update has a norm above this is scaled back to it, which keeps "
                               "single layers from overpowering the model (and the LoRA usable at higher strength). "
                               "0: off; 1 is usual. LoRA and DoRA runs; Train Steps shows how many layers it "
                               "scaled."),
            ],
            outputs=[OptimizerConfigType.Output("optimizer_config",
                                                tooltip="Optimizer and schedule, for a training node's "
                                                "optimizer_config.")],
        )

    @classmethod
    def validate_inputs(cls, learning_rate: float | None = None) -> bool | str:
        # Taking learning_rate here makes ComfyUI skip its own min / max check of it ("Value 0.0 smaller than min"),
        # so the range is checked here, with what to set. None: linked, checked when the node runs. Not a number:
        # ComfyUI's conversion already reported it.
        if isinstance(learning_rate, (int, float)):
            return learning_rate_problem(node_name(cls), learning_rate) or True
        return True

    @classmethod
    def execute(cls, optimizer, learning_rate, weight_decay, schedule, warmup_steps, schedule_steps,
                loraplus_lr_ratio=1.0, scale_weight_norms=0.0) -> io.NodeOutput:
        name = node_name(cls)
        check_finite(name, learning_rate=learning_rate, weight_decay=weight_decay, loraplus_lr_ratio=loraplus_lr_ratio,
                     scale_weight_norms=scale_weight_norms)
        problem = learning_rate_problem(name, learning_rate)
        if problem:  # a linked value, or a call from Python (workflows/headroom_train_distributed.py)
            raise ValueError(problem)
        config = OptimizerConfig(name=optimizer, lr=learning_rate, weight_decay=weight_decay, schedule=schedule,
                                 warmup_steps=warmup_steps, total_steps=schedule_steps,
                                 loraplus_lr_ratio=loraplus_lr_ratio, scale_weight_norms=scale_weight_norms)
        _checked(name, config.validate)
        try:  # an optimizer from an optional package: say now which pip package is missing, not mid-run
            check_available(optimizer)
        except MissingPackageError as error:
            raise MissingPackageError(f"{name}: {error}") from None
        return io.NodeOutput(config)


def _checked(node: str, validate) -> None:
    try:
        validate()
    except ValueError as error:
        raise ValueError(f"{node}: {error}") from error


# --- init ----------------------------------------------------------------------------------------------------
def check_text_encoder_training(clip, text_encoder_lr: float, lora_config: AdapterConfig,
                                optimizer_config: OptimizerConfig, devices: str, text_cache) -> None:
    """A run that trains the CLIP's text encoders too (text_encoder_lr > 0): its CLIP connected and holding a CLIP
    text encoder (text_encoder_lora.text_encoder_layers), as wide as the cached captions, and settings it trains
    with; ValueError saying what to change otherwise."""
    if text_encoder_lr < 0:
        raise ValueError(f"text_encoder_lr {text_encoder_lr:g} is negative: 0 (the text encoder not trained) or a "
                         "learning rate above 0")
    if text_encoder_lr == 0:
        return
    off = "or set text_encoder_lr to 0 (the text encoder not trained)"
    if clip is None:
        raise ValueError(f"text_encoder_lr {text_encoder_lr:g} trains the clip's text encoders, and no clip is "
                         f"connected: connect the CLIP the text cache was made with, {off}")
    if lora_config.kind not in TEXT_ENCODER_KINDS:
        raise ValueError(f"text_encoder_lr: a text encoder trains a LoRA of kind {', '.join(TEXT_ENCODER_KINDS)}, "
                         f"and LoRA Config's kind is {lora_config.kind}: choose one of those, {off}")
    if parse_devices(devices) > 1:
        raise ValueError(f"text_encoder_lr trains on one device: set devices to 1, {off}")
    if optimizer_config.name == "Prodigy" and text_encoder_lr != optimizer_config.lr:
        raise ValueError(f"text_encoder_lr {text_encoder_lr:g} with Prodigy, which finds one step size for all "
                         f"trained weights: set it to learning_rate ({optimizer_config.lr:g}), {off}")
    text_encoder_layers(clip)  # its ValueError names the CLIP's encoders where none is a CLIP text model
    cached = text_cache.empty_conditioning()["cross_attn"].shape[-1]
    given = clip.encode_from_tokens_scheduled(clip.tokenize(""))[0][0].shape[-1]
    if given != cached:
        raise ValueError(f"the clip encodes captions {given} wide, but the text cache holds them {cached} wide "
                         f"(another model's text encoder): connect the CLIP the text cache was made with, {off}")


def lora_run_inputs() -> list:
    """The inputs that open a LoRA run (Init and the all-in-one node): the shared groups (nodes/inputs.py)."""
    return [*model_and_caches(), lora_config_input(), optimizer_config_input(), run_name_input("my_lora"),
            *training_settings(), policy_input()]


def start_lora_run(model, latent_cache, text_cache, lora_config, optimizer_config, run_name, seed, batch_size,
                   grad_accumulation, precision, max_grad_norm, caption_dropout, timestep_sampling, loss_weighting,
                   min_snr_gamma, noise_offset, gradient_checkpointing, checkpoint_depth, holdout, policy=None,
                   loss_type: str = "mse", huber_delta: float = 0.1, ema_decay: float = 0.0,
                   prior_latent_cache=None, prior_text_cache=None, prior_ratio: float = 0.5, reference: str = "none",
                   noise_min: float = 0.0, noise_max: float = 1.0, devices: str = "1",
                   masked_out_weight: float = 0.0, ip_noise_gamma: float = 0.0, multires_noise_iterations: int = 0,
                   multires_noise_discount: float = 0.3, noise_offset_random_strength: bool = False,
                   ip_noise_gamma_random_strength: bool = False, clip=None, text_encoder_lr: float = 0.0,
                   node: str = "Train LoRA: Init (Headroom)", shown_on: str | None = None) -> TrainingRun:
    """Check every input (before any GPU work), then build or resume the run; `node`: the display name of the node
    opening it, for messages."""
    try:
        check_name(run_name, "run name")
        check_finite(node, max_grad_norm=max_grad_norm, caption_dropout=caption_dropout, min_snr_gamma=min_snr_gamma,
                     noise_offset=noise_offset, huber_delta=huber_delta, ema_decay=ema_decay, prior_ratio=prior_ratio,
                     noise_min=noise_min, noise_max=noise_max, masked_out_weight=masked_out_weight,
                     ip_noise_gamma=ip_noise_gamma, multires_noise_discount=multires_noise_discount,
                     text_encoder_lr=text_encoder_lr)
        if (prior_latent_cache is None) != (prior_text_cache is None):
            raise ValueError("prior images need both prior_latent_cache and prior_text_cache connected (or neither)")
        prior = (prior_latent_cache, prior_text_cache) if prior_latent_cache is not None else None
        if prior is not None and prior_ratio <= 0:
            raise ValueError("prior_ratio=0 with prior caches connected: set a share > 0, or disconnect them")
        if not isinstance(lora_config, AdapterConfig):
            raise ValueError("lora_config must come from a LoRA Config (Headroom) node")
        if not isinstance(optimizer_config, OptimizerConfig):
            raise ValueError("optimizer_config must come from an Optimizer Config (Headroom) node")
        lora_config.validate()
        optimizer_config.validate()
        check_trainable(model.model)
        check_quantized_kind(model.model, lora_config.kind)
        train, note = train_config(model, run_name, node, seed, batch_size, grad_accumulation, precision, max_grad_norm,
                                   caption_dropout, timestep_sampling, loss_weighting, min_snr_gamma, noise_offset,
                                   loss_type, huber_delta, ema_decay, prior_ratio=prior_ratio if prior else 0.0,
                                   noise_range=(noise_min, noise_max), masked_out_weight=masked_out_weight,
                                   extra_noise=dict(ip_noise_gamma=ip_noise_gamma,
                                                    multires_noise_iterations=multires_noise_iterations,
                                                    multires_noise_discount=multires_noise_discount,
                                                    noise_offset_random_strength=noise_offset_random_strength,
                                                    ip_noise_gamma_random_strength=ip_noise_gamma_random_strength))
        check_caches(model.model, latent_cache, text_cache)
        check_text_encoder_training(clip, text_encoder_lr, lora_config, optimizer_config, devices, text_cache)
        train, batch_note = effective_batch(train, latent_cache, holdout, run_name, node)
        # A full fine-tune on several devices shards its optimizer state (training/memory/sharded_optimizer.py).
        ranks = sharded_optimizer.state_ranks(parse_devices(devices), lora_config.kind, optimizer_config.name)
        trainable = model_trainable = dataclasses.replace(lora_trainable(model, lora_config, optimizer_config.name),
                                                          ema=train.ema_decay > 0, state_ranks=ranks)
        # The text encoder's LoRA trains with the model's (host RAM, disk and a card's plan count its tensors); a card's
        # plan also counts the CLIP's weights and each caption's activations on the device (measured when planned).
        encoder = TextEncoderLora(clip, lora_config) if text_encoder_lr > 0 else None
        if encoder is not None:
            trainable = with_text_encoder(model_trainable, encoder)
        planned = []  # the card's plan and its measured model, when one is made: the run keeps them

        def plan_card(card):
            spec = trainable
            if encoder is not None:
                spec = with_text_encoder(model_trainable, encoder, *longest_caption(text_cache, clip))
            planned.append(plan_for_card(model, latent_cache, text_cache, card, spec, train.batch_size,
                                         train.precision, node, lora_config, train.grad_accum))
            return planned[-1][0]

        policy, plan_note = resolve_policy(policy, gradient_checkpointing, checkpoint_depth, node=node,
                                           plan_card=plan_card)
        check_host_ram(policy, trainable, node)
        disk_note = check_disk_room(run_name, trainable, node)
        inputs_note = missing_inputs_note(model.model, node)
        # on the node before the run opens, and so before its first step
        send_node_text("\n".join(n for n in (plan_note, disk_note, inputs_note) if n), shown_on)
        if reference not in REFERENCES:
            raise ValueError(f"reference={reference!r}: choose one of {', '.join(map(repr, REFERENCES))}")
        if reference != "none":
            if prior is not None:
                raise ValueError(f"reference={reference!r} with prior images: prior images have no reference images; "
                                 "disconnect prior_latent_cache / prior_text_cache, or set reference to 'none'")
            try:
                check_reference_cache(model.model, latent_cache, text_cache)
            except ValueError as error:
                raise ValueError(f"reference={reference!r}: {error}") from None
        config = LoraRunConfig(family=model_family(model.model), adapter=lora_config, optimizer=optimizer_config,
                               train=train, holdout=holdout, reference=reference,
                               text_encoder_lr=text_encoder_lr if text_encoder_lr > 0 else None)
        encoder = {"clip": clip} if text_encoder_lr > 0 else {}  # (one device: check_text_encoder_training)
        run = open_on_devices(devices, model, open_lora_run, (latent_cache, text_cache, config, runs_root(), run_name),
                              {"policy": policy, "prior": prior, **encoder})
        run.precision_note = note
        run.batch_note, run.plan_note, run.inputs_note, run.disk_note = batch_note, plan_note, inputs_note, disk_note
        if planned:  # its predicted s/step goes to the memory record; its measurement to the run's own plans
            run.predicted_s_per_step, run.measured = planned[-1][0].predicted_s_per_step, planned[-1][1]
        return run
    except (ValueError, RunFolderError) as error:
        raise ValueError(named(node, str(error))) from error
    finally:  # the checks and the plan read the caches: no shard left mapped (also on an error)
        release_cache_files(latent_cache, text_cache, prior_latent_cache, prior_text_cache)


class HeadroomTrainLoraInit(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomTrainLoraInit",
            display_name="Train LoRA: Init (Headroom)",
            category=CATEGORY,
            description="Set up (or resume) a LoRA training run on this MODEL from cached latents and text. "
            "The MODEL itself is never modified: the adapter lives on a clone.",
            inputs=[*lora_run_inputs(), *added_train_inputs(), *prior_inputs(), reference_input(), *noise_range_inputs(),
                    devices_input(), masked_out_weight_input(), *extra_noise_inputs(), *text_encoder_inputs()],
            outputs=[TrainingRunType.Output("run", tooltip="The training run, for Train Steps, Validate, Save and Apply."),
                     io.Int.Output("step", tooltip="Step the run starts from (resumed).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, run_name=None, **_) -> int:
        return run_fingerprint(run_name)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        run = start_lora_run(**inputs, node=node_name(cls), shown_on=node_id(cls))
        return io.NodeOutput(run, run.step, ui=ui.PreviewText(opened_text(run)))


def check_checkpoint_inputs(node: str, checkpoint_every: int, checkpoint_minutes: float) -> None:
    check_finite(node, checkpoint_minutes=checkpoint_minutes)
    if checkpoint_every < 0 or checkpoint_minutes < 0:
        raise ValueError(f"{node}: checkpoint_every={checkpoint_every} and checkpoint_minutes={checkpoint_minutes} "
                         "must be >= 0 (0: off)")


# --- train -------------------------------------------------------------------------------------------------
class HeadroomTrainSteps(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomTrainSteps",
            display_name="Train LoRA: Steps (Headroom)",
            category=CATEGORY,
            description="Train the run to step N (not N more): the same N again does nothing, a higher N "
            "continues. A checkpoint is written every checkpoint_every steps / checkpoint_minutes minutes, at the "
            "end, and at the last finished step on cancel.",
            inputs=[TrainingRunType.Input("run", tooltip="A training run: from an Init node, or another Train Steps."),
                    io.Int.Input("steps", default=100, min=1, max=10_000_000,
                                 tooltip="The step to train the run to (a total, not a number of more steps). At or "
                                 "below the run's current step nothing is trained."),
                    *checkpoint_inputs()],
            outputs=[TrainingRunType.Output("run", tooltip="The same run, trained to `steps`."),
                     io.Float.Output("loss", tooltip="Training loss of the run's last step."),
                     io.Int.Output("step", tooltip="The run's step now.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, run: TrainingRun, steps: int, checkpoint_every: int = 0,
                checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES) -> io.NodeOutput:
        name = node_name(cls)
        check_checkpoint_inputs(name, checkpoint_every, checkpoint_minutes)
        note = steps_note(name, run, steps, "steps")
        run.train_to(steps, node_id=node_id(cls), checkpoint_every=checkpoint_every,
                     checkpoint_minutes=checkpoint_minutes)
        history = {**run.history(steps), **({"note": note} if note else {})}
        # room_note: the last save that removed the older checkpoint first, the disk holding no third
        text = [*([note] if note else []), *norms_text(run), *run.fallback.untold(),
                *([run.run_dir.room_note] if run.run_dir.room_note else [])]
        return io.NodeOutput(run, run.trainer.last_loss, run.step,
                             ui={HISTORY_KEY: [history], **({"text": text} if text else {})})


def norms_text(run: TrainingRun) -> list[str]:
    """scale_weight_norms' line: how many layers its cap scaled at the run's last step (none shown when off)."""
    norms = getattr(run.trainer, "last_norms", None)
    if norms is None:
        return []
    scaled, mean, largest = norms.tolist()
    return [f"scale_weight_norms {run.config.optimizer.scale_weight_norms:g}: {int(scaled)} of "
            f"{len(run.trainer.trainable.layers)} layers scaled back at step {run.step}; update norms mean "
            f"{mean:.3g}, largest {largest:.3g}"]


def steps_note(node: str, run: TrainingRun, steps: int, input_name: str) -> str | None:
    """What to tell the user when `steps` (a step to train *to*) trains nothing: the run is there already, or
    further (logged as a warning: lowering the number never rewinds a run)."""
    if steps > run.step:
        return None
    name = run.run_dir.name
    if steps == run.step:
        note = f"{node}: run '{name}' is at step {run.step} already: nothing to train (raise {input_name} to continue)"
        logging.info(note)
    else:
        note = (f"{node}: run '{name}' is at step {run.step}, past {input_name}={steps}: nothing trained, and the run "
                f"is not rewound. Set {input_name} above {run.step} to continue, or use a new run_name to start over.")
        logging.warning(note)
    return note


# --- validate ----------------------------------------------------------------------------------------------


class HeadroomValidate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomValidate",
            display_name="Validate LoRA (Headroom)",
            category=CATEGORY,
            description="Fixed-seed samples of the prompts with ComfyUI's own samplers on the training model and "
            "what the run trains (its current adapter, or its ControlNet applied to the run's control image), no "
            "second copy of the weights, saved as a grid per step in the run folder; and a deterministic "
            "validation loss (fixed items, noise levels and noise).",
            is_output_node=True,
            inputs=[TrainingRunType.Input("run", tooltip="The run to validate, e.g. from Train Steps."),
                    *validation_inputs(optional=False), weights_input("Validate"), compare_base_input(),
                    reference_images_input(), frames_input(), start_image_input(), frame_rate_input()],
            outputs=[io.Image.Output("images", tooltip="One sample per prompt (a black 64x64 image without prompts)."),
                     io.Float.Output("validation_loss",
                                     tooltip="Deterministic loss on the validation items: comparable across steps."),
                     TrainingRunType.Output("run", tooltip="The same run: chain Save after Validate to save after it.")],
        )

    @classmethod
    def execute(cls, run: TrainingRun, **inputs) -> io.NodeOutput:
        images, previews, loss = validate(cls, run, **inputs)
        # The chart of the training node showing this run restores its thumbnails from here after a reload.
        validation = {"run": run.run_dir.name, "step": run.step, "val_loss": loss,
                      "images": previews.values if previews is not None else []}
        ui_output = {**shown_images(run, previews), VALIDATION_KEY: [validation],
                     "text": [validated_text(run, loss, previews is not None)]}
        if previews is not None:
            ui_output[SAVED_KEY] = [saved_file("validation grid", "output", run.last_validation["grid"])]
            if "before_after" in run.last_validation:
                ui_output[SAVED_KEY].append(saved_file("before/after grid", "output", run.last_validation["before_after"]))
        if images is None:  # no prompts: only the loss; a black image keeps the IMAGE output connected
            return io.NodeOutput(torch.zeros(1, 64, 64, 3), loss, run, ui=ui_output)
        return io.NodeOutput(images, loss, run, ui=ui_output)


class HeadroomValidationHistory(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomValidationHistory",
            display_name="Validation History (Headroom)",
            category=CATEGORY,
            description="The run's validation samples over its steps as one picture: a row per validation (its step "
            "at the left), a column per prompt, read from the grids Validate saved in the run folder. What training "
            "did to each prompt, to pick the step to keep.",
            is_output_node=True,
            inputs=[TrainingRunType.Input("run", tooltip="The run whose validations to show (LoRA or ControlNet)."),
                    io.Int.Input("last", default=8, min=0, max=1000,
                                 tooltip="The newest this many validations, one row each; 0: all of them."),
                    io.Int.Input("cell_size", default=256, min=32, max=2048, advanced=True,
                                 tooltip="Each sample scaled down to at most this many pixels on its longer side "
                                 "(never enlarged), so many validations fit one picture.")],
            outputs=[io.Image.Output("history", tooltip="The picture: a row per validation, a column per prompt "
                                     "(a clip's first frame), with the steps and prompts written around it (a black "
                                     "64x64 image before the run's first validation with prompts).")],
        )

    @classmethod
    def fingerprint_inputs(cls, run, last=8, cell_size=256):
        # Runs again when the run folder holds other grids (a validation since, in this graph or another).
        grids = validation_grids(run) if isinstance(run, TrainingRun) else []
        return (getattr(run, "step", None), tuple(path.name for _, path in grids), last, cell_size)

    @classmethod
    def execute(cls, run: TrainingRun, last: int = 8, cell_size: int = 256) -> io.NodeOutput:
        name = node_name(cls)
        if not isinstance(run, TrainingRun):
            raise ValueError(f"{name}: the run input must be a TRAINING_RUN from a Headroom Init or training node, "
                             f"not {type(run).__name__}")
        sheet, notes = validation_history(run, last, cell_size)
        if sheet is None:  # nothing to show: said on the node, a black image keeps the IMAGE output connected
            return io.NodeOutput(torch.zeros(1, 64, 64, 3), ui={"text": notes})
        text = [f"{run_and_step(run)}: validation history, {sheet.shape[2]}x{sheet.shape[1]} px", *notes]
        return io.NodeOutput(sheet, ui={**ui.PreviewImage(sheet, cls=cls).as_dict(), "text": text})


# --- save / apply ------------------------------------------------------------------------------------------


def caption_tags_input():
    # Appended last and optional: workflows saved before it existed write the tag counts (the default).
    return io.Boolean.Input("caption_tags", advanced=True, default=True, optional=True,
                            tooltip="Write how many training images' captions hold each tag into the file (kohya's "
                            "ss_tag_frequency, in every format: what Civitai and LoRA managers show as the trained "
                            "words, the trigger word first). Off: the file holds no caption text.")


class HeadroomSaveLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomSaveLora",
            display_name="Save LoRA (Headroom)",
            category=CATEGORY,
            description="Save the run's adapter as a .safetensors LoRA under models/loras/<subfolder>/ that the "
            "stock Load LoRA node reads (listed without a restart).",
            is_output_node=True,
            inputs=[
                TrainingRunType.Input("run", tooltip="The LoRA run to save (its current step)."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/loras/ (empty: models/loras/ itself)."),
                io.String.Input("filename", default="", tooltip="Empty: <run name>_step<N>."),
                io.Combo.Input("dtype", options=list(SAVE_DTYPES), default="fp32",
                               tooltip="Precision of the saved weights: fp32 as trained; bf16 / fp16 half the file size."),
                io.Combo.Input("format", options=list(lora_formats.FORMATS), default="comfyui", optional=True,
                               tooltip="Key names in the file. comfyui: ComfyUI's own scheme (Load LoRA maps every "
                               "key). kohya: lora_unet_* names with sd-scripts metadata, for A1111 / Forge / "
                               "diffusers / Civitai (Load LoRA reads it too). diffusers: the names diffusers' "
                               "load_lora_weights reads (unet.* / transformer.*, alpha folded in, PEFT config in "
                               "the metadata); plain LoRA on sd15 / sdxl / sd3 / flux (Load LoRA reads it too). With "
                               "LoRA Config layer_alphas, diffusers misreads kohya files (one alpha for all): for "
                               "diffusers use diffusers."),
                weights_input("Save"),
                caption_tags_input(),
            ],
            outputs=[io.String.Output("lora_name", tooltip="The name Load LoRA lists.")],
        )

    @classmethod
    def execute(cls, run: TrainingRun, subfolder: str, filename: str, dtype: str,
                format: str = "comfyui", weights: str = "auto",  # noqa: A002 - the input's name
                caption_tags: bool = True) -> io.NodeOutput:
        check_run_kind(run, "lora", node_name(cls), "save")
        with said_by(node_name(cls)):
            name = save_lora(run, subfolder, filename, dtype, format, weights, caption_tags)
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("LoRA", "loras", name)],
                                       "text": [saved_text(run, "LoRA", "loras", name)]})


class HeadroomExtractLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomExtractLora",
            display_name="Extract LoRA from Full Fine-tune (Headroom)",
            category=CATEGORY,
            description="Save a LoRA that approximates a full fine-tune (LoRA Config kind full): each trained weight's "
            "difference to the base by its largest singular directions, biases whole. The stock Load LoRA reads it; "
            "a small file where Save LoRA writes the whole differences.",
            is_output_node=True,
            inputs=[
                TrainingRunType.Input("run", tooltip="A full fine-tune run (LoRA Config kind full), at its current step."),
                io.Int.Input("rank", default=64, min=0, max=4096,
                             tooltip="Singular directions kept per weight (fewer where a weight is smaller); 0: as "
                             "many as energy needs."),
                io.Float.Input("energy", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Keep, per weight, the fewest directions that hold this share of its "
                               "difference (0.9-0.99 is usual; capped by rank when rank is set). 0: by rank alone."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/loras/ (empty: models/loras/ itself)."),
                io.String.Input("filename", default="", tooltip="Empty: <run name>_step<N>_extracted."),
                io.Combo.Input("dtype", options=list(SAVE_DTYPES), default="fp32",
                               tooltip="Precision of the saved weights: fp32; bf16 / fp16 half the file size."),
                weights_input("Extract from"),
                caption_tags_input(),
            ],
            outputs=[io.String.Output("lora_name", tooltip="The name Load LoRA lists.")],
        )

    @classmethod
    def execute(cls, run: TrainingRun, rank: int, energy: float, subfolder: str, filename: str, dtype: str,
                weights: str = "auto", caption_tags: bool = True) -> io.NodeOutput:
        node = node_name(cls)
        check_finite(node, energy=energy)
        check_run_kind(run, "lora", node, "save")
        with said_by(node):
            name, kept = save_extracted_lora(run, subfolder, filename, rank, energy, dtype, weights, caption_tags)
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("LoRA", "loras", name)],
                                       "text": [f"{saved_text(run, 'LoRA', 'loras', name)}\n{kept}"]})


class HeadroomResizeLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomResizeLora",
            display_name="Resize LoRA (Headroom)",
            category=CATEGORY,
            description="Save a LoRA file at a lower rank (kohya's resize_lora): each layer's update kept by its "
            "largest singular directions, a smaller file for the same effect. Any file Load LoRA lists, in its own "
            "format (ComfyUI, kohya, diffusers keys; text-encoder layers too); LoHa / LoKr / OFT layers and diff "
            "patches are copied as they are.",
            is_output_node=True,
            inputs=[
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"),
                               tooltip="The LoRA file to resize, from models/loras/ (as Load LoRA lists it). It is "
                               "read, never changed."),
                io.Int.Input("rank", default=16, min=0, max=4096,
                             tooltip="Most directions kept per layer; a layer at this rank or below is copied as it "
                             "is. 0: as many as energy needs."),
                io.Float.Input("energy", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Keep, per layer, the fewest directions that hold this share of its update "
                               "(0.9-0.99 is usual; capped by rank when rank is set; kohya's sv_fro measures the "
                               "square root of it). 0: by rank alone."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/loras/ (empty: models/loras/ itself)."),
                io.String.Input("filename", default="",
                                tooltip="Empty: <the file's name>_resized. Never the file being resized."),
                io.Combo.Input("dtype", options=list(RESIZE_DTYPES), default="auto",
                               tooltip="Precision of the resized layers: auto as the file stores them; fp32; bf16 / "
                               "fp16 half the size."),
            ],
            outputs=[io.String.Output("lora_name", tooltip="The resized file's name, as Load LoRA lists it.")],
        )

    @classmethod
    def execute(cls, lora_name: str, rank: int, energy: float, subfolder: str, filename: str,
                dtype: str = "auto") -> io.NodeOutput:
        node = node_name(cls)
        check_finite(node, energy=energy)
        with said_by(node):
            name, done = save_resized_lora(lora_name, rank, energy, subfolder, filename, dtype)
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("LoRA", "loras", name)],
                                       "text": [f"{lora_name} resized: saved to models/loras/{name}\n{done}"]})


class HeadroomMergeLoras(io.ComfyNode):
    SLOTS = 4  # lora_1 .. lora_4

    @classmethod
    def define_schema(cls) -> io.Schema:
        loras = folder_paths.get_filename_list("loras")
        slots = []
        for index in range(1, cls.SLOTS + 1):
            options = loras if index == 1 else [MERGE_NONE, *loras]
            slots += [
                io.Combo.Input(f"lora_{index}", options=options, **({} if index == 1 else {"default": MERGE_NONE}),
                               tooltip=("A LoRA file to merge, from models/loras/ (as Load LoRA lists it), of any "
                                        "format (ComfyUI, kohya, diffusers); read, never changed." if index == 1 else
                                        f"Another LoRA file to merge; {MERGE_NONE}: this slot is empty.")),
                io.Float.Input(f"strength_{index}", default=1.0, min=-100.0, max=100.0, step=0.01,
                               tooltip=f"lora_{index}'s strength in the merge, as Load LoRA's strength (1 as trained, "
                               "negative subtracts it, 0 leaves it out); on its diffusion-model and text-encoder "
                               "layers alike."),
            ]
        return io.Schema(
            node_id="HeadroomMergeLoras",
            display_name="Merge LoRAs (Headroom)",
            category=CATEGORY,
            description="Merge LoRA files into one (kohya's svd_merge_lora): per layer the sum of their updates at "
            "their strengths, what chained Load LoRA nodes apply, exact or at a lower rank (largest singular "
            "directions). Files of any format merge (their layers are found through the MODEL's and CLIP's names, as "
            "Load LoRA finds them); saved in ComfyUI's keys.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", tooltip="The base model the LoRAs were trained for (as Load LoRA takes it): "
                               "each file's layers are found by its names. Only its layer names and shapes are read."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The checkpoint's CLIP, for files with text-encoder layers (kohya's lora_te_*); "
                              "without it such files are refused."),
                *slots,
                io.Int.Input("rank", default=0, min=0, max=4096,
                             tooltip="Most directions kept per layer. 0 (with energy 0): the exact sum, its rank the "
                             "files' ranks added."),
                io.Float.Input("energy", default=0.0, min=0.0, max=1.0, step=0.001,
                               tooltip="Keep, per layer, the fewest directions that hold this share of its summed "
                               "update (0.9-0.99 is usual; capped by rank when rank is set). 0: by rank alone."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/loras/ (empty: models/loras/ itself)."),
                io.String.Input("filename", default="",
                                tooltip="Empty: <the files' names>_merged. Never one of the files being merged."),
                io.Combo.Input("dtype", options=list(MERGE_DTYPES), default="auto",
                               tooltip="Precision of the merged file: auto as the files store their weights (fp32 "
                               "where they differ); fp32; bf16 / fp16 half the size."),
                io.Combo.Input("format", options=list(MERGE_FORMATS), default="comfyui",
                               tooltip="Key names of the merged file: comfyui (ComfyUI's own) or kohya (sd-scripts' "
                               "lora_unet_* / lora_te_* with its ss_* metadata, for A1111 / Forge / Civitai); the "
                               "stock Load LoRA reads both."),
            ],
            outputs=[io.String.Output("lora_name", tooltip="The merged file's name, as Load LoRA lists it.")],
        )

    @classmethod
    def execute(cls, model, rank: int, energy: float, subfolder: str, filename: str, dtype: str = "auto",
                format: str = "comfyui", clip=None, **slots) -> io.NodeOutput:  # noqa: A002 - the input's name
        node = node_name(cls)
        strengths = {f"strength_{i}": slots.get(f"strength_{i}", 1.0) for i in range(1, cls.SLOTS + 1)}
        check_finite(node, energy=energy, **strengths)
        loras = [(slots.get(f"lora_{i}", MERGE_NONE), strengths[f"strength_{i}"]) for i in range(1, cls.SLOTS + 1)]
        with said_by(node):
            name, done = save_merged_lora(model, clip, loras, rank, energy, subfolder, filename, dtype, format)
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("LoRA", "loras", name)],
                                       "text": [f"saved to models/loras/{name}\n{done}"]})


class HeadroomInspectLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomInspectLora",
            display_name="Inspect LoRA (Headroom)",
            category=CATEGORY,
            description="What a LoRA file holds (format, layer kinds, ranks, what it was trained on, its trigger "
            "words) and, with a MODEL / CLIP connected, what the stock Load LoRA patches of it and what it skips "
            "(a file for another model family, text-encoder layers without the CLIP): Load LoRA only logs those to "
            "the console.",
            is_output_node=True,
            inputs=[
                io.Model.Input("model", optional=True,
                               tooltip="The model you would load the LoRA onto (as Load LoRA takes it): the report "
                               "says how many of its weights the file patches. Only its layer names and shapes are "
                               "read."),
                io.Clip.Input("clip", optional=True,
                              tooltip="The CLIP you would load the LoRA onto, for files with text-encoder layers "
                              "(kohya's lora_te_*)."),
                io.Combo.Input("lora_name", options=folder_paths.get_filename_list("loras"),
                               tooltip="A LoRA file from models/loras/, as Load LoRA lists it; read, never changed."),
            ],
            outputs=[io.String.Output("report", tooltip="The report the node shows, as text."),
                     io.String.Output("trigger_words",
                                      tooltip="The words the LoRA was trained with, comma-separated (its "
                                      "modelspec trigger phrase, else its most frequent caption tags); empty where "
                                      "the file names none.")],
        )

    @classmethod
    def fingerprint_inputs(cls, lora_name=None, **_) -> str:
        return file_fingerprint(lora_name)

    @classmethod
    def execute(cls, lora_name: str, model=None, clip=None) -> io.NodeOutput:
        try:
            report, words = inspect_lora(lora_name, model, clip)
        except ValueError as error:
            raise ValueError(f"{node_name(cls)}: {error}") from error
        return io.NodeOutput(report, words, ui={"text": [report]})


class HeadroomApplyTrainedLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomApplyTrainedLora",
            display_name="Apply Trained LoRA (Headroom)",
            category=CATEGORY,
            description="The MODEL with the run's current adapter applied as ComfyUI weight patches (as Load LoRA "
            "does), for any downstream node, without saving a file first.",
            inputs=[io.Model.Input("model", tooltip="The MODEL to patch, usually the one the run trains on."),
                    TrainingRunType.Input("run", tooltip="The LoRA run whose current adapter is applied."),
                    io.Float.Input("strength", default=1.0, min=-100.0, max=100.0, step=0.01,
                                   tooltip="As Load LoRA's strength: 1 as trained, 0 off."),
                    # Appended last and optional: workflows saved before it existed keep working
                    io.Clip.Input("clip", optional=True,
                                  tooltip="A run that trains the text encoder too (text_encoder_lr): the CLIP to "
                                  "patch with its text-encoder layers at strength (as Load LoRA's strength_clip), "
                                  "usually the one the run trains. Prompts encoded with the clip output then match "
                                  "what Validate samples.")],
            outputs=[io.Model.Output("model", tooltip="A copy of the MODEL with the adapter applied."),
                     io.Clip.Output("clip", tooltip="A copy of the clip input with the run's text-encoder layers "
                                    "applied; the clip as given where the run does not train the text encoder "
                                    "(nothing where none is connected).")],
        )

    @classmethod
    def execute(cls, model, run: TrainingRun, strength: float, clip=None) -> io.NodeOutput:
        lora = check_run_kind(run, "lora", node_name(cls), "apply")
        check_finite(node_name(cls), strength=strength)
        return io.NodeOutput(lora.patched_model(run, model, strength), lora.patched_clip(run, clip, strength))


# --- all in one --------------------------------------------------------------------------------------------
def train_validate_save(node_cls, start, save, steps: int, validate_every: int, save_every: int, inputs: dict,
                        saved_as: tuple[str, str] = ("LoRA", "loras"), checkpoint_every: int = 0,
                        checkpoint_minutes: float = DEFAULT_CHECKPOINT_MINUTES, subfolder: str = "",
                        keep_saves: int = 0, save_dtype: str = "fp32"):
    """The all-in-one loop: `start(**init inputs)` builds or resumes the run, which then trains to `steps`,
    validating every `validate_every` and saving (`save(run)` -> name) every `save_every` steps, and at the end;
    resumable checkpoints every `checkpoint_every` steps / `checkpoint_minutes` minutes; `keep_saves` > 0: after each
    save, only the newest that many of the run's step saves in models/<saved_as folder>/`subfolder` are kept;
    `save_dtype`: what `save` saves a LoRA run in (validation's as_saved_file samples that file). Returns (run, saved
    name, validation loss, UI output)."""
    label = node_name(node_cls)
    check_checkpoint_inputs(label, checkpoint_every, checkpoint_minutes)
    names = validation_names()
    validation = {k: v for k, v in inputs.items() if k in names}
    check_finite(label, **validation)  # its validations' floats (cfg, frame_rate) before any training
    # its prompts' options and placeholders: not after hours of training, at the first validation
    parse_prompts(label, validation.get("prompts", ""), validation.get("width", 512), validation.get("height", 512))
    run = start(**{k: v for k, v in inputs.items() if k not in names})
    note = steps_note(label, run, steps, "steps")
    previews, loss, name, saved, pruned, prune_problems = None, float("nan"), "", [], [], []
    # the saves to come against the disk of models/<folder>: said before the first step (the Init part said the
    # checkpoints'), on the node and in the log
    save_bytes = run.trained.save_bytes(run, save_dtype)  # before any save is on disk to size the next
    saves_note = saves_room_note(run, saved_as[1], subfolder, keep_saves, saves_to_come(run.step, steps, save_every),
                                 save_bytes)
    disk_notes = [saves_note] if saves_note else []
    if saves_note:
        logging.warning("%s: %s", label, saves_note)
        send_node_text("\n".join([*run.notes, saves_note]), node_id(node_cls))
    while True:
        target = min(t for t in (steps, _next(run.step, validate_every), _next(run.step, save_every)) if t)
        run.train_to(target, node_id=node_id(node_cls), checkpoint_every=checkpoint_every,
                     checkpoint_minutes=checkpoint_minutes)
        done = run.step >= steps
        if done or (validate_every and run.step % validate_every == 0):
            _, previews, loss = validate(node_cls, run, **validation, saved_dtype=save_dtype)
            if previews is not None:
                saved.append(saved_file("validation grid", "output", run.last_validation["grid"]))
                if "before_after" in run.last_validation:
                    saved.append(saved_file("before/after grid", "output", run.last_validation["before_after"]))
        if done or (save_every and run.step % save_every == 0):
            room_note, problems = make_room_for_step_save(run, saved_as[1], subfolder, keep_saves, save_bytes)
            disk_notes += [room_note] if room_note else []
            prune_problems += [f"Warning: {problem}" for problem in problems]
            with said_by(label):
                name = save(run)
            saved.append(saved_file(*saved_as, name))
            if keep_saves:
                removed, problems = prune_step_saves(run, saved_as[1], subfolder, keep_saves)
                pruned += removed
                for problem in problems:
                    logging.warning("%s: %s", label, problem)
                    if f"Warning: {problem}" not in prune_problems:  # said already by the room made before the save
                        prune_problems.append(f"Warning: {problem}")
        if done:
            break
    history = {**run.history(steps), **({"note": note} if note else {})}
    outputs = {**shown_images(run, previews), HISTORY_KEY: [history],
               "text": [*run.notes, *disk_notes, *([note] if note else []), *run.fallback.untold(),
                        *([saved_text(run, *saved_as, name)] if name else []),
                        *([f"{len(pruned)} older save(s) removed (keep_saves {keep_saves}): {', '.join(pruned)}"]
                          if pruned else []), *prune_problems],
               SAVED_KEY: saved}
    return run, name, loss, outputs


def _next(step: int, every: int) -> int | None:
    return (step // every + 1) * every if every else None


class HeadroomTrainLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomTrainLora",
            display_name="Train LoRA (Headroom)",
            category=CATEGORY,
            description="Init + train to `steps` + validate every N steps + save every N steps, in one node. "
            "Queue it again with more steps to continue the same run.",
            is_output_node=True,
            inputs=[*lora_run_inputs(), *schedule_inputs("lora_subfolder"), *validation_inputs(optional=True),
                    *checkpoint_inputs(), *added_train_inputs(), *prior_inputs(), compare_base_input(),
                    reference_input(), reference_images_input(), frames_input(), *noise_range_inputs(),
                    devices_input(), start_image_input(), frame_rate_input(), masked_out_weight_input(),
                    keep_saves_input(), *extra_noise_inputs(), save_dtype_input(), *text_encoder_inputs(clip=False)],
            outputs=[io.Model.Output("model", tooltip="The MODEL with the trained LoRA applied, as Load LoRA "
                                     "applies the file saved (in save_dtype)."),
                     TrainingRunType.Output("run", tooltip="The training run, for Validate, Save and Apply nodes."),
                     io.String.Output("lora_name", tooltip="The last saved LoRA, as Load LoRA lists it."),
                     io.Float.Output("validation_loss", tooltip="Validation loss at the end."),
                     io.Clip.Output("clip", tooltip="The clip input with the trained text-encoder layers applied as "
                                    "Load LoRA applies the file saved (strength_clip 1), where text_encoder_lr "
                                    "trains them; else the clip as given (nothing where none is connected).")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, steps, validate_every, save_every, lora_subfolder, checkpoint_every=0,
                checkpoint_minutes=DEFAULT_CHECKPOINT_MINUTES, keep_saves=0, save_dtype="fp32",
                **inputs) -> io.NodeOutput:
        check_subfolder(lora_subfolder, f"{node_name(cls)}: lora_subfolder")
        if save_dtype not in SAVE_DTYPES:
            raise ValueError(f"{node_name(cls)}: save_dtype={save_dtype!r}: choose one of {', '.join(SAVE_DTYPES)}")
        run, lora_name, loss, outputs = train_validate_save(
            # its clip encodes the validation prompts, and is the one text_encoder_lr trains
            cls, lambda **init: start_lora_run(**init, clip=inputs.get("clip"), node=node_name(cls),
                                               shown_on=node_id(cls)),
            lambda run: save_lora(run, lora_subfolder, step_save_name(run), save_dtype),
            steps, validate_every, save_every, inputs, checkpoint_every=checkpoint_every,
            checkpoint_minutes=checkpoint_minutes, subfolder=lora_subfolder, keep_saves=keep_saves,
            save_dtype=save_dtype)
        return io.NodeOutput(run.trained.patched_model(run, saved_dtype=save_dtype), run, lora_name, loss,
                             run.trained.patched_clip(run, inputs.get("clip"), saved_dtype=save_dtype), ui=outputs)


NODES = [HeadroomLoraConfig, HeadroomOptimizerConfig, HeadroomTrainLoraInit, HeadroomTrainSteps, HeadroomValidate,
         HeadroomValidationHistory, HeadroomSaveLora, HeadroomExtractLora, HeadroomResizeLora, HeadroomMergeLoras,
         HeadroomInspectLora, HeadroomApplyTrainedLora, HeadroomTrainLora]
