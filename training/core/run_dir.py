"""A named run directory: everything needed to resume a run exactly, written atomically.

Layout of `<root>/<run name>/`:
  config.json                      the run's configuration (what must match to resume)
  latest.json                      {"step": N, "checkpoint": "checkpoints/step_00000N"}; replaced atomically
  checkpoints/step_00000N/         (a re-save of step N, e.g. after a validation, is step_00000N.1, .2, ...)
      adapter.safetensors          trainable weights (fp32, peft names)
      ema.safetensors              their exponential moving average (runs with ema_decay > 0 only)
      optimizer.pt                 optimizer, LR scheduler and grad-scaler state (torch.save; loaded weights_only)
      rng.pt                       torch CPU (and CUDA) RNG states
      trainer.json                 step, micro-step, loss history, validation-loss history
  validation/                      sample grids per step
  tensorboard/                     the run's curves for TensorBoard (training/core/scalar_log.py; written, never read)

A checkpoint directory is written under a temporary name and renamed into place, then latest.json is
replaced: a kill at any point leaves the previous checkpoint readable, and the next open removes the temp
folder (training/files.py prune_temp). A re-save of the same step goes to a new folder, so the one latest.json
names is never moved away. Nothing is ever unpickled.

Everything read back is untrusted (output/ takes uploads from any HTTP client): latest.json's checkpoint path
must name a checkpoint folder of this run (no symlinks out of it), JSON parses strictly, the files must be
regular files, and their contents are checked before use (here the structure; the trainer checks the weights'
keys, shapes and dtypes against what it trains).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import shutil
from typing import Any, Sequence

import torch
from safetensors.torch import load_file

from .. import os_compat, public_module
from ..data.files import (UntrustedFileError, check_room, display_path, format_bytes, free_bytes, is_within,
                          make_temp_dir, open_regular, path_in, prune_temp, read_json, save_safetensors, temp_name,
                          tensor_bytes, write_bytes, write_error, write_json, write_new, write_safetensors, write_torch)

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
NAME_MAX = 100  # a run name's characters; a file named after the run adds "_step000123" and the like
_CHECKPOINT = re.compile(r"checkpoints/(step_(\d{8})(?:\.(\d{1,6}))?)")
_CHECKPOINT_FOLDER = re.compile(r"step_(\d{8})(?:\.(\d{1,6}))?")
KEEP_CHECKPOINTS = 2
# Reads of the latest checkpoint when another process replaced it meanwhile (load_checkpoint).
READ_ATTEMPTS = 3
# The longest path a run writes inside its folder: checkpoints/<temp name of step_00000000.999999>/adapter.safetensors,
# a temp name adding 31 characters (files.temp_name: ".", ".hrtmp-", a 10-digit pid, "-", 8 hex digits, ".tmp").
LONGEST_INSIDE_RUN = len("checkpoints/") + len("step_00000000.999999") + 31 + len("/adapter.safetensors")
TRAINER_JSON_MAX_BYTES = 64 << 20


class CheckpointError(ValueError):
    """A run folder's checkpoint or pointer cannot be used; the message names it and what to do."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


class RunFolderError(RuntimeError):
    """The run folder vanished or was replaced while its run was loaded, or lost its config.json."""

    __module__ = public_module(__name__)


def check_name(name: str, what: str = "run name", longest: int = NAME_MAX) -> str:
    """A single safe path segment: letters, digits, `_ . -`; no `..`, no separators, not absolute. A full match:
    `$` would also match before a final newline, and folders named "x\\n" were created."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name or len(name) > longest:
        raise ValueError(
            f"{what} {str(name)[:120]!r} is not allowed: use 1-{longest} letters, digits, '_', '-' or '.', starting "
            "with a letter or digit, without '..' or path separators"
        )
    problem = os_compat.windows_name_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r} is not allowed: {problem}; choose another name")
    return name


def check_subfolder(subfolder: str, what: str = "subfolder") -> str:
    """A relative folder path of safe segments ('' allowed), joined with '/'."""
    if subfolder in ("", None):
        return ""
    if not isinstance(subfolder, str) or subfolder.startswith(("/", "\\")) or "\\" in subfolder or ":" in subfolder:
        raise ValueError(f"{what} {str(subfolder)[:120]!r} must be a relative path of plain names separated by '/'")
    for part in subfolder.split("/"):
        check_name(part, what=f"{what} part")
    return subfolder


def atomic_write_bytes(path: pathlib.Path, data: bytes, what: str = "file") -> None:
    write_bytes(path, data, what)


def atomic_write_json(path: pathlib.Path, value: Any, what: str = "file") -> None:
    write_json(path, value, what)


def atomic_save_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None,
                            what: str = "file") -> None:
    save_safetensors(path, tensors, what, metadata)


@dataclasses.dataclass
class Checkpoint:
    step: int  # optimizer steps done
    micro_step: int  # forward/backward passes done (step * accumulation)
    adapter: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    scaler: dict | None
    rng: dict[str, Any]
    loss_history: list[list[float]]  # [step, loss]
    validation_history: list[list[float]]  # [step, validation loss]
    ema: dict[str, torch.Tensor] | None = None  # averaged trainable weights, when the run keeps an EMA


class RunDir:
    def __init__(self, root: str | os.PathLike, name: str):
        self.name = check_name(name)
        self.root = pathlib.Path(root)
        self.path = self.root / self.name
        problem = os_compat.path_length_problem(self.path, LONGEST_INSIDE_RUN)
        if problem:
            raise ValueError(f"run name {self.name!r} in {display_path(self.root)}: {problem}")
        self._identity: tuple[int, int, int] | None = None  # config.json as this run read or wrote it
        self.room_note = ""  # the last save that removed the older checkpoints first to make room (_make_room)

    @property
    def config_path(self) -> pathlib.Path:
        return self.path / "config.json"

    @property
    def validation_dir(self) -> pathlib.Path:
        return self.path / "validation"

    @property
    def memory_record_path(self) -> pathlib.Path:
        """The run's per-phase memory record (memory_stats.PhaseRecorder JSON), rewritten after every phase."""
        return self.path / "memory_record.json"

    @property
    def display(self) -> str:
        return display_path(self.path)

    def exists(self) -> bool:
        return self.config_path.is_file()

    def read_config(self) -> dict | None:
        if not os.path.lexists(self.config_path):
            return None
        self._check_contained()
        try:
            config = read_json(self.config_path, "run configuration")
            if not isinstance(config, dict):
                raise UntrustedFileError("it is not a JSON object")
        except UntrustedFileError as error:
            raise self._unusable(self.config_path, error) from None
        self._bind()
        return config

    def write_config(self, config: dict) -> None:
        self._check_contained()
        write_json(self.config_path, config, f"configuration of run '{self.name}'")
        self._bind()

    def write_file_json(self, path: pathlib.Path, value: Any, what: str) -> None:
        """A JSON file in this run folder (e.g. the memory record), written only while the folder is the run's."""
        self.check_present()
        write_json(path, value, what, make_parents=False)

    def check_subfolder_inside(self, folder: pathlib.Path) -> None:
        """A subfolder the run writes into (checkpoints/, validation/) must not lead out of the run folder (a
        symlink someone put there)."""
        if os.path.lexists(folder) and not is_within(folder, self.path):
            raise CheckpointError(f"{display_path(folder)} leads outside the run folder (a symlink?): refused; move "
                                  "the run folder away, or use a new run name")

    def _check_contained(self) -> None:
        """The run folder itself (maybe a symlink) must lie inside the runs folder."""
        if os.path.lexists(self.path) and not is_within(self.path, self.root):
            raise CheckpointError(f"run folder {self.display} leads outside {display_path(self.root)} (a symlink?): "
                                  "refused; use another run name")

    def _bind(self) -> None:
        self._identity = self.config_identity(self.path)

    @staticmethod
    def config_identity(path: pathlib.Path) -> tuple[int, int, int] | None:
        """(device, inode, mtime) of a run folder's config.json, None without one: tells a re-created folder apart
        (file systems reuse inode numbers; the run never rewrites its config.json)."""
        try:
            info = os.stat(pathlib.Path(path) / "config.json")
        except OSError:
            return None
        return info.st_dev, info.st_ino, info.st_mtime_ns

    def present(self) -> bool:
        """Whether the run folder is still the one this run opened (its config.json, same file)."""
        if self._identity is None:
            return True  # not opened through its configuration (engine tests): nothing to compare
        return self.config_identity(self.path) == self._identity

    def check_present(self) -> None:
        """Raise RunFolderError when the run folder was deleted or replaced since this run opened it: writing
        into it would re-create a folder without config.json (which a later run then resumed unchecked)."""
        if not self.present():
            raise RunFolderError(
                f"run folder {self.display} was deleted or replaced while run '{self.name}' was loaded, so nothing "
                "more is written there. Queue again to start the run anew under that name (its Init node runs "
                "again), or restore the folder."
            )

    def prune_temp(self) -> list[str]:
        """Remove temp files and folders a killed writer left in the run folder (done when a run opens)."""
        self._check_contained()  # never list (let alone delete in) a folder a symlink leads to
        folders = [self.path] + [sub for sub in (self.path / "checkpoints", self.validation_dir)
                                 if not os.path.islink(sub) and is_within(sub, self.path)]
        return [name for folder in folders for name in prune_temp(folder)]

    def check_compatible(self, config: dict, added_later: dict[str, Any] | None = None,
                         removed_later: Sequence[str] = (), renamed: dict[str, dict[Any, Any]] | None = None) -> None:
        """Raise if this run directory holds a run whose configuration differs from `config`, or checkpoints
        without a configuration (nothing to check them against). `added_later`: {dotted key: value} of settings
        newer than some stored runs; a stored run without the key ran with that value, so it still resumes.
        `removed_later`: dotted keys older runs store that are no longer part of a run's configuration (ignored
        when `config` has none). `renamed`: {dotted key: {value now: the value earlier versions stored for the same
        thing}}."""
        self._check_contained()
        stored = self.read_config()
        if stored is None:
            if os.path.lexists(self.path / "latest.json") or os.path.lexists(self.path / "checkpoints"):
                raise RunFolderError(
                    f"run folder {self.display} holds checkpoints but no config.json, so they cannot be checked "
                    "against these settings: move the folder away (or restore its config.json), or use a new run name"
                )
            return
        stored_json, new_json = json.loads(json.dumps(stored)), json.loads(json.dumps(config))
        added_later, renamed = added_later or {}, renamed or {}
        differences = [(k, a, b) for k, a, b in _differences(stored_json, new_json)
                       if not (a is None and k in added_later and b == added_later[k])
                       and not (b is None and k in removed_later)
                       and not (k in renamed and b in renamed[k] and a == renamed[k][b])]
        if differences:
            # (a run stored before a setting existed ran with its added_later value: shown as stored)
            listed = "; ".join(f"{k}: stored {added_later[k] if a is None and k in added_later else a!r}, now {b!r}"
                               for k, a, b in differences[:6])
            raise ValueError(
                f"run '{self.name}' already exists at {self.display} with a different configuration ({listed}). "
                "Use a new run name, or set the inputs back to the stored values to resume it."
            )

    # --- checkpoints -------------------------------------------------------------------------------
    def _pointer(self) -> tuple[int, pathlib.Path] | None:
        """(step, checkpoint folder) that latest.json names, checked; None without latest.json."""
        pointer_path = self.path / "latest.json"
        if not os.path.lexists(pointer_path):
            return None
        self._check_contained()
        try:
            pointer = read_json(pointer_path, "checkpoint pointer", max_bytes=1 << 16)
            if not isinstance(pointer, dict):
                raise UntrustedFileError("it is not a JSON object")
            step, relative = pointer.get("step"), pointer.get("checkpoint")
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise UntrustedFileError(f"its step {str(step)[:40]!r} is not a step number")
            match = _CHECKPOINT.fullmatch(relative) if isinstance(relative, str) else None
            if match is None or int(match.group(2)) != step:  # (what it names is not repeated: maybe a server path)
                raise UntrustedFileError(f"it does not name a checkpoint folder of step {step} of this run")
            folder = path_in(self.path, relative, "checkpoint folder")
            if not is_within(folder, self.path / "checkpoints") or os.path.islink(self.path / relative):
                raise UntrustedFileError(f"{relative!r} leads outside the run's checkpoints folder")
        except UntrustedFileError as error:
            raise self._unusable(pointer_path, error) from None
        return step, self.path / relative

    def _unusable(self, path: pathlib.Path, problem: object) -> CheckpointError:
        return CheckpointError(
            f"run '{self.name}': {display_path(path)} cannot be used ({problem}). It was damaged or edited: move the "
            f"run folder {self.display} away (or restore that file), or use a new run name."
        )

    def latest_step(self) -> int | None:
        pointer = self._pointer()
        return None if pointer is None else pointer[0]

    def save_checkpoint(self, checkpoint: Checkpoint) -> pathlib.Path:
        self.check_present()
        checkpoints = self.path / "checkpoints"
        folder_name = self._new_folder_name(checkpoints, checkpoint.step)
        final = checkpoints / folder_name
        what = f"checkpoint of run '{self.name}' at step {checkpoint.step}"
        tensors = tensor_bytes(checkpoint.adapter) + tensor_bytes(checkpoint.optimizer) + tensor_bytes(checkpoint.rng) \
            + tensor_bytes(checkpoint.ema or {})
        needed = tensors + 64 * (len(checkpoint.loss_history) + len(checkpoint.validation_history)) + 65536
        tmp = None
        self.check_subfolder_inside(checkpoints)
        self._make_room(checkpoints, checkpoint.step, needed)
        check_room(final, tensors, what, needed)  # a checkpoint the disk cannot hold fails before it is written
        try:
            # A run opened through its config.json (check_present above) never re-creates a vanished folder.
            checkpoints.mkdir(parents=self._identity is None, exist_ok=True)
            tmp = make_temp_dir(checkpoints, folder_name)
            # write_safetensors copies the tensors off their device one at a time (not all of them at once). A
            # checkpoint is read back only when a run is opened again (resume): its pages leave the page cache as
            # they reach the disk, rather than the users' cached files (os_compat.open_to_write).
            write_new(tmp / "adapter.safetensors",
                      lambda target: write_safetensors(target, checkpoint.adapter, drop_cached=True))
            write_new(tmp / "optimizer.pt", lambda target: write_torch(
                target, {"optimizer": checkpoint.optimizer, "scheduler": checkpoint.scheduler, "scaler": checkpoint.scaler},
                drop_cached=True))
            write_new(tmp / "rng.pt", lambda target: write_torch(target, checkpoint.rng))
            if checkpoint.ema is not None:
                write_new(tmp / "ema.safetensors",
                          lambda target: write_safetensors(target, checkpoint.ema, drop_cached=True))
            trainer = json.dumps({
                "step": checkpoint.step, "micro_step": checkpoint.micro_step,
                "loss_history": _json_history(checkpoint.loss_history),
                "validation_history": _json_history(checkpoint.validation_history),
            }, allow_nan=False).encode()
            write_new(tmp / "trainer.json", lambda target: target.write_bytes(trainer))
            os_compat.replace(tmp, final, what)
            tmp = None
        except Exception as error:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            clear = write_error(error, what, final, needed)
            if clear is None:
                raise
            raise clear from error
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        write_json(self.path / "latest.json", {"step": checkpoint.step, "checkpoint": f"checkpoints/{folder_name}"},
                   f"checkpoint pointer of run '{self.name}'", make_parents=False)
        self._prune(keep=final)
        return final

    def _make_room(self, checkpoints: pathlib.Path, step: int, needed: int) -> None:
        """Before a save: where the disk would not hold the next checkpoint beside those kept, but would once the
        older ones go, they go first (the save's _prune removes them after it anyway), so a disk with room for two
        keeps saving. The latest stays until the next is whole. The next is sized as the larger of its tensors and
        the latest on disk (the same tensors, with what the files add), plus a margin; where removing would not make
        that room, nothing is removed and the save says "disk full" as it would have."""
        try:
            pointer = self._pointer()
            if pointer is None:
                return
            latest = pointer[1]
            older = [path for path in _checkpoint_folders(checkpoints) if path != latest]
        except (CheckpointError, OSError):  # a damaged pointer or no folder: the save replaces / makes them
            return
        free = free_bytes(checkpoints) if older else None
        if free is None:
            return
        want = next_checkpoint_room(max(needed, _folder_bytes(latest)))
        if free >= want:
            return
        freed = sum(_folder_bytes(path) for path in older)
        if free + freed < want:
            return
        removed = [path for path in older if _remove_folder(path)]
        if not removed:  # e.g. Windows refused to rename a folder in use: the save says "disk full" if it must
            return
        steps = sorted({int(_CHECKPOINT_FOLDER.fullmatch(path.name).group(1)) for path in removed})
        which = f"checkpoint (step {steps[0]}) was" if len(steps) == 1 else \
            f"checkpoints (steps {', '.join(map(str, steps))}) were"
        self.room_note = (f"disk: the older {which} removed before step "
                          f"{step} was saved, to make room ({format_bytes(free)} was free, a checkpoint takes about "
                          f"{format_bytes(want)}); the run keeps its latest checkpoint while it writes the next")
        logging.warning("run '%s': %s", self.name, self.room_note)

    @staticmethod
    def _new_folder_name(checkpoints: pathlib.Path, step: int) -> str:
        """step_N, or step_N.<k> when step N was saved before: the folder latest.json names is never replaced."""
        name = f"step_{step:08d}"
        if not os.path.lexists(checkpoints / name):
            return name
        versions = [int(m.group(2) or 0) for p in checkpoints.iterdir()
                    if (m := _CHECKPOINT_FOLDER.fullmatch(p.name)) and int(m.group(1)) == step]
        return f"{name}.{max(versions, default=0) + 1}"

    def _prune(self, keep: pathlib.Path) -> None:
        """Keep the checkpoint just written and the newest of earlier steps (KEEP_CHECKPOINTS in all); older
        steps and other copies of the kept step go."""
        kept_step = int(_CHECKPOINT_FOLDER.fullmatch(keep.name).group(1))
        folders = sorted(((int(match.group(1)), int(match.group(2) or 0)), path)
                         for path in _checkpoint_folders(self.path / "checkpoints") if path != keep
                         for match in [_CHECKPOINT_FOLDER.fullmatch(path.name)])
        earlier = [path for (step, _), path in folders if step < kept_step]
        doomed = [path for (step, _), path in folders if step >= kept_step]
        doomed += earlier[: max(0, len(earlier) - (KEEP_CHECKPOINTS - 1))]
        for stale in doomed:
            _remove_folder(stale)

    def load_checkpoint(self) -> Checkpoint | None:
        """The checkpoint latest.json names, its structure checked (CheckpointError naming the problem)."""
        pointer = self._pointer()
        for attempt in range(READ_ATTEMPTS):
            if pointer is None:
                return None
            try:
                return self._read_checkpoint(*pointer)
            except CheckpointError:
                # Several ranks read one run: rank 0 may save the step it resumed (e.g. after a validation) while
                # another rank still reads it, and prune the folder being read (Linux deletes it under the reader;
                # Windows refuses and prunes later). Then latest.json names the new copy: read that one.
                newer = self._pointer()
                if newer == pointer or attempt == READ_ATTEMPTS - 1:
                    raise
                pointer = newer
        return None  # not reached: the last attempt returns or raises

    def _read_checkpoint(self, step: int, folder: pathlib.Path) -> Checkpoint:
        try:
            current = folder / "trainer.json"
            trainer = read_json(current, "trainer state", max_bytes=TRAINER_JSON_MAX_BYTES)
            _check_trainer_state(trainer, step)
            current = folder / "optimizer.pt"
            states = _load_torch(current, "optimizer state")
            if not isinstance(states, dict) or not {"optimizer", "scheduler", "scaler"} <= set(states):
                raise UntrustedFileError("it lacks the optimizer / scheduler / scaler entries")
            if not isinstance(states["optimizer"], dict) or not isinstance(states["scheduler"], dict) or \
                    not isinstance(states["scaler"], (dict, type(None))):
                raise UntrustedFileError("its optimizer / scheduler / scaler entries are not state dicts")
            current = folder / "rng.pt"
            rng = _load_torch(current, "random number generator state")
            _check_rng(rng)
            current = folder / "adapter.safetensors"
            with open_regular(current, "trained weights"):  # a regular file of the run, not a symlink
                pass
            adapter = load_file(str(current))
            ema = None
            current = folder / "ema.safetensors"
            if os.path.lexists(current):
                with open_regular(current, "EMA weights"):
                    pass
                ema = load_file(str(current))
        except UntrustedFileError as error:
            raise self._unusable(current, error) from None
        except Exception as error:  # safetensors / torch parse errors of damaged files come in many types
            raise self._unusable(current, f"{type(error).__name__}: {str(error)[:200]}") from None
        return Checkpoint(
            step=step, micro_step=int(trainer["micro_step"]), adapter=adapter,
            optimizer=states["optimizer"], scheduler=states["scheduler"], scaler=states["scaler"], rng=rng,
            loss_history=_float_history(trainer["loss_history"]),
            validation_history=_float_history(trainer["validation_history"]), ema=ema,
        )


def _checkpoint_folders(checkpoints: pathlib.Path) -> list[pathlib.Path]:
    """The step folders in a run's checkpoints folder (not symlinks: never followed, never removed through)."""
    return [path for path in checkpoints.iterdir() if _CHECKPOINT_FOLDER.fullmatch(path.name) and not path.is_symlink()]


def _folder_bytes(folder: pathlib.Path) -> int:
    """The bytes of a checkpoint folder's files (flat; symlinks and anything not a file count nothing)."""
    total = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def _remove_folder(folder: pathlib.Path) -> bool:
    """Renamed to a temp name first: a kill mid-delete leaves no half checkpoint named step_* (a folder in use that
    Windows will not rename stays, to go at a later save: False)."""
    trash = folder.parent / temp_name(folder.name)
    try:
        os.replace(folder, trash)
    except OSError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    return True


def checkpoints_on_disk(root: str | os.PathLike, name: str) -> int:
    """How many checkpoint folders run `name` under `root` has now (a resumed run's: the room they take is taken);
    names only, nothing in them is opened. A run or checkpoints folder leading outside `root` (a symlink) is not
    listed: none (opening the run refuses it, naming it)."""
    folder = pathlib.Path(root) / name / "checkpoints"
    if not is_within(folder, root):
        return 0
    try:
        entries = os.listdir(folder)
    except OSError:  # no run of that name yet, or nothing readable: none
        return 0
    return sum(1 for entry in entries if _CHECKPOINT_FOLDER.fullmatch(entry))


def next_checkpoint_room(checkpoint_bytes: int) -> int:
    """The free space a save asks for beside the latest checkpoint (RunDir._make_room): the checkpoint, and a margin
    for its histories' growth and the file system's blocks."""
    return int(checkpoint_bytes * 1.01) + (64 << 10)


def disk_room_needed(checkpoint_bytes: int, kept: int) -> int:
    """The free space a run needs to keep saving, beyond the `kept` checkpoint folders already there: the first
    checkpoint where there is none, then the next beside the latest (next_checkpoint_room), the older folders' room
    counted (where the disk holds no more, they go first: RunDir._make_room)."""
    if kept == 0:
        return checkpoint_bytes + next_checkpoint_room(checkpoint_bytes)
    return max(0, next_checkpoint_room(checkpoint_bytes) - (kept - 1) * checkpoint_bytes)


def _json_history(history: list) -> list:
    """[step, value] pairs as strict JSON: a NaN / infinite value (a diverged validation) is written as null."""
    return [[step, value if math.isfinite(value) else None] for step, value in history]


def _float_history(history: list) -> list:
    return [[step, float("nan") if value is None else value] for step, value in history]


def _load_torch(path: pathlib.Path, what: str):
    with open_regular(path, what) as handle:
        return torch.load(handle, weights_only=True, map_location="cpu")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_trainer_state(trainer, step: int) -> None:
    if not isinstance(trainer, dict):
        raise UntrustedFileError("it is not a JSON object")
    if trainer.get("step") != step:
        raise UntrustedFileError(f"its step {str(trainer.get('step'))[:40]!r} is not the pointer's step {step}")
    micro = trainer.get("micro_step")
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < step:
        raise UntrustedFileError(f"its micro_step {str(micro)[:40]!r} is not a count of at least {step}")
    for key in ("loss_history", "validation_history"):
        history = trainer.get(key)
        if not isinstance(history, list) or not all(
                isinstance(entry, list) and len(entry) == 2 and _is_number(entry[0])
                and (_is_number(entry[1]) or entry[1] is None) for entry in history):
            raise UntrustedFileError(f"its {key} is not a list of [step, value] pairs")


def _check_rng(rng) -> None:
    reference = torch.get_rng_state()
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor):
        raise UntrustedFileError("it holds no torch generator state")
    state = rng["torch"]
    if state.dtype != reference.dtype or state.shape != reference.shape:
        raise UntrustedFileError(f"its generator state is {state.dtype} {list(state.shape)}, not "
                                 f"{reference.dtype} {list(reference.shape)}")
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, (list, tuple)) and all(
            isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.ndim == 1 for s in cuda)):
        raise UntrustedFileError("its CUDA generator states are not byte tensors")


def _differences(stored: Any, new: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(stored, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(stored) | set(new)):
            out += _differences(stored.get(key), new.get(key), f"{path}.{key}" if path else key)
        return out
    return [] if stored == new else [(path, stored, new)]


def capture_rng() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
