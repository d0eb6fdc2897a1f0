"""LoRA-family adapters (LoRA, DoRA, LoHa, LoKr, OFT) and full fine-tuning (kind full) on a module tree, built from
peft's layer classes (OFT: from ComfyUI's own OFT class, see `OFTLayer`; full: `FullLayer`).

peft's tuner layers wrap a base module and add the adapter path in `forward`; we use them directly
(not `get_peft_model`) so the same adapter can be swapped into and out of a module tree that other
code shares: `attach` replaces each target submodule by its peft wrapper, `detach` puts the very same
original submodule object back. The base module's parameters are never touched.

Export writes the keys ComfyUI's stock LoraLoader maps (`comfy.lora.load_lora` + `comfy/weight_adapter`):
  LoRA  <prefix><path>.lora_up.weight / .lora_down.weight / .alpha
  DoRA  the same + .dora_scale
  LoHa  <prefix><path>.hada_w1_a / hada_w1_b / hada_w2_a / hada_w2_b (/ hada_t1 / hada_t2) / .alpha
  LoKr  <prefix><path>.lokr_w1 | lokr_w1_a+lokr_w1_b, lokr_w2 | lokr_w2_a+lokr_w2_b (/ lokr_t2) / .alpha
  OFT   <prefix><path>.oft_blocks [block_num, block_size, block_size] / .alpha (the constraint)
  full  <prefix><path>.diff (the trained weight minus the base's) / .diff_b (the bias's)
"""
from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import math
import re
import sys
from typing import Iterable

import torch

from ..checks import check_finite, require_peft, require_version
from ..memory.trained_weights_on_host import to_compute

KINDS = ("lora", "dora", "loha", "lokr", "oft", "full")
FULL_PRECISIONS = ("fp32", "bf16_stochastic")
TARGET_MODES = ("preset", "all_linear", "all_layers")
# LoRA Config `layers`: at most this many patterns of at most this many characters (a layer path is under 100).
LAYER_PATTERNS_MAX = 64
LAYER_PATTERN_CHARS_MAX = 200
LAYER_LR_SCALE_MAX = 100.0  # LoRA Config layer_lr_scales: a layer's rate is at most this times the optimizer's
LAYER_RANK_MAX = 1024  # LoRA Config layer_ranks: as its rank input's largest
LAYER_ALPHA_MAX = 4096.0  # LoRA Config layer_alphas: as its alpha input's largest
# The kinds whose rank is a low-rank size and alpha its scale's numerator, which layer_ranks / layer_alphas may set
# per layer; why the others have neither (oft's alpha is a constraint, full has no scale).
LAYER_RANK_KINDS = ("lora", "dora", "loha", "lokr")
PEFT_KINDS = ("lora", "dora", "loha", "lokr")  # peft's layers; oft and full are the pack's own
_NO_LOW_RANK = {"oft": "its rank is the block size of the rotations", "full": "it trains the weights themselves"}
_NO_SCALE = {"oft": "its alpha is the constraint of the rotations, one for all layers",
             "full": "it trains the weights themselves"}



@dataclasses.dataclass(frozen=True)
class TargetPreset:
    """The layers a family's LoRA trains with targets="preset" (the family registry, nodes/bridge/families/, holds one per
    family): Linear module paths (relative to the denoiser root) matching any of `linear`, and with include_conv the
    Conv2d paths matching `conv` (None: the family has no conv preset)."""

    family: str
    linear: tuple[str, ...]
    conv: str | None = None


_ADAPTER_PARAM_PREFIXES = ("lora_A", "lora_B", "lora_magnitude_vector", "hada_", "lokr_", "oft.", "full_")


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    kind: str = "lora"  # lora | dora | loha | lokr | oft | full
    rank: int = 16  # oft: the block size; full: unused
    alpha: float = 16.0  # oft: the constraint (cap on the norm of each layer's skew-symmetric matrix)
    # preset: the family's layers | all_linear: every Linear inside the blocks | all_layers: every Linear and
    # Conv2d of the model (embedders and output layer too, like ComfyUI's own trainer)
    targets: str = "preset"
    include_conv: bool = False  # sd15 / sdxl: also the UNet block convolutions
    dropout: float = 0.0
    init_seed: int = 0
    init_lora: str | None = None  # a LoRA file (as Load LoRA lists it) the run starts from instead of zero
    # kind full: the trained weights W' in fp32 (exact) or bf16 updated with stochastic rounding (half the memory of
    # the weights and their gradient; needs the policy's fused backward, whose per-tensor step does the rounding)
    full_precision: str = "fp32"
    # Which of the targeted layers to train: patterns searched in the layer paths, "!" before one leaves its matches
    # out ("" = all of them; `layer_patterns`). musubi-tuner's include / exclude_patterns, ai-toolkit's only_if_contains
    # / ignore_if_contains.
    layers: str = ""
    # Learning rates per layer, as multiples of the optimizer's: "pattern=scale" pairs, patterns as in `layers`, the
    # first that matches a layer giving its scale (1 where none does). kohya's block learning-rate weights.
    layer_lr_scales: str = ""
    # Ranks per layer: "pattern=rank" pairs as in `layer_lr_scales` (the config's rank where none matches); a layer's
    # scale is its alpha / its rank, as in kohya's block_dims and peft's rank_pattern.
    layer_ranks: str = ""
    # Alphas per layer: "pattern=alpha" pairs as in `layer_ranks` (the config's alpha where none matches), so a layer's
    # scale is its alpha / its rank: kohya's conv_alpha (with conv_dim as layer_ranks) and block_alphas, peft's
    # alpha_pattern.
    layer_alphas: str = ""

    def validate(self) -> None:
        check_finite("adapter", alpha=self.alpha, dropout=self.dropout)
        layer_patterns(self.layers)
        layer_scale_patterns(self.layer_lr_scales)
        if self.kind not in KINDS:
            raise ValueError(f"adapter kind {self.kind!r} is unknown: choose one of {KINDS}")
        for name, sets, why, patterns in (
                ("layer_ranks", "a low-rank size", _NO_LOW_RANK, layer_rank_patterns(self.layer_ranks)),
                ("layer_alphas", "the alpha of a low-rank scale", _NO_SCALE, layer_alpha_patterns(self.layer_alphas))):
            if patterns and self.kind not in LAYER_RANK_KINDS:
                raise ValueError(f"{name} sets {sets} per layer, and kind {self.kind} has none ({why[self.kind]}): "
                                 f"clear {name}, or train kind {', '.join(LAYER_RANK_KINDS)}")
        if int(self.rank) != self.rank or self.rank <= 0:
            raise ValueError(f"rank={self.rank} must be a positive integer")
        if self.alpha <= 0:
            raise ValueError(f"alpha={self.alpha} must be > 0")
        if self.targets not in TARGET_MODES:
            raise ValueError(f"targets={self.targets!r}: choose one of {TARGET_MODES}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.kind == "oft":
            if self.rank < 2:
                raise ValueError(f"kind oft: rank is the block size of the rotations, and {self.rank} cannot rotate "
                                 "anything: use 2 or more (a divisor of every trained layer's output features)")
            if self.dropout:
                raise ValueError(f"kind oft has no dropout (ComfyUI's OFT has none): set dropout to 0, not "
                                 f"{self.dropout}")
        if self.kind == "full" and self.init_lora:
            raise ValueError(f"kind full cannot start from the LoRA file {self.init_lora} (init_lora): apply it with "
                             "Load LoRA on the MODEL and train on top of it (init_lora none); a full run continues "
                             "from its own checkpoints")
        if self.full_precision not in FULL_PRECISIONS:
            raise ValueError(f"full_precision={self.full_precision!r}: choose one of {', '.join(FULL_PRECISIONS)}")
        if self.kind != "full" and self.full_precision != "fp32":
            raise ValueError(f"full_precision {self.full_precision} is for kind full (a full fine-tune's trained weights); "
                             f"kind {self.kind} trains fp32 adapters: set full_precision to fp32")
        if self.kind == "full" and self.dropout:
            raise ValueError(f"kind full trains the weights themselves and has no adapter input to drop: set dropout "
                             f"to 0, not {self.dropout}")


def _name_patterns(text: str, input_name: str) -> list[str]:
    """The patterns of a LoRA Config layer-name input: separated by commas, spaces or new lines, at most
    LAYER_PATTERNS_MAX of them (they run against every layer path of the model)."""
    tokens = [token for token in re.split(r"[,\s]+", text.strip()) if token]
    if len(tokens) > LAYER_PATTERNS_MAX:
        raise ValueError(f"{input_name}: {len(tokens)} patterns, over {LAYER_PATTERNS_MAX}; one pattern can match "
                         "many layers (e.g. single_blocks.1?. is blocks 10-19)")
    for token in tokens:
        if len(token) > LAYER_PATTERN_CHARS_MAX:
            raise ValueError(f"{input_name}: the pattern {token[:40]!r}... is {len(token)} characters, over "
                             f"{LAYER_PATTERN_CHARS_MAX}; layer names are short: write a part of them")
    return tokens


def _name_matcher(pattern: str) -> re.Pattern:
    """A layer-name pattern as a matcher of whole paths: a path matches when its name contains the pattern, with the
    shell's wildcards (* any text, ? one character, [0-5] one of), dots literal: fnmatch's translation, case-sensitive
    on every OS (fnmatch.fnmatch would ignore case on Windows only). Not regular expressions, where "blocks.1." would
    also match "blocks.10." (`_name_patterns` has limited its length)."""
    return re.compile(fnmatch.translate(f"*{pattern}*"))


def layer_patterns(text: str) -> tuple[dict[str, re.Pattern], dict[str, re.Pattern]]:
    """LoRA Config `layers` read: ({pattern: matcher} to include, {pattern: matcher} to exclude); a pattern starting
    with "!" excludes (`_name_matcher` says what matches). Refused: a bare "!", too many or too long patterns."""
    include, exclude = {}, {}
    for token in _name_patterns(text, "layers"):
        negated = token.startswith("!")
        pattern = token[1:] if negated else token
        if not pattern:
            raise ValueError("layers: a lone '!' leaves nothing out; write the layers to leave out after it, e.g. "
                             "!img_mod")
        (exclude if negated else include)[token] = _name_matcher(pattern)
    return include, exclude


def _pattern_values(text: str, input_name: str, read, what: str, example: str
                    ) -> list[tuple[str, re.Pattern, object]]:
    """A LoRA Config "pattern=<what>" input read: [(pattern, matcher, read(value))] in order. `read` returns the value,
    or raises ValueError saying what is wrong with it; `example` shows a correct pair."""
    pairs = []
    for token in _name_patterns(text, input_name):
        pattern, equals, value = token.rpartition("=")
        if not (equals and pattern and value):
            raise ValueError(f"{input_name}: {token!r} is not pattern={what}; e.g. {example}")
        try:
            parsed = read(value)
        except ValueError as error:
            raise ValueError(f"{input_name}: {token!r}: {error}") from None
        pairs.append((pattern, _name_matcher(pattern), parsed))
    return pairs


def _decimal(value: str) -> float:
    """A decimal number written in ASCII (float() also reads other scripts' digits and underscores), or NaN."""
    if not re.fullmatch(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]{1,3})?", value):
        return math.nan
    return float(value)


def _scale(value: str) -> float:
    scale = _decimal(value)
    if not (math.isfinite(scale) and 0 < scale <= LAYER_LR_SCALE_MAX):
        raise ValueError(f"the scale must be above 0 and at most {LAYER_LR_SCALE_MAX:g} (to train no layer of it, "
                         "leave it out with layers)")
    return scale


def _rank(value: str) -> int:
    if not re.fullmatch(r"[0-9]{1,5}", value) or not 1 <= int(value) <= LAYER_RANK_MAX:  # ASCII digits only
        raise ValueError(f"the rank must be a whole number from 1 to {LAYER_RANK_MAX} (to train no layer of it, "
                         "leave it out with layers)")
    return int(value)


def _alpha(value: str) -> float:
    alpha = _decimal(value)
    if not (math.isfinite(alpha) and 0 < alpha <= LAYER_ALPHA_MAX):
        raise ValueError(f"the alpha must be above 0 and at most {LAYER_ALPHA_MAX:g}, as the alpha input")
    return alpha


def layer_scale_patterns(text: str) -> list[tuple[str, re.Pattern, float]]:
    """LoRA Config `layer_lr_scales` read: [(pattern, matcher, scale)] in order, from "pattern=scale" pairs; scales
    finite, above 0 (leave a layer out with `layers`) and at most LAYER_LR_SCALE_MAX."""
    return _pattern_values(text, "layer_lr_scales", _scale, "scale",
                           "single_blocks=0.5 trains the single blocks at half the learning rate")


def layer_rank_patterns(text: str) -> list[tuple[str, re.Pattern, int]]:
    """LoRA Config `layer_ranks` read: [(pattern, matcher, rank)] in order, from "pattern=rank" pairs; ranks whole,
    1 to LAYER_RANK_MAX (leave a layer out with `layers`, not with rank 0)."""
    return _pattern_values(text, "layer_ranks", _rank, "rank", "single_blocks=8 trains the single blocks at rank 8")


def layer_alpha_patterns(text: str) -> list[tuple[str, re.Pattern, float]]:
    """LoRA Config `layer_alphas` read: [(pattern, matcher, alpha)] in order, from "pattern=alpha" pairs; alphas
    finite, above 0 and at most LAYER_ALPHA_MAX."""
    return _pattern_values(text, "layer_alphas", _alpha, "alpha",
                           "in_layers=1 gives the ResBlocks' first convolutions alpha 1")


def _per_layer(paths: Iterable[str], pairs: list, input_name: str, default) -> dict:
    """{path: the value of the first of `pairs` whose pattern matches it, `default` where none does}. A pattern that
    matches none of `paths` is refused, as in `layers`."""
    paths = list(paths)
    for pattern, matcher, _ in pairs:
        if not any(matcher.match(path) for path in paths):
            raise ValueError(f"LoRA Config {input_name}: {pattern!r} matches none of the {len(paths)} trained "
                             f"layers (named like {paths[0]}, {paths[-1]}); these are ComfyUI's layer names")
    return {path: next((value for _, matcher, value in pairs if matcher.match(path)), default) for path in paths}


def layer_lr_scales(paths: Iterable[str], config: "AdapterConfig") -> dict[str, float]:
    """{path: its learning-rate scale} for the trained `paths`: the first `layer_lr_scales` pattern matching it, 1
    where none does."""
    return _per_layer(paths, layer_scale_patterns(config.layer_lr_scales), "layer_lr_scales", 1.0)


def layer_ranks(paths: Iterable[str], config: "AdapterConfig") -> dict[str, int]:
    """{path: its rank} for the trained `paths`: the first `layer_ranks` pattern matching it, the config's rank where
    none does."""
    return _per_layer(paths, layer_rank_patterns(config.layer_ranks), "layer_ranks", int(config.rank))


def layer_alphas(paths: Iterable[str], config: "AdapterConfig") -> dict[str, float]:
    """{path: its alpha} for the trained `paths`: the first `layer_alphas` pattern matching it, the config's alpha
    where none does."""
    return _per_layer(paths, layer_alpha_patterns(config.layer_alphas), "layer_alphas", float(config.alpha))


def filter_layers(paths: list[str], config: "AdapterConfig") -> list[str]:
    """The `paths` that `config.layers` keeps: those matching an include pattern (every path when there is none) and
    no exclude pattern. A pattern that matches none of `paths` is refused (a typo, or another naming: these are
    ComfyUI's module names, e.g. Flux's double_blocks.0.img_attn.qkv, not diffusers' transformer_blocks.0.attn.to_q),
    and so is a filter that keeps nothing."""
    include, exclude = layer_patterns(config.layers)
    if not include and not exclude:
        return paths
    named_like = ", ".join(dict.fromkeys([paths[0], paths[len(paths) // 2], paths[-1]]))
    selected = f"the {len(paths)} layers targets={config.targets} selects (named like {named_like})"
    for token, matcher in (*include.items(), *exclude.items()):
        if not any(matcher.match(path) for path in paths):
            raise ValueError(f"LoRA Config layers: {token!r} matches none of {selected}; these are ComfyUI's layer "
                             "names: correct the pattern or remove it")
    kept = [path for path in paths if (not include or any(m.match(path) for m in include.values()))
            and not any(m.match(path) for m in exclude.values())]
    if not kept:
        raise ValueError(f"LoRA Config layers {config.layers.strip()!r} leaves none of {selected} to train: exclude "
                         "less")
    return kept


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer an adapter can wrap: torch's, or ComfyUI's mixed-precision Linear (comfy.ops.mixed_precision_ops,
    what the stock loaders build for a scaled fp8 / int8 / nvfp4 file: a torch.nn.Module, not a torch.nn.Linear, whose
    weight may be a QuantizedTensor). Both take `x @ W^T + b` with `in_features` / `out_features`, which is all peft's
    layers and ours ask of a base; the quantized one runs its own forward and backward (comfy.ops QuantLinearFunc)."""
    if isinstance(module, torch.nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Linear" and hasattr(module, "comfy_cast_weights")
            and hasattr(module, "in_features") and weight is not None and weight.ndim == 2)


def select_targets(root: torch.nn.Module, preset: TargetPreset | None, config: AdapterConfig,
                   block_prefixes: Iterable[str], presets: Iterable[str] = ()) -> list[str]:
    """Paths of the submodules of `root` the adapter wraps, in module order. `preset`: the model family's (None:
    the model has none; `presets` lists the families that have one, for the message)."""
    config.validate()
    block_prefixes = tuple(block_prefixes)
    family = None if preset is None else preset.family
    if config.targets == "preset":
        if preset is None:
            listed = f" (presets: {', '.join(presets)})" if presets else ""
            raise ValueError(
                f"this model has no LoRA target preset{listed}; "
                "set targets to 'all_linear' to train every linear layer inside the model's blocks"
            )
        patterns = [re.compile(p) for p in preset.linear]
        conv = re.compile(preset.conv) if config.include_conv and preset.conv is not None else None
    elif config.targets == "all_linear" and not block_prefixes:
        raise ValueError("targets='all_linear' needs the model's blocks, and none were found")
    paths = []
    for path, module in root.named_modules():
        if not path:
            continue
        if config.targets == "preset":
            if is_linear(module) and any(p.search(path) for p in patterns):
                paths.append(path)
            elif conv is not None and isinstance(module, torch.nn.Conv2d) and conv.search(path):
                paths.append(path)
        elif config.targets == "all_layers":
            if is_linear(module) or isinstance(module, torch.nn.Conv2d):
                paths.append(path)
        elif is_linear(module) and any(path.startswith(b + ".") for b in block_prefixes):
            paths.append(path)
        elif config.include_conv and isinstance(module, torch.nn.Conv2d) and any(path.startswith(b + ".") for b in block_prefixes):
            paths.append(path)
    if not paths:
        raise ValueError(f"no target modules matched for family {family!r} with targets={config.targets!r}")
    return filter_layers(paths, config)


def _out_features(module: torch.nn.Module) -> int:
    return module.out_channels if isinstance(module, torch.nn.Conv2d) else module.out_features


def _oft_block_class():
    # ComfyUI's own OFT training module (comfy/weight_adapter/oft.py, what its TrainLoraNode trains): imported here,
    # not at module level, so the engine still imports where ComfyUI is absent (only kind oft needs it).
    from comfy.weight_adapter.oft import OFTDiff

    class OFTBlocks(OFTDiff):
        """OFTDiff without its `alpha` Parameter: nothing reads it (the constraint is kept as a float), and a frozen
        parameter inside the adapter would be taken for a base weight (weight streaming, the memory planner)."""

        def __init__(self, weights):
            super().__init__(weights)
            del self.alpha

    return OFTBlocks


class OFTLayer(torch.nn.Module):
    """Orthogonal finetuning of one Linear / Conv2d in ComfyUI's OFT parametrisation.

    ComfyUI's OFT (comfy/weight_adapter/oft.py, the format its loader reads) rotates the weight's OUTPUT axis:
    blocks B [block_num, block_size, block_size], Q = B - B^T (scaled down to norm alpha when its norm over all blocks
    is larger), R = (I + Q)(I - Q)^-1, and the loader's weight is W + einsum("k n m, k n ... -> k m ...", R - I, W).
    peft's OFT is not used: it rotates the INPUT features (W' = W R^T, on dim 1), which no OFT file of ComfyUI's can
    express (tests/comfy/test_oft.py shows no left factor reproduces it), and it parametrises and approximates R differently.

    The trainable blocks are ComfyUI's own OFTDiff (same Q, constraint and Cayley code as the loader). The rotation is
    applied to the base layer's output without its bias: y + (R - I)^T (y - b) per block of output features, which is
    the loader's weight times x in exact arithmetic; unlike rotating the weight it works on any base layer (low-bit,
    streamed, ComfyUI's cast ops) and keeps no rotated copy of the weight for backward. At init B = 0, R = I exactly,
    and the output is the base layer's, bit for bit.
    """

    def __init__(self, base: torch.nn.Module, block_size: int, constraint: float):
        super().__init__()
        out = _out_features(base)
        if out % block_size:
            raise ValueError(f"oft block size {block_size} does not divide the {out} output features")
        self.base_layer = base
        self.block_size, self.block_num = block_size, out // block_size
        blocks = torch.zeros(self.block_num, block_size, block_size, dtype=torch.float32)
        # The constraint as the saved file holds it (a float32 alpha), so training and the loader use the same value.
        self.oft = _oft_block_class()((blocks, None, _float32(constraint), None))

    def get_base_layer(self) -> torch.nn.Module:
        return self.base_layer

    # ComfyUI reads a layer's weight before calling it (comfy.ops.linear_input_act: Wan's feed-forward picks its INT8
    # kernel by it) and the base's is what this layer multiplies with, as peft's adapter layers answer.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base_layer, "bias", None)

    def rotation(self) -> torch.Tensor:
        """R per block [block_num, block_size, block_size], in float32 as ComfyUI's loader computes it (autocast off:
        under bf16 / fp16 autocast the Cayley product would otherwise run in half precision)."""
        blocks = self.oft.oft_blocks
        with torch.autocast(blocks.device.type, enabled=False):
            return self.oft._get_orthogonal_matrix(blocks.device, torch.float32)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.base_layer(x, *args, **kwargs)
        r = self.rotation()
        delta_r = (r - torch.eye(self.block_size, device=r.device, dtype=r.dtype)).to(y.dtype)
        channels_last = isinstance(self.base_layer, torch.nn.Conv2d)
        z = y.movedim(1, -1) if channels_last else y
        bias = getattr(self.base_layer, "bias", None)
        if bias is not None:
            z = z - bias.to(device=z.device, dtype=z.dtype)
        delta = torch.einsum("k n m, ... k n -> ... k m", delta_r, z.unflatten(-1, (self.block_num, self.block_size)))
        delta = delta.flatten(-2)
        return y + (delta.movedim(-1, 1) if channels_last else delta)


class FullLayer(torch.nn.Module):
    """Full fine-tuning of one Linear / Conv2d: the run trains its own copy of the layer's weight and bias,
    W' and b' (`full_trained_weight` / `full_trained_bias`), started from the base's (cast / dequantised to fp32 and
    then to `dtype`: what the base layer computes with, read by `read_base`), and the forward is F.linear / F.conv2d
    with W' and b' alone: the base layer is held (for saving and for `detach`) but never called, so a training step is
    the 3 products of training the layer in place (the old layout, the base's output plus x D^T for a trained
    difference D, took 5), and the base's weights need not be on the card for it.

    Why a copy beside ComfyUI's base and not the base itself: the base weights are ComfyUI's MODEL, shared with every
    other node, and are never written. What is saved is still what ComfyUI's loader applies as a "diff" patch
    (comfy/lora.py): W' - W, computed at save one layer at a time (`difference`), so the saved file goes through the
    stock Load LoRA onto the same base, and stock Save Model / Save Checkpoint write the merged model from there.
    Weight decay (AdamW's decoupled decay) now pulls W' towards zero, as in every other full fine-tuner (kohya
    sd-scripts, OneTrainer); with the difference it pulled towards the base weights.

    Memory: W' in fp32 (4 bytes per weight; `dtype` bf16: 2, trained with stochastic rounding by
    memory/fused_backward.py), with the gradient and optimizer state a full fine-tune has (the planner counts them
    from the layers' shapes: planner.TrainableSpec.of_full_layers); the base stays where ComfyUI placed it."""

    def __init__(self, base: torch.nn.Module, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32, read_base=None):
        """`read_base(device)`: the base's (weight, bias or None) in fp32 on `device`, as the layer computes with them
        (default `base_weights`; the ComfyUI bridge gives one that applies the MODEL's own patches)."""
        super().__init__()
        self.base_layer = base
        if isinstance(base, torch.nn.Conv2d) and base.padding_mode != "zeros":
            raise ValueError(f"kind full: a Conv2d with padding_mode {base.padding_mode!r} is not supported")
        self.read_base = read_base if read_base is not None else (lambda where: base_weights(base, where))
        # Made where they will live (`device`), one layer at a time: a model-sized copy built in host RAM first would
        # need that much host RAM for a moment on its way to the card. In host RAM
        # (memory/trained_weights_on_host.py), each product copies it to the input's device.
        weight, bias = self.read_base(device)
        self.full_trained_weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        self.full_trained_bias = None if bias is None else torch.nn.Parameter(bias.to(device=device, dtype=dtype))
        # Trained weights in host RAM (memory/trained_weights_on_host.py): `crossings` copies them to the compute
        # device and back; with their optimizer state on the card, backward hands each gradient, where it was
        # computed, to `device_step` (fused_backward.FusedBackward.step_on_device) instead of autograd.
        self.crossings = None
        self.device_step = None

    def get_base_layer(self) -> torch.nn.Module:
        return self.base_layer

    # ComfyUI reads a layer's weight before calling it (comfy.ops.linear_input_act: Wan's feed-forward picks its INT8
    # kernel by it): the weight this layer computes with is W', never the base's (code using it would skip training).
    @property
    def weight(self) -> torch.Tensor:
        return self.full_trained_weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.full_trained_bias

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        base = self.base_layer
        conv = (base.stride, base.padding, base.dilation, base.groups) if isinstance(base, torch.nn.Conv2d) else None
        return _CastProduct.apply(x, self.full_trained_weight, self.full_trained_bias, conv, self.crossings,
                                  self.device_step)

    @torch.no_grad()
    def difference(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """W' - W and b' - b in fp32, on W's device (what ComfyUI's "diff" / "diff_b" keys hold)."""
        device = self.full_trained_weight.device
        weight, bias = self.read_base(device)
        weight = self.full_trained_weight.float() - weight
        if bias is not None:
            bias = self.full_trained_bias.float() - bias
        return weight, bias


def base_weights(base: torch.nn.Module, device=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Linear / Conv2d's weight and bias in fp32 on `device`, as the layer computes with them: through ComfyUI's
    cast (comfy.ops cast_bias_weight: weights in another dtype or in host RAM, quantised weights, the weight functions
    of a partly loaded model), else the module's own (training/memory/lowbit.py's layers dequantise in `weight`)."""
    if hasattr(base, "comfy_cast_weights"):
        import comfy.ops  # only ComfyUI's layers have it: the engine imports without ComfyUI

        device = torch.device(device) if device is not None else base.weight.device
        weight, bias = comfy.ops.cast_bias_weight(base, None, dtype=torch.float32, device=device,
                                                  bias_dtype=torch.float32)
    else:
        weight, bias = base.weight, getattr(base, "bias", None)
    weight = weight.detach().to(device=device, dtype=torch.float32, copy=True)
    return weight, None if bias is None else bias.detach().to(device=device, dtype=torch.float32, copy=True)


def _linear_not_a_view(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, its result not a view. torch's linear multiplies a contiguous input of 3 or more dimensions with a
    bias as one addmm on its rows and returns a view of that: a custom Function's output that is a view cannot be
    changed in place (autograd refuses it: model code adding a residual with += would stop the step), and FSDP2
    warns at every sharded layer that in-place changes of it would skip its all-gather. The same addmm, written into
    a tensor of the output's shape: bit for bit F.linear, no extra copy. Under autocast the three are cast to its
    dtype first, as autocast casts linear's inputs (an `out=` product is not autocast: it would run in fp32)."""
    if bias is None or x.dim() < 3 or not x.is_contiguous():
        return torch.nn.functional.linear(x, weight, bias)  # not a view here
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point() and x.dtype != torch.float64:
        dtype = torch.get_autocast_dtype(device)
        x, weight, bias = x.to(dtype), weight.to(dtype), bias.to(dtype)
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    torch.addmm(bias, x.view(-1, x.shape[-1]), weight.t(), out=out.view(-1, weight.shape[0]))
    return out


class _CastProduct(torch.autograd.Function):
    """A layer's product with its own weight (F.linear, or F.conv2d with `conv` = (stride, padding, dilation,
    groups)), the weight cast to the input's dtype for the product only.

    Written by hand because torch's own linear / conv keep the cast copy they multiply with until backward: with the
    weight in fp32 under bf16 compute (or bf16 under a CPU's fp32) that is a copy of every trained weight in the
    compute dtype, held for the whole forward without checkpointing. Here backward casts the weight again.
    Gradients: the product's, in the weight's dtype (tests/comfy/test_adapters.py checks them against torch's).

    `crossings` (a weight in host RAM: memory/trained_weights_on_host.Crossings): the weight is copied to the input's
    device in its own dtype for the product, in forward and again in backward (a recompute's copy serving the backward
    after it). `device_step(tensor, on_device, grad)` (its optimizer state on the card): backward hands the weight's
    and bias's gradients there to it, returning none to autograd: no gradient crosses to the host, the update does
    (FusedBackward.step_on_device)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv, crossings=None, device_step=None):
        ctx.save_for_backward(x, weight)
        ctx.conv, ctx.bias_dtype, ctx.crossings, ctx.device_step = (conv, None if bias is None else bias.dtype,
                                                                     crossings, device_step)
        # The parameters themselves (the step writes them, the crossings find their copies by them): a saved tensor
        # comes back from checkpointing's hooks as another object.
        ctx.parameters = (weight, bias)
        if crossings is not None:  # backward reads the bias only to step it on the device
            weight = _crossed(crossings, weight, True)
            bias = None if bias is None else _crossed(crossings, bias, device_step is not None)
        cast = to_compute(weight, x)
        cast_bias = None if bias is None else to_compute(bias, x)
        if conv is None:
            return _linear_not_a_view(x, cast, cast_bias)
        return torch.nn.functional.conv2d(x, cast, cast_bias, *conv)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x = x.to(grad.dtype)
        crossings, step = ctx.crossings, ctx.device_step
        weight_param, bias_param = ctx.parameters
        # One copy on the device, the product's and the step's
        on_device = crossings.to_device(weight_param) if crossings is not None else weight
        cast = to_compute(on_device, grad)
        grad_x = grad_weight = grad_bias = None
        if ctx.conv is None:
            rows = grad.reshape(-1, grad.shape[-1])
            if ctx.needs_input_grad[0]:
                grad_x = grad @ cast
            if ctx.needs_input_grad[1]:
                grad_weight = rows.t() @ x.reshape(-1, x.shape[-1])
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = rows.sum(0)
        else:
            if ctx.needs_input_grad[0]:
                grad_x = torch.nn.grad.conv2d_input(x.shape, cast, grad, *ctx.conv)
            if ctx.needs_input_grad[1]:
                grad_weight = torch.nn.grad.conv2d_weight(x, cast.shape, grad, *ctx.conv)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_bias = grad.sum((0, 2, 3))
        if step is not None:  # stepped here, on the compute device, in the weight's dtype; autograd gets none
            if grad_weight is not None:
                step(weight_param, on_device, grad_weight.to(weight.dtype))
            if grad_bias is not None:
                step(bias_param, crossings.to_device(bias_param), grad_bias.to(ctx.bias_dtype))
            return grad_x, None, None, None, None, None
        # In the weight's dtype, on its device (a host weight's gradient crosses back here).
        return (grad_x, None if grad_weight is None else grad_weight.to(device=weight.device, dtype=weight.dtype),
                None if grad_bias is None else grad_bias.to(device=weight.device, dtype=ctx.bias_dtype), None, None,
                None)


def _crossed(crossings, tensor: torch.Tensor, backward_reads: bool) -> torch.Tensor:
    """A host tensor's copy on the device for a forward product, kept for the backward when this is a recompute and
    that backward reads it."""
    on_device = crossings.to_device(tensor)
    if backward_reads:
        crossings.keep(tensor, on_device)
    return on_device


def _float32(value: float) -> float:
    return torch.tensor(float(value), dtype=torch.float32).item()


def adapter_layer_types() -> tuple[type, ...]:
    """Every module type an AdapterSet swaps into a module tree. peft is imported where a run first makes one of its
    layers (_peft_layer), not with the pack: with its imports (bitsandbytes, parts of transformers) it was 1.7 of the
    pack's 2.1 s in ComfyUI's start-up. Until then no peft layer exists, so its base class is not asked for."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return (OFTLayer, FullLayer) + ((tuners.BaseTunerLayer,) if tuners is not None else ())


def _peft_layer(base: torch.nn.Module, config: AdapterConfig, device=None, read_base=None, rank: int | None = None,
                alpha: float | None = None) -> torch.nn.Module:
    rank, alpha = int(config.rank if rank is None else rank), float(config.alpha if alpha is None else alpha)
    if config.kind == "oft":
        return OFTLayer(base, rank, alpha)
    if config.kind == "full":
        return FullLayer(base, device, torch.bfloat16 if config.full_precision == "bf16_stochastic" else torch.float32,
                         read_base)
    # peft only for its kinds: oft and full are the pack's own layers and run where peft does not import
    from peft import LoHaConfig, LoKrConfig, LoraConfig
    from peft.tuners import loha, lokr
    from peft.tuners.lora import layer as lora_layer

    if config.kind in ("lora", "dora"):
        peft_config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=config.dropout, use_dora=config.kind == "dora")
        cls = lora_layer.Conv2d if isinstance(base, torch.nn.Conv2d) else lora_layer.Linear
        return _made_by_peft(cls, base, peft_config, rank, "lora_alpha", alpha)
    if config.kind == "loha":
        peft_config = LoHaConfig(r=rank, alpha=alpha, module_dropout=config.dropout)
        cls = loha.Conv2d if isinstance(base, torch.nn.Conv2d) else loha.Linear
        return _made_by_peft(cls, base, peft_config, rank, "alpha", alpha)
    peft_config = LoKrConfig(r=rank, alpha=alpha, module_dropout=config.dropout)
    cls = lokr.Conv2d if isinstance(base, torch.nn.Conv2d) else lokr.Linear
    return _made_by_peft(cls, base, peft_config, rank, "alpha", alpha)


# What a peft layer's constructor takes besides the config's fields.
_PEFT_LAYER_ARGUMENTS = frozenset({"self", "base_layer", "adapter_name", "r", "device", "dtype", "config", "kwargs"})


def _made_by_peft(cls: type, base: torch.nn.Module, peft_config, rank: int, alpha_name: str, alpha: float):
    """peft layer `cls` around `base` as `peft_config` says, on every peft Headroom declares (requirements.txt: 0.13
    on). peft 0.19 (LoRA) and 0.20 (LoHa, LoKr) made the layers take their config; before, each took the config's
    fields as keyword arguments, and an unknown `config=` fell into **kwargs unread: DoRA trained as plain LoRA, the
    dropout was lost, and LoKr (device and dtype first) failed. There the layer gets the config's fields as peft's
    own tuner gave them (LoRA: those its constructors or `update_layer` name; LoHa / LoKr: all of them, some read
    from **kwargs), so every peft builds the layer the config describes."""
    if "config" in inspect.signature(cls.update_layer).parameters:
        return cls(base, "default", config=peft_config, r=rank, **{alpha_name: alpha})
    from peft.tuners.lycoris_utils import LycorisConfig

    if isinstance(peft_config, LycorisConfig):  # LoHa / LoKr: peft's tuner passed the whole config (some read there)
        named = set(peft_config.to_dict())
    else:
        named = set(inspect.signature(cls.update_layer).parameters).union(
            *(inspect.signature(klass.__init__).parameters for klass in cls.__mro__ if "__init__" in vars(klass)))
    fields = {name: getattr(peft_config, name) for name in named - _PEFT_LAYER_ARGUMENTS - {alpha_name}
              if hasattr(peft_config, name)}
    return cls(base, adapter_name="default", r=rank, **{alpha_name: alpha}, **fields)


def _check_oft_block_size(root: torch.nn.Module, paths: list[str], block_size: int) -> None:
    outs = {path: _out_features(root.get_submodule(path)) for path in paths}
    bad = [path for path, out in outs.items() if out % block_size]
    if bad:
        common = math.gcd(*outs.values())
        fits = [d for d in range(2, common + 1) if common % d == 0]
        raise ValueError(
            f"kind oft: rank is the block size, and {block_size} does not divide the {outs[bad[0]]} output features "
            f"of {bad[0]} ({len(bad)} of the {len(paths)} trained layers); "
            + (f"block sizes that fit every trained layer: {', '.join(map(str, fits))}" if fits else
               "no block size fits every trained layer: choose other targets"))


def _split_path(path: str) -> tuple[str, str]:
    parent, _, child = path.rpartition(".")
    return parent, child


class AdapterSet:
    """The adapter layers of one run: created once, attached to / detached from a module tree."""

    def __init__(self, root: torch.nn.Module, paths: list[str], config: AdapterConfig,
                 device: torch.device | str | None = None, base_reader=None, on_card: Iterable[str] = (),
                 card_device: torch.device | str | None = None):
        """`device`: where kind full makes its trained weights (the size of the base's); the small adapters of the
        other kinds are made beside their base layer and moved with `to`. `base_reader(path, module, device)`: kind
        full's base (weight, bias) in fp32, as FullLayer's `read_base` (default adapters.base_weights). `on_card`:
        kind full with its trained weights in host RAM (`device` the host), the layers whose trained weights stay on
        `card_device` all the same (policy trained_weights_card_blocks), wherever `to` moves the rest."""
        config.validate()
        self.config = config
        self.on_card = frozenset(on_card)
        self.card_device = None if card_device is None else torch.device(card_device)
        if self.on_card and (config.kind != "full" or self.card_device is None):
            raise ValueError("on_card keeps a full fine-tune's trained layers on the card: kind full and a card_device")
        self.layers: dict[str, torch.nn.Module] = {}
        self.attached_to: torch.nn.Module | None = None
        if config.kind == "oft":
            _check_oft_block_size(root, paths, int(config.rank))
        if config.kind in PEFT_KINDS:
            require_peft(f"kind {config.kind}", "choose kind oft or full (the pack's own layers: no peft)")
        if config.kind == "lokr":
            require_version("peft", "0.14", "kind lokr", "whose LoKr leaves alpha / rank out of its forward (what "
                            "would train is not what the saved file applies)", "choose kind loha or lora")
        ranks, alphas = layer_ranks(paths, config), layer_alphas(paths, config)
        # Seeded init without disturbing the caller's global RNG stream.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.init_seed)
            for path in paths:
                base = root.get_submodule(path)
                if not (is_linear(base) or isinstance(base, torch.nn.Conv2d)):
                    raise TypeError(f"adapter target {path} is a {type(base).__name__}; only Linear and Conv2d are supported")
                read_base = None if base_reader is None else (
                    lambda where, path=path, base=base: base_reader(path, base, where))
                layer = _peft_layer(base, config, self.card_device if path in self.on_card else device, read_base,
                                    ranks[path], alphas[path])
                # peft casts the adapter to the base dtype (fp16/bf16/fp8 bases): trainable weights stay fp32 (a full
                # fine-tune's W': the dtype its full_precision chose).
                if config.kind != "full":
                    for name, param in self._own_parameters(layer):
                        param.data = param.data.float()
                self.layers[path] = layer

    @staticmethod
    def _own_parameters(layer: torch.nn.Module):
        return [(n, p) for n, p in layer.named_parameters() if n.startswith(_ADAPTER_PARAM_PREFIXES)]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for layer in self.layers.values() for _, p in self._own_parameters(layer)]

    def learning_rate_scales(self, loraplus_lr_ratio: float = 1.0) -> list[float]:
        """Per parameter (in `parameters()` order), its learning rate as a multiple of the optimizer's: its layer's
        `layer_lr_scales` scale, times `loraplus_lr_ratio` for a LoRA's up matrices (lora_B; LoRA+), down matrices
        and DoRA's magnitudes at the layer's scale."""
        if loraplus_lr_ratio != 1.0 and self.config.kind not in ("lora", "dora"):
            raise ValueError(f"loraplus_lr_ratio {loraplus_lr_ratio:g} (Optimizer Config) raises the learning rate of "
                             f"a LoRA's up matrices, and kind {self.config.kind} has none: set it to 1, or train kind "
                             "lora or dora")
        per_layer = layer_lr_scales(self.layers, self.config)
        return [per_layer[path] * (loraplus_lr_ratio if name.startswith("lora_B") else 1.0)
                for path, layer in self.layers.items() for name, _ in self._own_parameters(layer)]

    def cap_norms(self, max_norm: float) -> torch.Tensor:
        """Max-norm regularisation (kohya's scale_weight_norms), after an optimizer step: a layer whose update
        scale * up @ down has a Frobenius norm above `max_norm` gets both matrices scaled by sqrt(max_norm / norm), so
        the update's norm is `max_norm` and its direction unchanged. The norm comes from the rank x rank Gram
        matrices, |U D|^2 = sum((U^T U) * (D D^T)), never the product (a rank-16 Flux layer: 16 x 16 work, not
        3072 x 12288), and with no host sync. Returns [layers scaled, mean norm, largest norm] (after scaling) on the
        device, read when shown. Kinds lora and dora (the trainer refuses others)."""
        norms, factors = [], []
        with torch.no_grad():
            for layer in self.layers.values():
                up, down = layer.lora_B["default"].weight, layer.lora_A["default"].weight
                u, d = up.reshape(up.shape[0], -1).float(), down.reshape(down.shape[0], -1).float()
                norm = layer.scaling["default"] * torch.sum((u.T @ u) * (d @ d.T)).clamp_min(0.0).sqrt()
                factor = (max_norm / norm.clamp_min(1e-30)).clamp(max=1.0)  # 1: under the cap
                up.mul_(factor.sqrt().to(up.dtype))
                down.mul_(factor.sqrt().to(down.dtype))
                norms.append(norm * factor)
                factors.append(factor)
            norms = torch.stack(norms)
            return torch.stack([(torch.stack(factors) < 1.0).sum().float(), norms.mean(), norms.max()])

    def weights_in_host_ram(self, crossings, step=None) -> None:
        """Kind full with its trained weights in host RAM: each layer (but those kept `on_card`) copies them to the
        compute device and back through `crossings` (memory/trained_weights_on_host.Crossings); with their optimizer
        state on the card, its backward hands its gradients to `step(tensor, on_device, grad)`
        (fused_backward.FusedBackward.step_on_device; None: to autograd)."""
        for path, layer in self.layers.items():
            if isinstance(layer, FullLayer) and path not in self.on_card:
                layer.crossings, layer.device_step = crossings, step

    def parameters_in_host_ram(self) -> list[torch.nn.Parameter]:
        """The trained tensors that cross (`weights_in_host_ram`): all but those of the layers kept `on_card`."""
        return [p for path, layer in self.layers.items() if path not in self.on_card
                for _, p in self._own_parameters(layer)]

    def unread_base_layers(self) -> list[torch.nn.Module]:
        """The base layers a training step never reads: kind full's (FullLayer computes with its trained copy alone; the
        other kinds add to the base's output). Weight streaming leaves their weights in host RAM."""
        return [layer.base_layer for layer in self.layers.values() if isinstance(layer, FullLayer)]

    def to(self, device: torch.device) -> "AdapterSet":
        """Every trained tensor to `device`, but those of the layers kept `on_card` (to the card device)."""
        for path, layer in self.layers.items():
            where = self.card_device if path in self.on_card else device
            for _, param in self._own_parameters(layer):
                param.data = param.data.to(where)
                if param.grad is not None:
                    param.grad = param.grad.to(where)
        return self

    def train(self, mode: bool = True) -> None:
        for layer in self.layers.values():
            for name, child in layer.named_children():
                if name != "base_layer":
                    child.train(mode)
            layer.training = mode

    # --- attach / detach -------------------------------------------------------------------------------
    def attach(self, root: torch.nn.Module) -> None:
        if self.attached_to is not None:
            raise RuntimeError("adapter is already attached; detach it first")
        for path, layer in self.layers.items():
            parent_path, child = _split_path(path)
            parent = root.get_submodule(parent_path)
            if getattr(parent, child) is not layer.base_layer:
                raise RuntimeError(f"cannot attach adapter: {path} is not the module the adapter was built on")
            setattr(parent, child, layer)
        self.attached_to = root

    def detach(self) -> None:
        if self.attached_to is None:
            return
        for path, layer in self.layers.items():
            parent_path, child = _split_path(path)
            setattr(self.attached_to.get_submodule(parent_path), child, layer.base_layer)
        self.attached_to = None

    def start_from(self, lora: dict[str, tuple[torch.Tensor, torch.Tensor, float]], source: str) -> None:
        """Start from a saved LoRA: {module path: (down, up, scale)}, scale = the file's alpha / rank. Its up
        weights are rescaled by the file's scale over this adapter's, so the adapter's effect is exactly the
        file's; modules the file does not cover start at zero (no effect). Kind oft: {module path: (oft_blocks,
        alpha)} of an OFT file, taken as they are (same block size and constraint, so exactly the file's rotation)."""
        if self.config.kind == "oft":
            return self._start_from_oft(lora, source)
        if self.config.kind != "lora":
            raise ValueError(f"continuing from {source} needs kind lora (the file is a plain LoRA), not {self.config.kind}")
        outside = sorted(set(lora) - set(self.layers))
        if outside:
            raise ValueError(f"{source} adapts {len(outside)} layer(s) this run does not train (e.g. {outside[0]}); "
                             "choose targets / include_conv / layers that cover them (all_layers covers every layer)")
        with torch.no_grad():
            for path, (down, up, scale) in lora.items():
                layer = self.layers[path]
                a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
                rank = layer.r["default"]
                if down.shape[0] != rank:
                    change = (f"rank to {down.shape[0]}" if rank == self.config.rank else
                              f"layer_ranks to give it rank {down.shape[0]} there (now {rank})")
                    raise ValueError(f"{source} has rank {down.shape[0]} at {path}; set the LoRA config's {change} to "
                                     "continue it")
                if down.numel() != a.numel() or up.numel() != b.numel():
                    raise ValueError(f"{source}: {path} has shapes {tuple(up.shape)} / {tuple(down.shape)}, this "
                                     f"model's layer needs {tuple(b.shape)} / {tuple(a.shape)}: a LoRA of another model")
                a.copy_(down.reshape(a.shape).float())
                b.copy_(up.reshape(b.shape).float() * (scale / layer.scaling["default"]))

    def _start_from_oft(self, oft: dict[str, tuple[torch.Tensor, float | None]], source: str) -> None:
        outside = sorted(set(oft) - set(self.layers))
        if outside:
            raise ValueError(f"{source} adapts {len(outside)} layer(s) this run does not train (e.g. {outside[0]}); "
                             "choose targets / include_conv / layers that cover them (all_layers covers every layer)")
        with torch.no_grad():
            for path, (blocks, alpha) in oft.items():
                layer = self.layers[path]
                if blocks.shape[1] != layer.block_size:
                    raise ValueError(f"{source} has OFT block size {blocks.shape[1]} at {path}; set the LoRA config's "
                                     f"rank (the block size for oft) to {blocks.shape[1]} to continue it")
                if blocks.shape != layer.oft.oft_blocks.shape:
                    raise ValueError(f"{source}: {path} has blocks {tuple(blocks.shape)}, this model's layer needs "
                                     f"{tuple(layer.oft.oft_blocks.shape)}: an OFT file of another model")
                if alpha is None or alpha <= 0:
                    raise ValueError(f"{source} has no OFT constraint (alpha) at {path}; kind oft always trains with "
                                     "one (alpha > 0), so it cannot continue this file exactly")
                if _float32(alpha) != layer.oft.constraint:
                    raise ValueError(f"{source} has OFT constraint alpha {alpha:g} at {path}; set the LoRA config's "
                                     f"alpha to {alpha:g} to continue it")
                layer.oft.oft_blocks.copy_(blocks.float())

    # --- state ------------------------------------------------------------------------------------------
    def state_dict(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Trainable tensors under peft's own names (`<path>.<param>`): the exact resume format. `copy` False: the
        live tensors (detached), for writing them out at once (a copy of a full fine-tune's W' is the size of the
        trained weights, on their device)."""
        return {f"{path}.{name}": p.detach().clone() if copy else p.detach() for path, layer in self.layers.items()
                for name, p in self._own_parameters(layer)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        own = {f"{path}.{name}": p for path, layer in self.layers.items() for name, p in self._own_parameters(layer)}
        if own.keys() != state.keys():
            missing, extra = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
            raise ValueError(f"adapter state does not match this adapter: missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for key, param in own.items():
                if param.shape != state[key].shape:
                    raise ValueError(f"adapter state {key} has shape {tuple(state[key].shape)}, expected {tuple(param.shape)}")
                param.copy_(state[key].to(param))

    def comfy_state_dict(self, prefix: str = "diffusion_model.", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The adapter in the key format ComfyUI's LoraLoader maps (see module docstring)."""
        result: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for path, layer in self.layers.items():
                key = prefix + path
                if self.config.kind in ("lora", "dora"):
                    out = _export_lora(key, layer)
                elif self.config.kind == "loha":
                    out = _export_loha(key, layer)
                elif self.config.kind == "lokr":
                    out = _export_lokr(key, layer)
                elif self.config.kind == "full":
                    out = _export_full(key, layer)
                else:
                    out = _export_oft(key, layer)
                # Copies in host RAM at once, never views of the live parameters (a caller may hold the dict while the
                # weights change: EMA swap), and a full fine-tune's W' - W one layer at a time on the device.
                result.update({k: v.detach().to("cpu", dtype, copy=True).contiguous() for k, v in out.items()})
        return result

    def differences(self):
        """Kind full: ("<path>.weight" | "<path>.bias", W' - W in fp32) one layer at a time (a generator: no
        model-sized temporary), for LoRA extraction."""
        for path, layer in self.layers.items():
            weight, bias = layer.difference()
            yield f"{path}.weight", weight
            if bias is not None:
                yield f"{path}.bias", bias

    def upgrade_checkpoint(self, checkpoint):
        """A full fine-tune's checkpoint written with the old layout (a trained difference D beside the base:
        "<path>.full_weight" / "<path>.full_bias", and its EMA) in this layout, converted once: W' = W + D (the
        EMA's the same: the average of W + D is W + the average of D). The optimizer state carries over as it is:
        the gradient of W' is the gradient of D. Other checkpoints are returned unchanged."""
        old = {"full_weight": "full_trained_weight", "full_bias": "full_trained_bias"}
        saved = checkpoint.adapter
        if self.config.kind != "full" or not any(key.rpartition(".")[2] in old for key in saved):
            return checkpoint
        adapter, ema = {}, None if checkpoint.ema is None else dict(checkpoint.ema)
        # The trainer's parameter order: the EMA names each tensor by its index.
        order = {key: f"{index:06d}" for index, key in enumerate(self.state_dict(copy=False))}
        with torch.no_grad():
            for path, layer in self.layers.items():
                weight, bias = layer.read_base(layer.full_trained_weight.device)
                for name, base in (("full_weight", weight), ("full_bias", bias)):
                    key = f"{path}.{name}"
                    if key not in saved or base is None:
                        continue  # _mismatch names what is missing or extra
                    new = f"{path}.{old[name]}"
                    difference = saved[key]
                    adapter[new] = (base + difference.to(base)).to(difference.dtype).cpu()
                    name_in_ema = order.get(new)
                    if ema is not None and name_in_ema in ema:
                        ema[name_in_ema] = (base + ema[name_in_ema].to(base)).cpu()
        adapter.update({k: v for k, v in saved.items() if k.rpartition(".")[2] not in old})
        return dataclasses.replace(checkpoint, adapter=adapter, ema=ema)

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def _export_lora(key: str, layer) -> dict[str, torch.Tensor]:
    up = layer.lora_B["default"].weight.float()
    down = layer.lora_A["default"].weight.float()
    alpha = float(layer.lora_alpha["default"])
    out = {f"{key}.lora_up.weight": up, f"{key}.lora_down.weight": down, f"{key}.alpha": torch.tensor(alpha)}
    if "default" in layer.lora_magnitude_vector:
        base = layer.get_base_layer().weight.float()
        delta = (up.flatten(1) @ down.flatten(1)).reshape(base.shape) * layer.scaling["default"]
        magnitude = layer.lora_magnitude_vector["default"].weight.float().reshape(base.shape[0])
        merged_norm = (base + delta).flatten(1).norm(dim=1)
        # ComfyUI (comfy/weight_adapter/base.py weight_decompose, output-axis case) divides the merged weight by
        # the norm of the *unmerged* weight plus fp32 eps; peft divides by the merged norm. Folding the ratio into
        # dora_scale makes the stock loader reproduce peft's DoRA weight (tests check it against the real loader).
        base_norm = base.flatten(1).norm(dim=1) + torch.finfo(torch.float32).eps
        scale = magnitude * base_norm / merged_norm
        out[f"{key}.dora_scale"] = scale.reshape(base.shape[0], *([1] * (base.ndim - 1)))
    return out


def _export_loha(key: str, layer) -> dict[str, torch.Tensor]:
    out = {f"{key}.alpha": torch.tensor(float(layer.alpha["default"]))}
    for name in ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"):
        params = getattr(layer, name)
        if "default" in params:
            out[f"{key}.{name}"] = params["default"].float()
    return out


def _export_lokr(key: str, layer) -> dict[str, torch.Tensor]:
    out = {}
    for name in ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2"):
        params = getattr(layer, name)
        if "default" in params:
            out[f"{key}.{name}"] = params["default"].float()
    scaling = float(layer.scaling["default"])
    if "lokr_w1_b" in out or "lokr_w2_b" in out:
        # ComfyUI scales by alpha / rank only when a factor is decomposed; peft always scales by alpha / r.
        out[f"{key}.alpha"] = torch.tensor(float(layer.alpha["default"]))
    else:
        out[f"{key}.lokr_w1"] = out[f"{key}.lokr_w1"] * scaling
    return out


def _export_full(key: str, layer: FullLayer) -> dict[str, torch.Tensor]:
    weight, bias = layer.difference()
    return {f"{key}.diff": weight, **({} if bias is None else {f"{key}.diff_b": bias})}


def _export_oft(key: str, layer: OFTLayer) -> dict[str, torch.Tensor]:
    # ComfyUI's loader reads `alpha` as the constraint (> 0: Q is scaled down to norm alpha), as OFTDiff trained it.
    return {f"{key}.oft_blocks": layer.oft.oft_blocks.float(), f"{key}.alpha": torch.tensor(layer.oft.constraint)}
