"""Where runs and trained files live in ComfyUI's folders: the runs root (output/headroom_runs), a saved file's path
under models/<folder> and the name the stock loader lists it by, and the saves themselves (LoRA, ControlNet)."""
from __future__ import annotations

import os
import pathlib
from collections.abc import Callable

import folder_paths

from ...training.core.run_dir import NAME_MAX, check_name, check_subfolder
from ...training.data.files import prune_temp
from . import lora_formats
from .comfy_bridge import TrainingRun

RUNS_SUBFOLDER = "headroom_runs"


def runs_root() -> pathlib.Path:
    return pathlib.Path(folder_paths.get_output_directory()) / RUNS_SUBFOLDER


def models_file(folder: str, subfolder: str, filename: str, run: TrainingRun, what: str) -> tuple[pathlib.Path, pathlib.Path]:
    """(the models/<folder> root, the .safetensors path) a save node writes for `run`, names checked (empty
    filename: <run name>_step<N>)."""
    check_subfolder(subfolder, "subfolder")
    # Default names add to a run name of up to NAME_MAX characters (save_extracted_lora's the most): file names may be
    # that much longer, or a long run name would train and then fail to save.
    name = check_name(filename or f"{run.run_dir.name}_step{run.step:06d}", f"{what} file name",
                      longest=NAME_MAX + len("_step000000_extracted"))
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    root = pathlib.Path(folder_paths.get_folder_paths(folder)[0])
    return root, (root / subfolder / name if subfolder else root / name)


def listed_name(folder: str, root: pathlib.Path, path: pathlib.Path) -> str:
    """After a save: the name the stock loader lists for `path`, listed without a restart. (A new file changes its
    folder's mtime, which invalidates ComfyUI's file-list cache; dropping the entry too makes the new name show up
    at once even where mtimes are coarse.)"""
    folder_paths.filename_list_cache.pop(folder, None)
    # As folder_paths.recursive_search names it: with the OS's separator (Windows lists "headroom\\x.safetensors"; a
    # "/" name would load, but a combo checks it against the list: "Value not in list").
    return os.path.relpath(path, root)


def save_to_models(run: TrainingRun, folder: str, subfolder: str, filename: str, what: str,
                   write: Callable[[pathlib.Path], None]) -> str:
    """Write `run`'s trained `what` under models/<folder>/<subfolder>/ with `write(path)` (atomic: the strategy's
    save), after clearing what a killed save left there; returns the name the stock loader lists."""
    root, path = models_file(folder, subfolder, filename, run, what)
    with run.phase("save"):
        prune_temp(path.parent)
        write(path)
    return listed_name(folder, root, path)


def save_lora(run: TrainingRun, subfolder: str, filename: str, dtype: str = "fp32", file_format: str = "comfyui",
              weights: str = "auto", caption_tags: bool = True) -> str:
    """Write the adapter under models/loras/<subfolder>/; returns the name LoraLoader lists."""
    if file_format not in lora_formats.FORMATS:
        raise ValueError(f"format {file_format!r}: choose one of {', '.join(lora_formats.FORMATS)}")
    lora = run.trained_as("lora")
    return save_to_models(run, "loras", subfolder, filename, "LoRA",
                          lambda path: lora.save(run, path, dtype, file_format, weights, caption_tags))


def save_extracted_lora(run: TrainingRun, subfolder: str, filename: str, rank: int, energy: float,
                        dtype: str = "fp32", weights: str = "auto") -> tuple[str, str]:
    """Write a LoRA extracted from a full fine-tune's differences under models/loras/<subfolder>/ (empty filename:
    <run name>_step<N>_extracted); returns (the name LoraLoader lists, what the extraction kept)."""
    lora = run.trained_as("lora")
    filename = filename or f"{run.run_dir.name}_step{run.step:06d}_extracted"
    kept = []
    name = save_to_models(run, "loras", subfolder, filename, "LoRA",
                          lambda path: kept.append(lora.save_extracted(run, path, rank, energy, dtype, weights)))
    return name, kept[0]


def save_trained_controlnet(run: TrainingRun, subfolder: str, filename: str, weights: str = "auto") -> str:
    """Write the ControlNet under models/controlnet/<subfolder>/; returns the name ControlNetLoader lists."""
    controlnet = run.trained_as("controlnet")
    return save_to_models(run, "controlnet", subfolder, filename, "ControlNet",
                          lambda path: controlnet.save(run, path, weights))
