"""The family registry: every model family Headroom knows, one module each (nodes/bridge/families/<family>.py).

A family module defines `FAMILY`, a `Family` (nodes/bridge/families/base.py) saying how to recognise the family in a
ComfyUI MODEL, its LoRA target preset, its text and latent facts, its LoRA file naming facts and its ControlNet
builder (a `ControlNetType`), and nothing else: the code asks the registry instead of branching on family names.
Modules here are found by name (every module of this package but `base`), so a new family is one new file
(docs/ADDING_A_FAMILY.md).

"family" means one thing everywhere: sd15 / sdxl / sd3 / flux, the name stored in LoRA run folders and files. A
ControlNet's *type* (cldm "unet" / "sd3" / "flux") is what ControlNet run folders and files store under their
"family" key; it is named `ControlNetType.name` in the code.
"""
from __future__ import annotations

import importlib
import logging
import pkgutil

from ....training.core.adapters import AdapterConfig, TargetPreset, select_targets
from .base import ControlNetError, ControlNetType, Family

log = logging.getLogger("headroom")


def _discover() -> dict[str, Family]:
    families = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        try:
            module = importlib.import_module(f"{__name__}.{info.name}")
        except (ImportError, AttributeError, TypeError) as error:
            # A family module subclasses ComfyUI's classes at import: one renamed or missing in this ComfyUI leaves
            # that family out, never every node.
            log.warning("Headroom: the %s family is left out: this ComfyUI lacks what it uses (%s: %s). Other "
                        "families work; updating ComfyUI brings it back.", info.name, type(error).__name__, error)
            continue
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family) or family.name != info.name:
            raise ImportError(f"nodes/bridge/families/{info.name}.py must define FAMILY = Family(name={info.name!r}, ...)")
        families.append(family)
    return {family.name: family for family in sorted(families, key=lambda f: (f.position, f.name))}


FAMILIES: dict[str, Family] = _discover()
# ControlNet types by stored name, in family order (one type may serve several families: cldm for sd15 and sdxl).
CONTROLNET_TYPES: dict[str, ControlNetType] = {}
for _family in FAMILIES.values():
    if _family.controlnet is not None:
        CONTROLNET_TYPES.setdefault(_family.controlnet.name, _family.controlnet)


def get(name: str | None) -> Family | None:
    """The family of this name, or None."""
    return FAMILIES.get(name or "")


def family_of(model) -> Family | None:
    """The family of a ComfyUI model (a `comfy.model_base.BaseModel`), or None when none recognises it."""
    for family in FAMILIES.values():
        if family.recognise(model):
            return family
    return None


def family_name(model) -> str | None:
    """The family's name for a ComfyUI model (stored in run folders and LoRA files), or None."""
    family = family_of(model)
    return None if family is None else family.name


def lora_preset(name: str | None) -> TargetPreset | None:
    """The LoRA target preset of a family name (None: no such family)."""
    family = get(name)
    return None if family is None else family.lora_preset


def lora_targets(diffusion_model, name: str | None, config: AdapterConfig, block_prefixes) -> list[str]:
    """The module paths a LoRA of `config` trains in a model of family `name` (the trainer's own selection)."""
    return select_targets(diffusion_model, lora_preset(name), config, block_prefixes, presets=list(FAMILIES))


def inplace_blocks(model) -> bool:
    """Whether the model's blocks add into their inputs in place (training/memory/checkpointing.py runs them on clones).
    Asked of every family's rule, so models outside a family that share such blocks (Flux derivatives) say so too."""
    return any(family.inplace_blocks(model) for family in FAMILIES.values())


def controlnet_type_of(model_patcher) -> ControlNetType:
    """The ControlNet type a MODEL trains (cldm for any plain UNet, SD3 MMDiT, Flux XLabs, Qwen-Image InstantX), or a
    ControlNetError listing them."""
    base = model_patcher.model
    found = next((controlnet for controlnet in CONTROLNET_TYPES.values() if controlnet.accepts(base)), None)
    if found is None:
        family = family_name(base)
        raise ControlNetError(
            f"no ControlNet support for this MODEL: family {family or '(none)'} ({type(base).__name__} with "
            f"{type(base.diffusion_model).__name__}) has no ControlNet layout in ComfyUI's ControlNetLoader that Headroom "
            f"trains; train a LoRA for it instead, or a ControlNet on a supported family: {supported_controlnets()}")
    config = base.model_config.unet_config
    if found.latent_input_channels(config) != base.latent_format.latent_channels:
        # Inpainting / edit variants take extra input channels the ControlNet's x input does not have.
        raise ControlNetError(
            f"this {found.name} MODEL takes {found.latent_input_channels(config)} input channels but its latents have "
            f"{base.latent_format.latent_channels} (an inpainting or edit variant?); train the ControlNet on the plain "
            "base model")
    return found


def supported_controlnets() -> str:
    """The families that train ControlNets and their ControlNet types, for messages."""
    return "; ".join(f"{', '.join(f.name for f in FAMILIES.values() if f.controlnet is t)} ({name}: {t.description})"
                     for name, t in CONTROLNET_TYPES.items())


def controlnet_type(name: str) -> ControlNetType:
    """The ControlNet type of a stored name ("unet", "sd3", "flux")."""
    return CONTROLNET_TYPES[name]
