"""A LoRA file at a lower rank (kohya's resize_lora): each layer's update kept by its largest singular directions.

    resized, report = resize_lora(state, rank=16)            # or energy=0.95, or both
    save_file(resized, "models/loras/my_lora_rank16.safetensors")

A layer's update as ComfyUI's stock loader applies it is `scale * up @ down` (alpha / rank where the file holds an
alpha, else 1; convolutions flattened as the loader flattens them). Its SVD comes from two thin QRs and the SVD of a
rank x rank matrix (in float64, never the full product), so a Flux-width layer costs milliseconds. The kept directions
are split evenly between the new up and down (each times the square root of its singular value: neither side's
values grow large in fp16 / bf16) and alpha becomes the new rank (scale 1). `rank`: at most that many directions per
layer; `energy`: per layer the fewest that hold that share of the update's squared Frobenius norm (capped by `rank`
when both are given), the same measure as Extract LoRA (lora_extract). A layer already at or below the rank it
would get is copied as it is, bit for bit.

Keys keep their names, so a file keeps its format (ComfyUI's keys, kohya's, diffusers' / PEFT's, text-encoder layers
too); every naming ComfyUI's loader reads a LoRA layer by (comfy/weight_adapter/lora.py) is recognised. What is not a
plain up / down pair is copied unchanged: LoHa / LoKr / OFT layers, whole-tensor diff patches, LoCon layers with a
Tucker `lora_mid` (their rank is the core's). A DoRA layer's `dora_scale` is kept: the loader renormalises the
resized update, so the result is close to, not equal to, the best approximation of the DoRA weight.

Written here because no library in use resizes a LoRA state dict: kohya's resize script is a program of its own,
peft resizes nothing, and ComfyUI's loader only applies files.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ..checks import check_finite
from .lora_extract import rank_for

# (up suffix, down suffix) of every LoRA layer naming ComfyUI's loader reads, as comfy/weight_adapter/lora.py lists
# them; alpha is "<layer>.alpha" and a Tucker core "<layer>.lora_mid.weight" in all of them.
PAIR_SUFFIXES = (
    (".lora_up.weight", ".lora_down.weight"),  # ComfyUI's own, kohya's, LyCORIS'
    ("_lora.up.weight", "_lora.down.weight"),  # diffusers' attention processors
    (".lora_B.weight", ".lora_A.weight"),  # PEFT / diffusers
    (".lora.up.weight", ".lora.down.weight"),  # diffusers' older LoRA layers
    (".lora_B", ".lora_A"),  # Mochi
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),  # transformers'
    (".lora_B.default.weight", ".lora_A.default.weight"),  # PEFT's adapter name left in (Qwen-Image files)
)


def counted(number: int, noun: str) -> str:
    """'1 layer', '2 layers': a count and its noun (regular plurals)."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


@dataclasses.dataclass
class Pair:
    up: str
    down: str
    alpha: str | None


@dataclasses.dataclass
class Resized:
    """What resizing did, per layer (its name without the suffix): rank before and after, share of the update's
    energy kept; layers copied unchanged, and why."""

    ranks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    energy: dict[str, float] = dataclasses.field(default_factory=dict)
    # each layer's alpha after (its rank where the file holds no alpha: the stock loader's scale 1)
    alphas: dict[str, float] = dataclasses.field(default_factory=dict)
    kept_as_is: list[str] = dataclasses.field(default_factory=list)  # already at or below the rank they would get
    tucker: list[str] = dataclasses.field(default_factory=list)  # LoCon layers with a lora_mid, copied
    other_tensors: int = 0  # keys of no LoRA pair (LoHa, LoKr, OFT, diff, dora_scale, ...), copied
    # (rank, alpha) after, of each convolution with a kernel over 1x1 (kohya's conv_dim / conv_alpha layers)
    convolutions: dict[str, tuple[int, float]] = dataclasses.field(default_factory=dict)

    def new_ranks(self) -> dict[str, int]:
        return {layer: after for layer, (_, after) in self.ranks.items()}

    def summary(self) -> str:
        resized = {layer: ranks for layer, ranks in self.ranks.items() if layer not in self.kept_as_is}
        lines = []
        if resized:
            before = sorted({b for b, _ in resized.values()})
            after = [a for _, a in resized.values()]
            shares = [self.energy[layer] for layer in resized]
            lines.append(f"{counted(len(resized), 'layer')} resized: rank {'/'.join(map(str, before))} -> {min(after)}-"
                         f"{max(after)} (mean {sum(after) / len(after):.1f}), each keeping at least "
                         f"{min(shares):.1%} of its update's energy (mean {sum(shares) / len(shares):.1%})")
        else:
            lines.append("no layer was above the rank asked for: nothing resized")
        if self.kept_as_is:
            lines.append(f"{counted(len(self.kept_as_is), 'layer')} already at or below it, copied as they are")
        if self.tucker:
            lines.append(f"{counted(len(self.tucker), 'LoCon layer')} with a Tucker core (lora_mid) copied as they are")
        if self.other_tensors:
            lines.append(f"{counted(self.other_tensors, 'other tensor')} (LoHa / LoKr / OFT / diff / DoRA scales) "
                         "copied as they are")
        return "; ".join(lines)


def find_pairs(state: dict[str, torch.Tensor]) -> dict[str, Pair]:
    """The plain LoRA layers of a state dict, by layer name (the key without its suffix), as ComfyUI's loader pairs
    them: the first naming in PAIR_SUFFIXES whose up key is there, with the down key it reads beside it."""
    pairs: dict[str, Pair] = {}
    for key in state:
        for up_suffix, down_suffix in PAIR_SUFFIXES:
            if not key.endswith(up_suffix):
                continue
            layer = key[:-len(up_suffix)]
            if layer in pairs:
                break
            down = layer + down_suffix
            if down not in state:
                raise ValueError(f"{key} has no {down} beside it: the file is incomplete or not a LoRA")
            alpha = layer + ".alpha"
            pairs[layer] = Pair(key, down, alpha if alpha in state else None)
            break
    return pairs


def _checked(state: dict[str, torch.Tensor], layer: str, pair: Pair) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(up [out, r], down [r, n], scale) of one layer in float64, every field of the untrusted file checked."""
    up, down = state[pair.up], state[pair.down]
    for key, tensor in ((pair.up, up), (pair.down, down)):
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.ndim < 2:
            raise ValueError(f"{key} is not a floating-point matrix ({getattr(tensor, 'dtype', type(tensor).__name__)}, "
                             f"shape {tuple(getattr(tensor, 'shape', ()))})")
    alpha = None
    if pair.alpha is not None:
        alpha = state[pair.alpha]
        if not isinstance(alpha, torch.Tensor) or alpha.numel() != 1 or alpha.dtype == torch.bool:
            raise ValueError(f"{pair.alpha} must be one number (alpha), not {tuple(getattr(alpha, 'shape', ()))}")
        alpha = float(alpha.detach().double().reshape(()))
        if not math.isfinite(alpha):
            raise ValueError(f"{pair.alpha} is {alpha}: alpha must be a finite number")
    return checked_factors(layer, up, down, alpha)


def checked_factors(layer: str, up: torch.Tensor, down: torch.Tensor,
                    alpha: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(up [out, r], down [r, n], scale) of one LoRA layer in float64 (convolutions flattened as the stock loader
    flattens them), checked: they are floating-point matrices that multiply, hold finite values, alpha is finite (None:
    scale 1)."""
    for side, tensor in (("up", up), ("down", down)):
        if not tensor.is_floating_point() or tensor.ndim < 2:
            raise ValueError(f"{layer}: its {side} weight is not a floating-point matrix ({tensor.dtype}, shape "
                             f"{tuple(tensor.shape)})")
    up2, down2 = up.detach().flatten(1).double(), down.detach().flatten(1).double()
    if up2.shape[1] != down2.shape[0] or down2.shape[0] == 0:
        raise ValueError(f"{layer}: its up weight {tuple(up.shape)} and down weight {tuple(down.shape)} do not multiply "
                         "(the up's second size must be the down's first, the rank)")
    if not (torch.isfinite(up2).all() and torch.isfinite(down2).all()):
        raise ValueError(f"{layer}: its up / down weights hold NaN or infinite values; the LoRA is broken")
    if alpha is None:
        return up2, down2, 1.0
    if not math.isfinite(alpha):
        raise ValueError(f"{layer}: its alpha is {alpha}: alpha must be a finite number")
    return up2, down2, alpha / down2.shape[0]  # as the stock loader: alpha / the down weight's rows


def best_of_rank(up2: torch.Tensor, down2: torch.Tensor, scale: float, rank: int,
                 energy: float) -> tuple[torch.Tensor, torch.Tensor, int, float]:
    """The update `scale * up2 @ down2` (float64 matrices) by its largest singular directions, `rank_for(rank,
    energy)` of them: (new up [out, k], new down [k, n], k, share of the update's squared norm kept). The singular
    values are split evenly between the two (each side times their square roots)."""
    # up @ down = Qu (Ru Rd^T) Qd^T: the SVD of the small middle matrix is the update's, without forming it.
    q_up, r_up = torch.linalg.qr(up2)
    q_down, r_down = torch.linalg.qr(down2.T)
    u, s, vh = torch.linalg.svd((r_up @ r_down.T) * scale, full_matrices=False)
    total = float((s ** 2).sum())
    kept = rank_for(s, rank, energy) if total > 0 else 1  # an update of zeros (a LoRA never trained) needs one
    share = float((s[:kept] ** 2).sum()) / total if total > 0 else 1.0
    root = s[:kept].sqrt()
    return (q_up @ u[:, :kept]) * root, root[:, None] * (vh[:kept] @ q_down.T), kept, share


def resize_lora(state: dict[str, torch.Tensor], *, rank: int = 0, energy: float = 0.0,
                dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], Resized]:
    """The state dict with each plain LoRA layer above the rank it gets replaced by its truncated SVD (same keys;
    `dtype`: the resized layers' dtype, None: each layer's own), and what was done. Give `rank` > 0, `energy` in
    (0, 1], or both."""
    check_finite("LoRA resize", energy=energy)
    if not 0 <= energy <= 1 or (rank <= 0 and energy == 0):
        raise ValueError(f"give rank > 0 or energy in (0, 1] (rank {rank}, energy {energy})")
    pairs = find_pairs(state)
    if not pairs:
        raise ValueError("it holds no plain LoRA layers (up / down pairs): LoHa, LoKr, OFT and full differences have "
                         "no rank to reduce")
    report = Resized()
    out = dict(state)
    paired = set()
    for layer, pair in sorted(pairs.items()):
        paired |= {pair.up, pair.down} | ({pair.alpha} if pair.alpha else set())
        spatial = state[pair.down].ndim > 2 and any(size != 1 for size in state[pair.down].shape[2:])
        if layer + ".lora_mid.weight" in state:
            paired.add(layer + ".lora_mid.weight")
            report.tucker.append(layer)
            if spatial:  # its rank and alpha stay (metadata only: an unreadable alpha counts as its rank)
                rows, alpha = state[pair.down].shape[0], state.get(pair.alpha) if pair.alpha else None
                usable = isinstance(alpha, torch.Tensor) and alpha.numel() == 1 and alpha.is_floating_point()
                report.convolutions[layer] = (rows, float(alpha.reshape(())) if usable else float(rows))
            continue
        up2, down2, scale = _checked(state, layer, pair)
        before = down2.shape[0]
        new_up, new_down, kept, report.energy[layer] = best_of_rank(up2, down2, scale, rank, energy)
        report.ranks[layer] = (before, kept)
        if kept >= before:
            report.ranks[layer] = (before, before)
            report.alphas[layer] = scale * before
            report.kept_as_is.append(layer)
            if spatial:
                report.convolutions[layer] = (before, scale * before)
            continue
        up, down = state[pair.up], state[pair.down]
        out[pair.up] = new_up.reshape(up.shape[0], kept, *up.shape[2:]).to(dtype or up.dtype).contiguous()
        out[pair.down] = new_down.reshape(kept, *down.shape[1:]).to(dtype or down.dtype).contiguous()
        if not (torch.isfinite(out[pair.up]).all() and torch.isfinite(out[pair.down]).all()):
            raise ValueError(f"{layer}: its resized weights exceed {out[pair.up].dtype}'s range (the file's alpha "
                             "makes its update that large); save in fp32 or bf16")
        # alpha = the new rank: scale 1, the singular values are in the weights. A file without alphas is read at
        # scale 1 already, so none is added to it.
        if pair.alpha is not None:
            out[pair.alpha] = torch.tensor(float(kept), dtype=state[pair.alpha].dtype)
        report.alphas[layer] = float(kept)
        if spatial:
            report.convolutions[layer] = (kept, float(kept))
    report.other_tensors = len(set(state) - paired)
    return out, report
