"""LoRA file formats the save node writes: ComfyUI's own key scheme, and kohya's (sd-scripts / LyCORIS).

ComfyUI (default): `diffusion_model.<module path>.lora_up.weight / .lora_down.weight / .alpha` — what the
trainer exports (training/adapters.py); ComfyUI's loader maps it, other tools mostly do not.

kohya: `lora_unet_<name>.<same suffixes>` plus the `ss_*` / `modelspec.*` metadata other UIs show. That is
what A1111 / Forge load, what Civitai expects, and what diffusers converts (`load_lora_weights` reads kohya
files). <name> is the module path with `.` -> `_` in the naming sd-scripts uses for that family: diffusers'
block names for SD1.x / SD2.x (its UNet there is diffusers': `down_blocks_0_attentions_0_proj_in`), the
original module path everywhere else (SDXL: `input_blocks_4_1_proj_in`, Flux: `double_blocks_0_img_attn_qkv`,
SD3: `joint_blocks_0_x_block_attn_qkv`).

The names are taken from ComfyUI's own LoRA key map (`comfy.lora.model_lora_keys_unet`) rather than a table
written here: every name saved is, by construction, one the stock loader maps back to the same weight.
"""
from __future__ import annotations

import json

import torch

import comfy.lora
import comfy.lora_convert
import comfy.utils
import folder_paths

FORMATS = ("comfyui", "kohya")
KOHYA_PREFIX = "lora_unet_"

# ss_base_model_version / modelspec.architecture values sd-scripts writes for each family.
_KOHYA_BASE = {
    "sd15": ("sd_v1", "stable-diffusion-v1/lora"),
    "sdxl": ("sdxl_base_v1-0", "stable-diffusion-xl-v1-base/lora"),
    "sd3": ("sd3", "stable-diffusion-3/lora"),
    "flux": ("flux1", "flux-1-dev/lora"),
}
# LyCORIS' network module and algo names for the adapter kinds that are not plain LoRA.
_LYCORIS_ALGO = {"loha": "loha", "lokr": "lokr", "dora": "lora", "oft": "diag-oft"}


def kohya_names(model, module_paths, family: str | None) -> dict[str, str]:
    """{module path inside the diffusion model: kohya name} for the adapted modules of a ComfyUI MODEL.

    From ComfyUI's key map: of the `lora_unet_*` names that map to a module's weight, the diffusers-block one
    for SD1.x (what sd-scripts writes there), else the plain path form.
    """
    diffusers_blocks = family == "sd15"
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    candidates: dict[str, list[str]] = {}
    for name, weight_key in key_map.items():
        if name.startswith(KOHYA_PREFIX) and isinstance(weight_key, str):
            candidates.setdefault(weight_key, []).append(name)
    names: dict[str, str] = {}
    for path in module_paths:
        weight_key = f"diffusion_model.{path}.weight"
        found = candidates.get(weight_key)
        if not found:
            raise ValueError(f"module {path} has no kohya name in ComfyUI's LoRA key map; save in the comfyui format")
        plain = KOHYA_PREFIX + path.replace(".", "_")
        diffusers_style = [n for n in found if n != plain]
        if not diffusers_blocks and plain not in found:
            raise ValueError(f"module {path}: ComfyUI's LoRA key map has no {plain}")
        if diffusers_blocks and not diffusers_style:
            raise ValueError(f"module {path} has no diffusers block name in ComfyUI's LoRA key map")
        names[path] = diffusers_style[0] if diffusers_blocks else plain
    taken: dict[str, str] = {}
    for path, name in names.items():
        if name in taken:  # two modules under one name would load as one: refuse rather than write it
            raise ValueError(f"modules {taken[name]} and {path} both map to kohya name {name}")
        taken[name] = path
    return names


def to_kohya(state: dict[str, torch.Tensor], names: dict[str, str],
             prefix: str = "diffusion_model.") -> dict[str, torch.Tensor]:
    """Rename a ComfyUI-format adapter state dict (`<prefix><path>.<suffix>`) to kohya names."""
    # Longest paths first: `a.b` must not claim the keys of `a.b_c` style siblings through a shared prefix.
    paths = sorted(names, key=len, reverse=True)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        for path in paths:
            head = prefix + path + "."
            if key.startswith(head):
                out[names[path] + "." + key[len(head):]] = tensor
                break
        else:
            raise ValueError(f"adapter key {key} belongs to no adapted module")
    return out


def kohya_metadata(family: str | None, kind: str, rank: int, alpha: float, steps: int, title: str,
                   resolution: tuple[int, int] | None) -> dict[str, str]:
    """The sd-scripts metadata keys UIs read (network dim / alpha / base model / resolution / steps)."""
    base_version, architecture = _KOHYA_BASE.get(family or "", ("", ""))
    metadata = {
        "ss_network_module": "networks.lora" if kind == "lora" else "lycoris.kohya",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_steps": str(steps),
        "ss_max_train_steps": str(steps),
        "ss_output_name": title,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.title": title,
    }
    if kind != "lora":
        args = {"algo": _LYCORIS_ALGO[kind]}
        if kind == "dora":
            args["dora_wd"] = "True"
        metadata["ss_network_args"] = json.dumps(args)
    if base_version:
        metadata["ss_base_model_version"] = base_version
        metadata["modelspec.architecture"] = architecture
    if resolution is not None:
        metadata["ss_resolution"] = f"({resolution[0]}, {resolution[1]})"
        metadata["modelspec.resolution"] = f"{resolution[0]}x{resolution[1]}"
    return metadata


# Text-encoder parts of a LoRA file: Headroom trains the diffusion model only, so continuing drops them.
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "lora_clip", "te1_", "te2_")


def read_lora_file(model, name: str, kind: str = "lora") -> dict[str, tuple]:
    """The adapters of a LoRA file under models/loras/, read the way the stock loader reads it (ComfyUI's format
    conversion and key map: ComfyUI, kohya, diffusers / PEFT names all work): {module path: (down, up, alpha / rank)}
    of a plain LoRA file, or for kind oft {module path: (oft_blocks, alpha)} of an OFT file."""
    source = f"LoRA file {name}"
    path = folder_paths.get_full_path("loras", name)
    if path is None:
        raise ValueError(f"{source} is not in models/loras/ (Load LoRA lists the names to use)")
    state = comfy.lora_convert.convert_lora(comfy.utils.load_torch_file(path, safe_load=True))
    loaded = comfy.lora.load_lora(state, comfy.lora.model_lora_keys_unet(model.model, {}), log_missing=False)
    wanted = "oft" if kind == "oft" else "lora"
    used = set()
    out: dict[str, tuple] = {}
    for weight_key, adapter in loaded.items():
        used |= set(getattr(adapter, "loaded_keys", ()))
        held = getattr(adapter, "name", None)
        if held != wanted or not isinstance(weight_key, str):
            held = held or type(adapter).__name__
            if wanted == "oft":
                raise ValueError(f"{source}: {weight_key} holds a {held} update; kind oft continues OFT files only "
                                 "(oft_blocks): choose the kind the file was trained with")
            hint = "; set the LoRA config's kind to oft to continue it" if held == "oft" else ""
            article = "an" if held[:1] in ("a", "e", "i", "o", "u") else "a"
            raise ValueError(f"{source}: {weight_key} holds {article} {held} update; only plain LoRA files (up / down / "
                             f"alpha) can be continued{hint}")
        module = weight_key[len("diffusion_model."):-len(".weight")]
        if wanted == "oft":
            blocks, rescale, alpha, dora_scale = adapter.weights
            if rescale is not None or dora_scale is not None:
                raise ValueError(f"{source}: {weight_key} has an OFT rescale / DoRA scale, which kind oft does not "
                                 "train; only plain OFT files (oft_blocks / alpha) can be continued")
            out[module] = (blocks, alpha)
            continue
        up, down, alpha, mid, dora_scale, _ = adapter.weights
        if mid is not None or dora_scale is not None:
            raise ValueError(f"{source}: {weight_key} is a LoCon-mid / DoRA layer; only plain LoRA files can be continued")
        out[module] = (down, up, (alpha / down.shape[0]) if alpha is not None else 1.0)
    unmapped = [k for k in state if k not in used and not k.endswith(".alpha")
                and not k.startswith(_TEXT_ENCODER_PREFIXES)]
    if unmapped or not out:
        raise ValueError(f"{source}: {len(unmapped)} of its tensors map to no layer of this model (e.g. "
                         f"{(unmapped or list(state) or ['none'])[0]}): it was trained for another model family")
    return out
