"""GPU kit: every memory and speed figure of docs/benchmarks/gpu_kit.md, measured in one go on a borrowed GPU.

Runs ComfyUI in-process and drives Headroom's node classes as a workflow runs them (Offload Policy -> Memory Plan
(auto) -> Train LoRA: Init -> Train LoRA: Steps -> Validate LoRA (loss only)) on full-size models built from ComfyUI's
own classes with random bf16 weights (tests/realsize_models.py: nothing is downloaded). Per model: the resident run
and the planner's auto policy for each budget (6, 8, 12, 16, 24 GiB), each budget emulated on the large card with
torch.cuda.set_per_process_memory_fraction(budget / card total) (SDXL at 16 GiB also with a ballast allocation
filling the card beyond it instead: "16GB-ballast"). Then ComfyUI's own TrainLoraNode on SDXL and
Flux-dev (offloading off / on), full fine-tunes of SD3.5-Large and Flux-dev fitted to 24 and 48 GB cards (FULL_CARDS) and, with their trained weights in host RAM, to 16 GB (FULL_HOST_CARDS),
the CUDA-marked tests and, last, each named policy (POLICIES) as given on Flux-dev, SDXL and SD3.5-Large. LoRA rank 16, batch 1, 1024 px (Wan: 832x480, 33 frames).
Issue 41's streaming rows (STREAMING_MODELS) are timed over 10 steps after 3 of warm-up, the others over 4 after 1.

The caches are in memory (tests/memory_caches.py): random latents of the model's latent format and random
conditioning of the widths the model expects, so no text encoder or VAE is built and the figures are those of the
training step and the validation loss.

Each result is appended to <results>/results.jsonl as it is measured; a later command skips what is there (a
measurement that killed its process is recorded as "crashed" and not retried). A time guard starts no measurement
that would end after --minutes (guessing it as long as the longest so far) and records what is left. Ordered by
value: Flux-dev and SDXL resident, 16 and 8 GiB first. The page (docs/benchmarks/gpu_kit.md's GPU section) and the
picture are drawn from the JSON (bench/gpu/report.py).

    python3 bench/gpu/suite.py --results .gpukit/results --page $OUT/gpu_kit.md --png $OUT/gpu_vram.png
    python bench/gpu/suite.py --dry-run --results /tmp/kit      # the same path on the CPU with the tiny models

docs/GPU_KIT.md says how to run it on the borrowed machine (what travels, the commands).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from xml.etree import ElementTree

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT / "tests") not in sys.path:
    sys.path.append(str(REPO_ROOT / "tests"))  # the harness and the test helpers; appended: never shadows ComfyUI
GIB = 1024 ** 3
BUDGETS = (6, 8, 12, 16, 24)  # GB the planner's auto policy is asked to fit
RESULTS_FILE = "results.jsonl"


@dataclasses.dataclass(frozen=True)
class Model:
    arch: str  # tests/realsize_models.ARCHITECTURES
    tiny: str  # the built-in tiny family the dry run uses instead
    label: str
    width: int = 1024
    height: int = 1024
    frames: int = 1  # video: frames of the training clip


MODELS = {
    "flux_dev": Model("flux_dev", "flux", "Flux.1-dev"),
    "sdxl": Model("sdxl", "sdxl", "SDXL"),
    "qwen_image": Model("qwen_image", "qwen_image", "Qwen-Image"),
    "flux2_klein_9b": Model("flux2_klein_9b", "flux2", "Flux.2 Klein 9B"),
    "zimage": Model("zimage", "zimage", "Z-Image"),
    "wan22_14b": Model("wan21_14b", "wan21", "Wan 2.2 14B (one expert)", 832, 480, 33),
    "sd35_large": Model("sd35_large", "sd3", "SD3.5-Large"),
}
NATIVE_MODELS = ("sdxl", "flux_dev")  # ComfyUI's TrainLoraNode on the same work
# Named policies measured as given (Memory Plan in estimate mode, no budget), last: each memory feature's own cost.
# The bitsandbytes storages (int8, nf4) are left out: bitsandbytes does not travel (docs/GPU_KIT.md).
POLICIES = {
    "ckpt": {"checkpointing": "blocks"},
    "ckpt_offload": {"checkpointing": "blocks_cpu_offload"},
    "fp8_ckpt": {"base_storage": "fp8", "checkpointing": "blocks"},
    "streamed_ckpt": {"base_placement": "streamed", "checkpointing": "blocks"},
    "streamed_ckpt_offload": {"base_placement": "streamed", "checkpointing": "blocks_cpu_offload"},
    "streamed_ckpt_offload_hostopt": {"base_placement": "streamed", "checkpointing": "blocks_cpu_offload",
                                      "optimizer_state": "cpu"},
}
POLICY_MODELS = ("flux_dev", "sdxl", "sd35_large")
# Full fine-tunes (issue 27) fitted by the planner to these cards, GiB: the SD3.5 Large template's 24 GB and a larger one.
FULL_MODELS = ("sd35_large", "flux_dev")
FULL_CARDS = (24, 48)
# ... and with the Offload Policy's trained_weights host (the trained weights in host RAM, each tensor stepped where
# the planner puts its optimizer state: the card with Adafactor), GiB.
FULL_HOST_CARDS = (16,)
# ... and with AdamW's fp32 state (8 bytes per weight) streamed from host RAM to the card for each tensor's step
# (optimizer_state streamed), as the planner fits SD3.5-Large with AdamW to a 24 GB card (docs/benchmarks/
# full_finetune.md): the policy given (partial base, every block checkpointed), so the path runs in the dry run too.
FULL_STREAMED_STATE_CARDS = (24,)
FULL_STREAMED_STATE_MODELS = ("sd35_large",)
# ControlNet runs (the type's default blocks: SDXL's encoder copied, Flux's first 2 double blocks; AdamW, fused
# backward and bf16 weights as the templates sdxl_controlnet / flux_controlnet set them): the planned peak and
# predicted s/step of a ControlNet's own step (its calibration runs the ControlNet, the time model takes its blocks'
# measured times), never yet run on a GPU, against the measured. "resident": the whole card, planned for the record;
# a card ("16GB"): the Offload Policy's card set to it, the Init node's plan (emulated as the budgets are).
CONTROLNET_ROWS = {"sdxl": ("resident", "16GB"), "flux_dev": ("resident", "24GB")}
# LoRA runs that train the CLIP's text encoders too (Train LoRA: Init's text_encoder_lr; SDXL's CLIP-L + CLIP-G at real
# width, a caption of one full CLIP chunk): the plan counts the CLIP on the card and each caption's activations, never
# yet run on a GPU, against the measured; "resident" on the whole card, "16GB" the Offload Policy's card set to it.
TEXT_ENCODER_ROWS = {"sdxl": ("resident", "16GB")}


def plan(models: list[str], budgets: list[float], policies: list[str], full_cards: tuple[float, ...] = FULL_CARDS,
         full_host_cards: tuple[float, ...] = FULL_HOST_CARDS,
         full_streamed_state_cards: tuple[float, ...] = FULL_STREAMED_STATE_CARDS,
         controlnet: bool = True, text_encoder: bool = True) -> list[tuple[str, str, list[str]]]:
    """The measurements in order of value, as (kind, model, configs): configs "resident", "ckpt" (resident, every
    block checkpointed), a budget in GiB ("8GB"),
    "policy-<name>", or a full fine-tune's card ("full-24GB", "full-16GB-host", "full-24GB-streamed-state"); one model
    build per entry. Flux-dev and SDXL resident and at the budgets the last lease left open come first (the first
    command's share); the ControlNet rows (CONTROLNET_ROWS), then the text-encoder rows (TEXT_ENCODER_ROWS) follow the
    full fine-tunes."""
    # What the last H200 lease (2026-11-30) left open comes first: Flux-dev's 8 / 16 GiB rows again (their Steps
    # call's start, split now, and a traced step) and 6 GiB (validation's slack), SDXL resident (the calibration's
    # warm-up) and 8 GiB (1.51x its limit), then the full fine-tunes (issue 42: never measured); the rows it answered
    # (SDXL at 16 GiB, also with a ballast: 1.04x / 0.94x resident) later.
    first = {"flux_dev": [b for b in (8, 16, 6) if b in budgets], "sdxl": [b for b in budgets if b == 8]}
    steps: list[tuple[str, str, list[str]]] = [("cuda_tests", "", []), ("h2d", "", [])]
    head = [m for m in ("flux_dev", "sdxl") if m in models]
    # Flux-dev resident with every block checkpointed and no cap: the compute part of a streamed step's physical
    # limit (issue 41: max(compute with its recompute, bytes crossing / pinned bandwidth)).
    steps += [("lora", m, ["resident", *(["ckpt"] if m == "flux_dev" else []), *map(_config, first[m])])
              for m in head]
    fulls = [f"full-{card:g}GB" for card in full_cards] + [f"full-{card:g}GB-host" for card in full_host_cards]
    streamed_state = [f"full-{card:g}GB-streamed-state" for card in full_streamed_state_cards]
    for m in FULL_MODELS:
        configs = fulls + (streamed_state if m in FULL_STREAMED_STATE_MODELS else [])
        if m in models and configs:
            steps.append(("full", m, configs))
    if controlnet:
        steps += [("controlnet", m, list(configs)) for m, configs in CONTROLNET_ROWS.items() if m in models]
    if text_encoder:
        steps += [("text_encoder", m, list(configs)) for m, configs in TEXT_ENCODER_ROWS.items() if m in models]
    # SDXL at 16 GiB also with the smaller card made by a ballast allocation instead of the memory fraction (issue 41:
    # the 16 GiB row once ran 1.40x resident with the resident policy): "16GB-ballast" (Budget).
    for m in head:
        rest = [b for b in budgets if b not in first[m]]
        configs = [*map(_config, rest), *(PIN_ROWS if m == "flux_dev" and 12 in rest else []),
                   *(["16GB-ballast"] if m == "sdxl" and 16 in rest else [])]
        if configs:
            steps.append(("lora", m, configs))
    steps += [("native", m, ["offload_off", "offload_on"]) for m in NATIVE_MODELS if m in models]
    steps += [("lora", m, ["resident", *map(_config, budgets)]) for m in models if m not in head]
    steps += [("lora", m, [f"policy-{p}" for p in policies]) for m in POLICY_MODELS if m in models and policies]
    return steps


def _config(budget: float) -> str:
    return f"{budget:g}GB"


# Flux-dev at 12 GiB on a PC whose pinned-memory share leaves 8 GiB to pin (Windows: ComfyUI's 40 % of a 32 GB PC's
# RAM, less its own pins): the streamed blocks past it cross from pageable memory, which the time model prices
# (time_model.pinned_blocks, the pageable bandwidth). Predicted against measured, as the other rows.
PIN_ROWS = ("12GB-pin8",)


def parse_config(config: str) -> tuple[float | None, bool, float | None]:
    """A LoRA row's config as (budget GiB or None, ballast, GiB left to pin or None): "resident" (None, False, None),
    "8GB" (8, False, None), "16GB-ballast" (16, True, None), "12GB-pin8" (12, False, 8)."""
    if "GB" not in config or config.startswith("policy-"):
        return None, False, None
    budget, _, variant = config.partition("GB")
    pin = float(variant.removeprefix("-pin")) if variant.startswith("-pin") else None
    return float(budget), variant == "-ballast", pin


@contextlib.contextmanager
def pin_share(gib: float | None):
    """ComfyUI's pinned-memory account set so that `gib` GiB are left to pin (nodes/bridge/planning.pinnable_host_bytes
    reads MAX_PINNED_MEMORY less TOTAL_PINNED_MEMORY), as on a PC with less RAM; None: as it is."""
    if gib is None:
        yield
        return
    import comfy.model_management as mm

    saved = mm.MAX_PINNED_MEMORY
    mm.MAX_PINNED_MEMORY = mm.TOTAL_PINNED_MEMORY + int(gib * GIB)
    try:
        yield
    finally:
        mm.MAX_PINNED_MEMORY = saved


# Issue 41's rows: the streamed step against the resident one and the card's link, measured with the issue's 3 warm-up
# and 10 timed steps (--warmup / --steps); every other row takes --other-warmup / --other-steps (1 + 4: device time
# is scarce, and those rows ask memory questions first).
STREAMING_MODELS = ("flux_dev", "sdxl", "qwen_image")


def step_counts(args, kind: str, name: str, config: str) -> dict:
    """The warm-up and timed steps of one measurement: {"warmup": w, "steps": s}."""
    streaming = kind == "lora" and name in STREAMING_MODELS and not config.startswith("policy-")
    return ({"warmup": args.warmup, "steps": args.steps} if streaming else
            {"warmup": args.other_warmup, "steps": args.other_steps})


def measurement_id(kind: str, model: str, config: str) -> str:
    return "/".join(part for part in (kind, model, config) if part)


# --- results ----------------------------------------------------------------------------------------------------
class Results:
    """results.jsonl: one JSON object per line, appended and flushed as each measurement ends."""

    def __init__(self, folder: Path):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / RESULTS_FILE
        self.records = read_results(self.path)

    def done(self) -> set[str]:
        return {r["id"] for r in self.records if r.get("type") == "measurement"}

    def crashed(self) -> list[str]:
        """Started by an earlier command that never recorded an end: its process died (killed at the time limit,
        or a crash)."""
        started = [r["id"] for r in self.records if r.get("type") == "started"]
        return [i for i in dict.fromkeys(started) if i not in self.done()]

    def add(self, record: dict) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a killed process: the measurement is retried
                continue
    return records


# --- ComfyUI in-process -------------------------------------------------------------------------------------------
def import_comfyui(cpu: bool, **options) -> None:
    """ComfyUI in-process as tests/comfy_harness.py imports it (found the same way: $COMFYUI_PATH first), with a
    throw-away base directory; on the GPU unless `cpu`; Headroom as the package `headroom`. `options`: more of
    ComfyUI's command-line arguments (e.g. use_pytorch_cross_attention=True)."""
    import comfy_harness as harness

    if harness.COMFYUI_PATH is None:
        sys.exit(f"gpu kit: {harness.COMFYUI_FOUND_BY}")
    if str(harness.COMFYUI_PATH) not in sys.path:
        sys.path.insert(0, str(harness.COMFYUI_PATH))
    if "comfy.model_management" not in sys.modules:  # else imported already (the tests' harness): as it is
        import comfy.options

        comfy.options.enable_args_parsing(False)
        from comfy.cli_args import args

        args.cpu = cpu
        args.base_directory = tempfile.mkdtemp(prefix="headroom-gpukit-")
        for name, value in options.items():
            setattr(args, name, value)
        import comfy.model_management  # noqa: F401  (reads args at import)
        import folder_paths  # noqa: F401

    harness.register_module("headroom", REPO_ROOT / "__init__.py", package=True)


def comfyui_version() -> str:
    try:
        import comfyui_version

        return comfyui_version.__version__
    except ImportError:
        return "unknown"


# --- models and data ----------------------------------------------------------------------------------------------
def build_model(name: str, dry_run: bool):
    """The MODEL as a loader leaves it: weights in host RAM (the offload device), loaded by the nodes when needed.
    Full size: random bf16 weights made on the GPU (fast), then moved to host RAM."""
    import comfy.model_management as mm

    if dry_run:
        from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

        return build_tiny_model_patcher(MODELS[name].tiny, disable_dynamic=True)
    import realsize_models

    with torch.inference_mode():  # as ComfyUI's loaders make models
        patcher = realsize_models.build_model(MODELS[name].arch, device=mm.get_torch_device())
        patcher.model.to(patcher.offload_device)
        patcher.model.device = patcher.offload_device
    free_device()
    return patcher


def shape(name: str, dry_run: bool) -> tuple[int, int, int]:
    """(width, height, frames) of the training item."""
    spec = MODELS[name]
    if dry_run:
        return 64, 64, 5 if spec.frames > 1 else 1
    return spec.width, spec.height, spec.frames


def text_tokens(name: str, dry_run: bool) -> int:
    import realsize_models

    return 8 if dry_run else int(realsize_models.ARCHITECTURES[MODELS[name].arch]["text_tokens"])


def caches(patcher, width: int, height: int, frames: int, tokens: int, control: bool = False, caption: str = ""):
    """In-memory LATENT_CACHE / TEXT_CACHE of two items of this size (random latents of the model's format, random
    conditioning of the widths the model expects); `control`: each item with a random control of the kind the
    model's ControlNet type takes (pixels in 0..1, or a latent of the item's shape), as Cache Latents caches one;
    `caption`: the text the conditioning stands for (what a run training the text encoder encodes)."""
    from memory_caches import MemoryLatentCache, MemoryTextCache

    from headroom.nodes.bridge import video
    from headroom.nodes.bridge.families import family_of
    from headroom.nodes.bridge.planning import calibration_cond

    model = patcher.model
    family = family_of(model)
    downscale = family.latent_downscale if family else 8
    latent_frames = video.check_frames("gpu kit", model, frames)
    extra = (latent_frames,) * (model.latent_format.latent_dimensions - 2)
    generator = torch.Generator().manual_seed(0)
    latents = [torch.randn(model.latent_format.latent_channels, *extra, height // downscale, width // downscale,
                           generator=generator) for _ in range(2)]
    zeros = calibration_cond(model, tokens, torch.device("cpu"))
    cond = {key: torch.randn(value.shape, generator=generator) * 0.5 for key, value in zeros.items()}
    bucket = (width, height, frames) if frames > 1 else (width, height)
    controls, kind = None, None
    if control:
        from headroom.nodes.bridge.controlnet_build import controlnet_type_of

        kind = controlnet_type_of(patcher).hint
        controls = [torch.rand((latent.shape[-2] * 8, latent.shape[-1] * 8, 3) if kind == "pixels" else latent.shape,
                               generator=generator) for latent in latents]
    return (MemoryLatentCache(latents, ["caption", "caption"], {bucket: [0, 1]}, controls, kind),
            MemoryTextCache({"caption": cond}, {key: torch.zeros_like(value) for key, value in cond.items()},
                            captions={"caption": caption} if caption else None))


def free_device() -> None:
    import comfy.model_management as mm

    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache(True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def ballast_bytes(card: int, free: int, reserved: int) -> int:
    """The ballast that leaves a process `card` bytes of a larger card: what the driver has free (`free`) beyond what
    the card would still have free (`card` less what the caching allocator already holds, `reserved`); 0 when the card
    is no larger."""
    return max(0, free - max(0, card - reserved))


class Budget:
    """A card of `gb` GiB emulated on a larger one: the caching allocator may hold at most `gb` GiB of this process
    (torch.cuda.set_per_process_memory_fraction), and torch.cuda.mem_get_info, which ComfyUI's model management
    reads to decide how much of a model to load, reports that card (total `gb`, free what the allocator has not
    reserved of it). None: the whole card. A no-op without CUDA.

    `ballast` (issue 41's SDXL 16 GiB question: does the emulation itself slow a run down?): instead, one allocation
    fills the card beyond `gb` GiB (`ballast_bytes`), so the driver, mem_get_info and the allocator's out-of-memory path
    all see the smaller card unpatched and uncapped, as on a real one; torch's peaks then include the ballast
    (`self.ballast_bytes`: the row subtracts it)."""

    def __init__(self, gb: float | None, device, ballast: bool = False):
        self.gb, self.device, self.ballast = gb, device, ballast
        self.mem_get_info = None
        self.ballast_tensor, self.ballast_bytes = None, 0

    def __enter__(self):
        if self.device.type == "cuda" and self.gb is not None and self.ballast:
            free, total = torch.cuda.mem_get_info(self.device)
            card = min(total, int(self.gb * GIB))
            self.ballast_bytes = ballast_bytes(card, free, torch.cuda.memory_reserved(self.device))
            self.ballast_tensor = torch.empty(self.ballast_bytes, dtype=torch.uint8, device=self.device)
        elif self.device.type == "cuda" and self.gb is not None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            card = min(total, int(self.gb * GIB))
            torch.cuda.set_per_process_memory_fraction(card / total, self.device)
            self.mem_get_info = torch.cuda.mem_get_info

            def emulated(device=None):
                return max(0, card - torch.cuda.memory_reserved(device)), card

            torch.cuda.mem_get_info = emulated
        return self

    def __exit__(self, *exc):
        if self.ballast_tensor is not None:
            self.ballast_tensor = None
            torch.cuda.empty_cache()
        if self.mem_get_info is not None:
            torch.cuda.mem_get_info = self.mem_get_info
        if self.device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        return False


# --- one Headroom LoRA run through the nodes ---------------------------------------------------------------------
def lora_run(patcher, name: str, config: str, args) -> dict:
    """Offload Policy -> Memory Plan -> Init -> Steps (warm-up, then the timed steps) -> Validate (loss only); a
    "-pinN" row with ComfyUI's pinned-memory share leaving N GiB (pin_share)."""
    budget, _, pin = parse_config(config)
    with pin_share(pin):
        return _lora_run(patcher, name, config, args, budget, pin)


def _lora_run(patcher, name: str, config: str, args, budget: float | None, pin: float | None) -> dict:
    from headroom.nodes import memory as M, train_lora as T
    from headroom.nodes.bridge.planning import pinnable_host_bytes
    from headroom.training.memory.policy import OffloadPolicy

    width, height, frames = shape(name, args.dry_run)
    tokens = text_tokens(name, args.dry_run)
    latent_cache, text_cache = caches(patcher, width, height, frames, tokens)
    inputs = {field: default for field, _, default in OffloadPolicy.node_inputs()}
    inputs.update(POLICIES.get(config.removeprefix("policy-"), {}))  # resident: the node's defaults
    inputs["vram_budget_gb"] = budget or 0.0  # 0: auto (resident and named policies: the whole card)
    policy = M.HeadroomOffloadPolicy.execute(**inputs).args[0]
    record = {"width": width, "height": height, "frames": frames, "text_tokens": tokens, "budget_gb": budget,
              **({"pin_share_gb": pin, "pinnable_bytes_at_plan": pinnable_host_bytes()} if pin is not None else {})}
    started = time.perf_counter()
    _, plan_json, chosen = M.HeadroomMemoryPlan.execute(
        patcher, "estimate" if budget is None else "auto", 1, width, height, 16, "preset", "AdamW", "auto", tokens,
        policy=policy, frames=frames).args
    plan = json.loads(plan_json)
    phases = {p["phase"]: p["total_bytes"] for p in plan["phases"]}
    record.update(plan_seconds=time.perf_counter() - started, policy=chosen.describe(), policy_fields=chosen.to_dict(),
                  plan_fits=plan["fits"], plan_reason=plan["reason"],
                  planner_train_bytes=phases.get("training step"), planner_validation_bytes=phases.get("validation"),
                  base_device_bytes=plan.get("base_device_bytes"),
                  validation_base_device_bytes=plan.get("validation_base_device_bytes"),
                  plan_pageable_bytes=plan.get("pageable_bytes"), **plan_times(plan))
    free_device()
    lora = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
    optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
    return train_and_measure(patcher, name, config, args, record, chosen, lora, optimizer, latent_cache, text_cache)


def full_run(patcher, name: str, config: str, args) -> dict:
    """A full fine-tune ("full-24GB"): LoRA Config kind full on every Linear in the blocks with the bf16 difference,
    Adafactor, the Offload Policy's fused backward and its card set to that size (the Init node's planner picks
    placement, checkpointing and optimizer state), the card emulated on the large one; Init -> Steps -> Validate.
    "full-16GB-host": the same with the policy's trained_weights host (the planner picks the optimizer state's place:
    the card, each tensor stepped there in backward, or host RAM). "full-24GB-streamed-state": AdamW, its state
    streamed from host RAM for each tensor's step (FULL_STREAMED_STATE_CARDS: the policy given, budget card - 1 GiB)."""
    from headroom.nodes import memory as M, train_lora as T
    from headroom.training.memory.policy import OffloadPolicy

    width, height, frames = shape(name, args.dry_run)
    tokens = text_tokens(name, args.dry_run)
    latent_cache, text_cache = caches(patcher, width, height, frames, tokens)
    card_text, _, variant = config.removeprefix("full-").partition("-")
    card = float(card_text.removesuffix("GB"))
    inputs = {field: default for field, _, default in OffloadPolicy.node_inputs()}
    inputs.update(card=f"{card:g} GB", fused_backward=True)
    if variant == "host":
        inputs.update(trained_weights="host")
    elif variant == "streamed-state":
        inputs.update(card="custom", vram_budget_gb=card - 1.0, base_placement="partial", checkpointing="blocks",
                      optimizer_state="streamed")
    policy = M.HeadroomOffloadPolicy.execute(**inputs).args[0]
    optimizer_name = "AdamW" if variant == "streamed-state" else "Adafactor"
    record = {"width": width, "height": height, "frames": frames, "text_tokens": tokens, "budget_gb": card,
              "work": "full fine-tune: every Linear in the blocks, bf16 difference, fused backward, " + optimizer_name
              + {"host": ", trained weights in host RAM", "streamed-state": ", its state streamed from host RAM"}.get(
                  variant, "")}
    lora = T.HeadroomLoraConfig.execute("full", 16, 16.0, "all_linear", False, 0.0, 0,
                                        full_precision="bf16_stochastic").args[0]
    optimizer = T.HeadroomOptimizerConfig.execute(optimizer_name, 1e-6, 0.0, "constant", 0, 1000).args[0]
    return train_and_measure(patcher, name, config, args, record, policy, lora, optimizer, latent_cache, text_cache)


def controlnet_run(patcher, name: str, config: str, args) -> dict:
    """A ControlNet run (CONTROLNET_ROWS): Train ControlNet: Init -> Steps -> Validate (loss), AdamW, the Offload
    Policy's fused_backward on and the ControlNet's weights in bf16 (controlnet_precision bf16_stochastic, precision
    bf16) as the SDXL and Flux ControlNet templates set them; "resident" with the policy's other
    defaults on the whole card, "16GB" with its card set to that size (the Init node plans from its ControlNet's own
    step), the card emulated on the large one."""
    from headroom.nodes import memory as M, train_lora as T
    from headroom.training.memory.policy import OffloadPolicy

    width, height, frames = shape(name, args.dry_run)
    tokens = text_tokens(name, args.dry_run)
    latent_cache, text_cache = caches(patcher, width, height, frames, tokens, control=True)
    budget, _, _ = parse_config(config)
    inputs = {field: default for field, _, default in OffloadPolicy.node_inputs()}
    inputs.update(fused_backward=True)
    if budget is not None:
        inputs.update(card=f"{budget:g} GB")
    policy = M.HeadroomOffloadPolicy.execute(**inputs).args[0]
    record = {"width": width, "height": height, "frames": frames, "text_tokens": tokens, "budget_gb": budget,
              "work": "ControlNet: the type's default blocks, AdamW, fused backward, bf16 weights"}
    optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-5, 0.0, "constant", 0, 1000).args[0]
    return train_and_measure(patcher, name, config, args, record, policy, None, optimizer, latent_cache, text_cache,
                             precision="bf16", controlnet_precision="bf16_stochastic")


def text_encoder_run(patcher, name: str, config: str, args) -> dict:
    """A LoRA run that trains the CLIP's text encoders too (TEXT_ENCODER_ROWS): Train LoRA: Init with the family's CLIP
    at real width (the dry run: the tiny one) and text_encoder_lr, rank 16, AdamW; each step encodes the cache's
    caption (one full CLIP chunk) through the trained encoder. "resident" on the whole card, "16GB" with the Offload
    Policy's card set to that size (the Init node plans the CLIP with the model), emulated on the large one."""
    from headroom.nodes import memory as M, train_lora as T
    from headroom.training.memory.policy import OffloadPolicy

    width, height, frames = shape(name, args.dry_run)
    tokens = text_tokens(name, args.dry_run)
    caption = " ".join(["a"] * 75)  # one full CLIP chunk: what any caption of up to 75 tokens costs
    latent_cache, text_cache = caches(patcher, width, height, frames, tokens, caption=caption)
    if args.dry_run:
        from headroom.nodes.bridge.tiny_models import build_tiny_models

        clip = build_tiny_models(MODELS[name].tiny, 0)[1]
    else:
        import realsize_models

        with torch.inference_mode():  # as ComfyUI's loaders make the CLIP, in host RAM until a step loads it
            clip = realsize_models.build_clip(MODELS[name].arch)
    budget, _, _ = parse_config(config)
    inputs = {field: default for field, _, default in OffloadPolicy.node_inputs()}
    if budget is not None:
        inputs.update(card=f"{budget:g} GB")
    policy = M.HeadroomOffloadPolicy.execute(**inputs).args[0]
    record = {"width": width, "height": height, "frames": frames, "text_tokens": tokens, "budget_gb": budget,
              "work": "LoRA rank 16 + the CLIP's text encoders (text_encoder_lr 5e-05), AdamW"}
    lora = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
    optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
    return train_and_measure(patcher, f"{name}_text_encoder", config, args, record, policy, lora, optimizer,
                             latent_cache, text_cache, clip=clip, text_encoder_lr=5e-5)


def train_and_measure(patcher, name: str, config: str, args, record: dict, policy, lora, optimizer, latent_cache,
                      text_cache, precision: str = "auto", **init_inputs) -> dict:
    """Init -> Steps (warm-up, then the timed steps) -> Validate (loss only), under the record's budget; the run's
    own plan where no Memory Plan node gave one (a card's fit: the Init node plans). `lora` None: a ControlNet run
    (Train ControlNet: Init); `init_inputs`: the Init node's further inputs."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.nodes.bridge.planning import run_plan
    from headroom.training.memory.oom import is_out_of_memory

    device = torch.device(patcher.load_device)
    width, height, budget = record["width"], record["height"], record["budget_gb"]
    run = None
    try:
        with Budget(budget, device, ballast=config.endswith("-ballast")) as card, \
                torch.inference_mode():  # as ComfyUI runs nodes
            inputs = dict(
                model=patcher, latent_cache=latent_cache, text_cache=text_cache, optimizer_config=optimizer,
                run_name=f"gpukit_{name}_{config}" if lora is not None else f"gpukit_controlnet_{name}_{config}",
                seed=0, batch_size=1, grad_accumulation=1, precision=precision, max_grad_norm=1.0, caption_dropout=0.0,
                timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                gradient_checkpointing=False, checkpoint_depth=1, holdout=0, policy=policy, **init_inputs)
            run = (T.HeadroomTrainLoraInit.execute(lora_config=lora, **inputs) if lora is not None else
                   HeadroomTrainControlNetInit.execute(**inputs)).args[0]
            record["precision"] = run.trainer.config.precision
            if "planner_train_bytes" not in record:
                plan = run_plan(run)
                record.update(policy=run.policy.describe(), policy_fields=run.policy.to_dict(), plan_fits=plan.fits,
                              plan_reason=run.plan_note, planner_train_bytes=plan.phase("training step").total,
                              planner_validation_bytes=plan.phase("validation").total,
                              base_device_bytes=plan.base_device_bytes,
                              validation_base_device_bytes=plan.validation_base_device_bytes,
                              planner_text_encoder_bytes=plan.text_encoder_bytes(), **plan_times(plan.to_dict()))
            counters = [allocator_counters(device)]
            # issue 41: where a step spends its time: the last timed step traced (torch.profiler); resident rows too,
            # the kernels a budget row's step runs set against those of the same work with the card to itself
            trace = StepTrace(run, traced_step=args.steps)
            with counters_per_step():
                T.HeadroomTrainSteps.execute(run, args.warmup)  # loads the model, kernels, allocator, optimizer state
                counters.append(allocator_counters(device))
                with trace:
                    T.HeadroomTrainSteps.execute(run, args.warmup + args.steps)
                counters.append(allocator_counters(device))
            record.update(trace.result())
            crossed = crossed_per_step(run)
            record["allocator"] = allocator_deltas(counters, args.steps, step_counters(run, args.warmup, counters[1]))
            training = [p for p in run.record.memory.phases if p["phase"] == "training"][-1]
            own = validation_seconds(run, width, height)  # validation on its own placement (the plan's)
            validation = [p for p in run.record.memory.phases if p["phase"] == "validation"][-1]
            on_training = None  # the same on training's placement (issue 28), unless the plan made them the same
            base = record.get("base_device_bytes")
            if base is None or record.get("validation_base_device_bytes") != base:
                with training_placement_for_validation(run):
                    on_training = validation_seconds(run, width, height)
        def run_only(peak):  # torch's peaks count a ballast (Budget(ballast=True)) as this process's: not the run's
            return None if peak is None else peak - card.ballast_bytes

        timed_seconds = step_seconds(run, args.warmup)
        # The first timed step also holds the second Steps call's start (the report says how long); where it went:
        # ComfyUI's load with the placement's unload, and the streamer's attach by part (pack, pin, keep, slots)
        record["start_seconds"] = {"comfy_load": run.load_seconds, **run.trainer.stream_setup_seconds}
        record.update(status="ok", s_per_step=statistics.median(timed_seconds), first_step_seconds=timed_seconds[0],
                      train_peak_allocated=run_only(training.get("peak_allocated_bytes")),
                      train_peak_reserved=run_only(training.get("peak_reserved_bytes")),
                      train_peak_rss=training.get("peak_rss_bytes"),
                      validation_peak_allocated=run_only(validation.get("peak_allocated_bytes")),
                      validation_peak_reserved=run_only(validation.get("peak_reserved_bytes")),
                      ballast_bytes=card.ballast_bytes,
                      loss=float(run.trainer.last_loss), validation_seconds=own,
                      validation_seconds_training_placement=on_training,
                      validation_base_bytes=record.get("validation_base_device_bytes"),
                      training_base_bytes=record.get("base_device_bytes"))
        record.update(crossed)
    except Exception as error:  # an out-of-memory error is a result; anything else too, with its traceback
        record.update(status="oom" if is_out_of_memory(error) or "out of memory" in str(error).lower() else "failed",
                      error=_short(error), traceback=traceback.format_exc()[-3000:])
    finally:
        if run is not None:
            finding = run.fallback.detector.finding  # the driver's sysmem fallback (training/memory/fallback.py)
            record["fallback"] = None if finding is None else finding.as_dict()
            run.release()
            shutil.rmtree(run.run_dir.path, ignore_errors=True)  # its checkpoints: ~60 runs would fill the disk
        del run
        free_device()
    return record


# --- issue 41: the step against its physical limit ------------------------------------------------------------------
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_ooms", "num_device_alloc", "num_device_free")


class StepTrace:
    """The `traced_step`-th step of the Steps call inside the block traced by torch.profiler (issue 41: the copy /
    compute overlap), the device waited for at its end so its whole device work is in the trace (that step only: the
    others run untraced, the profiler idle until then). `result()`: {"overlap": overlap_figures(...)}, or
    {"overlap_error": ...} where no trace could be made (no CUPTI, say): the row keeps its other figures. On a CPU
    (the dry run) the same step is traced: no device work, all idle."""

    def __init__(self, run, traced_step: int):
        self.run, self.traced_step = run, traced_step
        self.error, self.profiler = None, None

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile, record_function, schedule

        cuda = self.run.denoiser.device.type == "cuda"
        trainer = self.run.trainer
        real = trainer.train_step
        # One warm-up step before the traced one where there is one: the profiler starts CUPTI there, not inside the
        # traced step's copy / compute figures (the step timings are a median: one slower step does not move them).
        # One cycle (repeat=1): a second would begin with its warm-up and clear the traced step's events at exit.
        warmup = min(1, self.traced_step - 1)
        cycle = schedule(wait=self.traced_step - 1 - warmup, warmup=warmup, active=1, repeat=1)
        try:
            self.profiler = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
                                    schedule=cycle).__enter__()
        except Exception as error:
            self.error = error
            return self

        def traced_step():
            with record_function("headroom_step"):
                loss = real()
                if cuda:
                    torch.cuda.synchronize(self.run.denoiser.device)
            self.profiler.step()
            return loss

        trainer.train_step = traced_step  # the instance's own, removed at exit
        return self

    def __exit__(self, *exc):
        self.run.trainer.__dict__.pop("train_step", None)
        if self.profiler is not None:
            try:
                self.profiler.__exit__(None, None, None)
            except Exception as error:
                self.error = self.error or error
        return False

    def result(self) -> dict:
        if self.error is not None or self.profiler is None:
            return {"overlap_error": _short(self.error) if self.error else "not traced"}
        try:
            events = list(self.profiler.events())
        except Exception as error:
            return {"overlap_error": _short(error)}
        marks = [(e.time_range.start, e.time_range.end) for e in events
                 if e.name == "headroom_step" and e.device_type == torch.autograd.DeviceType.CPU]
        if not marks:
            return {"overlap_error": "the traced step is not in the trace"}
        start, end = marks[-1]
        copies, kernels, named = [], [], []
        for event in events:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            span = (max(event.time_range.start, start), min(event.time_range.end, end))
            if span[1] <= span[0]:
                continue
            if "Memcpy HtoD" in event.name:
                copies.append(span)
            elif not event.name.startswith(("Memcpy", "Memset")):
                kernels.append(span)
                named.append((event.name, *span))
        return {"overlap": overlap_figures(start, end, copies, kernels), "kernels": top_kernels(named)}


TOP_KERNELS = 8


def top_kernels(kernels: list[tuple[str, float, float]], count: int = TOP_KERNELS) -> list[list]:
    """The kernels with the most device time in the traced step, as [name (first 120 characters), launches, seconds]
    (times in microseconds, as the profiler gives them): a budget row's slower step set against its resident row's
    says whether its kernels themselves ran slower (a convolution's algorithm chosen with less free memory, say) or
    the device waited."""
    totals: dict[str, list] = {}
    for name, begin, finish in kernels:
        entry = totals.setdefault(name[:120], [name[:120], 0, 0.0])
        entry[1] += 1
        entry[2] += (finish - begin) / 1e6
    return sorted(totals.values(), key=lambda entry: -entry[2])[:count]


def overlap_figures(start: float, end: float, copies: list[tuple[float, float]],
                    kernels: list[tuple[float, float]]) -> dict:
    """Seconds of one step (times in microseconds, as the profiler gives them): the device copying host -> device,
    computing, both at once, neither (idle: the device waiting for the CPU or for a copy it could not overlap)."""
    def union(spans):
        merged = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return merged

    def length(spans):
        return sum(b - a for a, b in spans)

    def intersect(xs, ys):
        out, i, j = [], 0, 0
        while i < len(xs) and j < len(ys):
            a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
            if a < b:
                out.append((a, b))
            if xs[i][1] < ys[j][1]:
                i += 1
            else:
                j += 1
        return out

    copy, compute = union(copies), union(kernels)
    both = length(intersect(copy, compute))
    busy = length(copy) + length(compute) - both
    return {"step_s": (end - start) / 1e6, "copy_s": length(copy) / 1e6, "compute_s": length(compute) / 1e6,
            "overlap_s": both / 1e6, "idle_s": max(0.0, end - start - busy) / 1e6, "copies": len(copies)}


def plan_times(plan: dict) -> dict:
    """The plan's predicted step (time_model.StepTime.to_dict: compute, transfer, its physical limit) and where the
    base's blocks are, from its JSON."""
    blocks = plan.get("blocks") or {}
    return {"predicted_s_per_step": plan.get("predicted_s_per_step"), "step_time": plan.get("step_time"),
            "plan_blocks": {"resident": len(blocks.get("resident", [])), "streamed": len(blocks.get("streamed", [])),
                            "checkpointed": len(blocks.get("checkpointed", [])), "slots": blocks.get("slots")}}


def allocator_counters(device) -> dict | None:
    """The caching allocator's counters now (torch.cuda.memory_stats); None without CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(name, 0)) for name in ALLOCATOR_COUNTERS}


@contextlib.contextmanager
def counters_per_step():
    """The run's per-step figures (TrainingRun.step_figures, read after each step) carry the allocator's counters."""
    from headroom.nodes.bridge import comfy_bridge

    figures = comfy_bridge.memory_figures
    comfy_bridge.memory_figures = lambda device: {**figures(device), "allocator": allocator_counters(device)}
    try:
        yield
    finally:
        comfy_bridge.memory_figures = figures


def step_counters(run, warmup: int, start: dict | None) -> list[dict]:
    """Each timed step's counters, as the difference from the step before (the first: from the warm-up's end)."""
    out, previous = [], start
    for step in sorted(s for s in run.step_figures if s > warmup):
        now = run.step_figures[step][2].get("allocator")
        if now is None or previous is None:
            return []
        out.append({name: now[name] - previous[name] for name in ALLOCATOR_COUNTERS})
        previous = now
    return out


def allocator_deltas(counters: list[dict | None], steps: int, per_step: list[dict] | None = None) -> dict | None:
    """What the allocator did in the warm-up and in the timed steps (in all, on average, and step by step): retries
    (a cudaMalloc that failed, the cache flushed and tried again), device-wide syncs, out-of-memory errors,
    cudaMalloc / cudaFree."""
    if any(c is None for c in counters):
        return None
    before, warm, timed = counters
    warmup = {name: warm[name] - before[name] for name in ALLOCATOR_COUNTERS}
    steady = {name: timed[name] - warm[name] for name in ALLOCATOR_COUNTERS}
    return {"warmup": warmup, "timed": steady, "per_step": per_step or [],
            "timed_per_step": {name: value / max(1, steps) for name, value in steady.items()}}


def h2d_bandwidth(dry_run: bool) -> dict:
    """Pinned and pageable host->device bandwidth, measured once each (time_model.h2d_bytes_per_s: what the planner
    uses; pageable prices the streamed blocks past the pin limit), and the CPU's copies into pinned staging buffers
    (time_model.host_copy_bytes_per_s); none on the CPU (nothing crosses)."""
    from headroom.training.memory import time_model

    if dry_run or not torch.cuda.is_available():
        return {"status": "ok", "h2d_bytes_per_s": None, "pageable_h2d_bytes_per_s": None,
                "host_copy_bytes_per_s": None, "probe_bytes": time_model.H2D_PROBE_BYTES,
                "note": "no CUDA device: nothing crosses"}
    device = torch.device("cuda")
    return {"status": "ok", "h2d_bytes_per_s": time_model.h2d_bytes_per_s(device),
            "pageable_h2d_bytes_per_s": time_model.h2d_bytes_per_s(device, pinned=False),
            "host_copy_bytes_per_s": time_model.host_copy_bytes_per_s(device), "probe_bytes": time_model.H2D_PROBE_BYTES}


def validation_seconds(run, width: int, height: int) -> float:
    """Wall time of one Validate call (the loss at 4 noise levels: denoiser forwards without backward)."""
    from headroom.nodes import train_lora as T

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    T.HeadroomValidate.execute(run, clip=None, vae=None, prompts="", negative="", sample_seed=0, sample_steps=1,
                               cfg=1.0, sampler_name="euler", scheduler="simple", width=width, height=height,
                               loss_timesteps=4)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started


@contextlib.contextmanager
def training_placement_for_validation(run):
    """Validation loaded as training places the base (what every run did before validation had its own placement):
    the A side of the kit's validation A/B."""
    from headroom.nodes.bridge.comfy_bridge import TrainingRun

    run.attached = lambda phase="training": TrainingRun.attached(run, "training")
    run._validation_device_share = run._base_device_share
    try:
        yield
    finally:
        del run.attached, run._validation_device_share


def crossed_per_step(run) -> dict:
    """Trained weights in host RAM (trained_weights_on_host.Crossings): the bytes that crossed each way per training
    step so far (twice in, once back), and the trained weights' bytes; optimizer state streamed
    (streamed_optimizer_state.StreamedState): the state's bytes crossed each way (in from the second step on, back at
    every step) and the state's bytes; {} for any other run."""
    fused, steps, out = run.trainer.optimizer, run.trainer.step, {}
    crossings = getattr(fused, "crossings", None)
    if crossings is not None:
        out.update({"crossed_to_device_per_step": crossings.to_device_bytes / steps,
                    "crossed_to_host_per_step": crossings.to_host_bytes / steps,
                    "trained_weight_bytes": sum(p.numel() * p.element_size() for p in run.trainer.params),
                    # those that cross: all but the blocks the plan keeps on the card (trained_weights_card_blocks)
                    "crossing_weight_bytes": sum(p.numel() * p.element_size()
                                                 for p in run.trained.adapters.parameters_in_host_ram()),
                    "card_blocks": len(run.policy.trained_card_blocks)})
    streamed = getattr(fused, "streamed_state", None)
    if streamed is not None:
        to_device, to_host = streamed.bytes_each_way
        out.update({"state_crossed_to_device": to_device, "state_crossed_to_host": to_host, "steps": steps,
                    "optimizer_state_bytes": sum(v.numel() * v.element_size() for state in fused.state.values()
                                                 for v in state.values() if isinstance(v, torch.Tensor))})
    return out


def step_seconds(run, warmup: int) -> list[float]:
    """Each timed step's wall time, from the run's per-step figures (the mean since the Steps call started)."""
    figures = run.step_figures
    steps = sorted(s for s in figures if s > warmup)
    out, previous = [], 0.0
    for index, step in enumerate(steps, start=1):
        total = figures[step][1] * index
        out.append(total - previous)
        previous = total
    return out


def _short(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 600 else text[:600] + "..."


# --- ComfyUI's TrainLoraNode ------------------------------------------------------------------------------------
def native_run(patcher, name: str, config: str, args) -> dict:
    """ComfyUI's TrainLoraNode on the same work (bf16, gradient checkpointing, AdamW, rank 16, batch 1): peak
    allocated / reserved over the whole node call and its seconds per step (bench/bench_train_step.native_train)."""
    from headroom.nodes.bridge.planning import calibration_cond
    from headroom.training.memory.oom import is_out_of_memory

    from comfy_harness import register_module

    bench = register_module("bench_train_step", REPO_ROOT / "bench" / "bench_train_step.py")
    device = torch.device(patcher.load_device)
    width, height, frames = shape(name, args.dry_run)
    latent_cache, _ = caches(patcher, width, height, frames, text_tokens(name, args.dry_run))
    samples = torch.stack([latent_cache.latent(i) for i in range(len(latent_cache))])
    cond = calibration_cond(patcher.model, text_tokens(name, args.dry_run), torch.device("cpu"))
    extra = {"pooled_output": cond["pooled_output"][None]} if "pooled_output" in cond else {}
    positive = [[torch.randn(cond["cross_attn"].shape)[None] * 0.5, extra] for _ in range(len(latent_cache))]
    offloading = config == "offload_on"
    record = {"width": width, "height": height, "offloading": offloading, "gradient_checkpointing": True,
              "training_dtype": "bf16"}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        timing = bench.native_train(patcher, samples, positive, steps=args.warmup + args.steps, batch=1, lr=1e-4,
                                    rank=16, dtype="bf16", checkpointing=True, offloading=offloading)
        record.update(status="ok", s_per_step=timing.get("step_wall"), seconds=timing["total"])
        if device.type == "cuda":
            record.update(peak_allocated=torch.cuda.max_memory_allocated(device),
                          peak_reserved=torch.cuda.max_memory_reserved(device))
    except Exception as error:
        record.update(status="oom" if is_out_of_memory(error) or "out of memory" in str(error).lower() else "failed",
                      error=_short(error), traceback=traceback.format_exc()[-3000:])
    finally:
        free_device()
    return record


# --- the CUDA-marked tests ----------------------------------------------------------------------------------------
CUDA_MARKERS = re.compile(r"skipif\(\s*not torch\.cuda\.is_available\(\)|mark\.cuda\b|requires_cuda")


def cuda_test_files() -> list[str]:
    """Test files with a CUDA marker (a skipif on torch.cuda.is_available(), pytest.mark.cuda)."""
    return sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
                  if CUDA_MARKERS.search(path.read_text(encoding="utf-8")))


def cuda_tests(timeout: float, only: list[str] | None = None) -> dict:
    files = cuda_test_files() if only is None else only
    record = {"files": files}
    if not files:
        return {**record, "status": "ok", "passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    with tempfile.TemporaryDirectory(prefix="headroom-cuda-tests-") as folder:
        junit = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *files]
        try:
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            return {**record, "status": "failed", "error": f"pytest ran past {timeout:.0f} s"}
        record["failures"] = failed_tests(junit)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {key: int(n) for n, key in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    record.update(status="ok" if done.returncode in (0, 5) else "failed", returncode=done.returncode, summary=summary,
                  passed=counts.get("passed", 0), failed=counts.get("failed", 0), skipped=counts.get("skipped", 0),
                  errors=counts.get("errors", counts.get("error", 0)))
    if done.returncode not in (0, 5):
        record["output"] = (done.stdout + done.stderr)[-4000:]
    return record


def failed_tests(junit: Path) -> list[dict]:
    """Each failed or erroring test of a pytest junit XML file with its message: what the output's tail, which keeps
    only the last failure in full, does not say (the first GPU session of the CUDA tests ran nine failures blind)."""
    try:
        cases = ElementTree.parse(junit).getroot().iter("testcase")
    except (OSError, ElementTree.ParseError):
        return []
    out = []
    for case in cases:
        for problem in (*case.findall("failure"), *case.findall("error")):
            text = (problem.get("message") or problem.text or "").strip()
            out.append({"test": f"{case.get('classname', '')}::{case.get('name', '')}", "kind": problem.tag,
                        "message": text[:600], "detail": (problem.text or "")[-1500:]})
    return out


# --- the machine ----------------------------------------------------------------------------------------------------
def machine(dry_run: bool) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "comfyui": comfyui_version(), "host": platform.machine(), "cpus": os.cpu_count(), "dry_run": dry_run}
    if torch.cuda.is_available() and not dry_run:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_total_bytes=props.total_memory,
                    driver=_driver_version())
    else:
        info.update(gpu=None, gpu_total_bytes=None)
    for package in ("transformers", "peft", "diffusers", "safetensors", "numpy"):
        try:
            info[package] = __import__(package).__version__
        except Exception:
            info[package] = None
    return info


def _driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# --- main -------------------------------------------------------------------------------------------------------------
def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, required=True, help="folder of results.jsonl (resumed when present)")
    parser.add_argument("--dry-run", action="store_true", help="the same path on the CPU with the tiny models")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="comma list of budgets in GiB")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help=f"comma list of named policies to measure as given ({', '.join(POLICIES)}), or none")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of the streaming rows (STREAMING_MODELS "
                        "resident, ckpt and budgets: issue 41 asks 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps of the streaming rows (issue 41: 3)")
    parser.add_argument("--other-steps", type=int, default=4, help="timed steps of every other run (fewer: more rows "
                        "per device command)")
    parser.add_argument("--other-warmup", type=int, default=1, help="warm-up steps of every other run")
    parser.add_argument("--minutes", type=float, default=8.0, help="start no measurement that would end after this many minutes (guessed: as long as the longest "
                        "so far)")
    parser.add_argument("--no-native", action="store_true", help="leave ComfyUI's TrainLoraNode out")
    parser.add_argument("--full-cards", default=",".join(map(str, FULL_CARDS)),
                        help=f"comma list of cards in GiB the full fine-tunes of {', '.join(FULL_MODELS)} are fitted "
                        "to (none: leave them out)")
    parser.add_argument("--full-host-cards", default=",".join(map(str, FULL_HOST_CARDS)),
                        help="comma list of cards in GiB the same full fine-tunes are fitted to with their trained "
                        "weights in host RAM (none: leave them out)")
    parser.add_argument("--full-streamed-state-cards", default=",".join(map(str, FULL_STREAMED_STATE_CARDS)),
                        help=f"comma list of cards in GiB a full fine-tune of {', '.join(FULL_STREAMED_STATE_MODELS)} "
                        "with AdamW runs on with its optimizer state streamed from host RAM (none: leave it out)")
    parser.add_argument("--no-controlnet", action="store_true", help="leave the ControlNet rows out (CONTROLNET_ROWS: "
                        + "; ".join(f"{m} {', '.join(c)}" for m, c in CONTROLNET_ROWS.items()) + ")")
    parser.add_argument("--no-text-encoder", action="store_true", help="leave the text-encoder rows out "
                        "(TEXT_ENCODER_ROWS: " + "; ".join(f"{m} {', '.join(c)}" for m, c in TEXT_ENCODER_ROWS.items())
                        + ")")
    parser.add_argument("--no-cuda-tests", action="store_true", help="leave the CUDA-marked tests out")
    parser.add_argument("--cuda-test-files", default=None,
                        help="comma-separated test files to run as the CUDA tests instead of every CUDA-marked one "
                             "(the CPU dry run in CI: those files already run in its suite)")
    parser.add_argument("--page", type=Path, help="write the GPU section into this Markdown file (its own section only)")
    parser.add_argument("--png", type=Path, help="draw the peak-VRAM picture here")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    # A command that restarts the suite (device.sh, after a CUDA error) counts its minutes from its own start.
    already = time.time() - float(os.environ["GPUKIT_STARTED"]) if "GPUKIT_STARTED" in os.environ else 0.0
    started = time.monotonic() - max(0.0, already)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip() and p.strip() != "none"]
    if any(p not in POLICIES for p in policies):
        parser.error(f"unknown policies in {args.policies!r}; known: {', '.join(POLICIES)}")
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu kit: no CUDA device here. Run it on a GPU machine (docs/GPU_KIT.md), or --dry-run on the CPU.")
        return 2
    results = Results(args.results)
    command = " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name if argv is None else "suite.py",
                                                *(sys.argv[1:] if argv is None else argv)])
    import_comfyui(cpu=args.dry_run)
    info = machine(args.dry_run)
    gpu = info["gpu"]  # each measurement says which card gave it: later commands may run on another kind
    results.add({"type": "command", "command": command, "date": datetime.datetime.now(datetime.timezone.utc)
                 .isoformat(timespec="seconds"), "machine": info})
    for lost in results.crashed():
        results.add({"type": "measurement", "id": lost, "status": "crashed",
                     "error": "the process ended inside this measurement (time limit or crash); not retried"})
    full_cards = tuple(float(c) for c in args.full_cards.split(",") if c.strip() and c.strip() != "none")
    full_host_cards = tuple(float(c) for c in args.full_host_cards.split(",") if c.strip() and c.strip() != "none")
    full_streamed_state_cards = tuple(float(c) for c in args.full_streamed_state_cards.split(",")
                                      if c.strip() and c.strip() != "none")
    steps = plan(models, budgets, policies, full_cards, full_host_cards, full_streamed_state_cards,
                 controlnet=not args.no_controlnet, text_encoder=not args.no_text_encoder)
    if args.no_cuda_tests:
        steps = [s for s in steps if s[0] != "cuda_tests"]
    if args.no_native:
        steps = [s for s in steps if s[0] != "native"]
    left: list[str] = []
    longest = 0.0  # the longest measurement of this command so far: what the next one may take

    def out_of_time() -> bool:
        return time.monotonic() - started + longest > args.minutes * 60

    broken = None  # the measurement after which this process's CUDA context failed: the rest in a new process
    for kind, name, configs in steps:
        todo = [c for c in configs or [""] if measurement_id(kind, name, c) not in results.done()]
        if not todo:
            continue
        if out_of_time():
            left += [measurement_id(kind, name, c) for c in todo]
            continue
        patcher = None
        for config in todo:
            ident = measurement_id(kind, name, config)
            if out_of_time():
                left.append(ident)
                continue
            results.add({"type": "started", "id": ident})
            print(f"gpu kit: {ident} ...", flush=True)
            t0 = time.perf_counter()
            try:
                if kind == "cuda_tests":
                    record = cuda_tests(timeout=max(60.0, args.minutes * 60 - (time.monotonic() - started)),
                                        only=None if args.cuda_test_files is None else
                                        [f for f in args.cuda_test_files.split(",") if f])
                elif kind == "h2d":
                    record = h2d_bandwidth(args.dry_run)
                else:
                    if patcher is None:
                        patcher = build_model(name, args.dry_run)
                    counts = step_counts(args, kind, name, config)
                    record = {"lora": lora_run, "full": full_run, "native": native_run,
                              "controlnet": controlnet_run, "text_encoder": text_encoder_run}[kind](
                        patcher, name, config, argparse.Namespace(**{**vars(args), **counts}))
                    record.update(warmup_steps=counts["warmup"], timed_steps=counts["steps"])
            except Exception as error:  # the model did not build, say: recorded, the kit goes on
                record = {"status": "failed", "error": _short(error), "traceback": traceback.format_exc()[-3000:]}
                if cuda_context_lost(error):
                    broken = ident
            record.update(type="measurement", id=ident, kind=kind, model=name, config=config,
                          seconds=time.perf_counter() - t0, gpu=gpu)
            results.add(record)
            longest = max(longest, record["seconds"])
            print(f"gpu kit: {ident}: {record['status']} in {record['seconds']:.0f} s", flush=True)
            if broken:
                break
        if broken:
            left += [measurement_id(k, n, c) for k, n, cs in steps for c in cs or [""]
                     if measurement_id(k, n, c) not in results.done()]
            break
        del patcher
        free_device()
    results.add({"type": "left", "ids": left, "minutes": (time.monotonic() - started) / 60})
    if args.page or args.png:
        from comfy_harness import register_module

        report = register_module("gpukit_report", Path(__file__).resolve().parent / "report.py")
        report.write(results.records, page=args.page, png=args.png)
    print(f"gpu kit: {len(results.done())} measurements recorded, {len(left)} left for the next command "
          f"({results.path})")
    if broken:
        print(f"gpu kit: the CUDA context failed in {broken}; the rest needs a new process", flush=True)
        return CUDA_CONTEXT_LOST
    return 0


CUDA_CONTEXT_LOST = 3  # the exit status that asks device.sh to start the suite again


def cuda_context_lost(error: BaseException) -> bool:
    """A CUDA error (not an out-of-memory) leaves the process's CUDA context unusable: every later call fails
    with it (the first GPU kit run lost 60 measurements so, each "failed in 0 s")."""
    return type(error).__name__ == "AcceleratorError" or "CUDA error:" in str(error)


if __name__ == "__main__":
    sys.exit(main())
