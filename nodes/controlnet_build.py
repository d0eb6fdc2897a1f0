"""ControlNets of ComfyUI's own classes, built from a frozen base MODEL, saved for the stock loader and
applied in memory exactly the way the stock `ControlNetApplyAdvanced` node applies a loaded one.

Per family (the classes ComfyUI's `comfy.controlnet` loads):

| family | ComfyUI class                        | initialised from the base                          | zero-initialised              | hint            | file layout (what `load_controlnet` detects)          |
|--------|--------------------------------------|----------------------------------------------------|-------------------------------|-----------------|-------------------------------------------------------|
| unet   | `comfy.cldm.cldm.ControlNet`         | time_embed, label_emb, input_blocks, middle_block  | zero_convs, middle_block_out, last hint conv | pixels (RGB 0..1) | cldm keys (`zero_convs.0.0.weight`...), or Control-LoRA |
| sd3    | `comfy.cldm.mmdit.ControlNet`        | embedders, pos_embed, first N joint_blocks         | controlnet_blocks, pos_embed_input | latents (VAE-encoded, SD3 scale, no shift) | diffusers SD3 ControlNet keys                |
| flux   | `comfy.ldm.flux.controlnet.ControlNetFlux` (XLabs) | img/txt/time/vector/guidance in, first N double_blocks | controlnet_blocks, pos_embed_input | pixels (RGB 0..1) | XLabs keys (BFL names, `*_norm.scale`)                 |

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
- sd3 / flux: no loader builds these from the MODEL; a mismatch is reported in `ExportedControlNet.problem`
  (and in the file's metadata): the file is still written, but the stock loader would not rebuild it.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import pathlib

import torch

import comfy.cldm.cldm
import comfy.cldm.mmdit
import comfy.controlnet
import comfy.latent_formats
import comfy.ldm.flux.controlnet
import comfy.ldm.flux.model
import comfy.ldm.modules.diffusionmodules.mmdit
import comfy.ldm.modules.diffusionmodules.openaimodel
import comfy.model_base
import comfy.model_detection
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.utils

from ..training import public_module
from ..training.files import save_safetensors

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = {
    "unet": "SD1.x / SD2.x / SDXL UNet models (cldm ControlNet)",
    "sd3": "SD3 / SD3.5 MMDiT models (SD3 ControlNet, diffusers layout)",
    "flux": "Flux.1 dev / schnell (double-block ControlNet, XLabs layout)",
}
HINT_KIND = {"unet": "pixels", "sd3": "latents", "flux": "pixels"}
# The conditioning entries each family's ControlNet reads (what its stock loader passes as extra_conds).
EXTRA_CONDS = {"unet": ("y",), "sd3": ("y",), "flux": ("y", "guidance")}


class ControlNetError(ValueError):
    """Bad input to a ControlNet builder: the message names the value and what to do."""

    __module__ = public_module(__name__)  # a clean type name in ComfyUI's error report


def _supported_text() -> str:
    return "; ".join(f"{name}: {text}" for name, text in SUPPORTED_FAMILIES.items())


# --- which family ------------------------------------------------------------------------------------------
def controlnet_family(model_patcher) -> str:
    """The ControlNet family of a MODEL ("unet", "sd3" or "flux"), or a ControlNetError listing them."""
    base = model_patcher.model
    diffusion_model = base.diffusion_model
    latent_channels = base.latent_format.latent_channels
    config = base.model_config.unet_config
    family = None
    if isinstance(diffusion_model, comfy.ldm.modules.diffusionmodules.openaimodel.UNetModel) and not config.get("use_temporal_resblock"):
        family = "unet"
    elif isinstance(base, comfy.model_base.SD3):
        family = "sd3"
    elif type(base) is comfy.model_base.Flux and config.get("image_model") == "flux":
        family = "flux"
    if family is None:
        raise ControlNetError(
            f"no ControlNet support for this MODEL ({type(base).__name__} with {type(diffusion_model).__name__}); "
            f"supported families: {_supported_text()}")
    if config.get("in_channels") != latent_channels:
        # Inpainting / edit variants take extra input channels the ControlNet's x input does not have.
        raise ControlNetError(
            f"this {family} MODEL takes {config.get('in_channels')} input channels but its latents have "
            f"{latent_channels} (an inpainting or edit variant?); train the ControlNet on the plain base model")
    return family


def base_depth(model_patcher, family: str) -> int:
    """How many blocks the base has that a ControlNet of this family can copy."""
    diffusion_model = model_patcher.model.diffusion_model
    if family == "unet":
        return len(diffusion_model.input_blocks)
    if family == "sd3":
        return len(diffusion_model.joint_blocks)
    return len(diffusion_model.double_blocks)


def default_blocks(family: str, depth: int) -> int:
    """Blocks copied when none are asked for: the whole encoder for a UNet (the stock loader derives the
    architecture from it), a quarter of the joint blocks for SD3 (6 of 24, as published SD3 ControlNets),
    two double blocks for Flux (as XLabs')."""
    if family == "unet":
        return depth
    if family == "sd3":
        return max(1, depth // 4)
    return min(2, depth)


# --- the trainable ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class TrainableControlNet:
    """A ControlNet module of ComfyUI's own class plus what is needed to save and apply it.

    Implements the trainer's `Trainable` protocol (parameters / state_dict / load_state_dict / train).
    `config` holds the module's constructor arguments (JSON-able), `blocks` the copied block count.
    `patcher` is the one ModelPatcher ComfyUI sees for the module: it lives exactly as long as the module
    (ComfyUI's loaded-model list holds patchers weakly and treats a dead patcher with a live module as a
    leak), and its load and offload devices are both the module's device, so ComfyUI's unloading never
    moves trained weights away from their optimizer.
    """

    module: torch.nn.Module
    family: str
    blocks: int
    config: dict
    patcher: comfy.model_patcher.ModelPatcher = dataclasses.field(repr=False)

    @property
    def hint(self) -> str:
        return HINT_KIND[self.family]

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.module.parameters())

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing, unexpected = self.module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ControlNetError(f"ControlNet weights do not fit this {self.family} ControlNet "
                                  f"({self.blocks} blocks): missing {missing[:5]}, unexpected {unexpected[:5]}")

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.module.parameters()).dtype


def _constructor_config(base_config: dict, family: str, blocks: int) -> dict:
    config = {k: v for k, v in base_config.items() if k not in ("dtype", "device", "operations")}
    if family == "unet":
        config.pop("out_channels", None)
        config["hint_channels"] = 3
    elif family == "sd3":
        config["num_blocks"] = blocks
        # Only the copied blocks exist in the ControlNet (and in its file, which is what the loader reads).
        config["x_block_self_attn_layers"] = [i for i in config.get("x_block_self_attn_layers", []) if i < blocks]
    else:
        config["depth"] = blocks
        config["depth_single_blocks"] = 0  # a double-block ControlNet
    return config


def _make_module(family: str, config: dict, dtype: torch.dtype, device, operations) -> torch.nn.Module:
    if family == "unet":
        return comfy.cldm.cldm.ControlNet(**config, dtype=dtype, device=device, operations=operations)
    if family == "sd3":
        return comfy.cldm.mmdit.ControlNet(**config, dtype=dtype, device=device, operations=operations)
    return comfy.ldm.flux.controlnet.ControlNetFlux(**config, dtype=dtype, device=device, operations=operations)


def _zero_initialised(family: str, module: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers whose zero start makes an untrained ControlNet change nothing. Only one layer on each path
    is zeroed (output projections, and the hint path's last layer); two zeros in a row would never learn."""
    if family == "unet":
        return [*module.zero_convs, module.middle_block_out, module.input_hint_block[-1]]
    return [*module.controlnet_blocks, module.pos_embed_input]


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
    family = controlnet_family(model_patcher)
    depth = base_depth(model_patcher, family)
    if blocks < 0:
        raise ControlNetError(f"blocks={blocks}: use 0 for the default or a positive block count")
    if blocks == 0:
        blocks = default_blocks(family, depth)
    if family == "unet" and blocks != depth:
        raise ControlNetError(
            f"blocks={blocks}: a UNet ControlNet copies the whole encoder ({depth} input blocks), which is how "
            "ComfyUI's loader rebuilds it; set blocks to 0")
    if blocks > depth:
        what = "joint blocks" if family == "sd3" else "double blocks"
        raise ControlNetError(f"blocks={blocks} is more than the base model's {depth} {what}; use 1..{depth} (0 = default)")

    base_config = dict(model_patcher.model.model_config.unet_config)
    config = _constructor_config(base_config, family, blocks)
    with torch.inference_mode(False):  # the module is trained later: its tensors must not be inference tensors
        module = _make_module(family, config, dtype, "cpu", comfy.ops.disable_weight_init)
        _init_hint_encoder_(module, torch.Generator().manual_seed(seed))
        for layer in _zero_initialised(family, module):
            for param in layer.parameters():
                torch.nn.init.zeros_(param)
        _copy_from_base_(module, model_patcher.model.diffusion_model.state_dict(), family, depth)
        module.to(device)
    json_config = {k: v for k, v in config.items() if _json_able(v)}
    device = torch.device(device)
    patcher = comfy.model_patcher.ModelPatcher(module, load_device=device, offload_device=device)
    return TrainableControlNet(module=module, family=family, blocks=blocks, config=json_config, patcher=patcher)


def _json_able(value) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


def _new_keys(family: str) -> tuple[str, ...]:
    """Prefixes of the module's own layers (not copied from the base)."""
    if family == "unet":
        return ("zero_convs.", "middle_block_out.", "input_hint_block.")
    return ("controlnet_blocks.", "pos_embed_input.", "input_hint_block.")


@torch.no_grad()
def _copy_from_base_(module: torch.nn.Module, base_sd: dict, family: str, depth: int) -> None:
    own = module.state_dict()
    new_prefixes = _new_keys(family)
    for key, target in own.items():
        if key.startswith(new_prefixes):
            continue
        source = base_sd.get(key)
        if source is None and family == "sd3" and key.startswith(f"joint_blocks.{depth - 1}.context_block."):
            # The base's last joint block is "pre-only" (its context output is unused), so it lacks the
            # context post-attention layers; in the ControlNet that block's context output is unused too.
            target.zero_()
            continue
        if source is None:
            raise ControlNetError(f"ControlNet key {key} has no counterpart in the base model; the base model "
                                  f"layout is not one ComfyUI's {family} ControlNet supports")
        if source.shape != target.shape:
            if family == "sd3" and ".context_block.adaLN_modulation.1." in key and source.shape[0] < target.shape[0]:
                # Pre-only block: its modulation rows are the leading chunks (shift/scale for attention)
                # of the full block's; the gates of the unused context outputs start at zero.
                target.zero_()
                target[: source.shape[0]].copy_(source.to(target.dtype))
                continue
            raise ControlNetError(f"ControlNet key {key}: base shape {tuple(source.shape)} != {tuple(target.shape)}")
        target.copy_(source.to(device=target.device, dtype=target.dtype))


# --- save in a layout the stock ControlNetLoader detects ---------------------------------------------------
@dataclasses.dataclass
class ExportedControlNet:
    tensors: dict[str, torch.Tensor]
    layout: str
    problem: str | None  # why the stock loader would not rebuild it faithfully, or None


def _effective(config: dict, signature_of, skip: set[str]) -> dict:
    params = inspect.signature(signature_of).parameters
    return {name: config.get(name, p.default) for name, p in params.items()
            if name not in skip and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


def _differences(ours: dict, theirs: dict) -> list[str]:
    def norm(v):
        return list(v) if isinstance(v, tuple) else v
    return [f"{k}: ours {ours[k]!r}, loader {theirs[k]!r}" for k in ours if norm(ours[k]) != norm(theirs[k])]


_UNUSED_CLDM = {"self", "dtype", "device", "operations", "use_checkpoint", "image_size", "transformer_depth_output",
                "hint_channels"}


def _cldm_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    detected = comfy.model_detection.model_config_from_unet(meta, "", True)
    if detected is None:
        return "comfy.model_detection does not recognise the UNet layout"
    ours = _effective(config, comfy.cldm.cldm.ControlNet.__init__, _UNUSED_CLDM)
    theirs = _effective(detected.unet_config, comfy.cldm.cldm.ControlNet.__init__, _UNUSED_CLDM)
    differences = _differences(ours, theirs)
    return "; ".join(differences) if differences else None


def _mmdit_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    converted = comfy.model_detection.convert_diffusers_mmdit(meta, "")
    detected = comfy.model_detection.model_config_from_unet(converted, "", True) if converted else None
    if detected is None:
        return "comfy.model_detection does not recognise the SD3 layout"
    skip = {"self", "dtype", "device", "operations", "num_blocks", "final_layer", "input_size", "out_channels",
            "pos_embed_scaling_factor", "use_checkpoint"}
    signature = comfy.ldm.modules.diffusionmodules.mmdit.MMDiT.__init__
    differences = _differences(_effective(config, signature, skip), _effective(detected.unet_config, signature, skip))
    return "; ".join(differences) if differences else None


def _flux_detection_problem(tensors: dict, config: dict) -> str | None:
    meta = {k: v.to("meta") for k, v in tensors.items()}
    detected = comfy.model_detection.model_config_from_unet(meta, "", True)
    if detected is None:
        return "comfy.model_detection does not recognise the Flux layout"
    fields = [f.name for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)
              if f.name not in ("out_channels", "depth_single_blocks")]
    defaults = {f.name: f.default for f in dataclasses.fields(comfy.ldm.flux.model.FluxParams)}
    ours = {k: config.get(k, defaults[k]) for k in fields}
    theirs = {k: detected.unet_config.get(k, defaults[k]) for k in fields}
    differences = _differences(ours, theirs)
    return "; ".join(differences) if differences else None


def _mmdit_to_diffusers_keys(own: dict[str, torch.Tensor], depth: int, blocks: int) -> dict[str, torch.Tensor]:
    """Invert ComfyUI's own diffusers->MMDiT key map (`comfy.utils.mmdit_to_diffusers`), which is what
    `load_controlnet_mmdit` applies: split fused qkv back into q/k/v, undo the scale/shift swap."""
    out = {}
    used = set()
    for diffusers_key, target in comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": blocks}).items():
        if isinstance(target, str):
            comfy_key, offset, fn = target, None, None
        else:
            comfy_key, offset = target[0], target[1]
            fn = target[2] if len(target) > 2 else None
        if comfy_key not in own:
            continue
        tensor = own[comfy_key]
        if offset is not None:
            tensor = tensor.narrow(offset[0], offset[1], offset[2])
        if fn is not None:
            if fn is not comfy.utils.swap_scale_shift:
                raise ControlNetError(f"unknown key transform {fn} for {diffusers_key} in ComfyUI's MMDiT map")
            tensor = fn(tensor)  # swapping the two halves is its own inverse
        out[diffusers_key] = tensor.contiguous()
        used.add(comfy_key)
    for key, tensor in own.items():  # ControlNet-only keys keep their names (the loader copies them as they are)
        if key not in used:
            out[key] = tensor.contiguous()
    return out


def export_controlnet(controlnet: TrainableControlNet) -> ExportedControlNet:
    """The ControlNet's tensors in the key layout the stock ControlNetLoader detects for its family."""
    own = {k: v.detach().to("cpu").contiguous() for k, v in controlnet.module.state_dict().items()}
    if controlnet.family == "unet":
        problem = _cldm_detection_problem(own, controlnet.config)
        if problem is None:
            return ExportedControlNet(own, "cldm", None)
        # ComfyUI's Control-LoRA loader builds the ControlNet from the MODEL it is applied to, then loads
        # every `.weight` / `.bias` in the file over it: full weights, any UNet geometry.
        tensors = dict(own)
        tensors["lora_controlnet"] = torch.tensor([])
        log.info("ControlNet saved in the Control-LoRA layout: ComfyUI's detection would rebuild the plain cldm "
                 "layout differently (%s)", problem)
        return ExportedControlNet(tensors, "control-lora", None)
    if controlnet.family == "sd3":
        depth = controlnet.config["depth"]
        tensors = _mmdit_to_diffusers_keys(own, depth, controlnet.blocks)
        return ExportedControlNet(tensors, "sd3-diffusers", _mmdit_detection_problem(tensors, controlnet.config))
    # XLabs files carry BFL's original names: RMSNorm scales are `*_norm.scale` (the loader renames them back).
    tensors = {(k[: -len(".weight")] + ".scale" if k.endswith("_norm.weight") else k): v for k, v in own.items()}
    return ExportedControlNet(tensors, "flux-xlabs", _flux_detection_problem(tensors, controlnet.config))


def controlnet_metadata(controlnet: TrainableControlNet, layout: str, extra: dict | None = None) -> dict[str, str]:
    metadata = {
        "headroom.kind": "controlnet",
        "headroom.family": controlnet.family,
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
                    path, controlnet.family, exported.problem)
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
    if controlnet.family == "unet":
        control = comfy.controlnet.ControlNet(module, load_device=device, manual_cast_dtype=manual_cast)
    elif controlnet.family == "sd3":
        control = comfy.controlnet.ControlNet(module, compression_ratio=1, latent_format=sd3_hint_latent_format(),
                                              load_device=device, manual_cast_dtype=manual_cast)
    else:
        control = comfy.controlnet.ControlNet(module, load_device=device, manual_cast_dtype=manual_cast,
                                              extra_conds=["y", "guidance"])
    control.control_model_wrapped = controlnet.patcher
    return control


def sd3_hint_latent_format():
    """The latent format `load_controlnet_mmdit` gives SD3 ControlNets: SD3's scale without its shift."""
    latent_format = comfy.latent_formats.SD3()
    latent_format.shift_factor = 0
    return latent_format


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
        hint = sd3_hint_latent_format().process_in(hint)
        expected = tuple(x_t.shape[-2:])
    if hint.ndim != 4 or tuple(hint.shape[-2:]) != expected:
        raise ControlNetError(f"control hint of shape {tuple(hint.shape)} does not fit latents of shape "
                              f"{tuple(x_t.shape)} (a {controlnet.family} ControlNet takes {controlnet.hint})")
    return hint


def control_residuals(controlnet: TrainableControlNet, model: comfy.model_base.BaseModel, x_t: torch.Tensor,
                      sigma: torch.Tensor, cond: dict, hint: torch.Tensor) -> dict:
    """The ControlNet's residuals for `model.apply_model(x_t, sigma, control=..., **cond)`: the inputs
    `comfy.controlnet.ControlNet.get_control` gives the module (strength 1, whole schedule), with grad."""
    dtype = controlnet.dtype
    context = cond.get("crossattn_controlnet", cond["c_crossattn"])
    extra = {name: comfy.model_base.convert_tensor(cond[name], dtype, x_t.device)
             for name in EXTRA_CONDS[controlnet.family] if cond.get(name) is not None}
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
    must run through `training.checkpointing.wrap_blocks(..., inplace_inputs=True)`, as the trainer does
    with the denoiser's blocks."""
    if controlnet.family == "flux":
        # Flux adds the residuals into a slice of its activations in place, which autograd allows only
        # when those activations are part of the graph: they are once the input requires grad.
        x_t = x_t.detach().requires_grad_(True)
    control = control_residuals(controlnet, model, x_t, sigma, cond, hint)
    return model.apply_model(x_t, sigma, control=control, transformer_options={}, **cond)


def check_control_cache(controlnet_family_name: str, latent_cache, node: str) -> None:
    """Every cached item has a control of the kind and size this ControlNet family takes."""
    wanted = HINT_KIND[controlnet_family_name]
    kind = getattr(latent_cache, "control_kind", None)
    if kind is None:
        raise ControlNetError(f"{node}: the LATENT_CACHE has no control images; give the dataset control images "
                              "(control_folder / control_images) and cache it again")
    if kind != wanted:
        raise ControlNetError(f"{node}: a {controlnet_family_name} ControlNet takes control {wanted} but the LATENT_CACHE "
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
