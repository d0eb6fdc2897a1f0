"""A LoRA extracted from what a full fine-tune changed (issue 27): the stock LoraLoader applies it to the base model.

    lora, report = extract_lora(base_state, trained_state, rank=64)          # or energy=0.95
    save_file(lora, "models/loras/my_finetune.safetensors")

Every weight of two or more dimensions (Linear, conv) that changed: the truncated SVD of the difference (torch.linalg,
in fp32), up = U * S, down = Vh, alpha = rank (so ComfyUI's scale alpha / rank is 1). `rank`: that many singular
values (fewer where the matrix is smaller); `energy`: per weight, the fewest singular values that hold that share of
the difference's squared Frobenius norm (capped by `rank` when both are given). Anything else that changed (biases,
norms: one-dimensional) is stored whole as ComfyUI's "diff" keys (`.diff`, `.diff_b`), which its loader adds exactly.
Keys are ComfyUI's LoRA format (`<prefix><module path>.lora_up.weight` / `.lora_down.weight` / `.alpha`), as the
saved LoRA of a LoRA run.

Written here because no library in use extracts a LoRA from two ComfyUI state dicts: peft builds adapters to train,
not from weight differences, and kohya's extract script is a program of its own, not an importable function.
"""
from __future__ import annotations

import dataclasses

import torch

from ..checks import check_finite


@dataclasses.dataclass
class Extracted:
    """What the extraction kept, per weight: rank and the share of the difference's energy it holds."""

    ranks: dict[str, int] = dataclasses.field(default_factory=dict)
    energy: dict[str, float] = dataclasses.field(default_factory=dict)
    whole: list[str] = dataclasses.field(default_factory=list)  # stored as diff keys (one-dimensional tensors)
    unchanged: int = 0

    def summary(self) -> str:
        kept = min(self.energy.values(), default=1.0)
        return (f"{len(self.ranks)} weights as LoRA (rank {min(self.ranks.values(), default=0)}-"
                f"{max(self.ranks.values(), default=0)}, at least {kept:.1%} of each difference's energy), "
                f"{len(self.whole)} tensors whole, {self.unchanged} unchanged")


def rank_for(singular: torch.Tensor, rank: int, energy: float) -> int:
    limit = singular.numel() if rank <= 0 else min(rank, singular.numel())
    if energy <= 0:
        return limit
    share = torch.cumsum(singular.double() ** 2, 0) / (singular.double() ** 2).sum()
    needed = int(torch.searchsorted(share, torch.tensor([energy], dtype=share.dtype)).item()) + 1
    return max(1, min(limit, needed))


def extract_lora(base: dict[str, torch.Tensor], trained: dict[str, torch.Tensor], *, rank: int = 0,
                 energy: float = 0.0, prefix: str = "diffusion_model.",
                 dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Extracted]:
    """The LoRA (ComfyUI keys, `dtype`) that takes `base` to `trained` (state dicts of one model, same keys), and
    what it kept. Give `rank` (> 0), `energy` (in (0, 1]) or both."""
    missing = sorted(set(base) ^ set(trained))
    if missing:
        raise ValueError(f"LoRA extraction: the two models' keys differ (e.g. {missing[0]}): extract from the model "
                         "the fine-tune started from")
    for key in base:
        if base[key].shape != trained[key].shape:
            raise ValueError(f"LoRA extraction: {key} is {tuple(base[key].shape)} in the base, "
                             f"{tuple(trained[key].shape)} trained")
    differences = ((key, trained[key].detach().float() - base[key].detach().float()) for key in sorted(base)
                   if base[key].is_floating_point())
    return extract_from_differences(differences, rank=rank, energy=energy, prefix=prefix, dtype=dtype)


def extract_from_differences(differences, *, rank: int = 0, energy: float = 0.0, prefix: str = "diffusion_model.",
                             dtype: torch.dtype = torch.float32) -> tuple[dict[str, torch.Tensor], Extracted]:
    """The LoRA of (state-dict key, trained minus base) pairs, e.g. a full fine-tune run's own differences
    (adapters.FullLayer), without a second copy of the model; as `extract_lora`."""
    check_finite("LoRA extraction", energy=energy)
    if not 0 <= energy <= 1 or (rank <= 0 and energy == 0):
        raise ValueError(f"LoRA extraction: give rank > 0 or energy in (0, 1] (rank {rank}, energy {energy})")
    out: dict[str, torch.Tensor] = {}
    report = Extracted()
    for key, difference in differences:
        difference = difference.detach().float()
        if not torch.any(difference):
            report.unchanged += 1
            continue
        module, _, name = key.rpartition(".")
        target = prefix + module
        if difference.ndim >= 2 and name == "weight":
            u, s, vh = torch.linalg.svd(difference.flatten(1), full_matrices=False)
            kept = rank_for(s, rank, energy)
            up = u[:, :kept] * s[:kept]
            down = vh[:kept].reshape(kept, *difference.shape[1:])
            out[f"{target}.lora_up.weight"] = up.reshape(up.shape[0], kept, *([1] * (difference.ndim - 2))).to(dtype)
            out[f"{target}.lora_down.weight"] = down.to(dtype).contiguous()
            out[f"{target}.alpha"] = torch.tensor(float(kept)).to(dtype)
            report.ranks[key] = kept
            report.energy[key] = float((s[:kept].double() ** 2).sum() / (s.double() ** 2).sum())
        elif name in ("weight", "bias"):
            out[f"{target}.{'diff' if name == 'weight' else 'diff_b'}"] = difference.to(dtype)
            report.whole.append(key)
        else:  # a buffer or parameter ComfyUI's LoRA keys cannot address
            raise ValueError(f"LoRA extraction: {key} changed and no LoRA key applies to it (only weights and biases)")
    return {k: v.contiguous() for k, v in out.items()}, report
