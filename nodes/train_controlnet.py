"""ControlNet training nodes: init a run, train it with HeadroomTrainSteps, validate, save; and an all-in-one.

Modular graph:  OptimizerConfig + MODEL + caches (with control images) -> TrainControlNetInit -> TrainSteps(N)
                -> Validate / SaveControlNet
The run is the same TRAINING_RUN as a LoRA run (same engine, run directory, resume, cancel, events); what
is trained is a ControlNet of ComfyUI's own class (nodes/bridge/controlnet_build.py) next to a clone of the frozen
MODEL (nodes/bridge/run_controlnet.py).
"""
from __future__ import annotations

import dataclasses

from comfy_api.latest import io, ui

from ..training.checks import check_finite, named
from ..training.core.adapters import FULL_PRECISIONS
from ..training.core.optimizers import OptimizerConfig
from ..training.core.run_dir import RunFolderError, check_name, check_subfolder
from ..training.memory import trained_weights_on_host
from ..training.memory.fused_backward import FusedBackward
from ..training.memory.policy import OffloadPolicy
from .bridge.comfy_bridge import (TrainingRun, check_run_kind, node_id, node_name, release_cache_files,
                                  said_by, send_node_text)
from .bridge.comfy_model import check_caches
from .bridge.controlnet_build import check_control_cache, controlnet_trainable, controlnet_type_name
from .bridge.families import CONTROLNET_TYPES
from .inputs import (DEFAULT_CHECKPOINT_MINUTES, added_train_inputs, checkpoint_inputs, devices_input,
                     extra_noise_inputs, keep_saves_input, masked_out_weight_input, model_and_caches,
                     optimizer_config_input, policy_input, run_name_input, schedule_inputs, training_settings,
                     validation_inputs, weights_input)
from .io_types import TrainingRunType
from .bridge.run_controlnet import ControlNetRunConfig, open_controlnet_run
from .bridge.model_files import check_disk_room, runs_root, save_trained_controlnet, step_save_name
from .bridge.planning import NewControlNet, check_host_ram, plan_for_card
from .bridge.rank_workers import open_on_devices
from .bridge.run_settings import effective_batch, resolve_policy, run_fingerprint, train_config
from .train_lora import CATEGORY, SAVED_KEY, opened_text, saved_file, saved_text, train_validate_save


def start_controlnet_run(model, latent_cache, text_cache, optimizer_config, run_name, seed, batch_size,
                         grad_accumulation, precision, max_grad_norm, caption_dropout, timestep_sampling,
                         loss_weighting, min_snr_gamma, noise_offset, gradient_checkpointing, checkpoint_depth,
                         holdout, blocks=0, init_seed=0, validation_control=None, validation_strength=1.0,
                         policy=None, loss_type: str = "mse", huber_delta: float = 0.1, ema_decay: float = 0.0,
                         devices: str = "1", masked_out_weight: float = 0.0, ip_noise_gamma: float = 0.0,
                         multires_noise_iterations: int = 0, multires_noise_discount: float = 0.3,
                         noise_offset_random_strength: bool = False, ip_noise_gamma_random_strength: bool = False,
                         controlnet_precision: str = "fp32", node: str = "Train ControlNet: Init (Headroom)",
                         shown_on: str | None = None) -> TrainingRun:
    """Check every input (before any GPU work), then build or resume the run; `node`: the display name of the node
    opening it, for messages."""
    try:
        check_name(run_name, "run name")
        check_finite(node, max_grad_norm=max_grad_norm, caption_dropout=caption_dropout, min_snr_gamma=min_snr_gamma,
                     noise_offset=noise_offset, validation_strength=validation_strength, huber_delta=huber_delta,
                     ema_decay=ema_decay, masked_out_weight=masked_out_weight, ip_noise_gamma=ip_noise_gamma,
                     multires_noise_discount=multires_noise_discount)
        if not isinstance(optimizer_config, OptimizerConfig):
            raise ValueError("optimizer_config must come from an Optimizer Config (Headroom) node")
        optimizer_config.validate()
        train, note = train_config(model, run_name, node, seed, batch_size, grad_accumulation, precision, max_grad_norm,
                                   caption_dropout, timestep_sampling, loss_weighting, min_snr_gamma, noise_offset,
                                   loss_type, huber_delta, ema_decay, masked_out_weight=masked_out_weight,
                                   extra_noise=dict(ip_noise_gamma=ip_noise_gamma,
                                                    multires_noise_iterations=multires_noise_iterations,
                                                    multires_noise_discount=multires_noise_discount,
                                                    noise_offset_random_strength=noise_offset_random_strength,
                                                    ip_noise_gamma_random_strength=ip_noise_gamma_random_strength))
        type_name = controlnet_type_name(model)
        check_caches(model.model, latent_cache, text_cache)
        train, batch_note = effective_batch(train, latent_cache, holdout, run_name, node)
        check_control_cache(type_name, latent_cache, node)
        config = ControlNetRunConfig(controlnet_type=type_name, blocks=blocks, init_seed=init_seed,
                                     optimizer=optimizer_config, train=train, holdout=holdout,
                                     controlnet_precision=controlnet_precision)
        if policy is None or isinstance(policy, OffloadPolicy):  # before the plan (other inputs: resolve_policy says)
            check_controlnet_precision(controlnet_precision, policy or OffloadPolicy(), train.precision)
        trainable = dataclasses.replace(controlnet_trainable(model, blocks, optimizer_config.name, config.dtype),
                                        ema=train.ema_decay > 0, bf16_weights_input="controlnet_precision")
        planned = []  # the card's plan and its measured model, when one is made: the run keeps them

        def plan_card(card):
            planned.append(plan_for_card(model, latent_cache, text_cache, card, trainable, train.batch_size,
                                         train.precision, node, controlnet=NewControlNet(blocks, config.dtype)))
            return planned[-1][0]

        policy, plan_note = resolve_policy(policy, gradient_checkpointing, checkpoint_depth, node=node,
                                           plan_card=plan_card)
        check_host_ram(policy, trainable, node)
        disk_note = check_disk_room(run_name, trainable, node)
        trained_weights_on_host.check_kind(policy, None)  # a full fine-tune's option: refused before the run opens
        # on the node before the run opens, and so before its first step
        send_node_text("\n".join(n for n in (plan_note, disk_note) if n), shown_on)
        run = open_on_devices(devices, model, open_controlnet_run,
                              (latent_cache, text_cache, config, runs_root(), run_name), {"policy": policy},
                              rank0_kwargs={"validation_control": validation_control,
                                            "validation_strength": validation_strength})
        run.precision_note = note
        run.batch_note, run.plan_note, run.disk_note = batch_note, plan_note, disk_note
        if planned:  # its predicted s/step goes to the memory record; its measurement to the run's own plans
            run.predicted_s_per_step, run.measured = planned[-1][0].predicted_s_per_step, planned[-1][1]
        return run
    except (ValueError, RunFolderError) as error:  # ControlNetError is a ValueError
        raise ValueError(named(node, str(error))) from error
    finally:  # the checks and the plan read the caches: no shard left mapped (also on an error)
        release_cache_files(latent_cache, text_cache)


def check_controlnet_precision(controlnet_precision: str, policy, precision: str) -> None:
    """bf16 ControlNet weights: fused backward and bf16 compute (FusedBackward.check_bf16_weights)."""
    if controlnet_precision == "bf16_stochastic":
        FusedBackward.check_bf16_weights("controlnet_precision", policy.fused_backward, precision)


def controlnet_inputs() -> list:
    """What only a ControlNet run has: the blocks it copies, its initial weights, its validation control."""
    return [
        io.Int.Input("blocks", advanced=True, default=0, min=0, max=1000,
                     tooltip="Blocks copied from the base: SD3 joint blocks / Flux double blocks / Qwen-Image transformer "
                     "blocks (0: a quarter of SD3's, 2 for Flux, 5 for Qwen-Image). UNet ControlNets always copy the "
                     "whole encoder (leave 0)."),
        io.Int.Input("init_seed", advanced=True, default=0, min=0, max=0xFFFFFFFF, tooltip="Seed of the hint encoder's initial weights."),
        io.Image.Input("validation_control", advanced=True, optional=True,
                       tooltip="Control image for validation samples; default: the first validation item's cached "
                       "control image (pixel caches only)."),
        io.Float.Input("validation_strength", default=1.0, min=0.0, max=10.0, step=0.01,
                       tooltip="ControlNet strength of validation samples (as ControlNetApplyAdvanced's strength)."),
    ]


def controlnet_precision_input():
    """Added after the others (last: saved workflows keep their widget values in order)."""
    return io.Combo.Input("controlnet_precision", options=list(FULL_PRECISIONS), default="fp32", advanced=True,
                          optional=True,
                          tooltip="The ControlNet's trained weights in fp32 (exact), or bf16_stochastic: bf16 weights, "
                          "each update rounded stochastically (half their memory and their gradients', no fp32 copy; "
                          "saved in bf16); needs the Offload Policy's fused_backward on and precision bf16.")


def controlnet_run_inputs() -> list:
    """The inputs that open a ControlNet run (Init and the all-in-one node): the shared groups (nodes/inputs.py)
    with the ControlNet's own caption dropout and inputs; no lora_config."""
    caption_dropout = io.Float.Input(
        "caption_dropout", advanced=True, default=0.5, min=0.0, max=1.0, step=0.01,
        tooltip="Conditioning dropout: this fraction of samples is trained with the empty prompt and the control "
        "image kept, so the ControlNet learns to follow the control alone (0.5 as in the ControlNet paper).")
    return [*model_and_caches(), optimizer_config_input(), run_name_input("my_controlnet"),
            *training_settings(caption_dropout=caption_dropout), *controlnet_inputs(), policy_input()]


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
            inputs=[*controlnet_run_inputs(), *added_train_inputs(), devices_input(), masked_out_weight_input(),
                    *extra_noise_inputs(), controlnet_precision_input()],
            outputs=[TrainingRunType.Output("run", tooltip="The training run, for Train Steps, Validate and Save."),
                     io.Int.Output("step", tooltip="Step the run starts from (resumed)."),
                     io.ControlNet.Output("control_net", tooltip="The run's ControlNet (in memory) for stock nodes.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def fingerprint_inputs(cls, run_name=None, **_) -> int:
        return run_fingerprint(run_name)

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        run = start_controlnet_run(**inputs, node=node_name(cls), shown_on=node_id(cls))
        return io.NodeOutput(run, run.step, run.trained.comfy_controlnet(),
                             ui=ui.PreviewText(opened_text(run)))


# --- save -------------------------------------------------------------------------------------------------


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
                TrainingRunType.Input("run", tooltip="The ControlNet run to save (its current step)."),
                io.String.Input("subfolder", default="headroom",
                                tooltip="Folder under models/controlnet/ (empty: models/controlnet/ itself)."),
                io.String.Input("filename", default="", tooltip="Empty: <run name>_step<N>."),
                weights_input("Save"),
            ],
            outputs=[io.String.Output("control_net_name", tooltip="The name Load ControlNet Model lists.")],
        )

    @classmethod
    def execute(cls, run, subfolder: str, filename: str, weights: str = "auto") -> io.NodeOutput:
        check_run_kind(run, "controlnet", node_name(cls), "save")
        with said_by(node_name(cls)):
            name = save_trained_controlnet(run, subfolder, filename, weights)
        return io.NodeOutput(name, ui={SAVED_KEY: [saved_file("ControlNet", "controlnet", name)],
                                       "text": [saved_text(run, "ControlNet", "controlnet", name)]})


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
            inputs=[*controlnet_run_inputs(), *schedule_inputs("controlnet_subfolder"),
                    *validation_inputs(optional=True), *checkpoint_inputs(), *added_train_inputs(), devices_input(),
                    masked_out_weight_input(), keep_saves_input(), *extra_noise_inputs(), controlnet_precision_input()],
            outputs=[io.ControlNet.Output("control_net", tooltip="The trained ControlNet (in memory) for stock nodes."),
                     TrainingRunType.Output("run", tooltip="The training run, for Validate and Save nodes."),
                     io.String.Output("control_net_name",
                                      tooltip="The last saved ControlNet, as Load ControlNet Model lists it."),
                     io.Float.Output("validation_loss", tooltip="Validation loss at the end.")],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, steps, validate_every, save_every, controlnet_subfolder, checkpoint_every=0,
                checkpoint_minutes=DEFAULT_CHECKPOINT_MINUTES, keep_saves=0, **inputs) -> io.NodeOutput:
        check_subfolder(controlnet_subfolder, f"{node_name(cls)}: controlnet_subfolder")
        run, name, loss, outputs = train_validate_save(
            cls, lambda **init: start_controlnet_run(**init, node=node_name(cls), shown_on=node_id(cls)),
            lambda run: save_trained_controlnet(run, controlnet_subfolder, step_save_name(run)),
            steps, validate_every, save_every, inputs, saved_as=("ControlNet", "controlnet"),
            checkpoint_every=checkpoint_every, checkpoint_minutes=checkpoint_minutes, subfolder=controlnet_subfolder,
            keep_saves=keep_saves)
        return io.NodeOutput(run.trained.comfy_controlnet(), run, name, loss, ui=outputs)


NODES = [HeadroomTrainControlNetInit, HeadroomSaveControlNet, HeadroomTrainControlNet]
