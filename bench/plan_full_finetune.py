"""The planner's figures for a full fine-tune of SD3.5 Large (8 B) at 1024 px on a 16, 24 and 80 GB card (issue 27),
as a run plans it: LoRA Config kind full on every Linear inside the blocks (targets all_linear), each memory option
of the run on top of the last, and for each card the policy the planner's auto mode (the Offload Policy's `card`)
chooses: base placement, checkpointing, optimizer state, and (with fused backward) whether the trained weights stay in
host RAM.

    python bench/plan_full_finetune.py                 # SD3.5 Large: a Markdown table, the versions and the date
    python bench/plan_full_finetune.py flux_dev        # the same for Flux.1-dev (any bench/plan_table.py template's)
    python bench/plan_full_finetune.py sdxl --targets all_layers --cards 8,12,16,24
                                                       # a template's LoRA Config targets, other cards (GB)

Planned, not measured. The model is described as bench/plan_table.py describes it (two blocks measured at real width on
this CPU, the full-depth model on the meta device); the trained tensors are what the run trains
(nodes/bridge/planning.lora_trainable: each targeted layer's trained copy, weight and bias).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time

import torch

import plan_table  # noqa: E402  (bench/: ComfyUI in-process, tests/ on sys.path)

CARDS_GB = (16, 24, 80)
RESERVE_GB = 1.0
# (label, optimizer, LoRA Config full_precision, Offload Policy fused_backward): the plain run, then one option at a
# time on top of the last.
VARIANTS = [
    ("fp32 weights, all gradients, AdamW", "AdamW", "fp32", False),
    ("+ fused backward", "AdamW", "fp32", True),
    ("+ bf16 weights, stochastic rounding", "AdamW", "bf16_stochastic", True),
    ("... with AdamW8bit state", "AdamW8bit", "bf16_stochastic", True),
    ("... with Adafactor state", "Adafactor", "bf16_stochastic", True),
    ("fp32 weights, all gradients, Adafactor", "Adafactor", "fp32", False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("architecture", nargs="?", default="sd35_large", help="a bench/plan_table.py template's")
    parser.add_argument("--targets", default="all_linear", help="LoRA Config targets (all_layers: convs and norms too)")
    parser.add_argument("--cards", default=",".join(map(str, CARDS_GB)), help="card sizes in GB, comma-separated")
    args = parser.parse_args()
    architecture, cards = args.architecture, [float(card) for card in args.cards.split(",") if card.strip()]
    plan_table.suite.import_comfyui(cpu=True, use_pytorch_cross_attention=True)
    torch.set_num_threads(1)
    import comfy.model_management

    comfy.model_management.pytorch_attention_flash_attention = lambda: True  # as on an NVIDIA GPU (plan_table.py)
    from headroom.nodes.bridge.planning import lora_trainable, with_host_step
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory.planner import RunShape, plan_auto
    from headroom.training.memory.policy import OffloadPolicy
    from headroom.training.core.optimizers import host_step_rate
    from headroom.training.memory.time_model import DEFAULT_H2D_BYTES_PER_S, DEFAULT_HOST_COPY_BYTES_PER_S

    started = time.monotonic()
    template = next((t for t in plan_table.TEMPLATES if t.architecture == architecture), None)
    if template is None:
        sys.exit(f"no template of architecture {architecture!r}: one of "
                 f"{', '.join(t.architecture for t in plan_table.TEMPLATES)}")
    description, _, full = plan_table.describe(template)
    shape = RunShape(1, 1024, 1024)
    print("| options | " + " | ".join(f"{c:g} GB card: training step (policy chosen) | host RAM" for c in cards) + " |")
    print("|---|" + "---:|---:|" * len(cards))
    for label, optimizer, precision, fused in VARIANTS:
        adapter = AdapterConfig(kind="full", targets=args.targets, full_precision=precision)
        trainable = with_host_step(lora_trainable(full, adapter, optimizer))  # as a run plans it
        cells = []
        for card in cards:
            plan = plan_auto(description, trainable, shape, OffloadPolicy(fused_backward=fused),
                             int((card - RESERVE_GB) * 2 ** 30))
            step = plan.phase("training step").total / 2 ** 30
            policy = plan.policy
            chosen = f"{policy.base_placement}, checkpointing {policy.checkpointing}, state {policy.optimizer_state_said}"
            if policy.trained_weights == "host":
                chosen += ", trained weights in host RAM"
                if policy.trained_card_blocks:
                    chosen += f" but {len(policy.trained_card_blocks)} blocks' kept on the card"
            if policy.base_storage != "as_loaded":
                chosen += f", base {policy.base_storage}"
            streamed = plan.host_bytes.get("streamed block weights", 0)
            if streamed >= 0.05 * 2 ** 30:
                chosen += f", {streamed / 2 ** 30:.1f} GiB of base streamed"
            peak = plan.peak
            if peak.phase != "training step":  # the card's peak is another phase (validation, as the saved file)
                chosen += f"; peak {peak.total / 2 ** 30:.1f} GiB in {peak.phase}"
            if plan.predicted_s_per_step is not None:
                chosen += f"; predicted {plan.predicted_s_per_step:.2f} s/step"
            cells += [f"{step:.1f} GiB ({chosen}){'' if plan.device_fits else ' **no fit**'}",
                      f"{sum(plan.host_bytes.values()) / 2 ** 30:.1f} GiB"]
        print(f"| {label} | " + " | ".join(cells) + " |")
    import comfyui_version

    count = trainable.param_count
    trained = ("every Linear in the blocks, with biases" if args.targets == "all_linear" else
               f"LoRA Config targets {args.targets}")
    print(f"\n{template.label}, {count / 1e9:.2f} B trained weights ({trained}), 1024x1024, "
          f"batch 1; budget = card - {RESERVE_GB:g} GiB; planned {datetime.date.today()}; torch {torch.__version__}, "
          f"ComfyUI {comfyui_version.__version__}, Python {platform.python_version()} ({time.monotonic() - started:.0f} s). "
          "Predicted s/step: the planner's time model without block times measured on a GPU (compute estimated from "
          f"reading the weights, so far too low), host <-> device copies at {DEFAULT_H2D_BYTES_PER_S / 1e9:.0f} GB/s, the "
          f"CPU's copies through the staging buffers at {DEFAULT_HOST_COPY_BYTES_PER_S / 1e9:.0f} GB/s and "
          "the optimizer step (in host RAM at this CPU's rate on one thread, measured as fused backward steps: "
          + ", ".join(f"{name} {host_step_rate(name, precision != 'fp32') * 1e9:.1f} ns per weight"
                      + (" with bf16 rounding" if precision != "fp32" else "")
                      for name, precision in sorted({(v[1], v[2]) for v in VARIANTS}))
          + "): meaningful where copies or a host RAM step bound it, not for compute-bound rows.")


if __name__ == "__main__":
    sys.exit(main())
