"""Validation of a run through ComfyUI: stock KSampler sampling of the training model and what the run trains, the
VAE decode (tiled as the policy says), the grids and latents saved in the run folder, the validation event."""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re

import numpy as np
import torch
from PIL import Image

import comfy.model_management
import comfy.sample
import folder_paths
import node_helpers
from comfy_api.latest import ui

from ...training.checks import check_finite
from ...training.core.validation_grid import grid_png, grid_samples, history_sheet, labelled_grid
from ...training.data.cache_store import item_conditioning
from ...training.data.files import open_regular, relative_text, save_safetensors, write_bytes
from ...training.memory.policy import PolicyError
from . import video
from .comfy_bridge import VALIDATE_EVENT, TrainingRun, node_id, node_name, send_event
from .comfy_model import REFERENCE_LATENTS, clear_model_caches, reference_inputs
from .caching import encode_with_reference
from .encoders import unload_encoder
from .planning import budget_bytes
from .sample_prompts import SamplePrompt, parse_prompts
from .start_image import start_image_node, stock_start_conditioning


@contextlib.contextmanager
def _fresh_model_caches(model):
    """Sampling from no cached prompt state of an earlier step's weights, and leaving none behind for the next user
    of the shared MODEL (comfy_model.clear_model_caches)."""
    clear_model_caches(model.model.diffusion_model)
    try:
        yield
    finally:
        clear_model_caches(model.model.diffusion_model)


def check_prompt_width(run: TrainingRun, conditioning: list) -> None:
    """Refuse a `clip` input whose prompts are not as wide as the run's cached captions (another model's text encoder,
    or a CLIPLoader set to another type), before sampling, instead of the sampler's "shapes cannot be multiplied"
    deep inside the model: the MODEL takes what the captions were cached as."""
    given = conditioning[0][0].shape[-1]
    cached = run.text_cache.empty_conditioning()["cross_attn"].shape[-1]
    if given != cached:
        raise ValueError(f"run '{run.run_dir.name}': the clip input encodes prompts {given} wide, but the run's "
                         f"captions were cached {cached} wide, as its MODEL takes them: connect the CLIP the captions "
                         "were cached with (Cache Text's clip), or load this one with the model's type (the type of "
                         "CLIPLoader / DualCLIPLoader)")


def sample_images(run: TrainingRun, clip, vae, prompts: list[str | SamplePrompt], negative: str, seed: int, steps: int,
                  cfg: float, sampler_name: str, scheduler: str, width: int, height: int,
                  lora_application: str = "as_saved_file",
                  base: bool = False, references: list | None = None,
                  reference_encoding: str | None = None, frames: int = 1,
                  starts: list | None = None, frame_rate: float | None = None,
                  saved_dtype: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """Stock KSampler sampling (same noise, same sampler code) on the training model + what the run trains (a LoRA as
    `lora_application` says, as_saved_file the file saved in `saved_dtype`: TrainingRun.sampling_model; a ControlNet
    run adds its control as ControlNetApplyAdvanced does). base=True: the run's MODEL alone (before/after
    comparisons). `references`: one VAE latent per prompt (or None), appended to the positive and negative
    conditioning as the stock ReferenceLatent node does; with `reference_encoding` (a stock edit text-encode node,
    TextEncodeQwenImageEdit), `references` are reference images [1, H, W, 3] and both prompts are encoded with them
    by that node, as the stock edit workflow does. frames > 1: clips of a video model from the stock empty video
    latent (nodes/bridge/video.py); their frames come back as images, prompt after prompt. `starts`: one start image
    [1, H, W, 3] per prompt of an image-to-video model, given with both prompts by its stock node (WanImageToVideo),
    whose latent the sampler starts from. `frame_rate`: set on both prompts by the stock LTXVConditioning node
    (models that read it: LTX-2); None: the model's default. A SamplePrompt's own negative / seed / steps / cfg
    (kohya's --n / --d / --s / --l) replace those arguments for its sample; its guidance (--g) is set on the
    positive prompt as FluxGuidance sets it. Returns (images, sampled latents)."""
    latent_frames = video.check_frames(f"run '{run.run_dir.name}'", run.source_model.model, frames)
    latents = []
    # comfy.sample.prepare_noise reseeds the global torch RNG; fork it so validating never changes what the
    # training run draws next (peft dropout uses the global RNG).
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    # The prompts through the run's text encoder where it trains one (TrainingRun.prompt_clip; base: the clip as given)
    prompt_clip = contextlib.nullcontext(clip) if base else run.prompt_clip(clip, lora_application, saved_dtype)
    model_context = run.base_sampling_model() if base else run.sampling_model(lora_application, saved_dtype)
    # The base keeps to validation's own planned placement while the sampler runs (TrainingRun.sampling_placement).
    with prompt_clip as clip, torch.no_grad(), torch.random.fork_rng(devices=devices), model_context as sampled, \
            run.sampling_placement(sampled) as model, _fresh_model_caches(model):
        negative_cond = clip.encode_from_tokens_scheduled(clip.tokenize(negative))
        check_prompt_width(run, negative_cond)  # before any sampling
        for index, line in enumerate(prompts):
            line = line if isinstance(line, SamplePrompt) else SamplePrompt(line)
            prompt, negative_text = line.text, negative if line.negative is None else line.negative
            if reference_encoding is not None and references is not None:  # both prompts with the reference image
                positive, negative_item = (encode_with_reference(reference_encoding, clip, text, references[index], vae)
                                           for text in (prompt, negative_text))
            else:
                positive = clip.encode_from_tokens_scheduled(clip.tokenize(prompt))
                negative_item = negative_cond if line.negative is None else \
                    clip.encode_from_tokens_scheduled(clip.tokenize(line.negative))
            if line.guidance is not None:  # --g: as the stock FluxGuidance node sets it, on the positive prompt
                positive = node_helpers.conditioning_set_values(positive, {"guidance": line.guidance})
            positive, negative_run = ((positive, negative_item) if base
                                      else run.sampling_conditioning(positive, negative_item, vae))
            if references is not None and reference_encoding is None:  # exactly ReferenceLatent (comfy_extras/nodes_edit_model.py), on both
                positive, negative_run = (node_helpers.conditioning_set_values(
                    c, {REFERENCE_LATENTS: [references[index]]}, append=True) for c in (positive, negative_run))
            if frame_rate is not None:
                positive, negative_run = video.stock_frame_rate_conditioning(positive, negative_run, frame_rate)
            # As EmptyLatentImage + KSampler make it: an 8x latent the sampler resizes to the model's own format
            # (channels and downscale: 16x for Flux.2).
            empty = torch.zeros([1, 4, height // 8, width // 8], device=comfy.model_management.intermediate_device())
            if frames > 1:
                empty = video.empty_video_latent(latent_frames, width, height, empty.device)
            if starts is not None:  # image-to-video: the stock node conditions both prompts and makes the latent
                positive, negative_run, start_latent = stock_start_conditioning(
                    start_image_node(run.source_model.model), positive, negative_run, vae, width, height, frames,
                    starts[index])
                empty = start_latent["samples"]
            # As KSampler resizes its latent: an 8x one (EmptyLatentImage's), the start node's at the model's own scale
            # (HunyuanVideo15ImageToVideo's is 16x: no downscale_ratio_spacial, left as it is).
            spatial = start_latent.get("downscale_ratio_spacial") if starts is not None else 8
            latent = comfy.sample.fix_empty_latent_channels(model, empty, spatial)
            line_seed = seed if line.seed is None else line.seed
            noise = comfy.sample.prepare_noise(latent, line_seed)
            latents.append(comfy.sample.sample(
                model, noise, steps if line.steps is None else line.steps, cfg if line.cfg is None else line.cfg,
                sampler_name, scheduler, positive, negative_run, latent, denoise=1.0, disable_pbar=True,
                seed=line_seed))
    samples = torch.cat(latents)
    with torch.no_grad():  # decoded after the denoiser's step is done: the VAE loads on its own
        return decode(run, vae, samples), samples


def base_samples(run: TrainingRun, clip, vae, prompts: list[str], *settings, reference_images=None,
                 references=None, frames: int = 1, starts=None, frame_rate: float | None = None) -> torch.Tensor:
    """The run's MODEL alone sampled (compare_base): the same for every validation of the run with the same prompts,
    settings, CLIP, VAE and reference images, so it is sampled once and reused (validate_every would otherwise
    resample the base)."""
    cached = getattr(run, "_base_samples", None)
    settings = (*settings, frames, frame_rate)
    if (cached is not None and cached[0] is clip and cached[1] is vae and cached[2] == (prompts, settings)
            and cached[4] is reference_images and _same_starts(cached[5], starts)):
        return cached[3]
    images, _ = sample_images(run, clip, vae, prompts, *settings[:-2], base=True, references=references,
                              reference_encoding=reference_text_encoding(run), frames=frames, starts=starts,
                              frame_rate=frame_rate)
    run._base_samples = (clip, vae, (prompts, settings), images, reference_images, starts)
    return images


def encode_references(run: TrainingRun, vae, reference_images: torch.Tensor | None, count: int,
                      node: str) -> list | None:
    """One VAE latent per prompt of the validation's reference images (as the stock VAE Encode makes it), or None
    without reference images; a count that fits neither one-for-all nor one-per-prompt, or a MODEL that takes no
    reference latents: a ValueError naming the node."""
    if reference_images is None or count == 0:
        if count and getattr(run.config, "reference", "none") != "none":
            logging.warning("%s: run '%s' trains with references but no reference_images are connected: the samples "
                            "have no reference image", node, run.run_dir.name)
        return None
    if reference_images.ndim != 4 or reference_images.shape[0] not in (1, count):
        raise ValueError(f"{node}: reference_images holds {reference_images.shape[0] if reference_images.ndim == 4 else 'no'} "
                         f"image batch for {count} prompt(s): give one image for every prompt, or one per prompt")
    cache = run.latent_cache
    if not reference_inputs(run.source_model.model, item_conditioning(run.text_cache, cache, 0), cache.latent(0)):
        raise ValueError(f"{node}: reference_images given, but this MODEL ({type(run.source_model.model).__name__}) "
                         "takes no reference latents (its extra_conds ignores reference_latents): disconnect "
                         "reference_images, or validate an edit / reference model")
    if reference_text_encoding(run) is not None:  # the images themselves: the stock edit text-encode node takes them
        latents = [image.unsqueeze(0) for image in reference_images]
    else:
        latents = [vae.encode(image.unsqueeze(0)) for image in reference_images]
    return latents * count if len(latents) == 1 else latents


def _same_starts(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))))


def start_images(run: TrainingRun, start_image: torch.Tensor | None, count: int, node: str) -> list | None:
    """One start image [1, H, W, 3] per prompt of an image-to-video MODEL (start_image_node): the given ones, else the
    first cached clip's first frame; None for other models, or an I2V run whose cache has no start images (it trains
    without one). A start image for a model that takes none, or a count that fits neither one-for-all nor
    one-per-prompt: a ValueError naming the node."""
    model = run.source_model.model
    if start_image_node(model) is None:
        if start_image is not None:
            raise ValueError(f"{node}: start_image given, but this MODEL ({type(model).__name__}) takes no start image "
                             "(image-to-video models such as Wan I2V and HunyuanVideo 1.5 do): disconnect start_image")
        return None
    if start_image is None:
        first = run.latent_cache.start_frame(0) if getattr(run.latent_cache, "start_image", None) else None
        if first is None:
            return None
        start_image = first.unsqueeze(0)
    if start_image.ndim != 4 or start_image.shape[0] not in (1, count):
        raise ValueError(f"{node}: start_image holds {start_image.shape[0] if start_image.ndim == 4 else 'no'} image "
                         f"batch for {count} prompt(s): give one image for every prompt, or one per prompt")
    images = [image.unsqueeze(0).float() for image in start_image]
    return images * count if len(images) == 1 else images


def reference_text_encoding(run: TrainingRun) -> str | None:
    """The stock edit text-encode node the run's captions were cached with (each with its reference image), or None."""
    return getattr(run.text_cache, "reference_encoding", None)


def decode(run: TrainingRun, vae, samples: torch.Tensor) -> torch.Tensor:
    """VAE Decode, tiled (ComfyUI's tiled decode) when the policy says "on", or for "auto" when the VAE's weights
    plus its full-decode working set would not fit the run's budget (OffloadPolicy.decode_tiled, the planner's rule);
    otherwise the stock VAE Decode, which itself retries in tiles after an out-of-memory error."""
    policy = run.policy
    needed = budget = None
    if policy.vae_tiled_decode == "auto":
        needed = vae.patcher.model_size() + vae.memory_used_decode(samples.shape, vae.vae_dtype)
        try:
            budget = budget_bytes(policy, torch.device(vae.device))
        except PolicyError:  # an "auto" budget with nothing free: the smallest working set
            budget = 0
    images = vae.decode_tiled(samples) if policy.decode_tiled(needed, budget) else vae.decode(samples)
    if images.ndim == 5:  # a video VAE's [B, T, H, W, 3] (Wan 2.1 latents of Qwen-Image): frames as images, as VAEDecode
        images = images.reshape(-1, *images.shape[-3:])
    return images


def _title(run: TrainingRun, what: str = "") -> str:
    return f"step {run.step} \u00b7 {run.run_dir.name}{what}"


def save_before_after(run: TrainingRun, base: torch.Tensor, trained: torch.Tensor, prompts: list[str]) -> pathlib.Path:
    """Base samples (top row, "before") over the run's samples (bottom row, "after"), same prompts and seeds, as one
    PNG next to the validation grid: step_<step>_before_after.png, labelled (training/core/validation_grid.py): the
    step and run above, each prompt over its column (a clip's frames: over all of them), each row's title at its
    left."""
    cells = np.stack([video.stock_pixels(base[..., :3]), video.stock_pixels(trained[..., :3])])  # [2, N*F, H, W, 3]
    span = cells.shape[1] // len(prompts)  # a clip's frames side by side under its prompt
    image = labelled_grid(cells, _title(run, " \u00b7 before / after, same seeds"),
                          [(prompt, span) for prompt in prompts],
                          ["before: base model", f"after: {run.run_dir.name} step {run.step}"])
    path = run.run_dir.validation_dir / f"step_{run.step:08d}_before_after.png"
    run.run_dir.check_present()
    run.run_dir.check_subfolder_inside(run.run_dir.validation_dir)
    write_bytes(path, grid_png(image), f"before/after grid of run '{run.run_dir.name}'")
    return path


def save_validation(run: TrainingRun, images: torch.Tensor, samples: torch.Tensor, prompts: list[str], frames: int = 1,
                    fps: float | None = None) -> pathlib.Path:
    """This step's validation images side by side as one PNG in the run directory, each prompt over its image and the
    step and run above (training/core/validation_grid.py), and the sampled latents (float, before decoding) next to it.
    Clips (frames > 1): a row of frames per prompt, the prompt at its left, and each clip as an animated WEBP next to
    it (nodes/bridge/video.py) at `fps` (None: VALIDATION_FPS)."""
    pixels = video.stock_pixels(images[..., :3])  # [N * F, H, W, 3]: each prompt's frames in order
    if frames == 1:
        image = labelled_grid(pixels[None], _title(run), [(prompt, 1) for prompt in prompts])
    else:
        image = labelled_grid(pixels.reshape(-1, frames, *pixels.shape[1:]), _title(run),
                              [(f"frame {index + 1}", 1) for index in range(frames)], prompts)
    path = run.run_dir.validation_dir / f"step_{run.step:08d}.png"
    png = grid_png(image)
    run.run_dir.check_present()  # the validation folder never re-creates a vanished run folder
    run.run_dir.check_subfolder_inside(run.run_dir.validation_dir)
    write_bytes(path, png, f"validation grid of run '{run.run_dir.name}'")
    if frames > 1:
        video.save_clips(path, images, frames, f"run '{run.run_dir.name}'", fps or video.VALIDATION_FPS)
    save_safetensors(path.with_name(f"step_{run.step:08d}_latents.safetensors"),
                     {"samples": samples.detach().float().cpu()}, f"validation latents of run '{run.run_dir.name}'")
    return path


def validate(node_cls, run: TrainingRun, clip=None, vae=None, prompts="", negative="", sample_seed=0,
             sample_steps=20, cfg=4.0, sampler_name="euler", scheduler="normal", width=512, height=512,
             loss_timesteps=4, lora_application="as_saved_file", weights="auto", compare_base=False,
             reference_images=None, frames=1, start_image=None, frame_rate=0.0, saved_dtype="fp32"):
    """(images or None, previews or None, validation loss); tells the live view (`headroom.validate`).
    compare_base: the run's MODEL alone is sampled too (same prompts, seeds) and a before/after grid saved.
    reference_images: the samples' reference images (edit models), added as ReferenceLatent adds them.
    start_image: image-to-video models' start image(s), through their stock node (WanImageToVideo); default: the first
    cached clip's first frame. frame_rate: models that read one (LTX-2): the clips' rate, through the stock
    LTXVConditioning node; 0: the first cached clip's (video.validation_frame_rate). saved_dtype: the dtype the
    all-in-one node saves in, whose file lora_application as_saved_file samples."""
    name = node_name(node_cls)
    check_finite(name, cfg=cfg, frame_rate=frame_rate)
    # kohya's --n / --d / --s / --l / --g / --w / --h read, ai-toolkit's [trigger] refused: before anything runs
    lines, width, height = parse_prompts(name, prompts, width, height)
    run.resolve_weights(weights)  # a wrong choice is an input error, before anything runs
    video.check_frames(name, run.source_model.model, frames)
    rate = video.validation_frame_rate(name, run.source_model.model, run.latent_cache, frame_rate)
    labels = [line.label for line in lines]
    if lines and (clip is None or vae is None):
        raise ValueError(f"{name}: validation prompts need the clip and vae inputs connected")
    images = previews = grid = before_after = None
    try:
        with run.phase("validation"):
            references = encode_references(run, vae, reference_images, len(lines), name)
            starts = start_images(run, start_image, len(lines), name) if lines else None
            loss = run.validation_loss(times=loss_timesteps, weights=weights)
            if lines:
                with run.weights(weights):
                    images, samples = sample_images(run, clip, vae, lines, negative, sample_seed, sample_steps, cfg,
                                                    sampler_name, scheduler, width, height, lora_application,
                                                    references=references,
                                                    reference_encoding=reference_text_encoding(run), frames=frames,
                                                    starts=starts, frame_rate=rate, saved_dtype=saved_dtype)
                grid = save_validation(run, images, samples, labels, frames, rate)
                if compare_base:
                    base_images = base_samples(run, clip, vae, lines, negative, sample_seed, sample_steps, cfg,
                                               sampler_name, scheduler, width, height,
                                               reference_images=reference_images, references=references,
                                               frames=frames, starts=starts, frame_rate=rate)
                    before_after = save_before_after(run, base_images, images, labels)
                previews = ui.PreviewImage(images, cls=node_cls)
    except BaseException as error:  # cancel, out of memory, a wrong input...: checkpoint kept, device memory freed
        run.fail("validation", error)
        raise
    finally:
        # policy encoders="unload_after_use" (default): text encoder and VAE leave the device once validation is done.
        for encoder in (clip, vae):
            if encoder is not None:
                unload_encoder(encoder.patcher, run.policy)
        # what validation read outside the model's attach (the prompt width check's empty caption, as_saved_file and
        # compare_base sampling, which never attach): no shard left mapped after the call
        run.release_cache_files()
    if previews is not None:
        output_dir = folder_paths.get_output_directory()
        run.last_validation = {"step": run.step, "images": previews.values,
                               "grid": os.path.relpath(grid, output_dir).replace(os.sep, "/")}
        if before_after is not None:
            run.last_validation["before_after"] = os.path.relpath(before_after, output_dir).replace(os.sep, "/")
    send_event(VALIDATE_EVENT, {"node": node_id(node_cls), "run": run.run_dir.name, "step": run.step,
                                "val_loss": loss, "images": previews.values if previews is not None else []})
    return images, previews, loss


# The run's validation grids Validation History reads (not the before/after grids beside them); each an untrusted file
# under output/: read only when a regular file of at most these sizes (a 1024 px sample per prompt, 16 prompts, is
# 17 Mpx; below PIL's own bomb warning at 89 Mpx; a clip grid of many frames may be larger and is left out, named).
GRID_NAME = re.compile(r"step_(\d{8})\.png")
MAX_GRID_BYTES = 256 << 20
MAX_GRID_PIXELS = 64 << 20


def validation_grids(run: TrainingRun) -> list[tuple[int, pathlib.Path]]:
    """(step, path) of the run's validation grids, oldest first."""
    folder = run.run_dir.validation_dir
    if not folder.is_dir():
        return []
    with os.scandir(folder) as entries:
        found = [(int(match.group(1)), pathlib.Path(entry.path)) for entry in entries
                 if (match := GRID_NAME.fullmatch(entry.name))]
    return sorted(found)


def _grid_from_file(path: pathlib.Path) -> tuple:
    with open_regular(path, "validation grid", MAX_GRID_BYTES) as handle, Image.open(handle) as image:
        if image.width * image.height > MAX_GRID_PIXELS:  # checked from the header, before any pixel is decoded
            raise ValueError(f"{image.width}x{image.height} pixels, more than the {MAX_GRID_PIXELS >> 20} Mpx this "
                             "node reads; a clip grid's clips are beside it as WEBP files")
        image.load()
        return grid_samples(image)


def validation_history(run: TrainingRun, last: int, cell_size: int) -> tuple[torch.Tensor | None, list[str]]:
    """The run's last `last` validations (0: all) as one sheet [1, H, W, 3] (a row per step, a column per prompt:
    training/core/validation_grid.history_sheet), and notes on the grids left out; (None, why) where there is none
    to show (a sink of a template graph: no error after a run trained without prompts)."""
    grids = validation_grids(run)
    if not grids:
        return None, [f"run '{run.run_dir.name}' has no validation grid yet: validate it with prompts (Validate "
                      "LoRA, or the Train node's prompts and validate_every)"]
    rows, notes = [], []
    for step, path in reversed(grids):  # newest first, until `last` are read
        if last and len(rows) == last:
            break
        try:
            samples, prompts = _grid_from_file(path)
        except (OSError, ValueError, KeyError, TypeError, Image.DecompressionBombError) as error:
            notes.insert(0, f"step {step}: {path.name} is not a readable validation grid "
                         f"({relative_text(str(error))[:160]}); left out")
            continue
        rows.insert(0, (step, samples, prompts))
    if not rows:
        return None, [f"none of run '{run.run_dir.name}''s validation grids can be read", *notes]
    steps = f"steps {rows[0][0]}-{rows[-1][0]}" if len(rows) > 1 else f"step {rows[0][0]}"
    title = f"{run.run_dir.name} \u00b7 {steps}"
    sheet, left_out = history_sheet(rows, title, cell_size)
    return torch.from_numpy(np.array(sheet.convert("RGB"))).float().div(255).unsqueeze(0), notes + left_out
