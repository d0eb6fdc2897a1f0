"""LoRA file formats the save node writes: ComfyUI's own key scheme, kohya's (sd-scripts / LyCORIS), diffusers'.

ComfyUI (default): `diffusion_model.<module path>.lora_up.weight / .lora_down.weight / .alpha` — what the
trainer exports (training/core/adapters.py); ComfyUI's loader maps it, other tools mostly do not.

kohya: `lora_unet_<name>.<same suffixes>` plus the `ss_*` / `modelspec.*` metadata other UIs show. That is
what A1111 / Forge load, what Civitai expects, and what diffusers converts (`load_lora_weights` reads kohya
files). <name> is the module path with `.` -> `_` in the naming sd-scripts uses for that family: diffusers'
block names for SD1.x / SD2.x (its UNet there is diffusers': `down_blocks_0_attentions_0_proj_in`), the
original module path everywhere else (SDXL: `input_blocks_4_1_proj_in`, Flux: `double_blocks_0_img_attn_qkv`,
SD3: `joint_blocks_0_x_block_attn_qkv`).

diffusers: the names diffusers' pipelines load (`load_lora_weights` / `lora_state_dict`), plain LoRA only, alpha
folded into the up weights (diffusers / PEFT files carry no per-layer alpha: scale 1) and the PEFT LoraConfig in
the `lora_adapter_metadata` entry diffusers reads. SD3 / Flux: PEFT names `transformer.<diffusers module
path>.lora_A.weight / .lora_B.weight`; a fused ComfyUI weight (qkv, Flux's single-block linear1) is written as
diffusers' separate layers (to_q / to_k / to_v / proj_mlp): the up rows split, the down weight repeated. SD1.x /
SDXL UNets: ComfyUI's key map has no PEFT names for the attention projections there, only diffusers' attention-
processor names (`unet.<block path>.processor.to_q`, `...processor.to_out`), so those are written with that
format's suffixes (`.to_q_lora.down.weight` / `.up.weight`) and other layers as `unet.<path>.lora.down.weight`;
diffusers' UNet loader converts both to PEFT names itself (`convert_unet_state_dict_to_peft`).

The names are taken from ComfyUI's own LoRA key map (`comfy.lora.model_lora_keys_unet`) rather than a table
written here: every name saved is, by construction, one the stock loader maps back to the same weight.
"""
from __future__ import annotations

import collections
import json
import re

import torch

import comfy.lora
import comfy.lora_convert
import comfy.utils
import folder_paths

from ...training.data.files import no_json_constants
from . import families

FORMATS = ("comfyui", "kohya", "diffusers")
KOHYA_PREFIX = "lora_unet_"
# The key diffusers writes and reads the PEFT LoraConfig under (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY).
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"

# LyCORIS' network module and algo names for the adapter kinds that are not plain LoRA.
_LYCORIS_ALGO = {"loha": "loha", "lokr": "lokr", "dora": "lora", "oft": "diag-oft"}


def diffusers_component(family: str | None) -> str | None:
    """The component of a diffusers pipeline the diffusion model is (the prefix of its LoRA keys), or None."""
    known = families.get(family)
    return None if known is None else known.diffusers_component


def kohya_names(model, module_paths, family: str | None) -> dict[str, str]:
    """{module path inside the diffusion model: kohya name} for the adapted modules of a ComfyUI MODEL.

    From ComfyUI's key map: of the `lora_unet_*` names that map to a module's weight, the diffusers-block one
    for SD1.x (what sd-scripts writes there), else the plain path form.
    """
    known = families.get(family)
    diffusers_blocks = known is not None and known.kohya_diffusers_block_names
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


# sd-scripts' text-encoder name prefixes by CLIP: one CLIP alone is lora_te_, SDXL's two lora_te1_ (L) / lora_te2_ (G).
_KOHYA_TEXT_ENCODERS = {("clip_l", False): "lora_te_", ("clip_l", True): "lora_te1_", ("clip_g", False): "lora_te_",
                        ("clip_g", True): "lora_te2_", ("clip_h", False): "lora_te_"}


def kohya_text_encoder_names(key_map: dict, clip_keys: set[str], weights) -> dict[str, str]:
    """{CLIP weight key: its kohya name} (`lora_te_text_model_encoder_layers_0_mlp_fc1`, SDXL's `lora_te1_...` /
    `lora_te2_...`), taken from ComfyUI's key map of the CLIP (`key_map`), so every name maps back to its weight."""
    pair = {"clip_l", "clip_g"} <= {key.split(".", 1)[0] for key in clip_keys}
    by_weight: dict[str, list[str]] = {}
    for name, weight in key_map.items():
        if isinstance(weight, str) and weight in clip_keys and name.startswith("lora_te"):
            by_weight.setdefault(weight, []).append(name)
    names = {}
    for weight in weights:
        prefix = _KOHYA_TEXT_ENCODERS.get((weight.split(".", 1)[0], pair and weight.startswith(("clip_l.", "clip_g."))))
        found = [name for name in by_weight.get(weight, []) if prefix and name.startswith(prefix)]
        if len(found) != 1:
            raise ValueError(f"text-encoder layer {weight} has no kohya name in ComfyUI's LoRA key map; save in the "
                             "comfyui format")
        names[weight] = found[0]
    return names


# The diffusers pipeline components of the CLIP text encoders ComfyUI's key map names (SD1.5 / SD2 / Flux: one,
# "text_encoder"; SDXL / SD3: CLIP-L "text_encoder", CLIP-G "text_encoder_2").
DIFFUSERS_TEXT_ENCODERS = ("text_encoder.", "text_encoder_2.")


def diffusers_text_encoder_names(key_map: dict, clip_keys: set[str], weights) -> dict[str, str]:
    """{CLIP weight key: its diffusers layer name} (`text_encoder.text_model.encoder.layers.0.mlp.fc1`, SDXL's CLIP-G
    `text_encoder_2.text_model...`), taken from ComfyUI's key map of the CLIP (`key_map`), so every name maps back
    to its weight."""
    by_weight: dict[str, list[str]] = {}
    for name, weight in key_map.items():
        if isinstance(weight, str) and weight in clip_keys and name.startswith(DIFFUSERS_TEXT_ENCODERS):
            by_weight.setdefault(weight, []).append(name)
    names = {}
    for weight in weights:
        found = by_weight.get(weight, [])
        if len(found) != 1:
            raise ValueError(f"text-encoder layer {weight} has no diffusers name in ComfyUI's LoRA key map; save in "
                             "the comfyui or kohya format")
        names[weight] = found[0]
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


# A full fine-tune's file holds whole-weight differences ("diff" keys), which only ComfyUI's loader reads.
FULL_FORMATS = ("kind full cannot be saved in the {format} format (it holds whole-weight differences, which only "
                "ComfyUI's Load LoRA applies): save it in the comfyui format; for a model file, load it with Load "
                "LoRA and save with the stock Save Model / Save Checkpoint nodes")


def check_kohya_kind(kind: str) -> None:
    if kind == "full":
        raise ValueError(FULL_FORMATS.format(format="kohya"))


def check_diffusers_kind(kind: str) -> None:
    """diffusers-format files hold plain LoRA; the other kinds have no file both ComfyUI and diffusers read."""
    if kind == "dora":
        raise ValueError("kind dora cannot be saved in the diffusers format (diffusers reads PEFT's "
                         "lora_magnitude_vector, ComfyUI's loader only dora_scale, so no such file loads in both); "
                         "save it in the comfyui or kohya format")
    if kind == "full":
        raise ValueError(FULL_FORMATS.format(format="diffusers"))
    if kind != "lora":
        raise ValueError(f"kind {kind} cannot be saved in the diffusers format (diffusers / PEFT LoRA files hold "
                         "plain LoRA); save it in the comfyui or kohya format")


def diffusers_names(model, module_paths, family: str | None) -> dict[str, list[tuple[str, torch.Tensor | None]]]:
    """{module path inside the diffusion model: [(diffusers layer name, rows)]}: the diffusers layer's up weight
    is the ComfyUI up weight's `rows` (an index tensor; None: all, in order).

    From ComfyUI's key map, the `unet.` / `transformer.` names of each module's weight: where diffusers keeps
    separate layers for parts of one ComfyUI weight (tuple entries `(key, (dim, offset, size))`), those parts,
    when they tile the weight's rows; else the first whole-weight name ComfyUI lists that the family prefers
    (`Family.diffusers_names_preferred`: Flux.2's `ff.linear_in` / `attn.to_out` / `attn.to_qkv_mlp_proj`, listed
    after Flux.1's names), or the first it lists (comfy.utils' conversion tables list diffusers' own name first,
    aliases of other tools after it: LyCORIS `ff.linear_in`); else a whole-weight name whose entry carries a function
    (`(key, None, function)`: ComfyUI adds function(diffusers delta)), when that function is a row permutation
    (SD3's last context modulation, `swap_scale_shift`), checked on the weight itself.
    """
    component = diffusers_component(family)
    if component is None:
        covered = ", ".join(name for name, known in families.FAMILIES.items() if known.diffusers_component)
        raise ValueError(f"the diffusers format covers {covered} models, not family {family} (ComfyUI's LoRA loader "
                         "maps no diffusers names for it); save in the comfyui or kohya format")
    preferred = [re.compile(p) for p in families.get(family).diffusers_names_preferred]
    key_map = comfy.lora.model_lora_keys_unet(model.model, {})
    state = model.model.state_dict()
    whole: dict[str, list[str]] = {}
    parts: dict[str, list[tuple[str, tuple[int, int, int]]]] = {}
    permuted: dict[str, list[tuple[str, object]]] = {}
    for name, target in key_map.items():
        if not name.startswith(component + "."):
            continue
        if isinstance(target, str):
            whole.setdefault(target, []).append(name)
        elif len(target) == 2:  # (key, (dim, offset, size))
            parts.setdefault(target[0], []).append((name, tuple(target[1])))
        elif len(target) == 3 and target[1] is None:  # (key, None, function)
            permuted.setdefault(target[0], []).append((name, target[2]))
    names: dict[str, list[tuple[str, torch.Tensor | None]]] = {}
    for path in module_paths:
        weight_key = f"diffusion_model.{path}.weight"
        weight = state.get(weight_key)
        split = sorted(parts.get(weight_key, []), key=lambda item: item[1][1])
        offsets = [sum(size for _, (_, _, size) in split[:i]) for i in range(len(split))]
        if (weight is not None and split and all(dim == 0 for _, (dim, _, _) in split)
                and [offset for _, (_, offset, _) in split] == offsets
                and sum(size for _, (_, _, size) in split) == weight.shape[0]):
            names[path] = [(name, torch.arange(offset, offset + size)) for name, (_, offset, size) in split]
        elif whole.get(weight_key):
            listed = whole[weight_key]
            names[path] = [(next((n for n in listed if any(p.search(n) for p in preferred)), listed[0]), None)]
        elif weight is not None and permuted.get(weight_key):
            name, function = permuted[weight_key][0]
            rows = _row_permutation(function, weight)
            if rows is None:
                raise ValueError(f"module {path}: ComfyUI maps diffusers' {name} to it through a function that is not "
                                 "a reordering of rows; save in the comfyui or kohya format")
            names[path] = [(name, rows)]
        else:
            raise ValueError(f"module {path} has no diffusers name in ComfyUI's LoRA key map; save in the comfyui "
                             "or kohya format")
    taken: dict[str, str] = {}
    for path, layers in names.items():
        for name, _ in layers:
            if name in taken:
                raise ValueError(f"modules {taken[name]} and {path} both map to diffusers name {name}")
            taken[name] = path
    return names


def _row_permutation(function, weight: torch.Tensor) -> torch.Tensor | None:
    """For `ComfyUI weight = function(diffusers weight)` a row permutation: the ComfyUI rows the diffusers
    weight's rows are (diffusers = comfy[result]), or None when the function is not that on this weight."""
    count = weight.shape[0]
    try:
        order = function(torch.arange(count, dtype=torch.float64).reshape(count, 1)).reshape(-1).round().long()
    except Exception:  # noqa: BLE001 - any failure means: not a row reordering
        return None
    if order.shape != (count,) or not torch.equal(order.sort().values, torch.arange(count)):
        return None
    rows = torch.argsort(order)  # comfy[i] = diffusers[order[i]]  =>  diffusers = comfy[argsort(order)]
    with torch.no_grad():
        diffusers_weight = weight.detach().float()[rows]
        if not torch.equal(function(diffusers_weight), weight.detach().float()):
            return None
    return rows


def _diffusers_module(name: str, component: str) -> tuple[str, str, str]:
    """(module path in the diffusers model, down suffix, up suffix) of a diffusers layer name from the key map.

    ComfyUI's attention-processor names (`<path>.processor.to_q`, `<path>.processor.to_out`) take that format's
    `_lora.down.weight` suffixes; diffusers reads them as `<path>.to_q` / `<path>.to_out.0` (it drops
    `.processor.` and maps `.to_out_lora` to `.to_out.0`). Other UNet names take `.lora.down.weight`, transformer
    names PEFT's `.lora_A.weight`.
    """
    path = name[len(component) + 1:]
    if ".processor." in path:
        module = path.replace(".processor.", ".")
        return (module + ".0" if module.endswith(".to_out") else module), "_lora.down.weight", "_lora.up.weight"
    if component == "unet":
        return path, ".lora.down.weight", ".lora.up.weight"
    return path, ".lora_A.weight", ".lora_B.weight"


def to_diffusers(state: dict[str, torch.Tensor], names: dict[str, list[tuple[str, torch.Tensor | None]]],
                 family: str | None, dtype: torch.dtype, prefix: str = "diffusion_model.",
                 component: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A ComfyUI-format plain-LoRA state dict (fp32) as diffusers names, alpha / rank folded into the up weights
    (each split part gets its rows of up, the whole down); also the PEFT LoraConfig fields of the file. The pipeline
    component: the family's model (`family`), or `component` (a text encoder's)."""
    component = component or families.FAMILIES[family].diffusers_component
    out: dict[str, torch.Tensor] = {}
    targets: dict[str, int] = {}  # diffusers module: its rank
    used = set()
    for path, layers in names.items():
        key = prefix + path
        down, up = state[f"{key}.lora_down.weight"].float(), state[f"{key}.lora_up.weight"].float()
        alpha = state.get(f"{key}.alpha")
        used |= {f"{key}.lora_down.weight", f"{key}.lora_up.weight", f"{key}.alpha"}
        rank = down.shape[0]
        if alpha is not None and float(alpha) != rank:
            up = up * (float(alpha) / rank)
        for name, rows in layers:
            module, down_suffix, up_suffix = _diffusers_module(name, component)
            part = up if rows is None else up[rows]
            out[name + down_suffix] = down.to(dtype).contiguous()
            out[name + up_suffix] = part.to(dtype).contiguous()
            targets[module] = rank
    left = sorted(set(state) - used)
    if left:
        raise ValueError(f"adapter key {left[0]} has no place in a diffusers-format file (plain LoRA only)")
    # alpha is folded into up, so every layer's alpha is its rank. Layers of another rank than the most common one
    # (LoRA Config layer_ranks) are named by their module paths in peft's rank_pattern / alpha_pattern, as diffusers
    # itself names them when it reads a file without this config (peft matches a key at the end of a path after a dot).
    rank = collections.Counter(targets.values()).most_common(1)[0][0]
    config = {"r": int(rank), "lora_alpha": int(rank), "target_modules": sorted(targets)}
    others = {module: int(r) for module, r in sorted(targets.items()) if r != rank}
    if others:
        config.update(rank_pattern=others, alpha_pattern=dict(others))
    from peft import LoraConfig  # on first use: peft's import is most of the pack's own (training/core/adapters.py)

    LoraConfig(**config)  # what diffusers builds from it: must construct
    return out, {f"{component}.{field}": value for field, value in config.items()}


def diffusers_metadata(config: dict) -> dict[str, str]:
    """The LoraConfig under the key diffusers reads (fields prefixed by the pipeline component, as it writes them)."""
    return {DIFFUSERS_METADATA_KEY: json.dumps(config, indent=2, sort_keys=True), "format": "pt"}


# Metadata a resized file must not carry over: hashes of the weights before (kohya's, modelspec's), and the run that
# wrote it (a run's keep_saves removes only files whose metadata names it as their writer).
_STALE_AFTER_RESIZE = ("sshs_model_hash", "sshs_legacy_hash", "modelspec.hash_sha256", "headroom.run")


def resized_metadata(metadata: dict[str, str] | None, ranks: dict[str, int], alphas: dict[str, float],
                     source: str, resize: dict,
                     convolutions: list[tuple[int, float]] = ()) -> tuple[dict[str, str], list[str]]:
    """A resized LoRA file's metadata (training/core/lora_resize.py): the source's, with its rank and alpha keys
    (kohya's ss_network_dim / ss_network_alpha: "Dynamic" where layers differ, as sd-scripts' resize writes them;
    Headroom's own; diffusers' PEFT LoraConfig: r, lora_alpha, rank_pattern, alpha_pattern per module) made to
    match the new layers (`ranks` / `alphas` by layer name), stale hashes left out, and where it came from. Also
    notes on what was left out. A diffusers config gets every layer's alpha = its rank (scale 1), as the stock loader
    reads a file without alpha keys, so diffusers then applies what ComfyUI applies. `convolutions`: (rank, alpha)
    after, of each convolution with a kernel over 1x1, for kohya's conv_dim / conv_alpha network args."""
    out = {k: v for k, v in (metadata or {}).items() if k not in _STALE_AFTER_RESIZE}
    notes = []
    common = collections.Counter(ranks.values()).most_common(1)[0][0]
    one_alpha = len(set(alphas.values())) == 1
    if "ss_network_dim" in out:
        out["ss_network_dim"] = str(common) if len(set(ranks.values())) == 1 else "Dynamic"
        out["ss_network_alpha"] = f"{next(iter(alphas.values())):g}" if one_alpha else "Dynamic"
    if "ss_network_args" in out:
        out["ss_network_args"] = _resized_network_args(out["ss_network_args"], convolutions)
    if "headroom.rank" in out:
        out["headroom.rank"] = str(common)
        out["headroom.alpha"] = f"{alphas[next(k for k, r in ranks.items() if r == common)]:g}"
    if DIFFUSERS_METADATA_KEY in out:
        try:
            config = json.loads(out[DIFFUSERS_METADATA_KEY], parse_constant=no_json_constants)
            if not isinstance(config, dict):
                raise ValueError("not an object")
            out[DIFFUSERS_METADATA_KEY] = json.dumps(_resized_peft_config(config, ranks), indent=2, sort_keys=True)
        except ValueError as error:
            del out[DIFFUSERS_METADATA_KEY]
            notes.append(f"its diffusers LoraConfig ({DIFFUSERS_METADATA_KEY}) could not be read ({error}) and was left "
                         "out: diffusers reads the ranks from the weights")
    out["headroom.resized_from"] = source
    out["headroom.resize"] = json.dumps(resize, sort_keys=True)
    return out, notes


def _resized_network_args(text: str, convolutions: list[tuple[int, float]]) -> str:
    """sd-scripts' network args after a resize: conv_dim / conv_alpha as kohya_conv_args writes them for the
    convolutions' new ranks (left out where they differ); the text as it was where it is not a JSON object of them."""
    try:
        args = json.loads(text, parse_constant=no_json_constants)
    except (ValueError, RecursionError):
        return text
    if not isinstance(args, dict) or "conv_dim" not in args:
        return text
    args = {k: v for k, v in args.items() if k not in ("conv_dim", "conv_alpha")}
    return json.dumps({**args, **kohya_conv_args("lora", list(convolutions))})


def _resized_peft_config(config: dict, ranks: dict[str, int]) -> dict:
    """The flattened "<component>.<field>" LoraConfig diffusers writes, with each component's r / lora_alpha the most
    common rank of its layers and the other layers in rank_pattern / alpha_pattern (alpha = rank: scale 1)."""
    components = {key.split(".", 1)[0] for key in config if "." in key and key.endswith(".r")}
    if not components:
        raise ValueError("no component's rank 'r' in it")
    out = dict(config)
    for component in sorted(components):
        modules = {_diffusers_module(layer, component)[0]: rank for layer, rank in ranks.items()
                   if layer.startswith(component + ".")}
        if not modules:
            continue
        common = collections.Counter(modules.values()).most_common(1)[0][0]
        others = {module: rank for module, rank in sorted(modules.items()) if rank != common}
        out[f"{component}.r"] = out[f"{component}.lora_alpha"] = int(common)
        out[f"{component}.rank_pattern"], out[f"{component}.alpha_pattern"] = others, dict(others)
    return out


def kohya_conv_args(kind: str, convolutions: list[tuple[int, float]]) -> dict[str, str]:
    """sd-scripts' / LyCORIS' `conv_dim` / `conv_alpha` network args (LoCon) for the (rank, alpha) of each trained
    convolution with a kernel larger than 1x1 (their 1x1 ones take network_dim / alpha, as ours take `rank` / `alpha`).
    Written only where one rank and one alpha hold for all of them: per-layer values are in the file's shapes and
    alpha keys, which loaders read; a single conv_dim would misstate them."""
    if kind == "oft" or not convolutions or len(set(convolutions)) != 1:  # OFT's rank is a block size, not a dim
        return {}
    rank, alpha = convolutions[0]
    return {"conv_dim": str(int(rank)), "conv_alpha": f"{float(alpha):g}"}


def kohya_metadata(family: str | None, kind: str, rank: int | str, alpha: float | str, steps: int | None, title: str,
                   resolution: tuple[int, int] | None, model=None,
                   network_args: dict[str, str] | None = None) -> dict[str, str]:
    """The sd-scripts metadata keys UIs read (network dim / alpha / base model / resolution / steps). `model`: the
    ComfyUI MODEL, for the family's model-dependent keys (Family.kohya_architecture: the variant's architecture
    string; Family.kohya_extra: SD2's v-prediction keys). `network_args`: more of sd-scripts' network args
    (kohya_conv_args), written in `ss_network_args` as sd-scripts writes them. `steps` None: not a trained file (a
    merge), no step keys."""
    known = families.get(family)
    base_version, architecture = known.kohya_base if known is not None else ("", "")
    if known is not None and known.kohya_architecture is not None and model is not None:
        architecture = known.kohya_architecture(model.model) or ""
    metadata = {
        "ss_network_module": "networks.lora" if kind == "lora" else "lycoris.kohya",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        **({} if steps is None else {"ss_steps": str(steps), "ss_max_train_steps": str(steps)}),
        "ss_output_name": title,
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.title": title,
    }
    args = dict(network_args or {})
    if kind != "lora":
        args["algo"] = _LYCORIS_ALGO[kind]
        if kind == "dora":
            args["dora_wd"] = "True"
    if args:
        metadata["ss_network_args"] = json.dumps(args)
    if base_version:
        metadata["ss_base_model_version"] = base_version
    if architecture:
        metadata["modelspec.architecture"] = architecture
    if known is not None and known.kohya_extra is not None and model is not None:
        metadata.update(known.kohya_extra(model.model))
    if resolution is not None:
        metadata["ss_resolution"] = f"({resolution[0]}, {resolution[1]})"
        metadata["modelspec.resolution"] = f"{resolution[0]}x{resolution[1]}"
    return metadata


def kohya_training_metadata(optimizer, train) -> dict[str, str]:
    """The sd-scripts keys of how the LoRA was trained (`optimizer`: OptimizerConfig, `train`: TrainConfig), as other
    UIs and Civitai list them."""
    objective = train.objective
    metadata = {
        "ss_optimizer": optimizer.name, "ss_learning_rate": str(optimizer.lr), "ss_unet_lr": str(optimizer.lr),
        "ss_lr_scheduler": optimizer.schedule, "ss_lr_warmup_steps": str(optimizer.warmup_steps),
        "ss_seed": str(train.seed), "ss_batch_size_per_device": str(train.batch_size),
        "ss_gradient_accumulation_steps": str(train.grad_accum), "ss_max_grad_norm": str(train.max_grad_norm),
        "ss_mixed_precision": train.precision, "ss_caption_dropout_rate": str(train.caption_dropout),
        "ss_noise_offset": str(objective.noise_offset), "ss_loss_type": objective.loss_type,
    }
    if objective.loss_weighting == "min_snr":
        metadata["ss_min_snr_gamma"] = str(objective.min_snr_gamma)
    if objective.loss_weighting == "debiased":
        metadata["ss_debiased_estimation"] = "True"
    if optimizer.scale_weight_norms:
        metadata["ss_scale_weight_norms"] = str(optimizer.scale_weight_norms)
    if objective.ip_noise_gamma:
        metadata["ss_ip_noise_gamma"] = str(objective.ip_noise_gamma)
    if objective.ip_noise_gamma_random_strength:
        metadata["ss_ip_noise_gamma_random_strength"] = "True"
    if objective.noise_offset_random_strength:
        metadata["ss_noise_offset_random_strength"] = "True"
    if objective.multires_noise_iterations:
        metadata["ss_multires_noise_iterations"] = str(objective.multires_noise_iterations)
        metadata["ss_multires_noise_discount"] = str(objective.multires_noise_discount)
    if optimizer.loraplus_lr_ratio != 1.0:
        metadata["ss_loraplus_lr_ratio"] = str(optimizer.loraplus_lr_ratio)
    return metadata


# Text-encoder parts of a LoRA file: Headroom trains the diffusion model only, so continuing drops them.
_TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "lora_clip", "te1_", "te2_")


def _join_rows(module: str, pieces, model, source: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One LoRA layer on a fused weight from diffusers layers holding row ranges of it (what the diffusers format
    writes: one down weight, the up rows split), each piece's alpha / rank folded into its rows of up."""
    rows = model.model.state_dict()[f"diffusion_model.{module}.weight"].shape[0]
    offsets = [sum(p[1] for p in pieces[:i]) for i in range(len(pieces))]
    if [p[0] for p in pieces] != offsets or sum(p[1] for p in pieces) != rows:
        raise ValueError(f"{source}: the layers it holds for {module} do not cover that weight; it cannot be continued")
    down = pieces[0][2]
    if any(not torch.equal(p[2], down) for p in pieces):
        raise ValueError(f"{source}: its separate layers for {module} (e.g. diffusers' to_q / to_k / to_v) have "
                         "different down weights, which one LoRA layer on ComfyUI's fused weight cannot hold; "
                         "it cannot be continued")
    return down, torch.cat([p[3] * p[4] if p[4] != 1.0 else p[3] for p in pieces]), 1.0


# Keys of a file that belong to a layer without being its up / down: load_lora reads them beside the adapter, by the
# layer's mapped name, without listing them in the adapter's loaded_keys.
_BESIDE_A_LAYER = (".alpha", ".dora_scale", ".diff", ".diff_b", ".w_norm", ".b_norm", ".set_weight", ".reshape_weight")


def keys_not_loaded(state: dict, loaded: dict, key_map: dict) -> list[str]:
    """The keys of a file's tensors `state` that `comfy.lora.load_lora(state, key_map)`, which returned `loaded`, left
    unread: what the stock loader logs as "lora key not loaded"."""
    read = {key for adapter in loaded.values() for key in getattr(adapter, "loaded_keys", ())}
    return [key for key in state if key not in read and not (
        key.endswith(_BESIDE_A_LAYER) and key[:key.rfind(".")] in key_map)]


def _with_peft_attention_names(key_map: dict) -> dict:
    """ComfyUI's key map with the PEFT names of SD1.x / SDXL attention projections added (`unet.<block>.attn1.to_k`,
    `...to_out.0`: what diffusers' training scripts and `save_lora_weights` write). The map holds only the
    attention-processor names there (`...processor.to_k`), so the stock loader drops those layers."""
    added = {}
    for name, target in key_map.items():
        if ".processor.to_" in name:
            peft = name.replace(".processor.to_", ".to_")
            added[peft + ".0" if peft.endswith(".to_out") else peft] = target
    return {**added, **key_map}


def read_lora_layers(model, name: str, kind: str = "lora", clip=None) -> tuple[dict[str, tuple], dict[str, tuple]]:
    """The adapters of a LoRA file under models/loras/, read the way the stock loader reads it (ComfyUI's format
    conversion and key map: ComfyUI, kohya, diffusers / PEFT names all work): {module path: (down, up, alpha / rank)}
    of a plain LoRA file, or for kind oft {module path: (oft_blocks, alpha)} of an OFT file; and with `clip`, its
    text encoders' layers too, as the stock Load LoRA maps them onto the CLIP (comfyui `text_encoders.*`, kohya
    `lora_te*` names), by module path under the CLIP's `cond_stage_model` (without `clip`: none, the file's
    text-encoder tensors left unread)."""
    source = f"LoRA file {name}"
    path = folder_paths.get_full_path("loras", name)
    if path is None:
        raise ValueError(f"{source} is not in models/loras/ (Load LoRA lists the names to use)")
    state = comfy.lora_convert.convert_lora(comfy.utils.load_torch_file(path, safe_load=True))
    key_map = _with_peft_attention_names(comfy.lora.model_lora_keys_unet(model.model, {}))
    if clip is not None:  # the CLIP's weights are keyed by their own paths, the model's under "diffusion_model."
        key_map.update(comfy.lora.model_lora_keys_clip(clip.cond_stage_model, {}))
    loaded = comfy.lora.load_lora(state, key_map, log_missing=False)
    diffs = sorted(t if isinstance(t, str) else t[0] for t, a in loaded.items() if isinstance(a, tuple) and a[0] == "diff")
    if diffs:  # ComfyUI's Train LoRA + Save LoRA Weights always write them (its trained biases / norms)
        raise ValueError(
            f"{source}: besides its LoRA layers it holds {len(diffs)} whole-tensor 'diff' patches (e.g. "
            f"{diffs[0][len('diffusion_model.'):]}: biases / norm weights trained directly, as ComfyUI's Train LoRA + "
            "Save LoRA Weights write them), which a Headroom run neither trains nor carries into what it saves; it "
            "cannot be continued. Apply the file with Load LoRA on the MODEL and train a new LoRA on top "
            "(init_lora none), or continue it with ComfyUI's Train LoRA (existing_lora)")
    wanted = "oft" if kind == "oft" else "lora"
    used = set()
    out: dict[str, tuple] = {}
    encoder: dict[str, tuple] = {}  # the CLIP's
    parts: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = {}
    for target, adapter in loaded.items():
        used |= set(getattr(adapter, "loaded_keys", ()))
        weight_key = target if isinstance(target, str) else target[0]
        part = None if isinstance(target, str) else target[1:]  # ((dim, offset, size),) or (None, function)
        rows_part = part is not None and part[0] is not None
        held = getattr(adapter, "name", None)
        if held != wanted or (wanted == "oft" and part is not None) or \
                (rows_part and (len(part) != 1 or part[0][0] != 0)):
            held = held or type(adapter).__name__
            if wanted == "oft":
                raise ValueError(f"{source}: {weight_key} holds a {held} update; kind oft continues OFT files only "
                                 "(oft_blocks): choose the kind the file was trained with")
            hint = "; set the LoRA config's kind to oft to continue it" if held == "oft" else ""
            article = "an" if held[:1] in ("a", "e", "i", "o", "u") else "a"
            raise ValueError(f"{source}: {weight_key} holds {article} {held} update; only plain LoRA files (up / down / "
                             f"alpha) can be continued{hint}")
        if not weight_key.startswith("diffusion_model."):  # a text encoder's (read only with `clip`: kind lora)
            up, down, alpha, mid, dora_scale, _ = adapter.weights
            if part is not None or mid is not None or dora_scale is not None:
                raise ValueError(f"{source}: {weight_key} of the text encoder is not a plain LoRA layer; only plain "
                                 "LoRA text-encoder layers (up / down / alpha) can be continued")
            encoder[weight_key[:-len(".weight")]] = (down, up, (alpha / down.shape[0]) if alpha is not None else 1.0)
            continue
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
        scale = (alpha / down.shape[0]) if alpha is not None else 1.0
        if part is not None and not rows_part:  # ComfyUI adds function(delta): a row permutation moves up's rows
            if _row_permutation(part[1], model.model.state_dict()[weight_key]) is None:
                raise ValueError(f"{source}: {weight_key} is patched through a function that is not a reordering of "
                                 "rows; it cannot be continued")
            out[module] = (down, part[1](up.float()), scale)
        elif part is None:
            out[module] = (down, up, scale)
        else:  # a diffusers layer that is rows of a fused ComfyUI weight (q / k / v of qkv)
            parts.setdefault(module, []).append((part[0][1], part[0][2], down, up, scale))
    for module, pieces in parts.items():
        out[module] = _join_rows(module, sorted(pieces, key=lambda p: p[0]), model, source)
    unmapped = [k for k in state if k not in used and not k.endswith(".alpha")
                and (clip is not None or not k.startswith(_TEXT_ENCODER_PREFIXES))]
    if unmapped or not (out or encoder):
        whose = "this model or its CLIP" if clip is not None else "this model"
        raise ValueError(f"{source}: {len(unmapped)} of its tensors map to no layer of {whose} (e.g. "
                         f"{(unmapped or list(state) or ['none'])[0]}): it was trained for another model family")
    return out, encoder
