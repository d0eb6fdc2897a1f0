"""Dataset and caching nodes: describe a dataset, then encode it once with ComfyUI's own VAE / CLIP
into content-addressed caches on disk, so training runs with neither encoder on the GPU.

The engine (`training.data.dataset`, `training.data.buckets`, `training.data.cache_store`) does the work;
nodes/bridge/caching.py turns ComfyUI's encoders into its callables and fingerprints, forwards progress and cancel,
and makes sure the encoder leaves the compute device when caching ends.

Cache folder: `headroom_cache`, registered with folder_paths (default `<models>/headroom_cache`;
nodes/bridge/cache_folders.py). ComfyUI reads extra_model_paths.yaml before it loads custom nodes, and an unknown
key there (`headroom_cache: /big/disk/cache`) becomes a folder_paths entry; ours is appended after it, so the
first path - the yaml's when given - is the one used.
"""
from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

from comfy_api.latest import io

from ..training.checks import check_finite
from ..training.data.caption_tags import MAX_KEEP, MAX_SHUFFLES
from ..training.data.dataset import (MAX_RESOLUTION, TRANSPARENCY_MODES, DatasetError, dataset_from_folder,
                                     dataset_from_image_list, dataset_from_tensors, folder_signature, split_captions,
                                     unread_repeat_folders_warning, with_trigger_word)
from ..training.data.video import MAX_CLIP_FRAMES, MAX_FRAMES_DEFAULT, VIDEO_EXTENSIONS, dataset_from_video_folder
from ..training.memory.policy import OffloadPolicy
from .bridge.cache_folders import check_dataset_folder, dataset_folders, dataset_roots, resolve_folders
from .bridge.caching import REFERENCE_ENCODINGS, cache_clip_text, cache_vae_latents
from .bridge.comfy_bridge import node_name
from .bridge.start_image import START_IMAGE_NODES
from .io_types import DatasetType, LatentCacheType, OffloadPolicyType, TextCacheType

log = logging.getLogger(__name__)


def _policy_tooltip() -> str:
    return ("Optional, from Offload Policy or Memory Plan (Headroom). Caching uses only its encoders setting: "
            "unload_after_use (default) takes the encoder off the device when caching ends, keep_loaded leaves it "
            "loaded for the next node. Caching encodes one item at a time with ComfyUI's own loading; the policy's "
            "budget, placement, checkpointing and optimizer settings concern training (connect it there too).")


def _check_policy(node: str, policy) -> None:
    if policy is not None and not isinstance(policy, OffloadPolicy):
        raise ValueError(f"{node}: policy must come from an Offload Policy (Headroom) or Memory Plan (Headroom) node")


# ---------------------------------------------------------------------------------------------------
# Nodes


_DATASET_TOOLTIP = ("The items (images, captions, crops; pixels load when cached), for Cache Latents and Cache "
                    "Text (Headroom).")


def _folder_input(example: str, what: str):
    """The folder a dataset node reads: a choice of input/'s subfolders (listed when the editor loads the node
    definitions; its refresh lists new ones). A value typed before it was a list, or a folder a server's
    HEADROOM_DATASET_ROOTS allows, is accepted too: the node's validate_inputs checks it instead of the list."""
    return io.Combo.Input("folder", options=dataset_folders(),
                          tooltip=f"Folder of {what} inside ComfyUI's input directory, e.g. '{example}'. The list is "
                          "the editor's copy from when it loaded the node definitions: after creating a folder while "
                          "ComfyUI runs, press R in the editor (Refresh Node Definitions) or reload the page to see it.")


def _trigger_word_input():
    # Appended last and optional: workflows saved before it existed keep working (captions as they are).
    return io.String.Input("trigger_word", default="", optional=True,
                           tooltip="A word (or words) put in front of every caption, e.g. 'sks_dog' -> 'sks_dog, a dog "
                           "on grass' (captions that start with it already are kept); prompt with it to call up what "
                           "the LoRA learned. Captions holding ai-toolkit's [trigger] placeholder get the word "
                           "there instead. On the folder nodes, an image or clip without a caption file is captioned "
                           "with the word alone. Changing it encodes the captions again (Cache Text).")


def _extra_resolutions_input():
    # Appended last and optional: workflows saved before it existed keep working (one size).
    return io.String.Input("extra_resolutions", default="", optional=True, advanced=True,
                           tooltip="Multi-resolution training: other sizes each item is also cached and trained "
                           "at, e.g. '512, 768' beside resolution 1024, each with its own buckets (a batch never mixes "
                           "sizes), so the LoRA learns the subject at every size it will be prompted at. Each size "
                           f"is one more latent per item (caching time, disk, steps per epoch); at most "
                           f"{MAX_EXTRA_RESOLUTIONS}, multiples of step. Empty: resolution only.")


MAX_EXTRA_RESOLUTIONS = 4


def _upscale_input():
    # Appended last and optional: workflows saved before it existed keep working (small images enlarged, as before).
    return io.Boolean.Input("upscale_small_images", default=True, optional=True, advanced=True,
                            tooltip="On: an image smaller than its bucket is enlarged to fill it. Off (kohya's "
                            "bucket_no_upscale): it trains in the nearest bucket of a smaller size that it fills, so "
                            "it is only ever scaled down (enlarged images teach softness). Cache Latents says how "
                            "many images were enlarged 1.25x or more.")


def _with_upscale(dataset, upscale_small_images: bool):
    return dataset if upscale_small_images else replace(dataset, upscale=False)


def _bucket_side_inputs() -> list:
    # Appended last and optional: workflows saved before they existed keep working (no limit).
    return [
        io.Int.Input("min_bucket_side", default=0, min=0, max=MAX_RESOLUTION, step=8, optional=True, advanced=True,
                     tooltip="No bucket side shorter than this (kohya's min_bucket_reso), so very wide or tall "
                     "images are cropped to a less extreme shape instead. 0: no limit (the step). A multiple of "
                     "step."),
        io.Int.Input("max_bucket_side", default=0, min=0, max=MAX_RESOLUTION, step=8, optional=True, advanced=True,
                     tooltip="No bucket side longer than this (kohya's max_bucket_reso): a wide bucket's long side "
                     "is cut to it and the bucket has fewer pixels (e.g. 1024 keeps every side of a 1024 run within "
                     "1024). 0: no limit. A multiple of step."),
    ]


def _with_bucket_sides(node: str, dataset, min_bucket_side: int, max_bucket_side: int):
    """The dataset with its buckets' side limits; errors name the node."""
    sides = (int(min_bucket_side or 0), int(max_bucket_side or 0))
    if sides == dataset.bucket_sides:
        return dataset
    try:
        return replace(dataset, bucket_sides=sides)
    except DatasetError as error:
        raise DatasetError(f"{node}: {error}") from None


def _with_extra_resolutions(node: str, dataset, extra_resolutions: str):
    """The dataset with the extra sizes `extra_resolutions` lists ('512, 768'); errors name the node."""
    parts = [part for part in re.split(r"[,;\s]+", extra_resolutions or "") if part]
    if not parts:
        return dataset
    if not all(re.fullmatch(r"[0-9]{1,6}", part) for part in parts) or len(parts) > MAX_EXTRA_RESOLUTIONS:
        raise ValueError(f"{node}: extra_resolutions={extra_resolutions[:80]!r}: give up to {MAX_EXTRA_RESOLUTIONS} "
                         "sizes as whole numbers separated by commas, e.g. '512, 768' (empty: resolution only)")
    try:
        return replace(dataset, extra_resolutions=tuple(int(part) for part in parts))
    except DatasetError as error:
        raise DatasetError(f"{node}: {error}") from None


FOLDER_NODE = "Dataset From Folder (Headroom)"
VIDEOS_NODE = "Dataset From Videos (Headroom)"


def _with_trigger_word(node: str, dataset, trigger_word: str):
    try:
        return with_trigger_word(dataset, trigger_word)
    except ValueError as error:
        raise ValueError(f"{node}: {error}") from None


NOTE_LINES = 20  # the most files a dataset node's text lists per kind; the server log lists all


def _dataset_from(node: str, build, **options):
    """The dataset `build` (the engine's folder reader) makes, its errors naming the node as users see it."""
    try:
        return build(**options)
    except DatasetError as error:
        raise DatasetError(f"{node}: {error}") from None


def _dataset_text(node: str, dataset, what: str, item: str) -> dict:
    """The dataset node's UI text (js/headroom_notes.js shows it on the node): how many items, which ones skip_bad
    left out and the captions with no item, each with its fix. Before, these went only to the server log, where a
    user training from the editor never looked. Nothing to say: an empty text, which clears an earlier one."""
    for warning in dataset.warnings:
        log.warning("%s: %s", node, warning)
    lines = []
    if dataset.extra_resolutions:
        lines.append(f"{len(dataset)} {what}, each cached and trained at {len(dataset.resolutions)} sizes "
                     f"({', '.join(map(str, dataset.resolutions))}).")
    if dataset.repeat_folders:
        passes = sum(item.repeats for item in dataset.items)
        lines += [f"{len(dataset)} {what} in {len(dataset.repeat_folders)} repeat folder(s), {passes} per epoch:",
                  *(f"- {folder.name}: {folder.images} x {folder.repeats}" + (
                      f" ({folder.named_captions} without a caption file, captioned "
                      f"{folder.name.partition('_')[2].strip()!r})" if folder.named_captions else "")
                    for folder in dataset.repeat_folders)]
    if dataset.unread_repeat_folders:
        lines.append(f"Warning: {unread_repeat_folders_warning(dataset.unread_repeat_folders)}.")
    if dataset.default_captions:
        lines.append(f"{dataset.default_captions} of {len(dataset)} {what} have no caption file: captioned with the "
                     "trigger word alone.")
    transparency = _transparency_text(dataset)
    if transparency:
        log.info("%s: %s", node, transparency)
        lines.append(transparency)
    if dataset.left_out:
        lines += [f"{len(dataset)} {what}; {len(dataset.left_out)} left out (skip_bad):", *_listed(dataset.left_out)]
    if dataset.notes:
        if not (dataset.left_out or dataset.repeat_folders or dataset.extra_resolutions or transparency
                or dataset.default_captions):
            lines.insert(0, f"{len(dataset)} {what}.")
        lines += [f"Warning: {len(dataset.notes)} caption(s) with no {item} of the same name (not used):",
                  *_listed(dataset.notes)]
    return {"text": ["\n".join(lines)] if lines else []}


def _transparency_text(dataset) -> str:
    """A line on the images with an alpha channel and what is done with them ('' when there are none and the
    transparency input is left at ignore). Said even at the default: their transparent pixels train as the colours
    stored under them (often black, or the photo the cut-out came from), which a user rarely means."""
    count, mode = dataset.alpha_images, dataset.transparency
    if not count:
        return "" if mode == "ignore" else (f"Warning: transparency is {mode}, but no image has an alpha channel: "
                                            "nothing changes.")
    images = f"{count} of {len(dataset)} images have an alpha channel"
    if mode == "ignore":
        return (f"Note: {images}; transparency is ignore, so their transparent pixels train as the colours stored "
                "under them (as Load Image reads them). Set transparency to loss_mask to learn only their opaque "
                "pixels, or to white / black to put them on that background.")
    if mode == "loss_mask":
        return f"{images}: only their opaque pixels are learned (transparency: loss_mask)."
    return f"{images}: put on a {mode} background (transparency: {mode})."


def _listed(problems: tuple[str, ...]) -> list[str]:
    shown = [f"- {problem}" for problem in problems[:NOTE_LINES]]
    if len(problems) > NOTE_LINES:
        shown.append(f"- ... and {len(problems) - NOTE_LINES} more (the server log lists every one)")
    return shown


def _check_folder(node: str, folder) -> bool | str:
    """A dataset node's validate_inputs, there so a folder typed before the input was a list (or one a server's
    HEADROOM_DATASET_ROOTS allows) is not refused for being missing from it; whether the folder exists is checked
    when the node runs, where the editor shows the message on the node (js/headroom_notes.js)."""
    if folder is not None and not isinstance(folder, str):
        return f"{node}: folder must be a folder name, not {type(folder).__name__}"
    return True


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
            description="Images with same-name .txt captions (or kohya's .caption) from a folder inside ComfyUI's "
            "input directory (or a folder the server's owner allows), with optional control images. A folder of "
            "kohya-style repeat folders ('10_ohwx dog', '1_style': no images of its own) is read folder by folder, "
            "each image trained on that many times per epoch, one without a caption file captioned with the "
            "folder's name ('ohwx dog'). Nothing is decoded here.",
            inputs=[
                _folder_input("my_dataset", "images with same-name .txt captions"),
                io.String.Input("control_folder", default="", optional=True,
                                tooltip="Optional sibling folder of control images, matched by file name, e.g. "
                                "'my_dataset_canny' next to 'my_dataset'. Empty: no control images."),
                *_bucket_inputs(),
                io.Boolean.Input("skip_bad", default=False,
                                 tooltip="Leave out unreadable images, missing captions and missing or mismatched "
                                 "control images (listed on the node) instead of stopping with an error."),
                io.String.Input("mask_folder", default="", optional=True,
                                tooltip="Optional sibling folder of loss masks matched by file name, e.g. "
                                "'my_dataset_masks': white is learned, black is not (grey: partly); an image "
                                "without a mask is learned whole. Empty: no masks."),
                _trigger_word_input(),
                _extra_resolutions_input(),
                # Appended last and optional: workflows saved before it existed keep working (alpha dropped).
                io.Combo.Input("transparency", options=list(TRANSPARENCY_MODES), default="ignore", optional=True,
                               advanced=True,
                               tooltip="What to do with images that have an alpha channel (transparent PNG or WebP "
                               "cut-outs). ignore: alpha dropped, as Load Image reads them (transparent pixels train "
                               "as whatever colour is stored under them). loss_mask: only opaque pixels are learned, "
                               "grey alpha partly (times the image's mask from mask_folder, if any). white / black: "
                               "put on that background, which the model then learns too. Images without "
                               "transparency are read alike in every mode."),
                _upscale_input(),
                *_bucket_side_inputs(),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def validate_inputs(cls, folder: str | None = None) -> bool | str:
        return _check_folder(FOLDER_NODE, folder)

    @classmethod
    def fingerprint_inputs(cls, folder: str, control_folder: str = "", mask_folder: str = "", **others) -> str:
        # ComfyUI reuses a node's output while its inputs are unchanged; an edited caption or image must
        # make a new DATASET, so the folders' listings are part of the fingerprint.
        try:
            return folder_signature(*resolve_folders(folder, control_folder, mask_folder)) + repr(sorted(others.items()))
        except (OSError, ValueError) as error:
            return f"unresolved: {error}"

    @classmethod
    def execute(cls, folder: str, resolution: int, step: int, crop: str, flip: bool, seed: int,
                skip_bad: bool, control_folder: str = "", mask_folder: str = "", trigger_word: str = "",
                extra_resolutions: str = "", transparency: str = "ignore",
                upscale_small_images: bool = True, min_bucket_side: int = 0, max_bucket_side: int = 0
                ) -> io.NodeOutput:
        check_dataset_folder(FOLDER_NODE, folder)
        images, control, masks = resolve_folders(folder, control_folder, mask_folder)
        dataset = _dataset_from(FOLDER_NODE, dataset_from_folder, folder=images, control_folder=control,
                                resolution=resolution, step=step, crop=crop, flip=flip, seed=seed, skip_bad=skip_bad,
                                roots=tuple(map(Path, dataset_roots())), mask_folder=masks, transparency=transparency,
                                default_caption=(trigger_word or "").strip() or None)
        dataset = _with_upscale(_with_extra_resolutions(FOLDER_NODE, dataset, extra_resolutions), upscale_small_images)
        dataset = _with_bucket_sides(FOLDER_NODE, dataset, min_bucket_side, max_bucket_side)
        return io.NodeOutput(_with_trigger_word(FOLDER_NODE, dataset, trigger_word),
                             ui=_dataset_text(FOLDER_NODE, dataset, "images", "image"))


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
            "clip.txt). Cache Latents cuts each clip to the frame counts its VAE takes (Wan, HunyuanVideo 1.5: "
            "4k+1; LTX-2: 8k+1). Nothing is decoded here.",
            inputs=[
                _folder_input("my_clips", "clips with same-name .txt captions"),
                *_bucket_inputs(),
                io.Boolean.Input("skip_bad", default=False,
                                 tooltip="Leave out unreadable clips and missing captions (listed on the node) instead "
                                 "of stopping with an error."),
                io.Int.Input("max_frames", default=MAX_FRAMES_DEFAULT, min=1, max=MAX_CLIP_FRAMES,
                             tooltip="Frames a clip gives at most (from its first frame), cut down to what the VAE "
                             "takes: 4k+1 for Wan / HunyuanVideo 1.5 (81 = 5 s at 16 fps), 8k+1 for LTX-2. Longer "
                             "clips give their first frames; shorter ones are used as long as they are, never "
                             "padded. Memory grows with it."),
                io.Int.Input("frame_stride", default=1, min=1, max=64,
                             tooltip="Use every n-th frame (2: a 30 fps video becomes 15 fps, twice the time span)."),
                io.String.Input("mask_folder", default="", optional=True,
                                tooltip="Optional sibling folder of loss masks matched by name, e.g. 'my_clips_masks': "
                                "white is learned, black is not (grey: partly). A clip's mask is one image (every "
                                "frame) or a video / frame folder with the clip's frame count (the same frames are "
                                "taken), of the clip's size; a clip without a mask is learned whole. Empty: no masks."),
                # Appended last and optional: workflows saved before it existed keep working.
                io.Float.Input("frame_rate", default=25.0, min=0.01, max=1000.0, step=0.01, optional=True,
                               tooltip="Frames per second of the frame folders (video files carry their own rate); "
                               "divided by frame_stride too. Models that read a clip's rate (LTX-2) train at it; "
                               "others ignore it."),
                _trigger_word_input(),
                _extra_resolutions_input(),
                _upscale_input(),
                *_bucket_side_inputs(),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def validate_inputs(cls, folder: str | None = None) -> bool | str:
        return _check_folder(VIDEOS_NODE, folder)

    @classmethod
    def fingerprint_inputs(cls, folder: str, mask_folder: str = "", **others) -> str:
        try:  # frame folders are subfolders: their listings count too
            root, _, masks = resolve_folders(folder, "", mask_folder)
            folders = [root, *sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink())]
            if masks is not None:
                folders += [masks, *sorted(p for p in masks.iterdir() if p.is_dir() and not p.is_symlink())]
            return folder_signature(*folders) + repr(sorted(others.items()))
        except (OSError, ValueError) as error:
            return f"unresolved: {error}"

    @classmethod
    def execute(cls, folder: str, resolution: int, step: int, crop: str, flip: bool, seed: int, skip_bad: bool,
                max_frames: int = MAX_FRAMES_DEFAULT, frame_stride: int = 1, mask_folder: str = "",
                frame_rate: float = 25.0, trigger_word: str = "", extra_resolutions: str = "",
                upscale_small_images: bool = True, min_bucket_side: int = 0, max_bucket_side: int = 0
                ) -> io.NodeOutput:
        check_finite(VIDEOS_NODE, frame_rate=frame_rate)
        check_dataset_folder(VIDEOS_NODE, folder)
        clips, _, masks = resolve_folders(folder, "", mask_folder)
        dataset = _dataset_from(VIDEOS_NODE, dataset_from_video_folder, folder=clips, resolution=resolution,
                                step=step, crop=crop, flip=flip, seed=seed, skip_bad=skip_bad,
                                roots=tuple(map(Path, dataset_roots())), max_frames=max_frames,
                                frame_stride=frame_stride, mask_folder=masks, frame_rate=frame_rate,
                                default_caption=(trigger_word or "").strip() or None)
        dataset = _with_upscale(_with_extra_resolutions(VIDEOS_NODE, dataset, extra_resolutions), upscale_small_images)
        dataset = _with_bucket_sides(VIDEOS_NODE, dataset, min_bucket_side, max_bucket_side)
        return io.NodeOutput(_with_trigger_word(VIDEOS_NODE, dataset, trigger_word),
                             ui=_dataset_text(VIDEOS_NODE, dataset, "clips", "clip or image"))


class HeadroomDatasetFromImages(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomDatasetFromImages",
            display_name="Dataset From Images (Headroom)",
            category="Headroom/data",
            description="A dataset from an IMAGE batch and its captions (one per line, in image order), with an "
            "optional control IMAGE batch of the same size; or from the image and text lists ComfyUI's own dataset "
            "nodes give (Load Image-Text (from Folder), Resize Images, Add Text Prefix, ...), images of any sizes, "
            "one caption each.",
            # Lists arrive whole (one run of the node, not one per image): ComfyUI's dataset nodes give lists.
            is_input_list=True,
            inputs=[
                io.Image.Input("images", tooltip="The training images: an IMAGE batch (e.g. from Load Image), or the "
                               "image list of ComfyUI's dataset nodes (sizes may differ)."),
                io.String.Input("captions", multiline=True, default="",
                                tooltip="One caption per line, in the order of the images; or the text list of "
                                "ComfyUI's dataset nodes (one caption per image)."),
                io.Image.Input("control_images", optional=True,
                               tooltip="One control image per image, of the same size."),
                *_bucket_inputs(),
                io.Mask.Input("masks", optional=True,
                              tooltip="Optional loss masks, one per image (or one for all) of the images' size: 1 "
                              "is learned, 0 is not. Load Image's MASK is 1 where the image is transparent: pass it "
                              "through Invert Mask to learn the opaque part."),
                _trigger_word_input(),
                _extra_resolutions_input(),
                _upscale_input(),
                *_bucket_side_inputs(),
            ],
            outputs=[DatasetType.Output("dataset", tooltip=_DATASET_TOOLTIP)],
        )

    @classmethod
    def execute(cls, images, captions, resolution, step, crop, flip, seed, control_images=None, masks=None,
                trigger_word="", extra_resolutions="", upscale_small_images=True, min_bucket_side=0,
                max_bucket_side=0) -> io.NodeOutput:
        node = "Dataset From Images (Headroom)"
        # is_input_list: every input is a list (a widget's value: a list of one); called directly: as given.
        images, texts = _as_list(images), _as_list(captions)
        controls = _as_list(control_images) if control_images is not None else None
        mask_list = _as_list(masks) if masks is not None else None
        settings = {name: _one_value(node, name, value) for name, value in dict(
            resolution=resolution, step=step, crop=crop, flip=flip, seed=seed, trigger_word=trigger_word,
            extra_resolutions=extra_resolutions, upscale_small_images=upscale_small_images,
            min_bucket_side=min_bucket_side, max_bucket_side=max_bucket_side).items()}
        buckets = {name: settings[name] for name in ("resolution", "step", "crop", "flip", "seed")}
        # One text: captions one per line (the widget); a list of texts: one caption each (ComfyUI's dataset nodes)
        captions_of = split_captions(texts[0]) if len(texts) == 1 else list(texts)
        if len(images) == 1:  # one IMAGE batch
            dataset = _dataset_from(node, dataset_from_tensors, images=images[0], captions=captions_of,
                                    control_images=controls[0] if controls else None,
                                    masks=mask_list[0] if mask_list else None, **buckets)
        else:  # a list of IMAGEs: ComfyUI's dataset nodes
            dataset = _dataset_from(node, dataset_from_image_list, images=images, captions=captions_of,
                                    control_images=controls, masks=mask_list, **buckets)
        dataset = _with_upscale(_with_extra_resolutions(node, dataset, settings["extra_resolutions"]),
                                settings["upscale_small_images"])
        dataset = _with_bucket_sides(node, dataset, settings["min_bucket_side"], settings["max_bucket_side"])
        return io.NodeOutput(_with_trigger_word(node, dataset, settings["trigger_word"]))


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _one_value(node: str, name: str, value):
    """A setting of a node whose inputs arrive as lists: its one value (a widget's list of one; a list input linked
    to it must hold one value throughout)."""
    values = _as_list(value)
    if not values or any(v != values[0] for v in values[1:]):
        raise ValueError(f"{node}: {name} got {len(values)} different values from a list; give it one value")
    return values[0]


class HeadroomCacheLatents(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomCacheLatents",
            display_name="Cache Latents (Headroom)",
            category="Headroom/cache",
            description="Encode the dataset's images and clips (bucketed, cropped, optionally mirrored) with the VAE, "
            "as stock VAE Encode does, into a cache on disk; a video VAE (Wan, HunyuanVideo 1.5, LTX-2) encodes "
            "each clip whole, cut to the frame counts it takes (4k+1; LTX-2: 8k+1). Cached items are reused "
            "without loading the VAE; the "
            "VAE is unloaded from the compute device when caching ends.",
            inputs=[
                DatasetType.Input("dataset", tooltip="From a Dataset node (Headroom)."),
                io.Vae.Input("vae", tooltip="The VAE of the model you will train (as VAE Encode uses it)."),
                io.Combo.Input("control_encoding", options=["pixels", "latents"], default="pixels",
                               tooltip="How control images are cached: pixels at the bucket size, or VAE latents "
                               "for ControlNet families that take latent hints (e.g. SD3 / Flux ones)."),
                OffloadPolicyType.Input("policy", optional=True, tooltip=_policy_tooltip()),
                io.Combo.Input("start_image", options=list(START_IMAGE_NODES), default="none", optional=True,
                               tooltip="Image-to-video (Wan I2V: WanImageToVideo; HunyuanVideo 1.5: "
                               "HunyuanVideo15ImageToVideo): also cache each clip's first frame as its start image, as "
                               "this stock node conditions the sampler with it, so an I2V model trains from its start "
                               "image. 'none': no start image (text-to-video)."),
            ],
            outputs=[LatentCacheType.Output("latent_cache", tooltip="The cached latents (and control images), for the "
                                        "training nodes' latent_cache."),
                     io.String.Output("summary", tooltip="Items encoded, items reused from the cache, warnings.")],
        )

    @classmethod
    def execute(cls, dataset, vae, control_encoding: str = "pixels", policy=None, start_image: str = "none") -> io.NodeOutput:
        name = node_name(cls)
        _check_policy(name, policy)
        cache, summary = cache_vae_latents(dataset, vae, control_encoding, policy, start_image, node=name)
        return io.NodeOutput(cache, summary)


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
                io.Combo.Input("reference_encoding", options=list(REFERENCE_ENCODINGS), default="none", optional=True,
                               tooltip="none: each caption as CLIP Text Encode encodes it. TextEncodeQwenImageEdit / "
                               "...Plus (Qwen-Image-Edit): each caption together with its item's control image (the "
                               "reference), exactly as that stock node encodes it (no VAE: the reference latents come "
                               "from Cache Latents), one entry per item; validate with reference_images, which are "
                               "then encoded by that node too (what the stock edit workflow does)."),
                io.Int.Input("tag_shuffles", default=0, min=0, max=MAX_SHUFFLES, optional=True, advanced=True,
                             tooltip="For tag captions ('ohwx, red hair, smiling, outdoors'): also cache up to this "
                             "many other orders of each caption's comma-separated tags; training picks one of a "
                             "caption's orders (as written or shuffled) at random per image and step, as kohya's "
                             "shuffle_caption does, so no tag owes its weight to its place. Each order is one more "
                             "encoding per caption (caching time and disk). 0: captions as written (sentences)."),
                io.Int.Input("keep_tags", default=1, min=0, max=MAX_KEEP, optional=True, advanced=True,
                             tooltip="With tag_shuffles: the first this many tags stay in place (the trigger word; "
                             "kohya's keep_tokens). The rest are shuffled."),
                # Appended last and optional: workflows saved before it existed keep working (no tag left out).
                io.Float.Input("tag_dropout", default=0.0, min=0.0, max=1.0, step=0.05, optional=True, advanced=True,
                               tooltip="With tag_shuffles: each shuffled order also leaves out each tag after the "
                               "first keep_tags with this probability (kohya's caption_tag_dropout_rate), so the "
                               "LoRA does not need every tag to call up what it learned; the caption as written stays "
                               "one of the orders. Typical: 0.05-0.2. 0: every tag kept."),
            ],
            outputs=[TextCacheType.Output("text_cache", tooltip="The encoded captions, for the training nodes' "
                                      "text_cache."),
                     io.String.Output("summary", tooltip="Captions encoded, captions reused from the cache, warnings.")],
        )

    @classmethod
    def execute(cls, dataset, clip, policy=None, reference_encoding: str = "none", tag_shuffles: int = 0,
                keep_tags: int = 1, tag_dropout: float = 0.0) -> io.NodeOutput:
        name = node_name(cls)
        _check_policy(name, policy)
        if clip is None:
            raise ValueError(f"{name}: the clip input is empty (the checkpoint has no text encoder?)")
        if reference_encoding not in REFERENCE_ENCODINGS:
            raise ValueError(f"{name}: reference_encoding={reference_encoding!r}: choose one of "
                             f"{', '.join(REFERENCE_ENCODINGS)}")
        if reference_encoding != "none" and not dataset.has_control:
            raise ValueError(f"{name}: reference_encoding={reference_encoding} encodes each caption with "
                             "its item's control image, but the dataset has none: give it the reference images as "
                             "control images (Dataset from Images' control_images, Dataset from Folder's "
                             "control_folder), or set reference_encoding to 'none'")
        for input_name, value, most in (("tag_shuffles", tag_shuffles, MAX_SHUFFLES),
                                        ("keep_tags", keep_tags, MAX_KEEP)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
                raise ValueError(f"{name}: {input_name}={value!r}: give a whole number from 0 to {most}")
        check_finite(name, tag_dropout=tag_dropout)
        if isinstance(tag_dropout, bool) or not isinstance(tag_dropout, (int, float)) or not 0 <= tag_dropout <= 1:
            raise ValueError(f"{name}: tag_dropout={tag_dropout!r}: give a number from 0 to 1")
        if tag_dropout and not tag_shuffles:
            raise ValueError(f"{name}: tag_dropout={tag_dropout:g} leaves tags out of the shuffled orders, and "
                             "tag_shuffles is 0 (none): set tag_shuffles to 4-8, or tag_dropout to 0")
        cache, summary = cache_clip_text(dataset, clip, policy, reference_encoding, node=name,
                                         tag_shuffles=tag_shuffles, keep_tags=keep_tags, tag_dropout=tag_dropout)
        return io.NodeOutput(cache, summary)


NODES = [HeadroomDatasetFromFolder, HeadroomDatasetFromVideos, HeadroomDatasetFromImages, HeadroomCacheLatents,
         HeadroomCacheText]
