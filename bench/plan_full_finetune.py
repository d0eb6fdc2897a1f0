"""The planner's figures for a full fine-tune of SD3.5 Large (8 B) at 1024 px on a 24 GB and an 80 GB card (issue 27):
each memory option of training/memory/full_plan.py, from the plain run (fp32 masters, every gradient, AdamW on the
device) to everything on (bf16 stochastic rounding, fused backward, Adafactor, optimizer state in host RAM).

    python bench/plan_full_finetune.py      # prints a Markdown table, the versions and the date

Planned, not measured. The model is described as bench/plan_table.py describes it (two blocks measured at real width on
this CPU, the full-depth model on the meta device); the trained tensors are every block's parameters.
"""
from __future__ import annotations

import datetime
import platform
import sys
import time

import torch

import plan_table  # noqa: E402  (bench/: ComfyUI in-process, tests/ on sys.path)

CARDS_GB = (24, 80)
RESERVE_GB = 1.0
# (label, optimizer, FullTraining fields): the plain run, then one option at a time on top of fused backward + bf16.
VARIANTS = [
    ("fp32 masters, all gradients, AdamW", "AdamW", dict(weights="fp32_masters", fused_backward=False)),
    ("+ fused backward", "AdamW", dict(weights="fp32_masters")),
    ("+ bf16 stochastic rounding", "AdamW", dict()),
    ("... with AdamW8bit state", "AdamW8bit", dict()),
    ("... with Adafactor state", "Adafactor", dict()),
    ("... with the AdamW state in host RAM", "AdamW", dict(optimizer_state="cpu")),
    ("... with Adafactor and offloaded checkpoints", "Adafactor", dict(checkpointing="blocks_cpu_offload")),
]


def main() -> None:
    plan_table.suite.import_comfyui(cpu=True, use_pytorch_cross_attention=True)
    torch.set_num_threads(1)
    import comfy.model_management

    comfy.model_management.pytorch_attention_flash_attention = lambda: True  # as on an NVIDIA GPU (plan_table.py)
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.training.memory.full_plan import FullTraining, estimate_full
    from headroom.training.memory.planner import RunShape, TrainableSpec

    started = time.monotonic()
    template = next(t for t in plan_table.TEMPLATES if t.architecture == "sd35_large")
    description, _, full = plan_table.describe(template)
    params = [p for _, block in training_blocks(full.model.diffusion_model) for p in block.parameters()]
    shape = RunShape(1, 1024, 1024)
    print("| options | " + " | ".join(f"training step, {c} GB card" for c in CARDS_GB) + " | host RAM |")
    print("|---|" + "---:|" * len(CARDS_GB) + "---:|")
    for label, optimizer, fields in VARIANTS:
        trainable = TrainableSpec.from_parameters(params, optimizer)
        cells = []
        for card in CARDS_GB:
            plan = estimate_full(description, trainable, shape, FullTraining(**fields), int((card - RESERVE_GB) * 2 ** 30))
            step = plan.phase("training step").total / 2 ** 30
            cells.append(f"{step:.1f} GiB{'' if plan.fits else ' (no fit)'}")
        host = sum(plan.host_bytes.values()) / 2 ** 30
        print(f"| {label} | " + " | ".join(cells) + f" | {host:.2f} GiB |")
    import comfyui_version

    count = sum(p.numel() for p in params)
    print(f"\nSD3.5 Large, {count / 1e9:.2f} B trained block parameters, 1024x1024, batch 1, checkpointing blocks unless "
          f"said; budget = card - {RESERVE_GB:g} GiB; planned {datetime.date.today()}; torch {torch.__version__}, "
          f"ComfyUI {comfyui_version.__version__}, Python {platform.python_version()} ({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
