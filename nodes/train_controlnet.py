"""ControlNet training nodes: init a run, train it with HeadroomTrainSteps, validate, save; and an all-in-one.

Modular graph:  OptimizerConfig + MODEL + caches (with control images) -> TrainControlNetInit -> TrainSteps(N)
                -> Validate / SaveControlNet
The run is the same TRAINING_RUN as a LoRA run (same engine, run directory, resume, cancel, events); what
is trained is a ControlNet of ComfyUI's own class (nodes/controlnet_build.py) next to a clone of the frozen
MODEL. Validation samples through ComfyUI's samplers with the control applied by the stock
ControlNetApplyAdvanced node to the same in-memory module: no second pipeline, no copy of the weights.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib

import torch

from comfy_api.latest import io, ui

from ..training.checks import check_finite
from ..training.files import prune_temp
from ..training.optimizers import OptimizerConfig
from ..training.run_dir import RunFolderError, check_name, check_subfolder
from ..training.trainer import TrainConfig, Trainer
from .comfy_bridge import TrainingSession, check_run_kind, config_json
from .comfy_model import ComfyDenoiser, check_caches, model_blocks
from .controlnet_build import (TrainableControlNet, apply_controlnet, build_controlnet, check_control_cache,
                               comfy_controlnet, controlled_prediction, controlnet_type_name, prepare_hint,
                               save_controlnet)
from .families import CONTROLNET_TYPES
from .train_lora import (CATEGORY, DEFAULT_CHECKPOINT_MINUTES, SAVED_KEY, TrainingRun, _checkpoint_inputs,
                         _added_train_inputs, _weights_input,
                         _schedule_inputs, _train_inputs, _validation_inputs, run_fingerprint,
                         listed_name, models_file, runs_root, saved_file, train_config,
                         train_validate_save)

CONTROL_HINT = "control_hint"  # the conditioning entry that carries an item's cached control through the trainer


# --- the engine piece: a denoiser that adds the ControlNet's residuals ----------------------------------------
class ControlNetDenoiser(ComfyDenoiser):
    """The base MODEL (frozen) with the ControlNet's residuals, as the samplers apply a ControlNet."""

    def __init__(self, patcher, controlnet: TrainableControlNet):
        super().__init__(patcher)
        self.controlnet = controlnet

    def predict(self, x_t: torch.Tensor, sigma: torch.Tensor, conds) -> torch.Tensor:
        controls = [cond[CONTROL_HINT] for cond in conds]
        text_conds = [{k: v for k, v in cond.items() if k != CONTROL_HINT} for cond in conds]
        hint = prepare_hint(self.controlnet, controls, x_t)
        return controlled_prediction(self.controlnet, self.model, x_t, sigma, self._model_conds(x_t, text_conds), hint)

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        """The base's blocks and the ControlNet's copied ones (checkpointed, and made safe for Flux's in-place
        input updates, by the trainer); its zero-initialised output projections are single layers."""
        own = [(f"controlnet.{name}", block) for name, block in model_blocks(self.controlnet.module)
               if not name.startswith(("zero_convs.", "controlnet_"))]
        return super().blocks() + own


# --- the TRAINING_RUN value -------------------------------------------------------------------------------
@dataclasses.dataclass
class ControlNetSessionConfig:
    controlnet_type: str  # the ControlNet type's stored name ("unet", "sd3", "flux"; nodes/families/)
    blocks: int  # 0: the type's default
    init_seed: int
    optimizer: OptimizerConfig
    train: TrainConfig
    holdout: int

    def to_json(self) -> dict:
        """As run folders store it: the type under its historical key "family" (stored runs resume)."""
        stored = config_json(self)
        return {"family": stored.pop("controlnet_type"), **stored}


class ControlNetSession(TrainingSession):
    """A ControlNet training run. Shares TrainingSession's train_to (progress, events, cancel -> checkpoint),
    validation_loss and release; what differs is what is trained and how it is attached."""

    trains = "controlnet"

    def __init__(self, model, latent_cache, text_cache, config: ControlNetSessionConfig, run_root: pathlib.Path,
                 run_name: str, policy=None, validation_control: torch.Tensor | None = None,
                 validation_strength: float = 1.0):
        stored = self._open_run(model, latent_cache, text_cache, config, run_root, run_name, policy, {"kind": "controlnet"})
        self.validation_strength = validation_strength
        self.validation_control = validation_control if validation_control is not None else \
            default_validation_control(latent_cache, self.validation_items)
        with torch.inference_mode(False):
            # A classic ModelPatcher even under dynamic VRAM: autograd keeps the weights a layer used until backward,
            # which aimdo-managed weights do not guarantee (docs/MEMORY.md). Elsewhere this is a plain clone.
            self.patcher = model.clone(disable_dynamic=True)
            self.controlnet = build_controlnet(model, blocks=config.blocks, seed=config.init_seed,
                                               device=self.patcher.load_device)  # copied from the full-precision base
            self._load_in_low_bit(self._low_bit_base(policy))
            self.denoiser = ControlNetDenoiser(self.patcher, self.controlnet)
            # Every item's conditioning also carries its cached control. Caption dropout swaps only the prompt
            # (the control stays): the ControlNet paper's prompt dropout.
            trainer = Trainer(self.denoiser, self.controlnet, latent_cache, text_cache, config.train, config.optimizer,
                              train_items=self.train_items, run_dir=self.run_dir, policy=policy,
                              item_extras=lambda item: {CONTROL_HINT: latent_cache.control(item)})
        self._finish_open(trainer, stored)

    def _device_extra_bytes(self) -> int:
        # The ControlNet's weights are loaded by its own ModelPatcher (counted by ComfyUI): gradients and the
        # optimizer's moments where they live on the device.
        trainable = sum(p.numel() * p.element_size() for p in self.trainer.params)
        return trainable * (1 if self.trainer.policy.optimizer_state == "cpu" else 3)

    @contextlib.contextmanager
    def attached(self):
        """The base clone and the ControlNet loaded through ComfyUI's model management."""
        self._load([self.patcher, self.controlnet.patcher])
        yield

    @contextlib.contextmanager
    def sampling_model(self, lora_application: str = "unmerged"):
        """The base clone with the ControlNet loaded; a LoRA's `lora_application` does not apply to a ControlNet."""
        with self.validating():
            yield self.patcher

    def comfy_controlnet(self):
        """A CONTROL_NET for stock nodes around the run's in-memory module (no copy)."""
        return comfy_controlnet(self.controlnet)

    def sampling_conditioning(self, positive, negative, vae=None):
        """Validation conditioning with the run's control image applied by the stock ControlNetApplyAdvanced."""
        if self.validation_control is None:
            raise ValueError("this ControlNet run has no validation control image: connect validation_control on "
                             "the init node (for latent-cached controls it cannot be taken from the cache)")
        if self.controlnet.hint == "latents" and vae is None:
            raise ValueError(f"a {self.controlnet.type_name} ControlNet VAE-encodes its control image: connect the vae")
        return apply_controlnet(positive, negative, self.comfy_controlnet(), self.validation_control,
                                self.validation_strength, 0.0, 1.0, vae=vae)

    def patched_model(self, model=None, strength: float = 1.0):
        check_run_kind(self, "lora", "HeadroomApplyTrainedLora", "apply")  # raises: a ControlNet run has no adapter

    def lora_metadata(self) -> dict[str, str]:
        check_run_kind(self, "lora", "HeadroomSaveLora", "save")  # raises: a ControlNet run has no adapter

    def controlnet_metadata(self) -> dict:
        return {"base_fingerprint": self.fingerprint, "steps": self.step, "run": self.run_dir.name,
                "session": self.config.to_json()}

    def __repr__(self) -> str:
        return f"TrainingRun({self.run_dir.name}, step {self.step}, {self.controlnet.type_name} ControlNet, {self.controlnet.blocks} blocks)"


def default_validation_control(latent_cache, items) -> torch.Tensor | None:
    """The first validation item's cached control image, when controls are cached as pixels."""
    if getattr(latent_cache, "control_kind", None) != "pixels":
        return None
    return latent_cache.control(items[0]).to(torch.float32).unsqueeze(0)


def start_controlnet_session(model, latent_cache, text_cache, optimizer_config, run_name, seed, batch_size,
                             grad_accumulation, precision, max_grad_norm, caption_dropout, timestep_sampling,
                             loss_weighting, min_snr_gamma, noise_offset, gradient_checkpointing, checkpoint_depth,
                             holdout, blocks=0, init_seed=0, validation_control=None, validation_strength=1.0,
                             policy=None, loss_type: str = "mse", huber_delta: float = 0.1, ema_decay: float = 0.0,
                             node: str = "HeadroomTrainControlNetInit") -> ControlNetSession:
    """Check every input (before any GPU work), then build or resume the run."""
    try:
        check_name(run_name, "run name")
        check_finite(node, max_grad_norm=max_grad_norm, caption_dropout=caption_dropout, min_snr_gamma=min_snr_gamma,
                     noise_offset=noise_offset, validation_strength=validation_strength, huber_delta=huber_delta,
                     ema_decay=ema_decay)
        if not isinstance(optimizer_config, OptimizerConfig):
            raise ValueError("optimizer_config must come from a HeadroomOptimizerConfig node")
        optimizer_config.validate()
        train, note = train_config(model, run_name, node, seed, batch_size, grad_accumulation, precision, max_grad_norm,
                                   caption_dropout, timestep_sampling, loss_weighting, min_snr_gamma, noise_offset,
                                   gradient_checkpointing, checkpoint_depth, loss_type, huber_delta, ema_decay)
        type_name = controlnet_type_name(model)
        check_caches(model.model, latent_cache, text_cache)
        check_control_cache(type_name, latent_cache, node)
        config = ControlNetSessionConfig(controlnet_type=type_name, blocks=blocks, init_seed=init_seed, optimizer=optimizer_config,
                                         train=train, holdout=holdout)
        session = ControlNetSession(model, latent_cache, text_cache, config, runs_root(), run_name, policy=policy,
                                    validation_control=validation_control, validation_strength=validation_strength)
        session.precision_note = note
        return session
    except (ValueError, RunFolderError) as error:  # ControlNetError is a ValueError
        message = str(error)
        raise ValueError(message if message.startswith("Headroom") else f"{node}: {message}") from error


def _controlnet_inputs() -> list:
    """HeadroomTrainLoraInit's inputs without lora_config, with ControlNet defaults and options."""
    inputs = []
    for item in _train_inputs():
        if item.id == "lora_config":
            continue
        if item.id == "run_name":
            item = io.String.Input("run_name", default="my_controlnet",
                                   tooltip="Folder under output/headroom_runs. An existing run with the same settings resumes.")
        if item.id == "caption_dropout":
            item = io.Float.Input("caption_dropout", default=0.5, min=0.0, max=1.0, step=0.01,
                                  tooltip="Conditioning dropout: this fraction of samples is trained with the empty "
                                  "prompt and the control image kept, so the ControlNet learns to follow the control "
                                  "alone (0.5 as in the ControlNet paper).")
        inputs.append(item)
    inputs[-1:-1] = [
        io.Int.Input("blocks", default=0, min=0, max=1000,
                     tooltip="Blocks copied from the base: SD3 joint blocks / Flux double blocks (0: a quarter of SD3's, "
                     "2 for Flux). UNet ControlNets always copy the whole encoder (leave 0)."),
        io.Int.Input("init_seed", default=0, min=0, max=0xFFFFFFFF, tooltip="Seed of the hint encoder's initial weights."),
        io.Image.Input("validation_control", optional=True,
                       tooltip="Control image for validation samples; default: the first validation item's cached "
                       "control image (pixel caches only)."),
        io.Float.Input("validation_strength", default=1.0, min=0.0, max=10.0, step=0.01,
                       tooltip="ControlNet strength of validation samples (as ControlNetApplyAdvanced's strength)."),
    ]
    return inputs


class HeadroomTrainControlNetInit(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomTrainControlNetInit",
            display_name="Train ControlNet: Init (Headroom)",
            category=CATEGORY,
            description="Set up (or resume) a ControlNet training run for this MODEL from cached latents, control "
            "images and text; train it with Train Steps. Families: " + "; ".join(
                t.description for t in CONTROLNET_TYPES.values()) + ".",
            inputs=[*_controlnet_inputs(), *_added_train_inputs()],
            outputs=[TrainingRun.Output("run", tooltip="The training run, for Train Steps, Validate and Save."),
                     io.Int.Output("step", tooltip="Step the run starts from (resumed)."),
                     io.ControlNet.Output("control_net", tooltip="The run's ControlNet (in memory) for stock nodes.")],
        )

    @classmethod
    def fingerprint_inputs(cls, run_name=None, **_) -> int:
        return run_fingerprint(run_name)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        session = start_controlnet_session(**inputs)
        return io.NodeOutput(session, session.step, session.comfy_controlnet(), ui=ui.PreviewText(session.precision_note))


# --- save -------------------------------------------------------------------------------------------------
def save_trained_controlnet(run: ControlNetSession, subfolder: str, filename: str, weights: str = "auto") -> str:
    """Write the ControlNet under models/controlnet/<subfolder>/ atomically; returns the name ControlNetLoader lists."""
    root, path = models_file("controlnet", subfolder, filename, run, "ControlNet")
    with run.phase("save"):
        prune_temp(path.parent)  # what a killed save left in that folder
        with run.weights(weights) as used:
            save_controlnet(run.controlnet, path, {**run.controlnet_metadata(), "headroom.weights": used})
    return listed_name("controlnet", root, path)


class HeadroomSaveControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomSaveControlNet",
            display_name="Save ControlNet (Headroom)",
            category=CATEGORY,
            description="Save the run's ControlNet as .safetensors under models/controlnet/<subfolder>/ in the layout "
            "the stock Load ControlNet Model node detects for its family (listed without a restart).",
            is_output_node=True,
            inputs=[
                TrainingRun.Input("run", tooltip="The ControlNet run to save (its current step)."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/controlnet/ (empty: models/controlnet/ itself)."),
                io.String.Input("filename", default="", tooltip="Empty: <run name>_step<N>."),
                _weights_input("Save"),
            ],
            outputs=[io.String.Output("control_net_name", tooltip="The name Load ControlNet Model lists.")],
        )

    @classmethod
    def execute(cls, run, subfolder: str, filename: str, weights: str = "auto") -> io.NodeOutput:
        check_run_kind(run, "controlnet", "HeadroomSaveControlNet", "save")
        try:
            name = save_trained_controlnet(run, subfolder, filename, weights)
        except ValueError as error:
            raise ValueError(f"HeadroomSaveControlNet: {error}") from error
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("ControlNet", "controlnet", name)]})


# --- all in one ------------------------------------------------------------------------------------------------
class HeadroomTrainControlNet(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomTrainControlNet",
            display_name="Train ControlNet (Headroom)",
            category=CATEGORY,
            description="Init + train to `steps` + validate every N steps + save every N steps, in one node. "
            "Queue it again with more steps to continue the same run.",
            is_output_node=True,
            inputs=[*_controlnet_inputs(), *_schedule_inputs("controlnet_subfolder"), *_validation_inputs(optional=True),
                    *_checkpoint_inputs(), *_added_train_inputs()],
            outputs=[io.ControlNet.Output("control_net", tooltip="The trained ControlNet (in memory) for stock nodes."),
                     TrainingRun.Output("run", tooltip="The training run, for Validate and Save nodes."),
                     io.String.Output("control_net_name",
                                      tooltip="The last saved ControlNet, as Load ControlNet Model lists it."),
                     io.Float.Output("validation_loss", tooltip="Validation loss at the end.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, steps, validate_every, save_every, controlnet_subfolder, checkpoint_every=0,
                checkpoint_minutes=DEFAULT_CHECKPOINT_MINUTES, **inputs) -> io.NodeOutput:
        check_subfolder(controlnet_subfolder, "HeadroomTrainControlNet: controlnet_subfolder")
        run, name, loss, outputs = train_validate_save(
            cls, lambda **init: start_controlnet_session(**init, node="HeadroomTrainControlNet"),
            lambda run: save_trained_controlnet(run, controlnet_subfolder, f"{run.run_dir.name}_step{run.step:06d}"),
            steps, validate_every, save_every, inputs, saved_as=("ControlNet", "controlnet"),
            checkpoint_every=checkpoint_every, checkpoint_minutes=checkpoint_minutes)
        return io.NodeOutput(run.comfy_controlnet(), run, name, loss, ui=outputs)


NODES = [HeadroomTrainControlNetInit, HeadroomSaveControlNet, HeadroomTrainControlNet]
