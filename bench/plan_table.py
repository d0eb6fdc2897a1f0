"""The planner's figures for the README's card table: for each shipped LoRA template (and ControlNet template), the
fastest policy whose planned peak fits an 8 / 12 / 16 / 24 GB card (what the Offload Policy node's `card` resolves
to), and that peak.

    python bench/plan_table.py            # prints two Markdown tables (device peaks, host RAM), the versions and the date
    python bench/plan_table.py sdxl_lora  # only these templates

Planned, not measured: the figures are the planner's (training/memory/planner.py) until a GPU measures them. Each
model is described as the training node describes it (nodes/bridge/planning.describe_comfy_model), from ComfyUI's own
classes (tests/realsize_models.py), as on an NVIDIA GPU that computes in bf16 (no manual cast; ComfyUI's PyTorch
attention, its default there, and its sampling estimate for it):
- each kind of block is measured at real width (its activations, by forwards at small sizes on this CPU), on a model
  with one block of each kind (the UNets at full size, in fp32 with their activations halved: bf16 convolutions on a
  CPU are too slow);
- the full-depth model is built on the meta device (no memory): its blocks, their weight bytes and the LoRA's
  trainable tensors come from it, each block taking the measured laws of its kind.
Text encoders and the VAE are left out (they run before training, one at a time, and ComfyUI loads what fits of
them); the run shape is the template's: batch 1, its resolution and rank and optimizer, a video template's frames.
"""
from __future__ import annotations

import dataclasses
import datetime
import platform
import re
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "bench" / "gpu"))
import suite  # noqa: E402  (ComfyUI in-process as the GPU kit imports it; puts tests/ on sys.path)

CARDS_GB = (8, 12, 16, 24)


@dataclasses.dataclass(frozen=True)
class Template:
    workflow: str  # workflows/<name>.json
    label: str
    architecture: str  # tests/realsize_models.py ARCHITECTURES
    measured_depth: object  # a model with one block of each kind (None: the full model)
    width: int
    height: int
    rank: int
    frames: int = 1
    scaled_fp8: bool = False  # the template loads a scaled fp8 file (ComfyUI's quantized layers: see as_scaled_fp8)
    controlnet: bool = False  # a ControlNet of the type's default blocks (no LoRA: rank unused), planned from its step
    policy: tuple = ()  # the template's Offload Policy fields beside its card, as (name, value) pairs
    controlnet_precision: str = "fp32"  # a ControlNet template's controlnet_precision (bf16_stochastic: bf16 weights)


# The templates' run settings (workflows/build_workflows.py): AdamW8bit, bf16, batch 1.
TEMPLATES = [
    Template("sd35_lora", "SD3.5 Large", "sd35_large", 2, 1024, 1024, 16),
    Template("flux_lora", "Flux.1 dev", "flux_dev", (1, 1), 1024, 1024, 16),
    Template("flux2_klein_lora", "Flux.2 Klein 4B", "flux2_klein_4b", (1, 1), 1024, 1024, 16),
    Template("zimage_lora", "Z-Image", "zimage", 1, 1024, 1024, 16),
    Template("qwen_image_lora", "Qwen-Image", "qwen_image", 1, 1024, 1024, 16),
    Template("krea2_lora", "Krea 2", "krea2", 1, 1024, 1024, 16),
    Template("ideogram4_lora", "Ideogram 4", "ideogram4", 1, 1024, 1024, 16, scaled_fp8=True),
    Template("hidream_o1_lora", "HiDream-O1", "hidream_o1", 1, 1024, 1024, 16),
    Template("wan21_lora", "Wan 2.1 T2V 1.3B", "wan21_1_3b", 1, 480, 480, 32, frames=33),
    Template("hunyuan_video15_lora", "HunyuanVideo 1.5", "hunyuan_video15", (1, 0), 848, 480, 32, frames=33),
    Template("ltx2_lora", "LTX-2 19B", "ltx2", 1, 768, 512, 32, frames=49),
    Template("sd15_lora", "SD1.5", "sd15", None, 512, 512, 16),
    Template("sdxl_lora", "SDXL", "sdxl", None, 1024, 1024, 16),
    # ControlNets: the measured model holds the blocks the ControlNet copies (Flux: 2 double blocks)
    Template("sd15_controlnet", "SD1.5 ControlNet", "sd15", None, 512, 512, 16, controlnet=True),
    Template("sdxl_controlnet", "SDXL ControlNet", "sdxl", None, 1024, 1024, 16, controlnet=True,
             policy=(("fused_backward", True),), controlnet_precision="bf16_stochastic"),
    Template("flux_controlnet", "Flux.1 dev ControlNet", "flux_dev", (2, 1), 1024, 1024, 16, controlnet=True,
             policy=(("fused_backward", True),), controlnet_precision="bf16_stochastic"),
]


def block_kind(name: str) -> str:
    """"double_blocks.7" -> "double_blocks": blocks of one kind share their layers' shapes."""
    return re.sub(r"\.\d+$", "", name)


def halved(law):
    return dataclasses.replace(law, **{f.name: getattr(law, f.name) / 2 for f in dataclasses.fields(law)})


def describe(template: Template):
    """(the planner's description of the full-size model, the LoRA's (or ControlNet's) trainable tensors, the patcher
    on meta). A ControlNet's own blocks are measured on the measured model (its calibration runs the ControlNet step,
    as the ControlNet Init node's plan does) and kept as measured: they are the same at any depth of the base."""
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.nodes.bridge.controlnet_build import controlnet_dtype, controlnet_trainable
    from headroom.nodes.bridge.planning import NewControlNet, describe_comfy_model, lora_trainable
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory import planner

    import realsize_models as models
    adapter = AdapterConfig(rank=template.rank, alpha=float(template.rank), targets="preset")
    # The UNets are measured in fp32 and their activations halved: bf16 convolutions on a CPU are ~240x slower
    # (docs/benchmarks/realsize_cpu.md, CPU compute precision), too slow for a full UNet; what autocast keeps in fp32
    # (norms) is then counted at half its size.
    unet = template.measured_depth is None
    dtype, precision = (torch.float32, "fp32") if unet else (torch.bfloat16, "bf16")
    measured_model = models.build_model(template.architecture, template.measured_depth, dtype=dtype, device="cpu",
                                        as_on_gpu=True)
    # A ControlNet built as its run's: bf16 weights where the template trains them so and the model computes in bf16
    # (fp32 ones would keep their bf16 casts for backward); a UNet's measured in fp32, then halved below.
    bf16 = not unet and template.controlnet_precision == "bf16_stochastic"
    measured = describe_comfy_model(measured_model, adapter, precision,
                                    controlnet=NewControlNet(0, torch.bfloat16 if bf16 else torch.float32)
                                    if template.controlnet else None)
    del measured_model
    if unet:
        measured = dataclasses.replace(
            measured, outside_saved=halved(measured.outside_saved), compute_element_size=2, stored_element_size=2,
            inference_bytes_per_latent_px=measured.inference_bytes_per_latent_px / 2,
            blocks=tuple(dataclasses.replace(b, saved=halved(b.saved), inputs=halved(b.inputs))
                         for b in measured.blocks),
            controlnet_blocks=tuple(dataclasses.replace(b, saved=halved(b.saved), inputs=halved(b.inputs))
                                    for b in measured.controlnet_blocks))
    full = models.build_model(template.architecture, None, device="meta", as_on_gpu=True)
    by_name = {block.name: block for block in measured.blocks}
    kinds = {}
    for block in measured.blocks:
        kinds.setdefault(block_kind(block.name), block)
    named = training_blocks(full.model.diffusion_model)
    laws = [by_name.get(name) or kinds[block_kind(name)] for name, _ in named]
    blocks = tuple(dataclasses.replace(profile, weight_copy_bytes=law.weight_copy_bytes,
                                       linear_copy_bytes=law.linear_copy_bytes)
                   for profile, law in zip(planner.describe_blocks(named, [k.saved for k in laws],
                                                                   [k.inputs for k in laws]), laws))
    linears = [m.weight.numel() for _, block in named for m in block.modules() if isinstance(m, torch.nn.Linear)]
    # The time model as on a GPU: no block times (this CPU's would say nothing of a GPU's; each block is then costed
    # at reading its weights, training/memory/time_model.py) and the default host->device bandwidth.
    untimed = planner.ActivationLaw()  # this CPU's seconds say nothing of a GPU's (below)
    description = dataclasses.replace(
        measured, blocks=blocks, largest_linear_numel=max(linears),
        controlnet_blocks=tuple(dataclasses.replace(b, forward_s=untimed, backward_per_forward=0.0)
                                for b in measured.controlnet_blocks),
        other_param_bytes=planner.frozen_bytes(full.model.diffusion_model) - sum(b.param_bytes for b in blocks),
        outside_forward_s=planner.ActivationLaw(), compute_device="cuda", h2d_bytes_per_s=0.0)
    if template.scaled_fp8:
        description = as_scaled_fp8(description)
    trainable = controlnet_trainable(full, 0, "AdamW8bit", controlnet_dtype(template.controlnet_precision)) \
        if template.controlnet else \
        lora_trainable(full, adapter, "AdamW8bit")
    return description, trainable, full


def as_scaled_fp8(description):
    """The description of the same model loaded from a scaled fp8 file (Ideogram 4's only release): each block Linear's
    weight stored in 1 byte a weight plus its scale, as ComfyUI's quantized layers hold it (streamed as such: the ring
    carries their inner tensors, training/memory/weight_streaming.py). A file with each block
    Linear quantized is what the released ones are; layers outside the blocks stay as loaded."""
    blocks = tuple(dataclasses.replace(
        b, param_bytes=b.param_bytes - b.linear_weight_bytes + b.linear_weight_numel + 4 * b.linear_count,
        linear_weight_bytes=b.linear_weight_numel) for b in description.blocks)
    # each quantized layer's weight is dequantised for its product (comfy.ops QuantLinearFunc): the largest in flight
    copy = description.largest_linear_numel * description.compute_element_size
    return dataclasses.replace(description, blocks=blocks, quantized_layers=sum(b.linear_count for b in blocks),
                               weight_copy_in_flight_bytes=max(copy, description.weight_copy_in_flight_bytes),
                               block_weight_copy_in_flight_bytes=copy)


def cell(plan) -> str:
    """"14.1 GiB: partial, fp8, ckpt" - the peak and what differs from the fastest policy."""
    policy = plan.policy
    parts = [policy.base_placement]
    if policy.base_storage != "as_loaded":
        parts.append(policy.base_storage)
    parts += {"off": [], "blocks": ["ckpt"], "blocks_cpu_offload": ["ckpt offload"]}[policy.checkpointing]
    if policy.checkpointing != "off" and policy.checkpoint_selection is not None:  # selective: k of n blocks
        parts[-1] += f" {len(plan.checkpointed_blocks)}/{len(plan.resident_blocks) + len(plan.streamed_blocks)}"
    if policy.optimizer_state != "gpu":
        parts.append(f"optim {policy.optimizer_state}")
    peak = f"{plan.peak_bytes / 2 ** 30:.1f} GiB"
    return f"{peak}: {', '.join(parts)}" if plan.fits else f"no fit (min {peak})"


def host_cell(plan) -> str:
    """"7.2 + 0.1 GiB": the base weights the plan leaves in host RAM (streamed to the card each step), plus the most
    the run adds to host RAM in one phase (training/memory/host_ram.py: optimizer state parked while sampling, EMA,
    offloaded block inputs). Neither counts what ComfyUI holds anyway (its process, the text encoders and VAE its
    loaders keep)."""
    streamed = plan.host_bytes.get("streamed block weights", 0)
    return f"{streamed / 2 ** 30:.1f} + {plan.host_added_bytes / 2 ** 30:.1f} GiB"


def main() -> None:
    suite.import_comfyui(cpu=True, use_pytorch_cross_attention=True)
    torch.set_num_threads(1)
    import comfy.model_management

    # ComfyUI's sampling estimate (memory_required) as on an NVIDIA GPU, where PyTorch attention is flash attention;
    # on a CPU it takes its formula for the split attention kernels, several times larger.
    comfy.model_management.pytorch_attention_flash_attention = lambda: True
    from headroom.nodes.bridge import video
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    chosen = sys.argv[1:]
    rows, host_rows = [], []
    for template in [t for t in TEMPLATES if not chosen or t.workflow in chosen]:
        started = time.monotonic()
        description, trainable, full = describe(template)
        latent_frames = video.check_frames("plan_table", full.model, template.frames) if template.frames > 1 else 1
        shape = planner.RunShape(1, template.width, template.height, None, latent_frames)
        cells, host_cells = [], []
        for card in CARDS_GB:
            policy = OffloadPolicy(card=f"{card} GB", **dict(template.policy))
            plan = planner.plan_auto(description, trainable, shape, policy, policy.budget_bytes())
            cells.append(cell(plan))
            host_cells.append(host_cell(plan))
        size = f"{template.width}x{template.height}" + (f", {template.frames} frames" if template.frames > 1 else "")
        base = description.frozen_bytes() / 2 ** 30
        rows.append(f"| {template.label} | `{template.workflow}` | {base:.1f} GiB, {size} | " + " | ".join(cells) + " |")
        host_rows.append(f"| {template.label} | `{template.workflow}` | " + " | ".join(host_cells) + " |")
        print(f"{rows[-1]} ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    import comfyui_version

    print("| family | template | base weights, run | " + " | ".join(f"{c} GB" for c in CARDS_GB) + " |")
    print("|---|---|---|" + "---|" * len(CARDS_GB))
    print("\n".join(rows))
    print("\nHost RAM of the same plans: base weights left in host RAM (streamed) + the most the run adds in one phase "
          "(beside what ComfyUI's process and loaded models hold)\n")
    print("| family | template | " + " | ".join(f"{c} GB" for c in CARDS_GB) + " |")
    print("|---|---|" + "---|" * len(CARDS_GB))
    print("\n".join(host_rows))
    print(f"\nplanned {datetime.date.today()}; torch {torch.__version__}, ComfyUI {comfyui_version.__version__}, "
          f"Python {platform.python_version()}; budget = card - 1 GiB reserve; batch 1, rank as the template, "
          "AdamW8bit, bf16; text encoders and VAE left out")


if __name__ == "__main__":
    main()
