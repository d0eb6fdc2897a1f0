"""Dataset and caching nodes: describe a dataset, then encode it once with ComfyUI's own VAE / CLIP
into content-addressed caches on disk, so training runs with neither encoder on the GPU.

The engine (`training.data.dataset`, `training.data.buckets`, `training.data.cache_store`) does the work; this module
only turns ComfyUI objects into callables and fingerprints, forwards progress and cancel, and makes
sure the encoder leaves the compute device when caching ends.

Cache folder: `headroom_cache`, registered with folder_paths (default `<models>/headroom_cache`).
ComfyUI reads extra_model_paths.yaml before it loads custom nodes, and an unknown key there
(`headroom_cache: /big/disk/cache`) becomes a folder_paths entry; ours is appended after it, so the
first path - the yaml's when given - is the one used.
"""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

import comfy.model_management
import comfy.utils
import folder_paths
from comfy_api.latest import io

from ..training.data.cache_store import (
    CacheStoreError, ShardStore, cache_latents, cache_text, fingerprint_state_dict, fingerprint_value,
)
from ..training.data.dataset import dataset_from_folder, dataset_from_tensors, folder_signature, split_captions
from ..training.data.files import WriteError, display_path, register_display_roots
from ..training.data.video import MAX_CLIP_FRAMES, MAX_FRAMES_DEFAULT, VIDEO_EXTENSIONS, dataset_from_video_folder
from ..training.memory.memory_stats import PhaseRecorder
from ..training.memory.policy import OffloadPolicy
from .io_types import DatasetType, LatentCacheType, OffloadPolicyType, TextCacheType

log = logging.getLogger(__name__)

CACHE_FOLDER_NAME = "headroom_cache"
DATASET_ROOTS_ENV = "HEADROOM_DATASET_ROOTS"


def register_cache_folder() -> None:
    """Add the default cache folder after any path extra_model_paths.yaml gave (idempotent)."""
    folder_paths.add_model_folder_path(CACHE_FOLDER_NAME, os.path.join(folder_paths.models_dir, CACHE_FOLDER_NAME))


register_cache_folder()


def comfy_folders():
    """(label, folder) of ComfyUI's folders, as user-facing messages name paths in them (training/data/files.py):
    output/, input/, temp/, models/, model folders elsewhere (extra_model_paths.yaml) by their kind, and the
    dataset roots the server owner allows."""
    models = folder_paths.models_dir
    yield "models", models
    for name, (paths, _) in list(folder_paths.folder_names_and_paths.items()):
        for path in paths:
            if not folder_paths.is_within_directory(models, path):
                yield name, path
    yield "output", folder_paths.get_output_directory()
    yield "input", folder_paths.get_input_directory()
    yield "temp", folder_paths.get_temp_directory()
    for index, root in enumerate(dataset_roots(warn=False)[1:]):
        yield f"{DATASET_ROOTS_ENV}[{index}]", root


register_display_roots(comfy_folders)


def cache_root() -> Path:
    return Path(folder_paths.get_folder_paths(CACHE_FOLDER_NAME)[0])


_RELOCATE_HINT = (
    "To keep the cache on another disk, add `headroom_cache: /path/with/space` to ComfyUI's "
    "extra_model_paths.yaml and restart ComfyUI."
)


def _with_hint(error: Exception) -> Exception:
    """The same error, saying how to move the cache to another disk."""
    text = str(error)
    return type(error)(f"{text}{'' if text.endswith('.') else '.'} {_RELOCATE_HINT}")


def _open_store(kind: str) -> ShardStore:
    try:
        return ShardStore(cache_root() / kind)
    except (CacheStoreError, WriteError) as error:
        raise _with_hint(error) from error


# ---------------------------------------------------------------------------------------------------
# Where datasets may be read from


def dataset_roots(warn: bool = True) -> list[str]:
    """ComfyUI's input directory plus the roots the server owner allows in $HEADROOM_DATASET_ROOTS."""
    roots = [folder_paths.get_input_directory()]
    for root in os.environ.get(DATASET_ROOTS_ENV, "").split(os.pathsep):
        if root.strip():
            if os.path.isabs(root.strip()):
                roots.append(root.strip())
            elif warn:
                log.warning("Headroom: ignoring relative path %r in %s (give absolute paths)", root, DATASET_ROOTS_ENV)
    return roots


def resolve_dataset_folder(folder: str, relative_to: str | None = None) -> Path:
    """The real path of `folder` (relative paths are taken from `relative_to`, default ComfyUI's input
    directory) if it lies inside an allowed root; otherwise a clear error. API clients of a shared
    server can send any string, so `..`, absolute paths and symlinks are all resolved before checking."""
    if not folder.strip():
        raise ValueError("dataset folder is empty: give a folder inside ComfyUI's input directory, e.g. 'my_dataset'")
    if any(ord(c) < 32 for c in folder):
        raise ValueError(f"dataset folder {folder[:120]!r} contains control characters (a newline?): give a plain "
                         "folder name inside ComfyUI's input directory")
    candidate = os.path.join(relative_to or folder_paths.get_input_directory(), folder.strip())
    roots = dataset_roots()
    if any(folder_paths.is_within_directory(root, candidate) for root in roots):
        return Path(os.path.realpath(candidate))
    listed = ", ".join(display_path(root) for root in roots)
    raise ValueError(
        f"dataset folder {folder[:120]!r} is outside the folders this server reads datasets from ({listed}). "
        f"Put the dataset inside ComfyUI's input directory, or have the server's owner add its parent folder to "
        f"the {DATASET_ROOTS_ENV} environment variable ({os.pathsep!r}-separated absolute paths)."
    )


def _resolve_folders(folder: str, control_folder: str, mask_folder: str = "") -> tuple[Path, Path | None, Path | None]:
    images = resolve_dataset_folder(folder)
    control = resolve_dataset_folder(control_folder, relative_to=str(images.parent)) if control_folder.strip() else None
    masks = resolve_dataset_folder(mask_folder, relative_to=str(images.parent)) if mask_folder.strip() else None
    return images, control, masks


# ---------------------------------------------------------------------------------------------------
# Fingerprints and bookkeeping of ComfyUI encoders


def _unpatched_state_dict(patcher) -> dict:
    """The encoder's own weights. While a patcher has LoRA-style patches applied, the module holds the
    patched weights and the originals sit in `patcher.backup`; the patches are fingerprinted apart."""
    state = patcher.model.state_dict()
    for key, saved in getattr(patcher, "backup", {}).items():
        if key in state:
            state[key] = saved.weight
    return state


def encoder_fingerprint(patcher) -> str:
    parts = [fingerprint_state_dict(_unpatched_state_dict(patcher))]
    if patcher.patches:
        parts.append(fingerprint_value(patcher.patches))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def unload_encoder(patcher, policy=None) -> None:
    """Take the encoder (and its clones) off the compute device through ComfyUI's own accounting, unless the
    policy keeps encoders loaded (then ComfyUI unloads them when it needs the room, as for stock nodes)."""
    if getattr(policy, "encoders", None) == "keep_loaded":
        return
    comfy.model_management.unload_model_and_clones(patcher)


def is_loaded(patcher) -> bool:
    return any(
        loaded.model is not None and loaded.model.clone_base_uuid == patcher.clone_base_uuid
        for loaded in comfy.model_management.current_loaded_models
    )


class _ProgressBar:
    """Forwards (done, total) to a ComfyUI ProgressBar made once the total is known."""

    def __init__(self):
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            self.bar = comfy.utils.ProgressBar(total)
        self.bar.update_absolute(done, total)


def _unbatch(tensor: torch.Tensor) -> torch.Tensor:
    # ComfyUI gives one prompt's conditioning tensors a leading batch dimension of 1.
    return tensor[0] if tensor.ndim >= 1 and tensor.shape[0] == 1 else tensor


def _policy_tooltip() -> str:
    return ("Optional, from Offload Policy or Memory Plan (Headroom). Caching uses only its encoders setting: "
            "unload_after_use (default) takes the encoder off the device when caching ends, keep_loaded leaves it "
            "loaded for the next node. Caching encodes one item at a time with ComfyUI's own loading; the policy's "
            "budget, placement, checkpointing and optimizer settings concern training (connect it there too).")


def _check_policy(node: str, policy) -> None:
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise ValueError(f"{node}: policy must come from a HeadroomOffloadPolicy or HeadroomMemoryPlan node")


# ---------------------------------------------------------------------------------------------------
# Nodes


_DATASET_TOOLTIP = ("The items (images, captions, crops; pixels load when cached), for Cache Latents and Cache "
                    "Text (Headroom).")


def _bucket_inputs() -> list:
    return [
        io.Int.Input("resolution", default=512, min=64, max=4096, step=8,
                     tooltip="Target side length: buckets have about resolution x resolution pixels. Must be a "
                     "multiple of step."),
        io.Int.Input("step", default=64, min=8, max=256, step=8,
                     tooltip="Bucket sides are multiples of this: 64 for UNets (SD1.5, SDXL), 16 for DiTs "
                     "(SD3, Flux)."),
        io.Combo.Input("crop", options=["center", "random"], default="center",
                       tooltip="Where to crop the overhang after resizing to cover the bucket. random is seeded "
                       "per image, so it is the same on every run."),
        io.Boolean.Input("flip", default=False,
                         tooltip="Also cache a mirrored copy of every image (two training items per image)."),
        io.Int.Input("seed", default=0, min=0, max=0xFFFFFFFFFFFFFFFF, tooltip="Seed of the random crops."),
    ]


class HeadroomDatasetFromFolder(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomDatasetFromFolder",
            display_name="Dataset From Folder (Headroom)",
            category="Headroom/data",
            description="Images with same-name .txt captions from a folder inside ComfyUI's input directory "
            "(or a folder the server's owner allows), with optional control images. Nothing is decoded here.",
            inputs=[
                io.String.Input("folder", default="",
                                tooltip="Folder relative to ComfyUI's input directory, e.g. 'my_dataset'."),
                io.String.Input("control_folder", default="", optional=True,
                                tooltip="Optional sibling folder of control images, matched by file name, e.g. "
                                "'my_dataset_canny' next to 'my_dataset'. Empty: no control images."),
                *_bucket_inputs(),
                io.Boolean.Input("skip_bad", default=False,
                                 tooltip="Leave out unreadable images, missing captions and missing or mismatched "
                                 "control images (listed as warnings) instead of stopping with an error."),
                io.String.Input("mask_folder", default="", optional=True,
                                tooltip="Optional sibling folder of loss masks matched by file name, e.g. "
                                "'my_dataset_masks': white is learned, black is not (grey: partly); an image "
                                "without a mask is learned whole. Empty: no masks."),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def fingerprint_inputs(cls, folder: str, control_folder: str = "", mask_folder: str = "", **others) -> str:
        # ComfyUI reuses a node's output while its inputs are unchanged; an edited caption or image must
        # make a new DATASET, so the folders' listings are part of the fingerprint.
        try:
            return folder_signature(*_resolve_folders(folder, control_folder, mask_folder)) + repr(sorted(others.items()))
        except (OSError, ValueError) as error:
            return f"unresolved: {error}"

    @classmethod
    def execute(cls, folder: str, resolution: int, step: int, crop: str, flip: bool, seed: int,
                skip_bad: bool, control_folder: str = "", mask_folder: str = "") -> io.NodeOutput:
        images, control, masks = _resolve_folders(folder, control_folder, mask_folder)
        dataset = dataset_from_folder(images, control, resolution=resolution, step=step, crop=crop, flip=flip,
                                      seed=seed, skip_bad=skip_bad, roots=tuple(map(Path, dataset_roots())),
                                      mask_folder=masks)
        for warning in dataset.warnings:
            log.warning("HeadroomDatasetFromFolder: %s", warning)
        return io.NodeOutput(dataset)


class HeadroomDatasetFromVideos(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomDatasetFromVideos",
            display_name="Dataset From Videos (Headroom)",
            category="Headroom/data",
            description="Clips for video models (Wan) from a folder inside ComfyUI's input directory (or a folder the "
            f"server's owner allows): video files ({', '.join(VIDEO_EXTENSIONS)}), subfolders of frame images and "
            "images (one-frame clips), each with a same-name .txt caption beside it (clip.mp4 + clip.txt, clip/ + "
            "clip.txt). Cache Latents cuts each clip to the frame counts its VAE takes (Wan: 4k+1). Nothing is "
            "decoded here.",
            inputs=[
                io.String.Input("folder", default="",
                                tooltip="Folder relative to ComfyUI's input directory, e.g. 'my_clips'."),
                *_bucket_inputs(),
                io.Boolean.Input("skip_bad", default=False,
                                 tooltip="Leave out unreadable clips and missing captions (listed as warnings) instead "
                                 "of stopping with an error."),
                io.Int.Input("max_frames", default=MAX_FRAMES_DEFAULT, min=1, max=MAX_CLIP_FRAMES,
                             tooltip="Frames a clip gives at most (from its first frame), cut down to what the VAE "
                             "takes: 4k+1 for Wan (81 = 5 s at 16 fps). Longer clips give their first frames; shorter "
                             "ones are used as long as they are, never padded. Memory grows with it."),
                io.Int.Input("frame_stride", default=1, min=1, max=64,
                             tooltip="Use every n-th frame (2: a 30 fps video becomes 15 fps, twice the time span)."),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def fingerprint_inputs(cls, folder: str, **others) -> str:
        try:  # frame folders are subfolders: their listings count too
            root = resolve_dataset_folder(folder)
            folders = [root, *sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())]
            return folder_signature(*folders) + repr(sorted(others.items()))
        except (OSError, ValueError) as error:
            return f"unresolved: {error}"

    @classmethod
    def execute(cls, folder: str, resolution: int, step: int, crop: str, flip: bool, seed: int, skip_bad: bool,
                max_frames: int = MAX_FRAMES_DEFAULT, frame_stride: int = 1) -> io.NodeOutput:
        dataset = dataset_from_video_folder(resolve_dataset_folder(folder), resolution=resolution, step=step, crop=crop,
                                            flip=flip, seed=seed, skip_bad=skip_bad,
                                            roots=tuple(map(Path, dataset_roots())), max_frames=max_frames,
                                            frame_stride=frame_stride)
        for warning in dataset.warnings:
            log.warning("HeadroomDatasetFromVideos: %s", warning)
        return io.NodeOutput(dataset)


class HeadroomDatasetFromImages(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomDatasetFromImages",
            display_name="Dataset From Images (Headroom)",
            category="Headroom/data",
            description="A dataset from an IMAGE batch and its captions (one per line, in image order), with an "
            "optional control IMAGE batch of the same size.",
            inputs=[
                io.Image.Input("images", tooltip="The training images as an IMAGE batch (e.g. from Load Image)."),
                io.String.Input("captions", multiline=True, default="",
                                tooltip="One caption per line, in the order of the images."),
                io.Image.Input("control_images", optional=True,
                               tooltip="One control image per image, of the same size."),
                *_bucket_inputs(),
                io.Mask.Input("masks", optional=True,
                              tooltip="Optional loss masks, one per image (or one for all) of the images' size: 1 "
                              "is learned, 0 is not."),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def execute(cls, images: torch.Tensor, captions: str, resolution: int, step: int, crop: str, flip: bool,
                seed: int, control_images: torch.Tensor | None = None, masks: torch.Tensor | None = None) -> io.NodeOutput:
        dataset = dataset_from_tensors(images, split_captions(captions), control_images, resolution=resolution,
                                       step=step, crop=crop, flip=flip, seed=seed, masks=masks)
        return io.NodeOutput(dataset)


class HeadroomCacheLatents(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomCacheLatents",
            display_name="Cache Latents (Headroom)",
            category="Headroom/cache",
            description="Encode the dataset's images and clips (bucketed, cropped, optionally mirrored) with the VAE, "
            "as stock VAE Encode does, into a cache on disk; a video VAE (Wan) encodes each clip whole, cut to the "
            "frame counts it takes (4k+1). Cached items are reused without loading the VAE; the "
            "VAE is unloaded from the compute device when caching ends.",
            inputs=[
                DatasetType.Input("dataset", tooltip="From a Dataset node (Headroom)."),
                io.Vae.Input("vae", tooltip="The VAE of the model you will train (as VAE Encode uses it)."),
                io.Combo.Input("control_encoding", options=["pixels", "latents"], default="pixels",
                               tooltip="How control images are cached: pixels at the bucket size, or VAE latents "
                               "for ControlNet families that take latent hints (e.g. SD3 / Flux ones)."),
                OffloadPolicyType.Input("policy", optional=True, tooltip=_policy_tooltip()),
            ],
            outputs=[LatentCacheType.Output("latent_cache", tooltip="The cached latents (and control images), for the "
                                        "training nodes' latent_cache."),
                     io.String.Output("summary", tooltip="Items encoded, items reused from the cache, warnings.")],
        )

    @classmethod
    def execute(cls, dataset, vae, control_encoding: str = "pixels", policy=None) -> io.NodeOutput:
        _check_policy("HeadroomCacheLatents", policy)
        vae.throw_exception_if_invalid()
        store = _open_store("latents")
        options = {
            "vae": type(vae.first_stage_model).__qualname__,
            "dtype": str(vae.vae_dtype),
            "output_dtype": str(vae.vae_output_dtype()),
        }
        recorder = PhaseRecorder(vae.device)
        try:
            with recorder.phase("caching latents"):
                cache, report = cache_latents(
                    dataset, store, vae.encode, encoder_fingerprint(vae.patcher), options,
                    control_encoding=control_encoding, progress=_ProgressBar(),
                    check_interrupt=comfy.model_management.throw_exception_if_processing_interrupted,
                    downscale=_spatial_downscale(vae), frame_step=_frame_step(vae),
                )
        except (CacheStoreError, WriteError) as error:
            raise _with_hint(error) from error
        finally:
            unload_encoder(vae.patcher, policy)
        cache.memory_phases = recorder.phases  # a training run built on this cache starts its memory record with it
        return io.NodeOutput(cache, report.summary())


def _frame_step(vae) -> int | None:
    """Pixel frames per latent frame of a video VAE (Wan 2.1: 4), as its own decode ratio says; None for an image VAE."""
    if getattr(vae, "latent_dim", 2) != 3:
        return None
    return vae.temporal_compression_decode()


def _spatial_downscale(vae) -> int:
    """Image px per latent px of a ComfyUI VAE (8; Flux.2: 16; 1 when it is not a plain number)."""
    ratio = vae.spacial_compression_encode()
    return ratio if isinstance(ratio, int) else 1


class HeadroomCacheText(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomCacheText",
            display_name="Cache Text (Headroom)",
            category="Headroom/cache",
            description="Encode every caption, and the empty prompt (for caption dropout), with the CLIP / text "
            "encoders as stock CLIP Text Encode does, keeping the pooled output and every other tensor it "
            "gives. Cached captions are reused without loading the encoders; they are unloaded when done.",
            inputs=[
                DatasetType.Input("dataset", tooltip="From a Dataset node (Headroom)."),
                io.Clip.Input("clip", tooltip="The text encoder(s) of the model you will train (the CLIP of its "
                              "loader)."),
                OffloadPolicyType.Input("policy", optional=True, tooltip=_policy_tooltip()),
            ],
            outputs=[TextCacheType.Output("text_cache", tooltip="The encoded captions, for the training nodes' "
                                      "text_cache."),
                     io.String.Output("summary", tooltip="Captions encoded, captions reused from the cache, warnings.")],
        )

    @classmethod
    def execute(cls, dataset, clip, policy=None) -> io.NodeOutput:
        _check_policy("HeadroomCacheText", policy)
        if clip is None:
            raise ValueError("HeadroomCacheText: the clip input is empty (the checkpoint has no text encoder?)")
        store = _open_store("text")
        options = {
            "text_encoder": type(clip.cond_stage_model).__qualname__,
            "tokenizer": type(clip.tokenizer).__qualname__,
            "layer_idx": clip.layer_idx,
            "tokenizer_options": repr(sorted(clip.tokenizer_options.items())),
        }
        dropped: set[str] = set()

        def encode(text: str) -> dict[str, torch.Tensor]:
            # Exactly CLIPTextEncode: tokenize, then encode_from_tokens_scheduled -> [[cond, {extras}]].
            conditioning = clip.encode_from_tokens_scheduled(clip.tokenize(text))
            if len(conditioning) != 1:
                raise ValueError(
                    "HeadroomCacheText: this CLIP has scheduled hooks, which give one conditioning per keyframe; "
                    "remove the hooks from the CLIP before caching"
                )
            cond, extras = conditioning[0]
            tensors = {"cross_attn": _unbatch(cond)}
            for name, value in extras.items():
                if isinstance(value, torch.Tensor):
                    tensors[name] = _unbatch(value)
                elif value is not None:
                    dropped.add(name)  # e.g. "hooks": a sampling-time feature, not part of the text embedding
            return tensors

        recorder = PhaseRecorder(clip.patcher.load_device)
        try:
            with recorder.phase("caching text"):
                cache, report = cache_text(
                    [item.caption for item in dataset.items], store, encode, encoder_fingerprint(clip.patcher), options,
                    progress=_ProgressBar(),
                    check_interrupt=comfy.model_management.throw_exception_if_processing_interrupted,
                )
        except (CacheStoreError, WriteError) as error:
            raise _with_hint(error) from error
        finally:
            unload_encoder(clip.patcher, policy)
        cache.memory_phases = recorder.phases
        if dropped:
            report.warnings.append(f"non-tensor conditioning entries not cached: {', '.join(sorted(dropped))}")
        return io.NodeOutput(cache, report.summary())


NODES = [HeadroomDatasetFromFolder, HeadroomDatasetFromVideos, HeadroomDatasetFromImages, HeadroomCacheLatents,
         HeadroomCacheText]
