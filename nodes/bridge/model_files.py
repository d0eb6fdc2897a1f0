"""Where runs and trained files live in ComfyUI's folders: the runs root (output/headroom_runs), a saved file's path
under models/<folder> and the name the stock loader lists it by, and the saves themselves (LoRA, ControlNet)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable

import folder_paths
import torch

from ...training.core.run_dir import (NAME_MAX, check_name, check_subfolder, checkpoints_on_disk, disk_room_needed,
                                      next_checkpoint_room)
from ...training.data.files import (DiskFullError, UntrustedFileError, display_path, format_bytes, free_bytes,
                                   open_regular, prune_temp, relative_text, save_safetensors)
from ...training.memory.planner import TrainableSpec
from . import lora_formats
from .comfy_bridge import TrainingRun
from .run_lora import SAVE_DTYPES

RUNS_SUBFOLDER = "headroom_runs"


def runs_root() -> pathlib.Path:
    return pathlib.Path(folder_paths.get_output_directory()) / RUNS_SUBFOLDER


def check_disk_room(run_name: str, trainable: TrainableSpec, node: str) -> str:
    """Before a run opens (LoRA and ControlNet Init nodes): its checkpoints against the free space on the disk of
    output/headroom_runs. Not even one fits (beside a resumed run's latest; its older ones go first): DiskFullError,
    as a save that met the full disk would say, before anything is written (its first save would fail after the
    steps it holds were trained). Room for one but not for the latest and the next (each save writes the next
    beside the latest, run_dir.RunDir._make_room): the warning the node shows (a save that meets a full disk says
    so, and the run goes on in memory until queueing again saves it). Else ""."""
    free = free_bytes(runs_root() / run_name)
    one = trainable.checkpoint_bytes()
    if free is None or not one:
        return ""
    parts = [f"trained weights {format_bytes(trainable.weight_bytes())}",
             f"{trainable.optimizer} state {format_bytes(trainable.optimizer_bytes())}"]
    if trainable.ema:
        parts.append(f"EMA {format_bytes(trainable.param_bytes())}")
    where = display_path(runs_root())
    # Adafactor (transformers', always installed) keeps a factored second moment only: where the state is most of a
    # checkpoint (AdamW's two fp32 moments are two thirds of a full fine-tune's), the size it would have says what
    # choosing it saves.
    lean = dataclasses.replace(trainable, optimizer="Adafactor").checkpoint_bytes()
    smaller = f" (with the Adafactor optimizer each would take about {format_bytes(lean)})" if lean * 1.5 <= one else ""
    kept = checkpoints_on_disk(runs_root(), run_name)
    if free + max(0, kept - 1) * one < one:
        raise DiskFullError(f"disk full: the checkpoints of run '{run_name}' cannot be saved in {where} (each needs "
                            f"about {format_bytes(one)}: {', '.join(parts)}; {format_bytes(free)} is free there"
                            f"){smaller}. Free space on that disk, or start ComfyUI with --output-directory on a disk "
                            "with room, then queue again; nothing was written.")
    needed = disk_room_needed(one, kept)
    if free < needed:
        message = (f"disk: each checkpoint of run '{run_name}' takes about {format_bytes(one)} ({', '.join(parts)}); "
                   f"a save writes the next beside the latest ({format_bytes(needed)} more at the peak), and "
                   f"{format_bytes(free)} is free on the disk of {where}: a later save will find it full{smaller}")
        logging.warning("%s: %s", node, message)
        return message
    return ""


def models_file(folder: str, subfolder: str, filename: str, run: TrainingRun, what: str
                ) -> tuple[pathlib.Path, pathlib.Path]:
    """(the models/<folder> root, the .safetensors path) a save node writes for `run`, names checked (empty
    filename: <run name>_step<N>)."""
    check_subfolder(subfolder, "subfolder")
    # Default names add to a run name of up to NAME_MAX characters (save_extracted_lora's the most): file names may be
    # that much longer, or a long run name would train and then fail to save.
    name = check_name(filename or step_save_name(run), f"{what} file name",
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
                        dtype: str = "fp32", weights: str = "auto", caption_tags: bool = True) -> tuple[str, str]:
    """Write a LoRA extracted from a full fine-tune's differences under models/loras/<subfolder>/ (empty filename:
    <run name>_step<N>_extracted); returns (the name LoraLoader lists, what the extraction kept)."""
    lora = run.trained_as("lora")
    filename = filename or f"{run.run_dir.name}_step{run.step:06d}_extracted"
    kept = []
    name = save_to_models(run, "loras", subfolder, filename, "LoRA",
                          lambda path: kept.append(lora.save_extracted(run, path, rank, energy, dtype, weights,
                                                                              caption_tags)))
    return name, kept[0]


RESIZE_DTYPES = ("auto", *SAVE_DTYPES)  # auto: each resized layer as the file stores it
MERGE_DTYPES = RESIZE_DTYPES  # auto: the merged files' dtype where they share one, else fp32
MERGE_NONE = "none"  # a Merge LoRAs slot left empty
MERGE_FORMATS = ("comfyui", "kohya")  # Save LoRA's but diffusers (its PEFT configs are not written for merges)


def read_lora_state(lora_name: str) -> tuple[str, dict[str, torch.Tensor], dict | None]:
    """(path, tensors, metadata) of LoRA file `lora_name` (a name Load LoRA lists), read as the stock loader reads it
    (safetensors, or torch's weights-only unpickler); errors name the file."""
    import comfy.utils

    path = folder_paths.get_full_path("loras", lora_name) if isinstance(lora_name, str) else None
    if path is None:
        raise ValueError(f"LoRA file {str(lora_name)[:120]!r} is not in models/loras/ (Load LoRA lists the names to "
                         "use)")
    try:
        state, metadata = comfy.utils.load_torch_file(path, safe_load=True, return_metadata=True)
    except Exception as error:  # noqa: BLE001 - any failure to read it: what the user must know is which file
        raise ValueError(f"LoRA file {lora_name} cannot be read ({type(error).__name__}: "
                         f"{relative_text(str(error))[:200]})") from None
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"LoRA file {lora_name} holds no tensors by name: it is not a LoRA")
    return path, state, metadata if isinstance(metadata, dict) else None


def lora_output(subfolder: str, filename: str, sources: list[str], suffix: str,
                reading: str) -> tuple[pathlib.Path, pathlib.Path]:
    """(models/loras root, path) of a LoRA file a tool node writes: `filename`, or the `sources`' names (the
    characters a saved name may have: "my lora (v2)" -> "my_lora_v2") joined + `suffix`; never one of the sources
    (`reading`: what they are, for the refusal)."""
    check_subfolder(subfolder, "subfolder")
    stems = [re.sub(r"[^A-Za-z0-9_.-]+|\.\.", "_", os.path.splitext(os.path.basename(s))[0]).strip("._-")
             for s in sources]
    default = "_".join(dict.fromkeys(s for s in stems if s))[:NAME_MAX].strip("._-") or "lora"
    name = check_name(filename or default + suffix, "LoRA file name", longest=NAME_MAX + len("_step000000_extracted"))
    name = name if name.endswith(".safetensors") else name + ".safetensors"
    root = pathlib.Path(folder_paths.get_folder_paths("loras")[0])
    path = root / subfolder / name if subfolder else root / name
    for source in sources:
        if os.path.exists(path) and os.path.samefile(path, source):
            raise ValueError(f"{name} is {reading}: choose another filename (the source stays as it is)")
    return root, path


def save_resized_lora(lora_name: str, rank: int, energy: float, subfolder: str, filename: str,
                      dtype: str = "auto") -> tuple[str, str]:
    """Write LoRA file `lora_name` (a name Load LoRA lists) at a lower rank (training/core/lora_resize.py) under
    models/loras/<subfolder>/ (empty filename: <its name>_resized), its key names, format and metadata kept (ranks,
    alphas and hashes made to match); returns (the name LoraLoader lists, what was done)."""
    from ...training.core.lora_resize import resize_lora

    if dtype not in RESIZE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(RESIZE_DTYPES)}")
    check_subfolder(subfolder, "subfolder")
    source, state, metadata = read_lora_state(lora_name)
    root, path = lora_output(subfolder, filename, [source], "_resized", "the file being resized")
    try:
        resized, report = resize_lora(state, rank=rank, energy=energy,
                                      dtype=None if dtype == "auto" else SAVE_DTYPES[dtype])
        metadata, notes = lora_formats.resized_metadata(metadata, report.new_ranks(), report.alphas, lora_name,
                                                        {"rank": rank, "energy": energy, "dtype": dtype},
                                                        list(report.convolutions.values()))
    except ValueError as error:
        raise ValueError(f"LoRA file {lora_name}: {error}") from None
    prune_temp(path.parent)
    save_safetensors(path, resized, "resized LoRA", metadata)
    before, after = os.path.getsize(source), os.path.getsize(path)
    summary = "; ".join([report.summary(), *notes, f"{format_bytes(before)} -> {format_bytes(after)}"])
    return listed_name("loras", root, path), summary


def save_trained_controlnet(run: TrainingRun, subfolder: str, filename: str, weights: str = "auto") -> str:
    """Write the ControlNet under models/controlnet/<subfolder>/; returns the name ControlNetLoader lists."""
    controlnet = run.trained_as("controlnet")
    return save_to_models(run, "controlnet", subfolder, filename, "ControlNet",
                          lambda path: controlnet.save(run, path, weights))


def step_save_name(run: TrainingRun) -> str:
    """The file name (without .safetensors) the all-in-one nodes save the run's current step under."""
    return f"{run.run_dir.name}_step{run.step:06d}"


def _step_saves_folder(folder: str, subfolder: str) -> pathlib.Path:
    root = pathlib.Path(folder_paths.get_folder_paths(folder)[0])
    return root / subfolder if subfolder else root


def _step_saves(run: TrainingRun, directory: pathlib.Path) -> list[os.DirEntry]:
    """The files in `directory` named as `run`'s step saves (step_save_name), oldest step first (OSError: it cannot be
    listed). Whether the run wrote them is asked of each where it matters (_written_by)."""
    pattern = re.compile(re.escape(run.run_dir.name) + r"_step(\d{6,})\.safetensors")
    entries = [(int(match[1]), entry) for entry in os.scandir(directory)
               if (match := pattern.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False)]
    return [entry for _, entry in sorted(entries, key=lambda pair: pair[0])]


def _remove_step_saves(folder: str, entries: list[os.DirEntry],
                       enough: Callable[[int], bool] = lambda removed_bytes: False) -> tuple[list[str], list[str]]:
    """Remove `entries` (the run's own: _written_by), in order, until `enough(bytes removed)`: (names removed,
    problems). A file that cannot be removed (on Windows: open in a loader) is named in the problems."""
    removed, problems, removed_bytes = [], [], 0
    for entry in entries:
        if enough(removed_bytes):
            break
        try:
            size = entry.stat(follow_symlinks=False).st_size
            os.remove(entry.path)
        except OSError as error:
            # a later prune tries it again: said, so the user knows closing the holder is enough
            problems.append(f"older save {entry.name} not removed ({error.strerror}; open in a loader or another "
                            "program? Once it is closed, the run's next save removes it)")
            continue
        removed.append(entry.name)
        removed_bytes += size
    if removed:
        folder_paths.filename_list_cache.pop(folder, None)  # the loaders' lists drop the removed names
    return removed, problems


def prune_step_saves(run: TrainingRun, folder: str, subfolder: str, keep: int) -> tuple[list[str], list[str]]:
    """Remove all but the newest `keep` of the run's step saves (step_save_name) in models/<folder>/<subfolder>/, as
    ai-toolkit's max_step_saves_to_keep does: (names removed, problems). A file is removed only when its metadata says
    this run wrote it (the run's name and base fingerprint): a file of the same name from anything else stays. A
    file that cannot be removed (on Windows: open in a loader) is named in the problems; the run goes on, and the
    next prune tries it again."""
    directory = _step_saves_folder(folder, subfolder)
    try:
        entries = _step_saves(run, directory)
    except OSError as error:
        return [], [f"older saves not pruned: {directory.name} cannot be listed ({error.strerror})"]
    older = entries[:-keep] if len(entries) > keep else []
    return _remove_step_saves(folder, [entry for entry in older if _written_by(run, entry.path)])


def make_room_for_step_save(run: TrainingRun, folder: str, subfolder: str, keep: int,
                            one: int) -> tuple[str, list[str]]:
    """Before an all-in-one node's step save with keep_saves `keep` >= 2: where the disk of models/<folder>/<subfolder>
    has no room for the next save (about as large as the run's newest there, else `one` bytes), but would have after
    removing the run's older saves that the prune after the save removes anyway (all but the newest keep - 1), those
    go first, oldest first, as few as make the room. At least one whole save stays while the next is written (with
    keep 1 nothing is removed first: the save finds the disk full and says so). Returns (the note saying what was
    removed, or "", problems)."""
    if keep < 2:
        return "", []
    directory = _step_saves_folder(folder, subfolder)
    free = free_bytes(directory)
    try:
        entries = _step_saves(run, directory)
        older = entries[:-(keep - 1)]
        if not older or free is None:
            return "", []
        newest = max(entries[-1].stat(follow_symlinks=False).st_size, one)
        needed = next_checkpoint_room(newest)
        if free >= needed:
            return "", []
        ours = [entry for entry in older if _written_by(run, entry.path)]
        removable = sum(entry.stat(follow_symlinks=False).st_size for entry in ours)
    except OSError:
        return "", []  # a folder or file gone meanwhile: the save goes on (the prune after it says what it finds)
    if free + removable < needed:
        return "", []  # removing would not make the room: everything stays, and the save says disk full
    removed, problems = _remove_step_saves(folder, ours, lambda removed_bytes: free + removed_bytes >= needed)
    if not removed:
        return "", problems
    which = f"save {removed[0]} was" if len(removed) == 1 else f"saves {', '.join(removed)} were"
    note = (f"disk: the older {which} removed before step {run.step} was saved, to make room "
            f"({format_bytes(free)} was free in {display_path(directory)}, a save takes about "
            f"{format_bytes(newest)}); keep_saves {keep} keeps the newest {keep}")
    logging.warning("%s", note)
    return note, problems


def saves_to_come(step: int, steps: int, save_every: int) -> int:
    """How many step saves an all-in-one node makes from `step` to `steps`: every `save_every` steps and at the end."""
    if steps <= step:
        return 0
    periodic = steps // save_every - step // save_every if save_every else 0
    return periodic + (0 if save_every and steps % save_every == 0 else 1)


def saves_room_note(run: TrainingRun, folder: str, subfolder: str, keep: int, to_come: int, one: int) -> str:
    """Before an all-in-one node trains: where its `to_come` step saves (each about as large as the run's newest
    there, else `one` bytes) will not fit the free space of models/<folder>/<subfolder> at their peak (with keep_saves
    `keep`: the newest `keep` of the run's saves, beside which the next is written where the room is there, the older
    ones removed first where not; make_room_for_step_save), the warning the node shows: a later save will find the
    disk full (the run's checkpoint keeps its steps). Else ""."""
    directory = _step_saves_folder(folder, subfolder)
    free = free_bytes(directory)
    if not to_come or free is None:
        return ""
    try:
        sizes = [entry.stat(follow_symlinks=False).st_size for entry in _step_saves(run, directory)
                 if _written_by(run, entry.path)]
    except OSError:
        sizes = []
    one = max(sizes[-1] if sizes else 0, one)
    if not one:
        return ""
    # At the peak: every save (keep 0), or the newest `keep` with the next written beside the only one (keep 1).
    peak = len(sizes) + to_come if not keep else min(len(sizes) + to_come, max(keep, 2))
    needed = peak * one - sum(sizes)
    if free >= needed:
        return ""
    if not keep:
        advice = (", or set keep_saves (the newest that many are kept: 2 needs room for two), or save less often "
                  "(save_every)")
    elif keep > 2:
        advice = ", or lower keep_saves (2 needs room for two)"
    else:  # keeping fewer does not help: a save is written beside the newest, so two are on disk at the peak
        advice = " (the next save is written beside the newest: room for two is the least)"
    kept = f" (keep_saves {keep})" if keep else ""
    return (f"disk: each save of run '{run.run_dir.name}' takes about {format_bytes(one)}; the {to_come} still to come "
            f"need about {format_bytes(needed)} more{kept}, and {format_bytes(free)} is free on the disk of "
            f"{display_path(directory)}: a later save will find it full. Free space there{advice}")


def _written_by(run: TrainingRun, path: str) -> bool:
    """Whether the safetensors file at `path` says `run` wrote it (its headroom.run and headroom.base_fingerprint);
    a file that cannot be read as one is not the run's."""
    metadata = _safetensors_metadata(path)
    return metadata.get("headroom.run") == run.run_dir.name and \
        metadata.get("headroom.base_fingerprint") == run.fingerprint


HEADER_MAX_BYTES = 100 << 20  # safetensors' own limit on a header


def _safetensors_metadata(path: str) -> dict:
    """A safetensors file's __metadata__ ({} where it has none or is no such file), read from its header alone. By
    hand, not safetensors.safe_open: that maps the whole file, and on Windows a file cannot be removed while a
    mapping of it lives."""
    try:
        with open_regular(path, "saved file") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 2 <= length <= HEADER_MAX_BYTES:
                return {}
            header = json.loads(handle.read(length).decode("utf-8"))
    except (UntrustedFileError, OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}
    metadata = header.get("__metadata__") if isinstance(header, dict) else None
    return metadata if isinstance(metadata, dict) else {}
