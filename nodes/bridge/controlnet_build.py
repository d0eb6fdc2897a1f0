"""ControlNets of ComfyUI's own classes, built from a frozen base MODEL, saved for the stock loader and
applied in memory exactly the way the stock `ControlNetApplyAdvanced` node applies a loaded one.

Per ControlNet type (the classes ComfyUI's `comfy.controlnet` loads; each is the builder hook of its families in
nodes/bridge/families/, where the code for each lives: sd15 and sdxl train "unet", sd3 "sd3", flux "flux", qwen_image
"qwen_image"):

| type   | ComfyUI class                        | initialised from the base                          | zero-initialised              | hint            | file layout (what `load_controlnet` detects)          |
|--------|--------------------------------------|----------------------------------------------------|-------------------------------|-----------------|-------------------------------------------------------|
| unet   | `comfy.cldm.cldm.ControlNet`         | time_embed, label_emb, input_blocks, middle_block  | zero_convs, middle_block_out, last hint conv | pixels (RGB 0..1) | cldm keys (`zero_convs.0.0.weight`...), or Control-LoRA |
| sd3    | `comfy.cldm.mmdit.ControlNet`        | embedders, pos_embed, first N joint_blocks         | controlnet_blocks, pos_embed_input | latents (VAE-encoded, SD3 scale, no shift) | diffusers SD3 ControlNet keys                |
| flux   | `comfy.ldm.flux.controlnet.ControlNetFlux` (XLabs) | img/txt/time/vector/guidance in, first N double_blocks | controlnet_blocks, pos_embed_input | pixels (RGB 0..1) | XLabs keys (BFL names, `*_norm.scale`)                 |
| qwen_image | `comfy.ldm.qwen_image.controlnet.QwenImageControlNetModel` (InstantX) | embedders, first N transformer_blocks | controlnet_blocks, controlnet_x_embedder | latents (VAE-encoded, Wan 2.1 scale) | the module's keys (InstantX; rebuilt at the released widths) |

The hint kinds follow the loaders: `load_controlnet_mmdit` gives its ControlNet a latent format, so the
apply node VAE-encodes the control image and scales it (`latent_format.process_in`, shift 0); the cldm
and XLabs loaders give none, so their ControlNets get the control image's pixels at 8x the latent size.

The stock loader rebuilds the architecture from the file's key shapes (`comfy.model_detection`), which
knows the attention geometry of real checkpoints only. `export_controlnet` runs that same detection on
the tensors it is about to write (as meta tensors, so it costs no memory) and compares it with the
module's own constructor arguments:
- unet: if detection would rebuild something else (e.g. tiny or unusual UNets, whose head count the
  table does not know), the file is written in the Control-LoRA layout instead: ComfyUI then builds the
  ControlNet from the config of the MODEL it is applied to and loads every weight from the file.
- sd3 / flux / qwen_image: no loader builds these from the MODEL; a mismatch is reported in `ExportedControlNet.problem`
  (and in the file's metadata): the file is still written, but the stock loader would not rebuild it.

`ControlNetDenoiser` is the engine's denoiser of a ControlNet step (the run trains through it; the planner's
calibration measures a ControlNet run's step through it too: nodes/bridge/planning._ControlNetStep).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib

import torch

import comfy.controlnet
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.ops

from ...training.data.files import save_safetensors
from ...training.memory.planner import TrainableSpec
from . import families
from .comfy_model import ComfyDenoiser, model_blocks, training_blocks
from .families import CONTROLNET_TYPES, ControlNetError, ControlNetType, controlnet_type_of
from .families.base import ExportedControlNet

log = logging.getLogger(__name__)

def supported_text() -> str:
    """The ControlNet types and the models they serve, for messages and the init node's description."""
    return families.supported_controlnets()


def controlnet_type_name(model_patcher) -> str:
    """The stored name of the ControlNet type a MODEL trains ("unet", "sd3" or "flux"), or a ControlNetError."""
    return controlnet_type_of(model_patcher).name


# --- the trainable ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainableControlNet:
    """A ControlNet module of ComfyUI's own class plus what is needed to save and apply it.

    Implements the trainer's `Trainable` protocol (parameters / state_dict / load_state_dict / train).
    `controlnet_type` is its family's ControlNet builder hook (nodes/bridge/families/); `config` holds the module's
    constructor arguments (JSON-able), `blocks` the copied block count.
    `patcher` is the one ModelPatcher ComfyUI sees for the module: it lives exactly as long as the module
    (ComfyUI's loaded-model list holds patchers weakly and treats a dead patcher with a live module as a
    leak), and its load and offload devices are both the module's device, so ComfyUI's unloading never
    moves trained weights away from their optimizer.
    """

    module: torch.nn.Module
    controlnet_type: ControlNetType
    blocks: int
    config: dict
    patcher: comfy.model_patcher.ModelPatcher = dataclasses.field(repr=False)

    @property
    def type_name(self) -> str:
        """The type's stored name ("unet", "sd3", "flux"): what run folders and files keep as "family"."""
        return self.controlnet_type.name

    @property
    def hint(self) -> str:
        return self.controlnet_type.hint

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """`copy` False: the live tensors (detached), for writing them out at once (adapters.AdapterSet.state_dict)."""
        return {k: v.detach().clone() if copy else v.detach() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ControlNetError(f"ControlNet weights do not fit this {self.type_name} ControlNet "
                                  f"({self.blocks} blocks): missing {missing[:5]}, unexpected {unexpected[:5]}")

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype


@torch.no_grad()
def _init_hint_encoder_(module: torch.nn.Module, generator: torch.Generator) -> None:
    """torch's default conv init for the hint encoder (the one part learned from scratch), seeded; ComfyUI's
    ops skip init because their weights normally come from a file."""
    hint_encoder = getattr(module, "input_hint_block", None)
    if hint_encoder is None:
        return
    for layer in hint_encoder.modules():
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or weight.ndim < 2:
            continue
        torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
        bias = getattr(layer, "bias", None)
        if isinstance(bias, torch.nn.Parameter):
            bound = 1.0 / math.sqrt(weight[0].numel())
            torch.nn.init.uniform_(bias, -bound, bound, generator=generator)


def build_controlnet(model_patcher, blocks: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: torch.device | str = "cpu") -> TrainableControlNet:
    """A ControlNet for the MODEL's family, initialised from its (unchanged) base weights.

    blocks: joint blocks (SD3) / double blocks (Flux) to copy; 0 = the family default. UNet ControlNets
    always copy the whole encoder. The base module is only read.
    """
    controlnet_type, blocks, depth, config = _controlnet_config(model_patcher, blocks)
    with torch.inference_mode(False):  # the module is trained later: its tensors must not be inference tensors
        module = controlnet_type.make_module(config, dtype, "cpu", comfy.ops.disable_weight_init)
        _init_hint_encoder_(module, torch.Generator().manual_seed(seed))
        for layer in controlnet_type.zero_initialised(module):
            for param in layer.parameters():
                torch.nn.init.zeros_(param)
        _copy_from_base_(module, model_patcher.model.diffusion_model.state_dict(), controlnet_type, depth)
        module.to(device)
    json_config = {k: v for k, v in config.items() if _json_able(v)}
    device = torch.device(device)
    patcher = comfy.model_patcher.ModelPatcher(module, load_device=device, offload_device=device)
    return TrainableControlNet(module=module, controlnet_type=controlnet_type, blocks=blocks, config=json_config,
                               patcher=patcher)


def _controlnet_config(model_patcher, blocks: int, input_name: str = "blocks"
                       ) -> tuple[ControlNetType, int, int, dict]:
    """(type, blocks copied, the base's depth, the module's constructor config) of the MODEL's ControlNet; a block
    count it cannot have is refused naming `input_name`, the node input that set it."""
    controlnet_type = controlnet_type_of(model_patcher)
    depth = controlnet_type.base_depth(model_patcher.model.diffusion_model)
    if blocks < 0:
        raise ControlNetError(f"{input_name}={blocks}: use 0 for the default or a positive block count")
    if blocks == 0:
        blocks = controlnet_type.default_blocks(depth)
    controlnet_type.check_blocks(blocks, depth, input_name)
    base_config = {k: v for k, v in model_patcher.model.model_config.unet_config.items()
                   if k not in ("dtype", "device", "operations")}
    return controlnet_type, blocks, depth, controlnet_type.constructor_config(base_config, blocks)


def check_controlnet_blocks(model_patcher, blocks: int, input_name: str) -> None:
    """The ControlNet builders' checks of a block count, naming another node's input (the Memory Plan's)."""
    _controlnet_config(model_patcher, blocks, input_name)


def resolved_blocks(model_patcher, blocks: int) -> int:
    """The blocks a ControlNet of `blocks` copies (0: the type's default count)."""
    return _controlnet_config(model_patcher, blocks)[1]


def controlnet_dtype(controlnet_precision: str) -> torch.dtype:
    """The dtype a ControlNet's weights train in for its controlnet_precision (fp32, bf16_stochastic)."""
    return torch.bfloat16 if controlnet_precision == "bf16_stochastic" else torch.float32


def controlnet_trainable(model_patcher, blocks: int, optimizer: str, dtype: torch.dtype = torch.float32
                         ) -> TrainableSpec:
    """The trainable tensors of the ControlNet `build_controlnet` would make (its weights in `dtype`), for the
    planner: built on the meta device (shapes only, no memory)."""
    controlnet_type, _, _, config = _controlnet_config(model_patcher, blocks)
    module = controlnet_type.make_module(config, dtype, "meta", comfy.ops.disable_weight_init)
    return dataclasses.replace(TrainableSpec.from_parameters(module.parameters(), optimizer), saved_as_trained=True,
                               **controlnet_step_blocks(model_patcher, blocks))


def controlnet_step_blocks(model_patcher, blocks: int) -> dict[str, int]:
    """For the planner's time model, a ControlNet run of `blocks` (0: the type's default) on this base: how many of the
    base's first training blocks run no backward (the control joins after them) and how many the ControlNet copies
    (TrainableSpec.without_backward, copied_blocks)."""
    controlnet_type, blocks, _, _ = _controlnet_config(model_patcher, blocks)
    names = [name for name, _ in training_blocks(model_patcher.model.diffusion_model)]
    return {"without_backward": controlnet_type.base_blocks_without_backward(names),
            "copied_blocks": controlnet_type.copied_base_blocks(names, blocks)}


def _json_able(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


@torch.no_grad()
def _copy_from_base_(module: torch.nn.Module, base_sd: dict, controlnet_type: ControlNetType, depth: int) -> None:
    own = module.state_dict()
    for key, target in own.items():
        if key.startswith(controlnet_type.new_keys):
            continue
        source = base_sd.get(key)
        if (source is None or source.shape != target.shape) and controlnet_type.copy_missing(key, source, target, depth):
            continue  # a key the base lacks or has in another shape, that the type knows how to fill
        if source is None:
            raise ControlNetError(f"ControlNet key {key} has no counterpart in the base model; the base model "
                                  f"layout is not one ComfyUI's {controlnet_type.name} ControlNet supports")
        if source.shape != target.shape:
            raise ControlNetError(f"ControlNet key {key}: base shape {tuple(source.shape)} != {tuple(target.shape)}")
        target.copy_(source.to(device=target.device, dtype=target.dtype))


# --- save in a layout the stock ControlNetLoader detects ---------------------------------------------------
def export_controlnet(controlnet: TrainableControlNet) -> ExportedControlNet:
    """The ControlNet's tensors in the key layout the stock ControlNetLoader detects for its family."""
    own = {k: v.detach().to("cpu").contiguous() for k, v in controlnet.module.state_dict().items()}
    return controlnet.controlnet_type.export(own, controlnet.config, controlnet.blocks)


def controlnet_metadata(controlnet: TrainableControlNet, layout: str, extra: dict | None = None) -> dict[str, str]:
    metadata = {
        "headroom.kind": "controlnet",
        "headroom.family": controlnet.type_name,
        "headroom.blocks": str(controlnet.blocks),
        "headroom.hint": controlnet.hint,
        "headroom.layout": layout,
        "headroom.config": json.dumps(controlnet.config, sort_keys=True),
    }
    for key, value in (extra or {}).items():
        metadata[f"headroom.{key}"] = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return metadata


def save_controlnet(controlnet: TrainableControlNet, path, extra_metadata: dict | None = None) -> ExportedControlNet:
    """Write the ControlNet as safetensors (atomically) in its stock-loadable layout, with metadata
    (family, blocks, hint, layout, config, plus `extra_metadata`, e.g. base fingerprint and steps).
    A layout the stock loader would rebuild differently is still written, with a warning."""
    exported = export_controlnet(controlnet)
    extra = dict(extra_metadata or {})
    if exported.problem is not None:
        extra["stock_loader_problem"] = exported.problem
        log.warning("%s: ComfyUI's ControlNetLoader would not rebuild this %s ControlNet faithfully (%s)",
                    path, controlnet.type_name, exported.problem)
    save_safetensors(pathlib.Path(path), exported.tensors, f"ControlNet {pathlib.Path(path).name}",
                     controlnet_metadata(controlnet, exported.layout, extra))
    return exported


# --- apply in memory, as the stock nodes apply a loaded ControlNet -----------------------------------------
def comfy_controlnet(controlnet: TrainableControlNet) -> comfy.controlnet.ControlNet:
    """A ComfyUI CONTROL_NET object around the SAME module (no weight copy), configured as the stock
    loader configures one for this family, with the trainable's own patcher."""
    module = controlnet.module
    device = controlnet.patcher.load_device
    moved = {p.device for p in module.parameters()} - {device}
    if moved:
        raise ControlNetError(f"the ControlNet module was built for {device} but has weights on {sorted(map(str, moved))}; "
                              "build it on the device it trains on")
    manual_cast = comfy.model_management.unet_manual_cast(controlnet.dtype, device)
    if manual_cast is not None:
        _cast_weights_when_sampling(module)
    control = controlnet.controlnet_type.comfy_controlnet(module, device, manual_cast)
    control.control_model_wrapped = controlnet.patcher
    return control


def _cast_weights_when_sampling(module: torch.nn.Module) -> None:
    """Where ComfyUI computes weights of this dtype in another (`unet_manual_cast`: bf16 weights on a CPU or a card
    without bf16), the stock loader builds the module with casting ops; this one's ops (trained in their own dtype)
    cast likewise, but only in a forward without gradients (sampling): the training forward reads the weights
    themselves, whose gradients a cast copy would not reach (checkpointed recomputes included: they run with
    gradients). A forward pre-hook, as the stock ControlNet object copies itself per sampling and keeps the module."""
    if getattr(module, "_headroom_casts_when_sampling", False):
        return
    ops = [m for m in module.modules() if isinstance(m, comfy.ops.CastWeightBiasOp)]

    def cast_without_grad(_module, _args):
        cast = not torch.is_grad_enabled()
        for op in ops:
            op.comfy_cast_weights = cast

    module.register_forward_pre_hook(cast_without_grad)
    module._headroom_casts_when_sampling = True


def apply_controlnet(positive, negative, control_net, image, strength: float = 1.0, start_percent: float = 0.0,
                     end_percent: float = 1.0, vae=None):
    """Exactly the stock `ControlNetApplyAdvanced` node (it is called), for in-memory validation."""
    import nodes  # ComfyUI's nodes.py

    return nodes.ControlNetApplyAdvanced().apply_controlnet(
        positive, negative, control_net, image, strength, start_percent, end_percent, vae=vae)


# --- the training forward: what ControlNet.get_control computes, differentiably ------------------------------
def prepare_hint(controlnet: TrainableControlNet, controls: list[torch.Tensor], x_t: torch.Tensor) -> torch.Tensor:
    """Cached control items -> the hint tensor the module takes, as the stock apply path builds it.

    pixels: [H, W, 3] 0..1 at the bucket size (8x the latent), as `get_control` resizes the control image.
    latents: [C, h, w] raw VAE output, scaled as `get_control` does with the loader's latent format."""
    hint = torch.stack([c.to(torch.float32) for c in controls]).to(x_t.device)
    if controlnet.hint == "pixels":
        hint = hint.movedim(-1, 1)
        expected = (x_t.shape[-2] * 8, x_t.shape[-1] * 8)
    else:
        hint = controlnet.controlnet_type.hint_latent_format().process_in(hint)
        expected = tuple(x_t.shape[-2:])
    if hint.ndim != x_t.ndim or tuple(hint.shape[-2:]) != expected:  # 5-D with video latents (Qwen-Image)
        raise ControlNetError(f"control hint of shape {tuple(hint.shape)} does not fit latents of shape "
                              f"{tuple(x_t.shape)} (a {controlnet.type_name} ControlNet takes {controlnet.hint})")
    return hint


def control_residuals(controlnet: TrainableControlNet, model: comfy.model_base.BaseModel, x_t: torch.Tensor,
                      sigma: torch.Tensor, cond: dict, hint: torch.Tensor) -> dict:
    """The ControlNet's residuals for `model.apply_model(x_t, sigma, control=..., **cond)`: the inputs
    `comfy.controlnet.ControlNet.get_control` gives the module (strength 1, whole schedule), with grad."""
    dtype = controlnet.dtype
    context = cond.get("crossattn_controlnet", cond["c_crossattn"])
    extra = {name: comfy.model_base.convert_tensor(cond[name], dtype, x_t.device)
             for name in controlnet.controlnet_type.extra_conds if cond.get(name) is not None}
    timestep = model.model_sampling.timestep(sigma)
    x = model.model_sampling.calculate_input(sigma, x_t)
    control = controlnet.module(x=x.to(dtype), hint=hint.to(dtype), timesteps=timestep.to(dtype),
                                context=comfy.model_management.cast_to_device(context, x_t.device, dtype), **extra)
    # As ControlBase.control_merge: every kind of residual list is present (the models index all three).
    return {key: list(control.get(key, [])) for key in ("input", "middle", "output")}


def controlled_prediction(controlnet: TrainableControlNet, model: comfy.model_base.BaseModel, x_t: torch.Tensor,
                          sigma: torch.Tensor, cond: dict, hint: torch.Tensor) -> torch.Tensor:
    """The base model's x0 estimate with the ControlNet's residuals added, differentiable in the ControlNet.

    Flux blocks (the base's and the ControlNet's) add into their inputs in place; for a backward pass they
    must run through `training.memory.checkpointing.wrap_blocks(..., inplace_inputs=True)`, as the trainer does
    with the denoiser's blocks."""
    if controlnet.controlnet_type.input_requires_grad:
        # Flux adds the residuals into a slice of its activations in place, which autograd allows only
        # when those activations are part of the graph: they are once the input requires grad.
        x_t = x_t.detach().requires_grad_(True)
    control = control_residuals(controlnet, model, x_t, sigma, cond, hint)
    return model.apply_model(x_t, sigma, control=control, transformer_options={}, **cond)


def check_control_cache(type_name: str, latent_cache, node: str) -> None:
    """Every cached item has a control of the kind and size this ControlNet type takes."""
    wanted = CONTROLNET_TYPES[type_name].hint
    kind = getattr(latent_cache, "control_kind", None)
    if kind is None:
        raise ControlNetError(f"{node}: the LATENT_CACHE has no control images; give the dataset control images "
                              "(control_folder / control_images) and cache it again")
    if kind != wanted:
        raise ControlNetError(f"{node}: a {type_name} ControlNet takes control {wanted} but the LATENT_CACHE "
                              f"holds control {kind}; cache with control_encoding={wanted}")
    for index in range(len(latent_cache)):
        control = latent_cache.control(index)
        if control is None:
            raise ControlNetError(f"{node}: cached item {latent_cache.name(index)!r} has no control image; give every "
                                  "image a control image (or remove it) and cache again")
        latent = latent_cache.latent(index)
        expected = (latent.shape[-2] * 8, latent.shape[-1] * 8, 3) if wanted == "pixels" else tuple(latent.shape)
        if tuple(control.shape) != expected:
            raise ControlNetError(f"{node}: the control of cached item {latent_cache.name(index)!r} has shape "
                                  f"{tuple(control.shape)}, expected {expected}; re-cache the dataset")


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
        x_t, sigma = self.comfy_input(x_t, sigma)

        def forward(index, x, s, cond):  # per batchable group (Qwen-Image: captions of different lengths)
            part = hint if index is None else hint.index_select(0, index.to(hint.device))
            return controlled_prediction(self.controlnet, self.model, x, s, cond, part)

        return self.grouped_forward(x_t, sigma, self._item_conds(x_t, text_conds), forward)

    def blocks(self) -> list[tuple[str, torch.nn.Module]]:
        """The base's blocks and the ControlNet's copied ones (checkpointed, and made safe for Flux's in-place
        input updates, by the trainer); its zero-initialised output projections are single layers."""
        own = [(f"controlnet.{name}", block) for name, block in model_blocks(self.controlnet.module)
               if not name.startswith(("zero_convs.", "controlnet_"))]
        return super().blocks() + own
