"""A named run directory: everything needed to resume a run exactly, written atomically.

Layout of `<root>/<run name>/`:
  config.json                      the run's configuration (what must match to resume)
  latest.json                      {"step": N, "checkpoint": "checkpoints/step_00000N"}; replaced atomically
  checkpoints/step_00000N/
      adapter.safetensors          trainable weights (fp32, peft names)
      optimizer.pt                 optimizer, LR scheduler and grad-scaler state (torch.save; loaded weights_only)
      rng.pt                       torch CPU (and CUDA) RNG states
      trainer.json                 step, micro-step, loss history, validation-loss history
  validation/                      sample grids per step

A checkpoint directory is written under a temporary name and renamed into place, then latest.json is
replaced: a crash at any point leaves the previous checkpoint readable. Nothing is ever unpickled.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
KEEP_CHECKPOINTS = 2


def check_name(name: str, what: str = "run name") -> str:
    """A single safe path segment: letters, digits, `_ . -`; no `..`, no separators, not absolute."""
    if not isinstance(name, str) or not _NAME.match(name) or ".." in name:
        raise ValueError(
            f"{what} {name!r} is not allowed: use 1-100 letters, digits, '_', '-' or '.', starting with a letter or "
            "digit, without '..' or path separators"
        )
    return name


def check_subfolder(subfolder: str, what: str = "subfolder") -> str:
    """A relative folder path of safe segments ('' allowed), joined with '/'."""
    if subfolder in ("", None):
        return ""
    if subfolder.startswith(("/", "\\")) or "\\" in subfolder or ":" in subfolder:
        raise ValueError(f"{what} {subfolder!r} must be a relative path of plain names separated by '/'")
    for part in subfolder.split("/"):
        check_name(part, what=f"{what} part")
    return subfolder


def atomic_write_bytes(path: pathlib.Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: pathlib.Path, value: Any) -> None:
    atomic_write_bytes(path, json.dumps(value, indent=2, sort_keys=True).encode())


def atomic_save_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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


class RunDir:
    def __init__(self, root: str | os.PathLike, name: str):
        self.name = check_name(name)
        self.root = pathlib.Path(root)
        self.path = self.root / self.name

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

    def exists(self) -> bool:
        return self.config_path.is_file()

    def read_config(self) -> dict | None:
        return json.loads(self.config_path.read_text()) if self.exists() else None

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.config_path, config)

    def check_compatible(self, config: dict) -> None:
        """Raise if this run directory holds a run whose configuration differs from `config`."""
        stored = self.read_config()
        if stored is None:
            return
        stored_json, new_json = json.loads(json.dumps(stored)), json.loads(json.dumps(config))
        differences = _differences(stored_json, new_json)
        if differences:
            listed = "; ".join(f"{k}: stored {a!r}, now {b!r}" for k, a, b in differences[:6])
            raise ValueError(
                f"run '{self.name}' already exists at {self.path} with a different configuration ({listed}). "
                "Use a new run name, or set the inputs back to the stored values to resume it."
            )

    # --- checkpoints -------------------------------------------------------------------------------
    def latest_step(self) -> int | None:
        pointer = self.path / "latest.json"
        if not pointer.is_file():
            return None
        return int(json.loads(pointer.read_text())["step"])

    def save_checkpoint(self, checkpoint: Checkpoint) -> pathlib.Path:
        checkpoints = self.path / "checkpoints"
        checkpoints.mkdir(parents=True, exist_ok=True)
        final = checkpoints / f"step_{checkpoint.step:08d}"
        tmp = pathlib.Path(tempfile.mkdtemp(dir=checkpoints, prefix=f".{final.name}."))
        try:
            save_file({k: v.contiguous().cpu() for k, v in checkpoint.adapter.items()}, str(tmp / "adapter.safetensors"))
            torch.save({"optimizer": checkpoint.optimizer, "scheduler": checkpoint.scheduler, "scaler": checkpoint.scaler},
                       tmp / "optimizer.pt")
            torch.save(checkpoint.rng, tmp / "rng.pt")
            (tmp / "trainer.json").write_text(json.dumps({
                "step": checkpoint.step, "micro_step": checkpoint.micro_step,
                "loss_history": checkpoint.loss_history, "validation_history": checkpoint.validation_history,
            }))
            if final.exists():  # re-saving the same step: move the old copy aside first (rename needs an empty target)
                stale = checkpoints / f".stale-{final.name}-{os.getpid()}"
                os.replace(final, stale)
                shutil.rmtree(stale)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_json(self.path / "latest.json", {"step": checkpoint.step, "checkpoint": f"checkpoints/{final.name}"})
        self._prune(keep=final)
        return final

    def _prune(self, keep: pathlib.Path) -> None:
        older = sorted(p for p in (self.path / "checkpoints").glob("step_*") if p != keep)
        for stale in older[: max(0, len(older) - (KEEP_CHECKPOINTS - 1))]:
            shutil.rmtree(stale, ignore_errors=True)

    def load_checkpoint(self) -> Checkpoint | None:
        pointer = self.path / "latest.json"
        if not pointer.is_file():
            return None
        folder = self.path / json.loads(pointer.read_text())["checkpoint"]
        trainer = json.loads((folder / "trainer.json").read_text())
        states = torch.load(folder / "optimizer.pt", weights_only=True)
        return Checkpoint(
            step=int(trainer["step"]), micro_step=int(trainer["micro_step"]),
            adapter=load_file(str(folder / "adapter.safetensors")),
            optimizer=states["optimizer"], scheduler=states["scheduler"], scaler=states["scaler"],
            rng=torch.load(folder / "rng.pt", weights_only=True),
            loss_history=trainer["loss_history"], validation_history=trainer["validation_history"],
        )


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
