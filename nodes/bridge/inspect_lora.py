"""Inspect LoRA (Headroom): what a LoRA file holds, and what the stock Load LoRA applies of it to a MODEL / CLIP.

Load LoRA applies what matches and only logs the rest ("lora key not loaded" in the console, a shape error per
layer): a file made for another family, a text-encoder part without the CLIP, or a naming ComfyUI's map misses
patches nothing and the image is unchanged, with no error on the node. This module reads the file as the stock
loader does (`comfy.sd.load_lora_for_models`: ComfyUI's key maps of the MODEL and CLIP, `comfy.lora_convert`,
`comfy.lora.load_lora`), deliberately with the stock maps only (Merge LoRAs adds diffusers' SD1.x / SDXL attention
names, which the stock loader skips: where those are all it skips, the report says Merge LoRAs rewrites the file), and
says what is patched, what is skipped and why. A .safetensors file is read from its header (shapes and dtypes; tensors
of a few elements whole): what the report needs, whatever the file's size. The file and its metadata are untrusted:
every value shown is typed, cut to length and stripped of control characters.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import folder_paths
import torch

import comfy.lora
import comfy.lora_convert

from ...training.core.lora_resize import counted
from ...training.data.files import format_bytes, no_json_constants
from .comfy_model import model_family
from .lora_formats import _TEXT_ENCODER_PREFIXES, _with_peft_attention_names, keys_not_loaded
from .model_files import read_lora_state

_READ_WHOLE = 16  # elements: a tensor this small is read (alphas, reshape sizes), a larger one is its shape
# safetensors' dtype names (the header's) as torch dtypes; another one is read whole
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_SHOWN = 160  # characters of one metadata value in the report
_TRIGGER_WORDS = 8  # the most frequent caption tags given as trigger words
_JSON_MAX_CHARACTERS = 4 << 20
# The metadata a report shows, in this order: (key, label). kohya's ss_*, the SAI model spec, Headroom's own.
_MADE_FOR = (("modelspec.architecture", "architecture"), ("ss_base_model_version", "base model"),
             ("ss_sd_model_name", "trained on"))
_TRAINING = (("ss_steps", "steps"), ("ss_epoch", "epochs"), ("ss_num_train_images", "images"),
             ("ss_resolution", "resolution"), ("ss_learning_rate", "learning rate"),
             ("ss_network_module", "network"), ("ss_network_dim", "dim"), ("ss_network_alpha", "alpha"),
             ("ss_network_args", "network args"), ("headroom.format", "saved by Headroom as"),
             ("headroom.merged_from", "merged from"))
# How a key names its layer kind (LyCORIS / kohya / ComfyUI suffixes), to describe a file without a MODEL.
_KIND_OF_SUFFIX = (("hada_w1_a", "LoHa"), ("lokr_w1", "LoKr"), ("lokr_w1_a", "LoKr"), ("oft_blocks", "OFT"),
                   ("oft_diag", "OFT"), ("dora_scale", "DoRA"), ("lora_mid", "LoCon Tucker"), (".diff", "difference"),
                   ("lora_down.weight", "LoRA"), ("lora_A.weight", "LoRA"), ("lora.down.weight", "LoRA"),
                   ("lora_linear_layer.down.weight", "LoRA"))
_DOWN_SUFFIXES = ("lora_down.weight", "lora_A.weight", "lora.down.weight", "lora_linear_layer.down.weight")


def shown(value, longest: int = _SHOWN) -> str:
    """An untrusted metadata value as one safe line: control characters (newlines, escapes) as spaces, cut to
    `longest` characters."""
    text = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+", " ", str(value)).strip()
    return text if len(text) <= longest else text[:longest - 3] + "..."


def file_format(keys) -> str:
    """The naming a LoRA file uses, from its keys."""
    keys = list(keys)
    if any(k.startswith(("diffusion_model.", "text_encoders.")) for k in keys):
        return "ComfyUI (diffusion_model.* / text_encoders.*)"
    if any(k.startswith(("lora_unet_", "lora_te")) for k in keys):
        return "kohya (lora_unet_* / lora_te_*)"
    if any(k.startswith("lycoris_") for k in keys):
        return "LyCORIS (lycoris_*)"
    if any(k.startswith(("unet.", "transformer.", "text_encoder.", "text_encoder_2.", "base_model.model."))
           or ".lora_A." in k or ".lora_B." in k for k in keys):
        return "diffusers / PEFT (unet.* / transformer.*)"
    return "other"


def kinds(keys) -> dict[str, int]:
    """{layer kind: how many keys name one} (LoRA, LoHa, LoKr, OFT, DoRA, difference...)."""
    found: dict[str, int] = {}
    for key in keys:
        kind = next((k for suffix, k in _KIND_OF_SUFFIX if key.endswith(suffix)), None)
        if kind:
            found[kind] = found.get(kind, 0) + 1
    return found


def ranks(state: dict[str, torch.Tensor]) -> list[int]:
    """The ranks of the file's LoRA layers (rows of each down weight)."""
    return [int(t.shape[0]) for k, t in state.items() if k.endswith(_DOWN_SUFFIXES) and t.dim() >= 2]


def trigger_words(metadata: dict) -> list[str]:
    """The words a LoRA was trained with: modelspec's trigger phrase, else the most frequent caption tags in kohya's
    ss_tag_frequency (Headroom's runs put their trigger word first), what LoRA managers show."""
    phrase = metadata.get("modelspec.trigger_phrase")
    if isinstance(phrase, str) and shown(phrase):
        return [shown(word, 80) for word in phrase.split(",") if shown(word)][:_TRIGGER_WORDS]
    text = metadata.get("ss_tag_frequency")
    if not isinstance(text, str) or len(text) > _JSON_MAX_CHARACTERS:
        return []
    try:
        value = json.loads(text, parse_constant=no_json_constants)
    except (ValueError, RecursionError):
        return []
    counts: dict[str, int] = {}
    for tags in value.values() if isinstance(value, dict) else ():
        for tag, count in tags.items() if isinstance(tags, dict) else ():
            if isinstance(count, int) and not isinstance(count, bool) and count > 0 and shown(tag):
                counts[shown(tag, 80)] = counts.get(shown(tag, 80), 0) + count
    return [tag for tag, _ in sorted(counts.items(), key=lambda t: -t[1])[:_TRIGGER_WORDS]]


def _merged_from(text) -> str:
    """Merge LoRAs' record of its sources ([{"lora": name, "strength": number}...]) as "a x 0.5 + b x 0.5"; as it
    is written where it is not that."""
    try:
        value = json.loads(text, parse_constant=no_json_constants) if len(text) < _JSON_MAX_CHARACTERS else None
        return " + ".join(f"{shown(item['lora'], 80)} x {item['strength']:g}" for item in value[:8]) + \
            (" + ..." if len(value) > 8 else "")
    except (ValueError, TypeError, KeyError, RecursionError):
        return shown(text)


def _mm(a, b) -> tuple[int, ...] | None:
    """The shape of ComfyUI's `torch.mm(a, b)` of a layer's two factors (None: they do not multiply)."""
    if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return None
    return a.shape[0], b.shape[1]


def _tucker(core, b, a) -> tuple[int, ...] | None:
    """The shape of ComfyUI's `einsum("i j k l, j r, i p -> p r k l", core, b, a)` (LoHa's and LoKr's CP core)."""
    if core.dim() != 4 or b is None or a is None or b.dim() != 2 or a.dim() != 2 or \
            core.shape[0] != a.shape[0] or core.shape[1] != b.shape[0]:
        return None
    return a.shape[1], b.shape[1], core.shape[2], core.shape[3]


def _fits(adapter, shape: tuple[int, ...], part) -> bool | None:
    """Whether a layer fits the weight it patches as ComfyUI 0.33's weight adapters compute it (comfy/weight_adapter:
    the layer's product reshaped to the weight, or to the rows `part` names): LoRA (LoCon's Tucker core and a
    reshaped weight too), LoHa, LoKr (CP cores too), OFT, BOFT, GLoRA, differences and set weights. A layer that does
    not fit is logged as an error and left out, or (a Tucker core or reshape that does not fit) makes sampling fail.
    None where the kind is not checked (one ComfyUI adds later)."""
    if part and isinstance(part[0], tuple) and len(part[0]) == 3:  # (dim, offset, size): ComfyUI narrows the weight
        dim, _, size = part[0]
        shape = tuple(size if i == dim else n for i, n in enumerate(shape))
    if isinstance(adapter, tuple):
        return tuple(adapter[1][0].shape) == shape if adapter[0] in ("diff", "set") else None
    name, weights = getattr(adapter, "name", None), getattr(adapter, "weights", ())
    if name == "lora":
        up, down, _, mid, _, reshape = weights
        if reshape is not None:  # the weight zero-padded to this shape first: never smaller in any dimension
            if not isinstance(reshape, (list, tuple)) or len(reshape) != len(shape) or \
                    not all(isinstance(n, int) and n >= size for n, size in zip(reshape, shape)):
                return False
            shape = tuple(reshape)
        if down.dim() < 2 or up.dim() < 2:
            return False
        down_shape = tuple(down.shape)
        if mid is not None:  # LoCon's Tucker core (r, r, kh, kw) folded into down: (r, in, kh, kw)
            if mid.dim() != 4 or math.prod(down_shape[:1] + down_shape[2:]) != mid.shape[1] or \
                    mid.shape[0] != down_shape[0]:
                return False
            down_shape = (down_shape[0], down_shape[1], mid.shape[2], mid.shape[3])
        # ComfyUI's product: up and down flattened to matrices, multiplied, reshaped to the weight
        return math.prod(up.shape[1:]) == down_shape[0] and \
            up.shape[0] * math.prod(down_shape[1:]) == math.prod(shape)
    if name == "loha":  # (w1a @ w1b) * (w2a @ w2b), each from a CP core where one is given; reshaped to the weight
        w1a, w1b, _, w2a, w2b, t1, t2 = weights[:7]
        m1 = _tucker(t1, w1b, w1a) if t1 is not None else _mm(w1a, w1b)
        m2 = _tucker(t2, w2b, w2a) if t2 is not None else _mm(w2a, w2b)
        if m1 is None or m2 is None:
            return False
        try:
            return math.prod(torch.broadcast_shapes(m1, m2)) == math.prod(shape)
        except RuntimeError:  # the two products' shapes do not broadcast
            return False
    if name == "lokr":  # kron(w1, w2), each given or a product (w2 also from a CP core); reshaped to the weight
        w1, w2, _, w1_a, w1_b, w2_a, w2_b, t2 = weights[:8]
        m1 = tuple(w1.shape) if w1 is not None else _mm(w1_a, w1_b)
        m2 = tuple(w2.shape) if w2 is not None else _tucker(t2, w2_b, w2_a) if t2 is not None else _mm(w2_a, w2_b)
        return m1 is not None and m2 is not None and math.prod(m1) * math.prod(m2) == math.prod(shape)
    if name == "oft":  # block-diagonal rotation of the weight's rows: block count x block size = the rows
        blocks = weights[0]
        return blocks.dim() == 3 and blocks.shape[1] == blocks.shape[2] and len(shape) >= 1 and \
            blocks.shape[0] * blocks.shape[1] == shape[0]
    if name == "boft":  # ComfyUI 0.33 compares the layer's alpha with 0: without one it logs an error, leaves it out
        return weights[2] is not None and _boft_fits(weights[0], weights[1], shape)
    if name == "glora":
        return _glora_fits(*weights[:5], shape)
    return None


def _boft_fits(blocks, rescale, shape: tuple[int, ...]) -> bool:
    """BOFT: `stages` butterfly stages of `count` rotations of `size` rows each; stage i pairs rows 2^i x size / 2
    apart, so the rows split evenly into groups of 2^i x size at every stage, and count x size = the rows; the
    rescale multiplies the rotated weight (it must broadcast to it)."""
    if blocks.dim() != 4 or blocks.shape[2] != blocks.shape[3] or len(shape) < 1:
        return False
    stages, count, size = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    rows, half = shape[0], size // 2
    if half == 0 or count * size != rows or any(rows % (2 * (2 ** i) * half) for i in range(stages)):
        return False
    if rescale is not None:
        try:
            return tuple(torch.broadcast_shapes(shape, tuple(rescale.shape))) == shape
        except RuntimeError:
            return False
    return True


def _glora_fits(a1, a2, b1, b2, alpha, shape: tuple[int, ...]) -> bool:
    """GLoRA as ComfyUI computes it: the old LyCORIS form b2 @ b1 + (W @ a2) @ a1, where its shapes say so (a square
    weight whose rank equals its rows), else (W a1) a2 + b1 @ b2; every factor flattened to a matrix."""
    if min(a1.dim(), a2.dim(), b1.dim(), b2.dim()) < 2 or len(shape) < 2:
        return False
    old = b2.shape[1] == b1.shape[0] == a1.shape[0] == a2.shape[1]
    ranked = old
    if b2.shape[0] == b1.shape[1] == a1.shape[1] == a2.shape[0]:
        ranked = True
        old = old and a2.shape[0] == shape[0] and shape[0] == shape[1]
    if not ranked and alpha is not None:  # ComfyUI finds no rank to scale alpha by: sampling fails
        return False
    (a1r, a1c), (a2r, a2c), (b1r, b1c), (b2r, b2c) = (
        (w.shape[0], math.prod(w.shape[1:])) for w in (a1, a2, b1, b2))
    if old:
        if b2c != b1r or math.prod(shape[1:]) != a2r or a2c != a1r:
            return False
        try:
            summed = torch.broadcast_shapes((b2r, b1c), (shape[0], a1c))
        except RuntimeError:
            return False
        return math.prod(summed) == math.prod(shape)
    return shape[1] == a1r and a1c == a2r and a2c == shape[1] and b1c == b2r and b1r * b2c == math.prod(shape)


def header_state(path: str) -> tuple[dict[str, torch.Tensor], dict | None] | None:
    """(tensors, metadata) of a .safetensors file read from its header alone: each tensor on the meta device with its
    shape and dtype, the few-element ones (alphas, reshape sizes: load_lora reads their values) read whole. A 2 GB
    file costs its header, not 2 GB of RAM and a read of every byte. None for other files and headers safetensors
    refuses (the full reader then says why)."""
    if not path.lower().endswith(".safetensors"):
        return None
    from safetensors import SafetensorError, safe_open

    state = {}
    try:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                shape, dtype = piece.get_shape(), _SAFETENSORS_DTYPES.get(piece.get_dtype())
                state[key] = handle.get_tensor(key) if dtype is None or math.prod(shape) <= _READ_WHOLE else \
                    torch.empty(shape, dtype=dtype, device="meta")
            metadata = handle.metadata()
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    return (state, metadata) if state else None


def file_fingerprint(lora_name) -> str:
    """What changes when the file named `lora_name` is replaced (its size and time): ComfyUI reuses a node's output
    while its inputs are unchanged, and a file saved again under the same name must be inspected again."""
    path = folder_paths.get_full_path("loras", lora_name) if isinstance(lora_name, str) else None
    try:
        status = os.stat(path) if path else None
    except (OSError, ValueError) as error:
        return f"unreadable: {error}"
    return f"{status.st_size}:{status.st_mtime_ns}" if status else "not found"


def inspect_lora(lora_name: str, model=None, clip=None) -> tuple[str, str]:
    """(report, trigger words) of LoRA file `lora_name` (a name Load LoRA lists): with `model` / `clip` first what
    the stock Load LoRA patches of it and what it skips, then its format, layers and metadata."""
    path = folder_paths.get_full_path("loras", lora_name) if isinstance(lora_name, str) else None
    header = header_state(path) if path else None
    if header is None:  # not a readable .safetensors file: read whole, as the stock loader reads it (errors said)
        path, state, metadata = read_lora_state(lora_name)
    else:
        state, metadata = header
    metadata = metadata or {}
    lines = []
    if model is None and clip is None:
        lines.append("connect the MODEL (and the CLIP) to see what Load LoRA applies of it")
    else:
        check = applied_by_load_lora(state, model, clip)
        lines += [check.verdict(model, clip), *check.problems, *check.notes]
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in state.values()})
    found = ranks(state)
    rank_text = "" if not found else f", rank {found[0]}" if min(found) == max(found) else \
        f", ranks {min(found)}-{max(found)}"
    lines += [f"file: {format_bytes(os.path.getsize(path))}, {counted(len(state), 'tensor')} ({', '.join(dtypes)}), "
              f"{file_format(state)} names",
              "layers: " + (", ".join(f"{kind} {n}" for kind, n in kinds(state).items()) or "none found") + rank_text]
    made_for = [f"{shown(metadata[key])} ({label})" for key, label in _MADE_FOR if metadata.get(key)]
    if made_for:
        lines.append("made for: " + "; ".join(made_for))
    training = [f"{label} {_merged_from(metadata[key]) if key == 'headroom.merged_from' else shown(metadata[key])}"
                for key, label in _TRAINING if metadata.get(key)]
    if training:
        lines.append("trained: " + ", ".join(training))
    words = trigger_words(metadata)
    if words:
        lines.append("trigger words: " + ", ".join(words))
    return "\n".join(lines), ", ".join(words)


@dataclasses.dataclass
class LoadLoraCheck:
    """What the stock Load LoRA does with a file: the weights it patches per part, and what it skips."""

    model_weights: int = 0  # weights of the diffusion model patched
    clip_weights: int = 0  # weights of the CLIP patched
    unreadable: str = ""  # why ComfyUI's reader fails on the file
    skipped: list[str] = dataclasses.field(default_factory=list)  # keys no weight matches ("lora key not loaded")
    text_encoder: list[str] = dataclasses.field(default_factory=list)  # text-encoder keys, no CLIP connected
    misfits: list[str] = dataclasses.field(default_factory=list)  # weights a layer of which does not fit
    lacking: list[str] = dataclasses.field(default_factory=list)  # mapped weights the model lacks ("NOT LOADED")
    unchecked: int = 0  # layers of kinds whose shapes are not checked here (_fits)
    peft_names: bool = False  # every skipped key is a diffusers / PEFT attention name Merge LoRAs reads
    tensors: int = 0
    what: str = "MODEL"  # what was connected, for the text

    @property
    def problems(self) -> list[str]:
        """What Load LoRA skips, worst first; each with its first key in sorted order (the same for any key order)."""
        out = [f"! Load LoRA cannot read it: {self.unreadable}"] if self.unreadable else []
        if self.text_encoder:
            out.append(f"! {counted(len(self.text_encoder), 'text-encoder tensor')} (e.g. "
                       f"{shown(min(self.text_encoder))}): connect the CLIP to check them (Load LoRA applies them to "
                       "the CLIP)")
        if self.skipped:
            out.append(f"! {len(self.skipped)} of its {counted(self.tensors, 'tensor')} match no weight of this "
                       f"{self.what}: Load LoRA skips them (its console says \"lora key not loaded\"), e.g. "
                       f"{shown(min(self.skipped))}; the file is for another model family, or uses names ComfyUI does "
                       "not map")
        if self.misfits:
            verb = "does not fit" if len(self.misfits) == 1 else "do not fit"
            out.append(f"! {counted(len(self.misfits), 'layer')} {verb} the shape of the weight it patches (e.g. "
                       f"{shown(min(self.misfits))}): ComfyUI logs an error and leaves it out (a LoCon Tucker core or "
                       "a reshape that does not fit stops sampling instead); the file is for another model")
        if self.lacking:
            out.append(f"! {counted(len(self.lacking), 'layer')} name weights this model lacks (e.g. "
                       f"{shown(min(self.lacking))}): Load LoRA says \"NOT LOADED\"")
        return out

    @property
    def notes(self) -> list[str]:
        out = ["-> they are diffusers / PEFT attention names (attn1.to_q ...) that ComfyUI's key map lacks: Merge "
               "LoRAs (Headroom) with this file alone at strength 1 writes it in ComfyUI's names, which Load LoRA "
               "applies whole"] if self.peft_names else []
        if self.unchecked:
            out.append(f"({counted(self.unchecked, 'layer')} of kinds whose shapes are not checked here: ComfyUI "
                       "checks them only when sampling)")
        return out

    def verdict(self, model, clip) -> str:
        parts = []
        if model is not None:
            family = model_family(model.model)
            parts.append(f"{counted(self.model_weights, 'weight')} of the diffusion model"
                         + (f" ({family})" if family else ""))
        if clip is not None:
            parts.append(f"{counted(self.clip_weights, 'weight')} of the CLIP")
        head = "NOTHING APPLIES" if not self.model_weights + self.clip_weights else \
            "PARTLY APPLIES" if self.problems else "OK"
        return f"{head}: Load LoRA patches {' and '.join(parts)}"


def applied_by_load_lora(state: dict[str, torch.Tensor], model, clip) -> LoadLoraCheck:
    """The file's tensors `state` as the stock loader applies them to `model` and / or `clip`."""
    key_map: dict = {}
    model_shapes: dict[str, tuple[int, ...]] = {}
    clip_shapes: dict[str, tuple[int, ...]] = {}
    if model is not None:  # the maps of comfy.sd.load_lora_for_models, in its order
        key_map = comfy.lora.model_lora_keys_unet(model.model, key_map)
        model_shapes = {k: tuple(v.shape) for k, v in model.model.state_dict().items()}
    if clip is not None:
        key_map = comfy.lora.model_lora_keys_clip(clip.cond_stage_model, key_map)
        clip_shapes = {k: tuple(v.shape) for k, v in clip.cond_stage_model.state_dict().items()}
    check = LoadLoraCheck(what="MODEL or CLIP" if model is not None and clip is not None else
                          "MODEL" if model is not None else "CLIP")
    try:
        converted = comfy.lora_convert.convert_lora(state)
        loaded = comfy.lora.load_lora(converted, key_map, log_missing=False)
    except Exception as error:  # noqa: BLE001 - a malformed file makes ComfyUI's reader fail anywhere
        check.unreadable = f"{type(error).__name__}: {shown(error, 200)}"
        return check
    check.tensors = len(converted)
    model_patched: set[str] = set()
    clip_patched: set[str] = set()
    for target, adapter in loaded.items():
        weight = target if isinstance(target, str) else target[0]
        shape = model_shapes.get(weight) or clip_shapes.get(weight)
        if shape is None:  # mapped, yet not a tensor of the model (ComfyUI logs "NOT LOADED")
            check.lacking.append(weight)
            continue
        fits = _fits(adapter, shape, () if isinstance(target, str) else target[1:])
        if fits is False:
            check.misfits.append(weight)
        else:  # a weight counted once however many layers patch parts of it (diffusers' q / k / v of a fused qkv)
            (model_patched if weight in model_shapes else clip_patched).add(weight)
        check.unchecked += fits is None
    check.model_weights, check.clip_weights = len(model_patched), len(clip_patched)
    skipped = keys_not_loaded(converted, loaded, key_map)
    if clip is None:
        check.text_encoder = [key for key in skipped if key.startswith((*_TEXT_ENCODER_PREFIXES, "text_encoders."))]
    check.skipped = [key for key in skipped if key not in set(check.text_encoder)]
    if check.skipped and model is not None:  # what Merge LoRAs reads beyond the stock map (lora_formats says why)
        wider_map = _with_peft_attention_names(key_map)
        still = keys_not_loaded(converted, comfy.lora.load_lora(converted, wider_map, log_missing=False), wider_map)
        check.peft_names = not set(check.skipped) & set(still)
    return check
