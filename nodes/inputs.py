"""The training nodes' shared inputs, declared once: the LoRA and ControlNet nodes compose their input lists from
these named groups (node ids, input names, order, types and defaults are the public API: tests/node_schemas.json).

Optional inputs that came after the first release go last on every node, so saved workflows keep working (their
widget values are positional).

Expert and family-specific inputs carry the V3 `advanced` flag: the editor folds them behind the node's "advanced
inputs" toggle, so an everyday node shows at most 15 widgets (names, order and values are unchanged by it).
"""
from __future__ import annotations

import comfy.samplers
from comfy_api.latest import io

from ..training.core.objective import LOSS_TYPES, LOSS_WEIGHTINGS, MULTIRES_ITERATIONS_MAX, TIMESTEP_SAMPLINGS
from ..training.core.trainer import PRECISIONS
from .bridge.comfy_bridge import WEIGHT_CHOICES
from .io_types import LatentCacheType, LoraConfigType, OffloadPolicyType, OptimizerConfigType, TextCacheType
from .bridge.rank_workers import DEVICES
from .bridge.run_lora import LORA_APPLICATIONS, REFERENCES, SAVE_DTYPES

DEFAULT_CHECKPOINT_MINUTES = 10.0


# --- opening a run (the Init and all-in-one nodes) ---------------------------------------------------------------
def model_and_caches() -> list:
    """The MODEL a run trains on and its dataset's caches."""
    return [
        io.Model.Input("model", tooltip="The MODEL to train on (e.g. from Load Checkpoint); it is never modified."),
        LatentCacheType.Input("latent_cache", tooltip="The dataset's latents, from Cache Latents (Headroom)."),
        TextCacheType.Input("text_cache", tooltip="The dataset's captions encoded, from Cache Text (Headroom)."),
    ]


def lora_config_input():
    return LoraConfigType.Input("lora_config", tooltip="What to train, from LoRA Config (Headroom).")


def optimizer_config_input():
    return OptimizerConfigType.Input("optimizer_config", tooltip="From Optimizer Config (Headroom).")


def run_name_input(default: str):
    return io.String.Input("run_name", default=default,
                           tooltip="Folder under output/headroom_runs. An existing run with the same settings resumes.")


def training_settings(caption_dropout=None) -> list:
    """seed ... holdout: how a run trains (every kind); `caption_dropout`: a kind's own version of that input."""
    return [
        io.Int.Input("seed", advanced=True, default=0, min=0, max=0xFFFFFFFF,
                     tooltip="Seed of the item order, noise levels and noise: the same seed trains the same run, and a "
                     "resumed run continues exactly."),
        io.Int.Input("batch_size", default=1, min=1, max=256,
                     tooltip="Items per step, drawn from one aspect-ratio bucket."),
        io.Int.Input("grad_accumulation", advanced=True, default=1, min=1, max=1024,
                     tooltip="Batches whose gradients add up before each optimizer step: effective batch size = "
                     "batch_size x this, memory of one batch."),
        io.Combo.Input("precision", advanced=True, options=["auto", *PRECISIONS], default="auto",
                       tooltip="Compute precision (autocast); trainable weights always stay fp32. auto: bf16 on a "
                       "CUDA GPU that supports it, fp16 on other CUDA GPUs, fp32 on a CPU (bf16 there is far slower: "
                       "no native kernels); a resumed run keeps the precision it started with. fp16 uses a gradient "
                       "scaler."),
        io.Float.Input("max_grad_norm", advanced=True, default=1.0, min=0.0, max=1000.0, step=0.01,
                       tooltip="0 disables clipping."),
        caption_dropout or io.Float.Input("caption_dropout", advanced=True, default=0.0, min=0.0, max=1.0, step=0.01,
                                          tooltip="Fraction of samples trained with the empty prompt (cached)."),
        io.Combo.Input("timestep_sampling", advanced=True, options=list(TIMESTEP_SAMPLINGS), default="uniform",
                       tooltip="shifted: times shifted as the model samples (SD3 / Flux shift)."),
        io.Combo.Input("loss_weighting", advanced=True, options=list(LOSS_WEIGHTINGS), default="none",
                       tooltip="min_snr: min-SNR-gamma weighting; debiased: the debiased estimation (kohya's "
                       "debiased_estimation_loss), which weighs the noisiest times less (eps / v models; flow models: "
                       "none)."),
        io.Float.Input("min_snr_gamma", advanced=True, default=5.0, min=0.1, max=100.0, step=0.1,
                       tooltip="Gamma of the min_snr loss weighting (used only when loss_weighting is min_snr)."),
        io.Float.Input("noise_offset", advanced=True, default=0.0, min=0.0, max=1.0, step=0.001,
                       tooltip="Adds this much of a per-channel constant to the noise, which helps learn very dark "
                       "or bright images (0: off)."),
        io.Boolean.Input("gradient_checkpointing", default=False,
                         tooltip="Recompute each block's activations in backward: much less memory, slower steps. "
                         "A policy's own checkpointing setting takes precedence."),
        io.Int.Input("checkpoint_depth", advanced=True, default=1, min=1, max=5,
                     tooltip="1: each model block; 2: each child of a block (finer, less memory, more recompute)."),
        io.Int.Input("holdout", advanced=True, default=0, min=0, max=100000,
                     tooltip="Last N cached items held out for the validation loss; 0 validates on training items. "
                     "With flip or extra_resolutions each image gives several items, in a row: hold out all of the "
                     "last image's (2 with flip, x the number of sizes) to keep it unseen."),
    ]


def policy_input():
    return OffloadPolicyType.Input("policy", optional=True,
                                   tooltip="Optional, from Offload Policy or Memory Plan (Headroom): budget, where the "
                                   "frozen base and optimizer state live, checkpointing. None: all on the device.")


def checkpoint_inputs() -> list:
    """How often a training node writes a resumable checkpoint (optional and last: saved workflows keep working)."""
    return [
        io.Int.Input("checkpoint_every", advanced=True, default=0, min=0, max=10_000_000, optional=True,
                     tooltip="Write a resumable checkpoint to the run folder every N steps (0: not by steps). With "
                     "checkpoint_minutes this bounds what a crash, a kill or a power cut can lose."),
        io.Float.Input("checkpoint_minutes", advanced=True, default=DEFAULT_CHECKPOINT_MINUTES, min=0.0, max=10080.0,
                       step=1.0,
                       optional=True,
                       tooltip="Also write one whenever this many minutes passed since the last (0: not by time). "
                       "A checkpoint is always written at the end and on cancel; queueing again resumes from the "
                       "last one."),
    ]


def added_train_inputs() -> list:
    """Training settings added after the first release: optional and last on every training node, so saved
    workflows keep working (their widget values are positional)."""
    return [
        io.Combo.Input("loss_type", advanced=True, options=list(LOSS_TYPES), default="mse", optional=True,
                       tooltip="mse: squared error (standard). l1: absolute error. huber: squared below huber_delta, "
                       "absolute above: less pulled by outlier samples (noisy or mislabelled images). In the "
                       "model's own eps / v / flow space; min_snr weighting still applies."),
        io.Float.Input("huber_delta", advanced=True, default=0.1, min=0.0001, max=10.0, step=0.001, optional=True,
                       tooltip="Where the huber loss turns from squared to absolute (used only with loss_type huber)."),
        io.Float.Input("ema_decay", advanced=True, default=0.0, min=0.0, max=0.99999, step=0.0001, optional=True,
                       tooltip="Keep an exponential moving average of the trained weights in host RAM (0: off; "
                       "0.99-0.999 usual: it averages over about 1 / (1 - decay) steps, so keep that well below the "
                       "run's steps). Validate and Save use it when set (their weights input)."),
    ]


def prior_inputs() -> list:
    """Prior (regularisation) images for LoRA runs: optional and last on the LoRA training nodes."""
    return [
        LatentCacheType.Input("prior_latent_cache", advanced=True, optional=True,
                              tooltip="Optional regularisation / prior images (e.g. generic images of the class), "
                              "cached like the training images: trained on too, so the LoRA keeps what the model "
                              "knew."),
        TextCacheType.Input("prior_text_cache", advanced=True, optional=True,
                            tooltip="The prior images' captions, cached."),
        io.Float.Input("prior_ratio", advanced=True, default=0.5, min=0.0, max=0.95, step=0.01, optional=True,
                       tooltip="Share of the steps that train on the prior images, evenly interleaved (0.5: every "
                       "other batch). Used only when the prior caches are connected."),
    ]


def noise_range_inputs() -> list:
    """The part of the noise range a LoRA run trains (Wan 2.2 A14B experts): optional and last on the LoRA Init and
    all-in-one nodes; part of the run (a resumed run keeps it)."""
    return [
        io.Float.Input("noise_min", advanced=True, default=0.0, min=0.0, max=1.0, step=0.005, optional=True,
                       tooltip="Train only noise levels from here (0..1; flow models: sigma). Wan 2.2 A14B's two experts "
                       "each denoise part of the range: its high-noise expert 0.875..1 (I2V: 0.9..1), its low-noise "
                       "expert 0..0.875 (I2V: 0..0.9); train each expert's LoRA on its own part. 0 and 1: everything."),
        io.Float.Input("noise_max", advanced=True, default=1.0, min=0.0, max=1.0, step=0.005, optional=True,
                       tooltip="Train only noise levels up to here (see noise_min)."),
    ]


def extra_noise_inputs() -> list:
    """kohya's input perturbation, pyramid noise and random strengths: appended last and optional on every training
    node, so workflows saved before they existed keep working (off); part of the run. Their values reach the run's
    ObjectiveConfig under the same names."""
    return [
        io.Float.Input("ip_noise_gamma", advanced=True, default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                       tooltip="Input perturbation (kohya's ip_noise_gamma): the model's input gets this much extra "
                       "noise while the loss still asks for the clean target, which reduces the drift between "
                       "training and sampling. 0: off; 0.1 is usual."),
        io.Int.Input("multires_noise_iterations", advanced=True, default=0, min=0, max=MULTIRES_ITERATIONS_MAX,
                     optional=True,
                     tooltip="Multi-resolution (pyramid) noise, kohya's name: adds coarser noise in this many steps, "
                     "which helps learn overall tone and contrast (very dark or bright images). 0: off; 6-10 usual."),
        io.Float.Input("multires_noise_discount", advanced=True, default=0.3, min=0.01, max=1.0, step=0.01,
                       optional=True,
                       tooltip="How much each coarser step adds (its weight is this to the power of the step): 0.3 "
                       "usual, 0.1 light. Used only when multires_noise_iterations is above 0."),
        io.Boolean.Input("noise_offset_random_strength", advanced=True, default=False, optional=True,
                         tooltip="kohya's name: each sample's noise offset at a strength drawn from 0 to noise_offset "
                         "(then the largest) instead of noise_offset itself."),
        io.Boolean.Input("ip_noise_gamma_random_strength", advanced=True, default=False, optional=True,
                         tooltip="kohya's name: each sample's input perturbation at a strength drawn from 0 to "
                         "ip_noise_gamma (then the largest) instead of ip_noise_gamma itself."),
    ]


def text_encoder_inputs(clip: bool = True) -> list:
    """Training the CLIP's text encoders too (LoRA runs): optional and last, so workflows saved before they existed
    keep working (off). The all-in-one node's `clip` (its validation prompts') serves it too: `clip` False leaves it
    out here."""
    clip_input = [io.Clip.Input("clip", advanced=True, optional=True,
                                tooltip="The CLIP whose text encoders text_encoder_lr trains: the one the text cache "
                                "was made with. Not needed when text_encoder_lr is 0.")] if clip else []
    return [*clip_input, io.Float.Input(
        "text_encoder_lr", advanced=True, default=0.0, min=0.0, max=1.0, step=1e-8, optional=True,
        tooltip="Above 0: also train a LoRA (of LoRA Config's kind and rank) on the clip's CLIP text encoders, "
        "CLIP-L / CLIP-G / OpenCLIP-H (SD1.5, SD2, SDXL, SD3, Flux's CLIP-L; not T5 or LLM encoders), at this "
        "learning rate (kohya's text_encoder_lr; often half the model's or less): each step encodes its captions "
        "through it instead of reading the text cache. Saved in the same file; Load LoRA applies it with "
        "strength_clip, and validation encodes its prompts with it. 0: the text encoder is not trained.")]


def layer_names_input(name: str, tooltip: str):
    """A LoRA Config / Memory Plan input of layer-name patterns (training/core/adapters.py reads them): advanced,
    optional and empty by default, so workflows saved before it existed keep working (every layer, one value)."""
    return io.String.Input(name, default="", multiline=True, optional=True, advanced=True, tooltip=tooltip)


def masked_out_weight_input():
    # Appended last and optional on every training node: workflows saved before it existed keep working (0).
    return io.Float.Input("masked_out_weight", advanced=True, default=0.0, min=0.0, max=1.0, step=0.01, optional=True,
                          tooltip="Loss weight of what loss masks leave out (mask_folder, masks, transparency "
                          "loss_mask): 0, they are not learned at all; a little, e.g. 0.1 (OneTrainer's unmasked "
                          "weight), keeps the model's backgrounds from drifting while the subject is learned. Items "
                          "without a mask are learned whole either way.")


def frames_input():
    # Appended last and optional: workflows saved before it existed keep working (images).
    return io.Int.Input("frames", advanced=True, default=1, min=1, max=1025, optional=True,
                        tooltip="Video models (wan21, hunyuan_video15, ltx2): frames per validation clip, as the "
                        "stock empty video latent's length (4k+1, e.g. 17 or 81; LTX-2: 8k+1, e.g. 25 or 121), saved "
                        "as an animated WEBP and a frame grid. 1: images.")


def reference_input():
    """Edit / reference models (LoRA runs): optional and last on the LoRA Init and all-in-one nodes."""
    return io.Combo.Input("reference", advanced=True, options=list(REFERENCES), default="none", optional=True,
                          tooltip="Edit / reference models (Flux.1 Kontext, Flux.2, Qwen-Image-Edit...): 'control "
                          "latents' passes every item's cached control image as its reference image, as the stock "
                          "Reference Latent node does (the dataset's control image = the reference, the image = the "
                          "target, the caption = the instruction; Cache Latents with control_encoding 'latents'). "
                          "none: no reference. Part of the run: a resumed run keeps its setting.")


# --- the all-in-one nodes' schedule; validation and save -----------------------------------------------------
def schedule_inputs(subfolder_input: str) -> list:
    """The all-in-one nodes' steps / validate / save schedule (LoRA and ControlNet)."""
    return [
        io.Int.Input("steps", default=1000, min=1, max=10_000_000,
                     tooltip="The step to train the run to (a total): queue again with a higher number to continue."),
        io.Int.Input("validate_every", default=0, min=0, max=10_000_000, tooltip="0: only at the end."),
        io.Int.Input("save_every", default=0, min=0, max=10_000_000, tooltip="0: only at the end."),
        io.String.Input(subfolder_input, default="headroom",
                        tooltip="Folder under ComfyUI's models folder (loras/ or controlnet/) the saves go to."),
    ]


def keep_saves_input():
    # Appended last and optional: workflows saved before it existed keep every save, as before.
    return io.Int.Input("keep_saves", advanced=True, default=0, min=0, max=10_000, optional=True,
                        tooltip="Keep only the newest this many of the run's step saves (<run>_step<N>) in the "
                        "subfolder, removing older ones after each save (ai-toolkit's max_step_saves_to_keep); only "
                        "files this run wrote are removed; at 2 or more, where the disk has no room for the next "
                        "save, the older ones go before it is written. 0: keep every save.")


def save_dtype_input():
    # Train LoRA's; appended last and optional: workflows saved before it existed save in fp32, as before.
    return io.Combo.Input("save_dtype", advanced=True, options=list(SAVE_DTYPES), default="fp32", optional=True,
                          tooltip="Precision of each saved file (Save LoRA's dtype, kohya's save_precision): fp32 as "
                          "trained; bf16 / fp16 half the file (a full fine-tune's differences: half of 48 GB for "
                          "Flux.1-dev). Validation's as_saved_file samples the file in this precision.")


def validation_inputs(optional: bool) -> list:
    """Validate's settings; optional on the all-in-one nodes (no prompts: only the validation loss)."""
    return [
        io.Clip.Input("clip", optional=optional, tooltip="Encodes the validation prompts (as CLIP Text Encode)."),
        io.Vae.Input("vae", optional=optional, tooltip="Decodes the samples (as VAE Decode)."),
        io.String.Input("prompts", multiline=True, default="", optional=optional,
                        tooltip="One prompt per line; empty: no images, only the validation loss. A line may end "
                        "with kohya's sample options (as in sd-scripts / musubi-tuner prompt files): --n negative, "
                        "--d seed, --s steps, --l cfg, --g guidance (as FluxGuidance), --w / --h size (the same on every "
                        "line)."),
        io.String.Input("negative", default="", optional=optional, tooltip="Negative prompt of every sample."),
        io.Int.Input("sample_seed", advanced=True, default=0, min=0, max=0xFFFFFFFFFFFFFFFF, optional=optional,
                     tooltip="Noise seed of the samples: the same at every validation, so steps compare."),
        io.Int.Input("sample_steps", default=20, min=1, max=1000, optional=optional,
                     tooltip="Sampling steps, as KSampler's steps."),
        io.Float.Input("cfg", default=4.0, min=0.0, max=100.0, step=0.1, optional=optional,
                       tooltip="Classifier-free guidance scale, as KSampler's cfg."),
        io.Combo.Input("sampler_name", advanced=True, options=comfy.samplers.KSampler.SAMPLERS, default="euler",
                       optional=optional,
                       tooltip="Sampler, as KSampler's sampler_name."),
        io.Combo.Input("scheduler", advanced=True, options=comfy.samplers.KSampler.SCHEDULERS, default="normal",
                       optional=optional,
                       tooltip="Noise schedule, as KSampler's scheduler."),
        io.Int.Input("width", default=512, min=16, max=8192, step=8, optional=optional,
                     tooltip="Width of the samples in pixels."),
        io.Int.Input("height", default=512, min=16, max=8192, step=8, optional=optional,
                     tooltip="Height of the samples in pixels."),
        io.Int.Input("loss_timesteps", advanced=True, default=4, min=1, max=64, optional=optional,
                     tooltip="Fixed noise levels of the deterministic validation loss."),
        # Optional everywhere: workflows saved before this input existed keep working.
        io.Combo.Input("lora_application", advanced=True, options=list(LORA_APPLICATIONS), default="as_saved_file",
                       optional=True,
                       tooltip="How the samples apply a LoRA run's adapter. as_saved_file: exactly what the stock Load "
                       "LoRA node makes of the saved file (the adapter baked into the weights in their own dtype), so "
                       "the images predict what users get. unmerged: computed next to the frozen weights in full "
                       "precision (no weight patching; differs by the rounding of bf16 / fp16 weights). ControlNet "
                       "runs ignore it."),
    ]


def compare_base_input():
    # Appended last and optional: workflows saved before it existed keep working (no comparison).
    return io.Boolean.Input("compare_base", default=False, optional=True,
                            tooltip="Also sample the input MODEL without the run's adapter (same prompts and seeds) "
                            "and save a before/after grid (base on top, trained below) as "
                            "validation/step_<step>_before_after.png in the run folder.")


def reference_images_input():
    # Appended last and optional: workflows saved before it existed keep working (no reference).
    return io.Image.Input("reference_images", advanced=True, optional=True,
                          tooltip="Edit / reference models: reference image(s) of the validation samples, VAE-encoded "
                          "and added to the positive and negative prompts as the stock VAE Encode + Reference Latent "
                          "nodes do. One image for every prompt, or one per prompt (in prompt order).")


def start_image_input():
    # Appended last and optional: workflows saved before it existed keep working (the first clip's first frame).
    return io.Image.Input("start_image", advanced=True, optional=True,
                          tooltip="Image-to-video models (Wan I2V, HunyuanVideo 1.5): the validation clips' start image, "
                          "given with the prompts by the stock WanImageToVideo / HunyuanVideo15ImageToVideo node. One "
                          "image for every prompt, or one per prompt; not connected: the first cached clip's first "
                          "frame (none if the cache has no start images).")


def frame_rate_input():
    # Appended last and optional: workflows saved before it existed keep working (the first cached clip's rate).
    return io.Float.Input("frame_rate", advanced=True, default=0.0, min=0.0, max=1000.0, step=0.01, optional=True,
                          tooltip="Models that read a clip's frame rate (LTX-2): the validation clips' frames per "
                          "second, set by the stock LTXVConditioning node (use the same there); also the animated "
                          "WEBP's rate. 0: the first cached clip's rate (its video's / frame_stride; the model's "
                          "default 25 where unknown). Other models: leave 0.")


def weights_input(what: str):
    return io.Combo.Input("weights", options=list(WEIGHT_CHOICES), default="auto", optional=True,
                          tooltip=f"{what} the trained weights or their moving average (EMA, when the Init node's "
                          "ema_decay is set). auto: the EMA when the run keeps one.")


def validation_names() -> set[str]:
    """The names of the validation inputs an all-in-one node hands to validation (not to the run it opens)."""
    return ({item.id for item in validation_inputs(optional=True)}
            | {compare_base_input().id, reference_images_input().id, frames_input().id, start_image_input().id,
               frame_rate_input().id})


def devices_input():
    """The training nodes' `devices` input (LoRA and ControlNet, Init and all-in-one; appended last when it came:
    inputs added since go after it)."""
    return io.Combo.Input("devices", advanced=True, options=list(DEVICES), default="1", optional=True,
                          tooltip="Data-parallel training on this many devices: 1 trains in this process as "
                          "always; N > 1 starts N - 1 worker processes (GPUs cuda:1..N-1 beside this one; on a "
                          "CPU, N CPU processes), each training 1/N of every batch (the same global batch). "
                          "A full fine-tune (LoRA Config kind full) keeps 1/N of its optimizer state on each device. "
                          "Cancel stops every rank; only this process writes the run folder. Linux only (Windows refuses N > 1). "
                          "docs/DISTRIBUTED.md")
