"""Offload policy and memory plan nodes (the ComfyUI side of describing a MODEL for the planner: nodes/bridge/planning.py).

- HeadroomOffloadPolicy -> OFFLOAD_POLICY (training/memory/policy.py), consumed by the caching, training and
  validation nodes. Its inputs are the OffloadPolicy fields, each described by the NodeInput in its field's
  metadata (one source: a new field is a new input). A budget of 0 means "auto": what ComfyUI can make free on
  its device (free memory plus what its loaded models occupy, since loading a model unloads others) minus the
  reserve, resolved when the policy is used.
- HeadroomMemoryPlan: MODEL (+ optional CLIP / VAE) + what is trained + batch + bucket + policy -> the
  planner's per-phase estimate (text, JSON) and the policy to use ("estimate": the given one; "auto": the
  fastest that fits). The model is described from its own modules and code: blocks and their weight
  bytes from `diffusion_model` (the same blocks the trainer checkpoints and streams), activations measured
  by running it at small calibration sizes (training/memory/planner.py), ComfyUI's own `memory_required` for the
  sampling working set and the VAE's `memory_used_encode/decode` for caching and decoding.
"""
from __future__ import annotations

from comfy_api.latest import io, ui

from ..training.core.adapters import FULL_PRECISIONS, TARGET_MODES
from ..training.checks import MissingPackageError, check_finite
from ..training.core.optimizers import OPTIMIZERS
from ..training.memory import lowbit
from ..training.memory.host_ram import HOST_RESERVE_BYTES, host_room
from ..training.memory.policy import GIB, NodeInput, OffloadPolicy, PolicyError
from ..training.core.trainer import PRECISIONS
from .inputs import layer_names_input
from .io_types import OffloadPolicyType
from .bridge.comfy_bridge import node_name
from .bridge.planning import PLAN_KINDS, available_device_bytes, plan_run

CATEGORY = "Headroom/memory"
MODES = ("estimate", "auto")


_IO_KINDS = {"float": io.Float, "int": io.Int, "bool": io.Boolean, "combo": io.Combo, "string": io.String}


def _policy_input(name: str, spec: NodeInput, default) -> io.Input:
    """One OffloadPolicy field as the policy node's input (its NodeInput, training/memory/policy.py)."""
    options = {key: getattr(spec, key) for key in ("min", "max", "step") if getattr(spec, key) is not None}
    if spec.kind == "combo":
        options["options"] = list(spec.options)
    if spec.advanced:
        options["advanced"] = True
    return _IO_KINDS[spec.kind].Input(name, default=default, tooltip=spec.tooltip, optional=spec.optional, **options)


# --- nodes ---------------------------------------------------------------------------------------------------
class HeadroomOffloadPolicy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomOffloadPolicy",
            display_name="Offload Policy (Headroom)",
            category=CATEGORY,
            description="How a run uses device memory: budget, where the frozen base lives and in which precision, "
            "what is recomputed, where optimizer state sits. One policy for caching, training and validation.",
            inputs=[_policy_input(name, spec, default) for name, spec, default in OffloadPolicy.node_inputs()],
            outputs=[OffloadPolicyType.Output("policy", tooltip="For the policy input of the Cache, Train and Memory "
                                              "Plan nodes (Headroom).")],
        )

    @classmethod
    def execute(cls, **inputs) -> io.NodeOutput:
        floats = {name: inputs[name] for name, spec, _ in OffloadPolicy.node_inputs()
                  if spec.kind == "float" and name in inputs}
        name = node_name(cls)
        check_finite(name, **floats)
        try:
            policy = OffloadPolicy.from_node_inputs(inputs)
        except PolicyError as error:
            raise ValueError(f"{name}: {error}") from None
        try:  # int8 / nf4 need the optional bitsandbytes: say so now, not when a run opens
            lowbit.check_available(policy.base_storage)
        except MissingPackageError as error:
            raise MissingPackageError(f"{name}: {error}") from None
        text = policy.describe_before_fit() if policy.fits_card else policy.describe()
        if policy.budget_is_auto:
            available = available_device_bytes()
            text += (f"\nauto budget now: {available / GIB:.2f} GiB available - {policy.reserve_gb:g} GiB reserve = "
                     f"{max(0, available - policy.reserve_gb * GIB) / GIB:.2f} GiB")
        room = host_room(policy.host_ram_budget_gb)
        if room is not None:
            text += (f"\nhost RAM: {room.in_use_bytes / GIB:.2f} GiB in use now, the run may grow it to "
                     f"{room.limit_bytes / GIB:.2f} GiB" + (f" (what the OS reports available, less {HOST_RESERVE_BYTES / GIB:g} GiB)" if room.auto else ""))
        if policy.fits_card:
            text += (f"\ncard {policy.card}: when a training run opens, the planner picks the fastest placement, storage, "
                     "checkpointing and optimizer state that fit it, and the training node shows them")
        return io.NodeOutput(policy, ui=ui.PreviewText(text))


class HeadroomMemoryPlan(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="HeadroomMemoryPlan",
            display_name="Memory Plan (Headroom)",
            category=CATEGORY,
            description="Estimated peak device memory per phase (caching, training step, validation, save), itemised, "
            "for training a LoRA, a full fine-tune or a ControlNet on this MODEL; 'auto' picks the fastest policy that "
            "fits the budget and says why. "
            "Activations are measured by running the model at small sizes (a few seconds).",
            inputs=[
                io.Model.Input("model", tooltip="The MODEL to plan for (e.g. from Load Checkpoint); it is loaded and "
                               "run at small sizes to measure it."),
                OffloadPolicyType.Input("policy", optional=True, tooltip="Default: a resident policy, auto budget."),
                io.Combo.Input("mode", options=list(MODES), default="estimate",
                               tooltip="estimate: plan the given policy; auto: choose the fastest policy that fits."),
                io.Int.Input("batch_size", default=1, min=1, max=256, tooltip="Batch size of the planned run."),
                io.Int.Input("width", default=1024, min=64, max=8192, step=8,
                             tooltip="Width in pixels of the largest training bucket."),
                io.Int.Input("height", default=1024, min=64, max=8192, step=8,
                             tooltip="Height in pixels of the largest training bucket."),
                io.Int.Input("rank", default=16, min=1, max=1024, tooltip="LoRA rank of the planned run."),
                io.Combo.Input("targets", options=list(TARGET_MODES), default="preset",
                               tooltip="Which layers the planned LoRA trains, as LoRA Config's targets."),
                io.Combo.Input("optimizer", options=list(OPTIMIZERS), default="AdamW",
                               tooltip="The planned optimizer (its state size), as Optimizer Config's optimizer."),
                io.Combo.Input("precision", options=["auto", *PRECISIONS], default="auto",
                               tooltip="Compute precision of the planned run, as the training nodes' input: auto is "
                               "bf16 on a CUDA GPU that supports it, fp16 on other CUDA GPUs, fp32 on a CPU."),
                io.Int.Input("text_tokens", default=0, min=0, max=4096,
                             tooltip="Length of the cached text conditioning; 0 = the family's usual length."),
                io.Clip.Input("clip", optional=True, tooltip="Adds the text encoders to the caching estimate."),
                io.Vae.Input("vae", optional=True, tooltip="Adds VAE encode / decode to caching and validation."),
                # Appended last and optional: workflows saved before it existed keep working (images).
                io.Int.Input("frames", default=1, min=1, max=1025, optional=True,
                             tooltip="Video models (wan21, hunyuan_video15, ltx2): frames of the longest training clip "
                             "(4k+1, e.g. 33 or 81; LTX-2: 8k+1); the step's activations and, with the VAE, its "
                             "encode / decode estimates grow with "
                             "them. 1: images."),
                layer_names_input("layers",
                                  "Which of the targeted layers the planned LoRA trains, as LoRA Config's layers "
                                  "(empty: all of them)."),
                layer_names_input("layer_ranks",
                                  "Ranks per layer of the planned LoRA, as LoRA Config's layer_ranks (empty: rank "
                                  "for all)."),
                # Appended last and optional, as frames.
                io.Combo.Input("kind", options=list(PLAN_KINDS), default="lora", optional=True, advanced=True,
                               tooltip="What the planned run trains: lora (at rank), full (a full fine-tune of the "
                               "targeted layers' weights, LoRA Config's kind full) or controlnet (a ControlNet of "
                               "controlnet_blocks blocks, as Train ControlNet: Init plans it; rank and targets "
                               "unused)."),
                io.Combo.Input("trained_precision", options=list(FULL_PRECISIONS), default="fp32", optional=True,
                               advanced=True,
                               tooltip="Kinds full and controlnet: the trained weights in fp32, or bf16_stochastic "
                               "(LoRA Config's full_precision, the ControlNet nodes' controlnet_precision: half "
                               "their memory; needs the policy's fused_backward, and for a ControlNet precision "
                               "bf16)."),
                # Appended last and optional, as kind.
                io.Int.Input("controlnet_blocks", default=0, min=0, max=1000, optional=True, advanced=True,
                             tooltip="Kind controlnet: the blocks the planned ControlNet copies from the base, as "
                             "the ControlNet nodes' blocks (0: the family's default; UNet ControlNets always copy "
                             "the whole encoder)."),
                # Appended last and optional, as kind.
                io.Boolean.Input("train_text_encoder", default=False, optional=True, advanced=True,
                                 tooltip="Kind lora, clip connected: plan a run that trains the CLIP's text encoders "
                                 "too (Train LoRA: Init's text_encoder_lr above 0): the CLIP's weights and each "
                                 "caption's activations (measured on a caption of one full CLIP chunk, 75 tokens) "
                                 "on the device in a step, and its LoRA at rank with the trained weights."),
            ],
            outputs=[io.String.Output("plan_text", tooltip="The plan as text (also shown on the node)."),
                     io.String.Output("plan_json", tooltip="The plan as JSON: each phase's estimate, itemised."),
                     OffloadPolicyType.Output("policy", tooltip="The policy planned (estimate) or chosen (auto), for "
                                              "the policy input of the Cache and Train nodes.")],
            is_output_node=True,  # useful on its own: the plan shows on the node
        )

    @classmethod
    def execute(cls, model, mode, batch_size, width, height, rank, targets, optimizer, precision, text_tokens,
                policy=None, clip=None, vae=None, frames: int = 1, layers: str = "", layer_ranks: str = "",
                kind: str = "lora", trained_precision: str = "fp32", controlnet_blocks: int = 0,
                train_text_encoder: bool = False) -> io.NodeOutput:
        policy = policy if policy is not None else OffloadPolicy()
        if not isinstance(policy, OffloadPolicy):
            raise ValueError(f"{node_name(cls)}: policy must come from an Offload Policy (Headroom) node")
        plan = plan_run(model, policy, mode, batch_size, width, height, rank, targets, optimizer, precision,
                             text_tokens, clip, vae, node=node_name(cls), frames=frames, layers=layers or "",
                             layer_ranks=layer_ranks or "", kind=kind, trained_precision=trained_precision,
                             controlnet_blocks=controlnet_blocks, train_text_encoder=train_text_encoder)
        text = plan.to_text()
        return io.NodeOutput(text, plan.to_json(), plan.policy, ui=ui.PreviewText(text))


NODES = [HeadroomOffloadPolicy, HeadroomMemoryPlan]
