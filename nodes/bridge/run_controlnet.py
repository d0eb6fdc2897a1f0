"""What a ControlNet run trains: a ControlNet of ComfyUI's own class (nodes/bridge/controlnet_build.py) next to the frozen
training clone (`ControlNetTraining`, the strategy of a `TrainingRun` in nodes/bridge/comfy_bridge.py), and how it is
saved, applied, sampled and described. Validation samples through ComfyUI's samplers with the control applied by
the stock ControlNetApplyAdvanced code to the same in-memory module: no second pipeline, no copy of the weights.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ...training.core.adapters import FULL_PRECISIONS
from ...training.core.optimizers import OptimizerConfig
from ...training.core.trainer import TrainConfig
from .comfy_bridge import TrainingRun, config_json
from .controlnet_build import (CONTROL_HINT, ControlNetDenoiser, TrainableControlNet, apply_controlnet,
                               build_controlnet, comfy_controlnet, controlnet_dtype, save_controlnet)

# --- the ControlNet run ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class ControlNetRunConfig:
    """A ControlNet run's configuration, as its run folder stores it (config.json "session")."""
    controlnet_type: str  # the ControlNet type's stored name ("unet", "sd3", "flux"; nodes/bridge/families/)
    blocks: int  # 0: the type's default
    init_seed: int
    optimizer: OptimizerConfig
    train: TrainConfig
    holdout: int
    # The ControlNet's trained weights: fp32, or bf16 rounded stochastically in each step (fused backward steps them).
    controlnet_precision: str = "fp32"

    def __post_init__(self):
        if self.controlnet_precision not in FULL_PRECISIONS:
            raise ValueError(f"controlnet_precision={self.controlnet_precision!r}: choose one of "
                             f"{', '.join(FULL_PRECISIONS)}")

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the ControlNet's weights train in."""
        return controlnet_dtype(self.controlnet_precision)

    def to_json(self) -> dict:
        """As run folders store it: the type under its historical key "family" (stored runs resume)."""
        stored = config_json(self)
        return {"family": stored.pop("controlnet_type"), **stored}


def default_validation_control(latent_cache, items) -> torch.Tensor | None:
    """The first validation item's cached control image, when controls are cached as pixels."""
    if getattr(latent_cache, "control_kind", None) != "pixels":
        return None
    return latent_cache.control(items[0]).to(torch.float32).unsqueeze(0)


class ControlNetTraining:
    """A TrainingRun's strategy for ControlNet runs: the ControlNet (`controlnet`) built from the full-precision
    base, and the control image and strength validation samples with (default: the first validation item's cached
    control)."""

    trains = "controlnet"

    def __init__(self, validation_control: torch.Tensor | None = None, validation_strength: float = 1.0,
                 initial_weights: dict | None = None):
        self.validation_control, self.validation_strength = validation_control, validation_strength
        self.initial_weights = initial_weights  # a worker rank: rank 0's ControlNet weights (for_other_ranks)
        self.controlnet: TrainableControlNet | None = None  # built by `build`

    def caches(self) -> tuple:
        """No cache beside the run's own."""
        return ()

    def identity(self, run) -> dict:
        return {"kind": "controlnet"}

    def build(self, run) -> tuple:
        """(denoiser, trainable, Trainer options): the ControlNet next to the run's training clone."""
        if self.validation_control is None:
            self.validation_control = default_validation_control(run.latent_cache, run.validation_items)
        placement, config = run.placement, run.config
        self.controlnet = build_controlnet(run.source_model, blocks=config.blocks, seed=config.init_seed,
                                           dtype=config.dtype, device=placement.patcher.load_device)
        # (copied from the full-precision base)
        if self.initial_weights is not None:  # a worker rank starts from rank 0's weights, whatever built them
            self.controlnet.load_state_dict(self.initial_weights)
            self.initial_weights = None
        with placement.low_bit_storage():
            pass  # nothing is built on the low-bit layers: the ControlNet copied the full-precision ones
        latent_cache = run.latent_cache
        # Every item's conditioning also carries its cached control. Caption dropout swaps only the prompt (the
        # control stays): the ControlNet paper's prompt dropout.
        return (ControlNetDenoiser(placement.patcher, self.controlnet), self.controlnet,
                {"item_extras": lambda item: {CONTROL_HINT: latent_cache.control(item)}})

    def for_other_ranks(self) -> dict:
        """What the worker ranks of a multi-device run open it with beyond rank 0's inputs: rank 0's ControlNet
        weights (copied; the ranks then train identical copies)."""
        return {"initial_weights": self.controlnet.state_dict()}

    # --- on the device --------------------------------------------------------------------------------------
    def patchers(self, run) -> list:
        """The base clone and the ControlNet's own ModelPatcher."""
        return [run.placement.patcher, self.controlnet.patcher]

    def device_extra_bytes(self, trainer) -> int:
        # The ControlNet's weights are loaded by its own ModelPatcher (counted by ComfyUI): gradients and the
        # optimizer's moments where they live on the device.
        trainable = sum(p.numel() * p.element_size() for p in trainer.params)
        return trainable * (1 if trainer.policy.optimizer_state in ("cpu", "streamed") else 3)

    def unread_base_layers(self) -> list:
        """The base runs whole beside the ControlNet: every weight of it is read."""
        return []

    @contextlib.contextmanager
    def attach(self, run):
        yield  # loading both patchers is all: the ControlNet runs beside the base, never inside it

    def check_detached(self, run) -> None:
        pass  # the base module never carries the ControlNet

    # --- sampling -------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sampling_model(self, run, lora_application: str = "unmerged", saved_dtype: str = "fp32"):
        """The base clone with the ControlNet loaded; a LoRA's `lora_application` and `saved_dtype` do not apply to
        a ControlNet."""
        with run.validating():
            yield run.placement.patcher

    def sampling_conditioning(self, run, positive, negative, vae=None):
        """Validation conditioning with the run's control image applied by the stock ControlNetApplyAdvanced."""
        if self.validation_control is None:
            raise ValueError("this ControlNet run has no validation control image: connect validation_control on "
                             "the init node (for latent-cached controls it cannot be taken from the cache)")
        if self.controlnet.hint == "latents" and vae is None:
            raise ValueError(f"a {self.controlnet.type_name} ControlNet VAE-encodes its control image: connect the vae")
        return apply_controlnet(positive, negative, self.comfy_controlnet(), self.validation_control,
                                self.validation_strength, 0.0, 1.0, vae=vae)

    # --- apply, save, describe ------------------------------------------------------------------------------
    def comfy_controlnet(self):
        """A CONTROL_NET for stock nodes around the run's in-memory module (no copy)."""
        return comfy_controlnet(self.controlnet)

    def metadata(self, run) -> dict:
        return {"base_fingerprint": run.fingerprint, "steps": run.step, "run": run.run_dir.name,
                "session": run.config.to_json()}

    def save(self, run, path, weights: str = "auto") -> None:
        """Write the ControlNet to `path` (atomically) in the layout the stock loader detects, of the trained
        weights or their EMA (`weights`)."""
        with run.weights(weights) as used:
            save_controlnet(self.controlnet, path, {**self.metadata(run), "headroom.weights": used})

    def save_bytes(self, run, dtype: str = "fp32") -> int:
        """About what `save` writes: the ControlNet's tensors as it holds them (model_files.saves_room_note; `dtype`, a
        LoRA save's, does not apply)."""
        return sum(t.numel() * t.element_size() for t in self.controlnet.state_dict(copy=False).values())

    def describe(self, run) -> str:
        return f"{self.controlnet.type_name} ControlNet, {self.controlnet.blocks} blocks"


def open_controlnet_run(model, latent_cache, text_cache, config: ControlNetRunConfig, run_root, run_name: str,
                        policy=None, validation_control: torch.Tensor | None = None,
                        validation_strength: float = 1.0, initial_weights: dict | None = None) -> TrainingRun:
    """Build (or resume from its run folder) a ControlNet run on `model`; `initial_weights`: the ControlNet's
    weights before training (a worker rank: rank 0's), instead of those built from the base and init_seed."""
    return TrainingRun(model, latent_cache, text_cache, config,
                       ControlNetTraining(validation_control, validation_strength, initial_weights), run_root, run_name,
                       policy=policy)
