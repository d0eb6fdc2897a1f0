"""Several LoRAs as one (kohya's svd_merge_lora): per layer, the sum of the files' updates at their strengths.

    merged, report = merge_updates({"diffusion_model.x.weight": [Update(up, down, 0.8 * alpha / r), ...]}, rank=32)

A layer's update is `scale * up @ down` (the stock loader's alpha / rank, times the strength the file is merged at),
so the sum of a layer's updates is one product of stacked factors, `[s1 up1, s2 up2] @ [down1; down2]`, of rank
r1 + r2: exact, with no SVD. `rank` / `energy` then keep its largest singular directions (lora_resize.best_of_rank:
two thin QRs and a small SVD in float64, never the full product), as Resize LoRA does. Whole-tensor differences
(ComfyUI's `diff` patches: biases and norms trained directly) add up as they are.

Written here because no library in use merges LoRA state dicts: kohya's merge scripts are programs of their own, peft
merges adapters into a model (not into one adapter), and ComfyUI's loader only applies files.
"""
from __future__ import annotations

import dataclasses

import torch

from .lora_resize import best_of_rank, counted


@dataclasses.dataclass
class Update:
    """One file's update of one weight: `scale * up @ down`, up [out, r] and down [r, n] in float64 (a file's layer
    that is rows of a fused weight has its up padded to all the weight's rows with zeros)."""

    up: torch.Tensor
    down: torch.Tensor
    scale: float


@dataclasses.dataclass
class Merged:
    """What merging did, per weight: its rank as the sum of the files' (before) and kept (after), the share of the
    summed update's energy kept; differences added."""

    ranks: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    energy: dict[str, float] = dataclasses.field(default_factory=dict)
    differences: int = 0

    def summary(self) -> str:
        lines = []
        if self.ranks:
            after = [a for _, a in self.ranks.values()]
            reduced = [layer for layer, (before, kept) in self.ranks.items() if kept < before]
            line = (f"{counted(len(self.ranks), 'LoRA layer')}, rank {min(after)}-{max(after)} "
                    f"(mean {sum(after) / len(after):.1f})")
            if reduced:
                shares = [self.energy[layer] for layer in reduced]
                line += (f"; {len(reduced)} reduced from the sum of their ranks, each keeping at least "
                         f"{min(shares):.1%} of its summed update's energy (mean {sum(shares) / len(shares):.1%})")
            else:
                line += ": the exact sum of the files' updates"
            lines.append(line)
        if self.differences:
            lines.append(f"{counted(self.differences, 'whole-tensor difference')} (diff) added")
        return "; ".join(lines)


def merge_updates(layers: dict[str, list[Update]], *, rank: int = 0,
                  energy: float = 0.0) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], Merged]:
    """{weight: (up [out, k], down [k, n]) in float64, at scale 1} summing each weight's updates, and what was done.
    rank 0 and energy 0: the exact sum (k the sum of the ranks); otherwise each summed update by its largest singular
    directions, at most `rank` (when > 0), the fewest holding `energy` of it (when > 0); a sum already at or below
    the rank it would get is kept exact."""
    if not 0 <= energy <= 1 or rank < 0:
        raise ValueError(f"rank must be 0 or more and energy in [0, 1] (rank {rank}, energy {energy})")
    report = Merged()
    merged = {}
    for weight, updates in sorted(layers.items()):
        up = torch.cat([u.up * u.scale for u in updates], dim=1)
        down = torch.cat([u.down for u in updates], dim=0)
        before = down.shape[0]
        if rank == 0 and energy == 0:
            merged[weight], report.ranks[weight], report.energy[weight] = (up, down), (before, before), 1.0
            continue
        new_up, new_down, kept, share = best_of_rank(up, down, 1.0, rank, energy)
        if kept >= before:  # nothing to drop: the exact factors, not a rotation of them
            new_up, new_down, kept = up, down, before
        merged[weight], report.ranks[weight], report.energy[weight] = (new_up, new_down), (before, kept), share
    return merged, report
