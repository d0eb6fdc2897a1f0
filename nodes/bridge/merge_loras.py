"""Merge LoRAs (Headroom): LoRA files of any format Load LoRA reads, summed at their strengths into one file.

Each file is read the way the stock loader reads it (`comfy.lora_convert.convert_lora`, ComfyUI's key maps of the
MODEL and CLIP given, `comfy.lora.load_lora`), so ComfyUI, kohya and diffusers / PEFT files merge with each other:
their layers meet at the model weight they patch (a diffusers q / k / v layer as rows of ComfyUI's fused qkv). The
sums (training/core/lora_merge.py) are written in ComfyUI's own keys: `diffusion_model.<path>.lora_up.weight` for
the diffusion model, `text_encoders.<clip path>.lora_up.weight` for text-encoder layers, both names the stock loader
maps (comfy/lora.py), `.diff` / `.diff_b` for whole-tensor differences.
"""
from __future__ import annotations

import json
import math
import os

import torch

import comfy.lora
import comfy.lora_convert

from ...training.core.lora_merge import Update, merge_updates
from ...training.core.lora_resize import checked_factors, counted
from ...training.core.run_dir import check_subfolder
from ...training.data.files import format_bytes, no_json_constants, prune_temp, save_safetensors
from . import lora_formats
from .comfy_model import model_family
from .lora_formats import _TEXT_ENCODER_PREFIXES, _row_permutation, _with_peft_attention_names, keys_not_loaded
from .model_files import MERGE_DTYPES, MERGE_FORMATS, MERGE_NONE, listed_name, lora_output, read_lora_state
from .run_lora import MAX_SAVED_TAGS, SAVE_DTYPES

_TAG_FREQUENCY_MAX_BYTES = 4 << 20


class _Sources:
    """The MODEL's and CLIP's weights a file's layers may patch: ComfyUI's key map of both and each weight's shape."""

    def __init__(self, model, clip):
        self.key_map = _with_peft_attention_names(comfy.lora.model_lora_keys_unet(model.model, {}))
        self.shapes = {key: tuple(value.shape) for key, value in model.model.state_dict().items()}
        self.clip_keys: set[str] = set()
        if clip is not None:
            clip_state = clip.cond_stage_model.state_dict()
            self.key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, self.key_map)
            self.clip_keys = set(clip_state)
            self.shapes.update({key: tuple(value.shape) for key, value in clip_state.items()})
        self.has_clip = clip is not None

    def saved_names(self, model, weights: set[str], file_format: str) -> dict[str, str]:
        """{weight: the name its merged layer is saved under (before `.lora_up.weight` / `.diff`)}. comfyui: ComfyUI's
        generic names, which its key map holds for every weight (`diffusion_model.<path>`, `text_encoders.<clip
        path>`); kohya: sd-scripts' (`lora_unet_*` as Save LoRA writes them, `lora_te_*` / `lora_te1_*` /
        `lora_te2_*` for CLIP-L / CLIP-G layers), which A1111 / Forge read too."""
        if file_format == "comfyui":
            return {w: ("text_encoders." if w in self.clip_keys else "") + w[:-len(".weight")] for w in weights}
        unet = sorted(w for w in weights if w not in self.clip_keys)
        names = lora_formats.kohya_names(model, [w[len("diffusion_model."):-len(".weight")] for w in unet],
                                         model_family(model.model))
        out = {w: names[w[len("diffusion_model."):-len(".weight")]] for w in unet}
        return out | lora_formats.kohya_text_encoder_names(self.key_map, self.clip_keys,
                                                           [w for w in weights if w in self.clip_keys])

    def saved_keys(self, model, layers, differences, file_format: str) -> tuple[dict[str, str], dict[str, str]]:
        """({weight: name} of the merged LoRA layers, {target: key} of the differences) in `file_format`."""
        def owner(target: str) -> str | None:  # the weight whose name a difference takes (a bias: its layer's)
            return target if target.endswith(".weight") else \
                target[:-len(".bias")] + ".weight" if target.endswith(".bias") else None

        owners = {target: owner(target) for target in differences}
        for target, weight in owners.items():
            if weight is None or weight not in self.shapes:
                if file_format != "comfyui" or target in self.clip_keys:
                    raise ValueError(f"the difference for {target} has no name in the {file_format} format: save in "
                                     "the comfyui format")
        names = self.saved_names(model, set(layers) | {w for w in owners.values() if w in self.shapes}, file_format)
        keys = {}
        for target, weight in owners.items():
            if weight is None or weight not in self.shapes:
                keys[target] = f"{target}.diff"  # ComfyUI's map names the model's other tensors as they are
            else:
                keys[target] = f"{names[weight]}.diff" if target == weight else f"{names[weight]}.diff_b"
        return {w: names[w] for w in layers}, keys


def _read(name: str, state: dict[str, torch.Tensor], strength: float, sources: _Sources,
          layers: dict[str, list[Update]], differences: dict[str, torch.Tensor], dtypes: set) -> None:
    """Add the updates of LoRA file `name` (its tensors: `state`) at `strength` to `layers` / `differences` (by the
    model weight they patch). Every field of the (untrusted) file is checked; errors name it."""
    source = f"LoRA file {name}"
    try:
        state = comfy.lora_convert.convert_lora(state)
        loaded = comfy.lora.load_lora(state, sources.key_map, log_missing=False)
    except Exception as error:  # noqa: BLE001 - a malformed file makes ComfyUI's reader fail anywhere
        raise ValueError(f"{source} cannot be read as a LoRA ({type(error).__name__}: {str(error)[:200]})") from None
    for target, adapter in loaded.items():
        weight = target if isinstance(target, str) else target[0]
        shape = sources.shapes.get(weight)
        if shape is None:  # ComfyUI's map names only the model's keys; a converted file may still name others
            raise ValueError(f"{source}: {weight} is not a weight of this model")
        if isinstance(adapter, tuple):  # ("diff", (tensor,)) and ComfyUI's other whole-tensor patches
            if adapter[0] != "diff" or not isinstance(target, str):
                raise ValueError(f"{source}: {weight} holds a {adapter[0]!r} patch; only LoRA layers (up / down) and "
                                 "whole-tensor differences (diff) merge")
            tensor = adapter[1][0]
            if not tensor.is_floating_point() or tuple(tensor.shape) != shape or not torch.isfinite(tensor).all():
                raise ValueError(f"{source}: the difference for {weight} is {tensor.dtype} {tuple(tensor.shape)} "
                                 f"(the weight is {shape}), or holds NaN / infinite values")
            differences[weight] = differences.get(weight, 0) + tensor.double() * strength
            dtypes.add(tensor.dtype)
            continue
        held = getattr(adapter, "name", type(adapter).__name__)
        if held != "lora":
            raise ValueError(f"{source}: {weight} holds a {held} update; only plain LoRA layers (up / down) and "
                             "whole-tensor differences merge: apply that file with its own Load LoRA node")
        up, down, alpha, mid, dora_scale, reshape = adapter.weights
        if mid is not None or dora_scale is not None or reshape is not None:
            what = "a LoCon Tucker core (lora_mid)" if mid is not None else \
                "a DoRA scale" if dora_scale is not None else "a reshape"
            raise ValueError(f"{source}: {weight} has {what}, whose update is not a sum of products; only plain LoRA "
                             "layers merge: apply that file with its own Load LoRA node")
        up2, down2, scale = checked_factors(f"{source}: {weight}", up, down, alpha)
        rows, columns = shape[0], math.prod(shape[1:])
        if down2.shape[1] != columns:
            raise ValueError(f"{source}: {weight}'s down weight {tuple(down.shape)} does not fit the model's weight "
                             f"{shape}: it was trained for another model")
        part = () if isinstance(target, str) else target[1:]
        if not part:
            placed = up2
        elif len(part) == 1 and part[0] is not None and len(part[0]) == 3 and part[0][0] == 0:
            _, offset, size = part[0]  # a diffusers layer that is rows of a fused ComfyUI weight (q / k / v of qkv)
            if up2.shape[0] != size or offset + size > rows:
                raise ValueError(f"{source}: {weight}'s rows {offset}-{offset + size} do not fit its up weight "
                                 f"{tuple(up.shape)} or the model's weight {shape}")
            placed = up2.new_zeros(rows, up2.shape[1])
            placed[offset:offset + size] = up2
        elif len(part) == 2 and part[0] is None and callable(part[1]) and \
                _row_permutation(part[1], torch.arange(rows, dtype=torch.float32).reshape(rows, 1)) is not None:
            placed = part[1](up2)  # ComfyUI reorders the update's rows for this layout: the up's rows alike
        else:
            raise ValueError(f"{source}: {weight} is patched through a part ({part!r:.80}) that is not rows of it")
        if placed.shape[0] != rows:
            raise ValueError(f"{source}: {weight}'s up weight {tuple(up.shape)} does not fit the model's weight "
                             f"{shape}: it was trained for another model")
        layers.setdefault(weight, []).append(Update(placed, down2, scale * strength))
        dtypes |= {up.dtype, down.dtype}
    unmapped = keys_not_loaded(state, loaded, sources.key_map)
    if unmapped:
        text = [key for key in unmapped if key.startswith((*_TEXT_ENCODER_PREFIXES, "text_encoders."))]
        if text and not sources.has_clip:
            raise ValueError(f"{source} has text-encoder layers (e.g. {text[0]}): connect the checkpoint's CLIP to "
                             "clip, as Load LoRA takes it")
        raise ValueError(f"{source}: {len(unmapped)} of its tensors map to no layer of this model (e.g. {unmapped[0]}):"
                         " it was trained for another model family")
    if not loaded:
        raise ValueError(f"{source} holds no LoRA layer (only {', '.join(sorted(state)[:3])}...)")


def _tag_frequency(metadatas: list[dict], notes: list[str], names: list[str]) -> dict[str, str]:
    """kohya's ss_tag_frequency of the merged file: the files' counts added per dataset name (what LoRA managers show
    as trained words), each dataset's MAX_SAVED_TAGS most frequent; a file's unreadable entry left out, noted."""
    merged: dict[str, dict[str, int]] = {}
    for name, metadata in zip(names, metadatas):
        text = metadata.get("ss_tag_frequency")
        if text is None:
            continue
        try:
            if not isinstance(text, str) or len(text) > _TAG_FREQUENCY_MAX_BYTES:
                raise ValueError("too long")
            value = json.loads(text, parse_constant=no_json_constants)
            if not isinstance(value, dict) or not all(
                    isinstance(tags, dict) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                   for n in tags.values()) for tags in value.values()):
                raise ValueError("not {dataset: {tag: count}}")
        except (ValueError, RecursionError) as error:
            notes.append(f"{name}'s ss_tag_frequency could not be read ({str(error)[:80]}) and was left out")
            continue
        for dataset, tags in value.items():
            counts = merged.setdefault(dataset, {})
            for tag, count in tags.items():
                counts[tag] = counts.get(tag, 0) + count
    if not merged:
        return {}
    return {"ss_tag_frequency": json.dumps({dataset: dict(sorted(tags.items(), key=lambda t: -t[1])[:MAX_SAVED_TAGS])
                                            for dataset, tags in merged.items()})}


def save_merged_lora(model, clip, loras: list[tuple[str, float]], rank: int, energy: float, subfolder: str,
                     filename: str, dtype: str = "auto", file_format: str = "comfyui") -> tuple[str, str]:
    """Write the LoRA files `loras` ((name Load LoRA lists, strength); names "none" and strength 0 left out) merged
    into one under models/loras/<subfolder>/ (empty filename: <their names>_merged), each layer's summed update kept
    exact (rank 0, energy 0) or by its largest singular directions; returns (the name LoraLoader lists, what was
    done)."""
    if dtype not in MERGE_DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(MERGE_DTYPES)}")
    if file_format not in MERGE_FORMATS:
        raise ValueError(f"format {file_format!r}: choose one of {', '.join(MERGE_FORMATS)}")
    if not 0 <= energy <= 1 or rank < 0:
        raise ValueError(f"rank must be 0 or more and energy in [0, 1] (rank {rank}, energy {energy})")
    chosen = [(name, strength) for name, strength in loras if name != MERGE_NONE and strength != 0]
    if not chosen:
        raise ValueError("no LoRA to merge: choose at least one file (lora_1 ...) with a strength other than 0")
    check_subfolder(subfolder, "subfolder")
    files = [read_lora_state(name) for name, _ in chosen]  # (path, tensors, metadata) each
    root, path = lora_output(subfolder, filename, [f[0] for f in files], "_merged", "one of the files being merged")
    sources = _Sources(model, clip)
    layers: dict[str, list[Update]] = {}
    differences: dict[str, torch.Tensor] = {}
    dtypes: set = set()
    for (lora_name, strength), (_, state, _) in zip(chosen, files):
        _read(lora_name, state, strength, sources, layers, differences, dtypes)
    folded = sorted(set(layers) & set(differences))
    for weight in folded:  # one weight, one patch in a file: LoRA updates on a weight with a difference join it
        shape = sources.shapes[weight]
        differences[weight] = differences[weight] + sum(
            ((u.up * u.scale) @ u.down).reshape(shape) for u in layers.pop(weight))
    merged, report = merge_updates(layers, rank=rank, energy=energy)
    report.differences = len(differences)
    if dtype == "auto":
        out_dtype = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in SAVE_DTYPES.values() \
            else torch.float32
    else:
        out_dtype = SAVE_DTYPES[dtype]
    state = {}
    names, difference_keys = sources.saved_keys(model, merged, differences, file_format)
    for weight, (up, down) in merged.items():
        shape, prefix, kept = sources.shapes[weight], names[weight], down.shape[0]
        state[f"{prefix}.lora_up.weight"] = up.reshape(shape[0], kept, *([1] * (len(shape) - 2))).to(out_dtype)
        state[f"{prefix}.lora_down.weight"] = down.reshape(kept, *shape[1:]).to(out_dtype)
        state[f"{prefix}.alpha"] = torch.tensor(float(kept))  # scale 1: the strengths and alphas are in the weights
    for target, difference in differences.items():
        state[difference_keys[target]] = difference.to(out_dtype)
    overflow = next((key for key, tensor in state.items() if not torch.isfinite(tensor).all()), None)
    if overflow:
        raise ValueError(f"the merged {overflow} exceeds {out_dtype}'s range: save in fp32 or bf16")
    notes = [f"{counted(len(folded), 'weight')} with both a LoRA layer and a difference saved as differences"] \
        if folded else []
    metadata = {"headroom.format": file_format,
                "headroom.merged_from": json.dumps([{"lora": n, "strength": s} for n, s in chosen]),
                "headroom.merge": json.dumps({"rank": rank, "energy": energy, "dtype": dtype}, sort_keys=True),
                **_tag_frequency([f[2] or {} for f in files], notes, [n for n, _ in chosen])}
    if file_format == "kohya":  # what A1111 / Forge / Civitai show; one rank for all layers or "Dynamic"
        ranks = {down.shape[0] for _, down in merged.values()}
        dim = str(next(iter(ranks))) if len(ranks) == 1 else "Dynamic"
        metadata |= lora_formats.kohya_metadata(model_family(model.model), "lora", dim, dim, None,
                                                path.name[:-len(".safetensors")], None, model=model)
    prune_temp(path.parent)
    save_safetensors(path, {k: v.contiguous() for k, v in state.items()}, "merged LoRA", metadata)
    text = " + ".join(f"{n} x {s:g}" for n, s in chosen)
    summary = "; ".join([f"merged {text}", report.summary(), *notes, format_bytes(os.path.getsize(path))])
    return listed_name("loras", root, path), summary
