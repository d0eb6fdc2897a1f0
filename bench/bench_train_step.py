"""Benchmark: seconds per LoRA training step, per optimizer and per precision, and side by side with
ComfyUI's own `TrainLoraNode` on the same tiny model, data and settings, in one run.

For each tiny family (real ComfyUI SD1.5 / SD3 / Flux classes with random weights), 4 synthetic images are
cached through the caching nodes. Then, on the same MODEL:
- Headroom (HeadroomTrainLoraInit + HeadroomTrainSteps): AdamW at fp32 / bf16 / fp16 and with gradient
  checkpointing, and every other optimizer at fp32; targets `all_layers` (every Linear and Conv2d, as the
  native node adapts every weight).
- ComfyUI native `TrainLoraNode`: LoRA on every weight (plus its bias/norm offsets, which it always adds),
  AdamW, MSE, batch, rank and learning rate as above, fp32 and bf16 without gradient checkpointing, fp32
  with it. A configuration the native node cannot train is reported with its error.
Step time = (time to N+W steps - time to W steps) / N, so set-up (the native node's deep copy of the model,
our Init) is left out of it; set-up plus the W warm-up steps is reported separately.

    OMP_NUM_THREADS=1 python bench/bench_train_step.py [--families sd15,sd3,flux] [--steps 20] [--warmup 5]
        [--threads 1] [--write docs/benchmarks/cpu_step_time.md]

Needs a ComfyUI checkout (found like the tests do: $COMFYUI_PATH or ~/comfy/ComfyUI); runs on the CPU.
Prints a Markdown section; --write puts it into the given file in place of its previous version (heading to the end
of the table; notes below the table are kept), or at the end.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ["AdamW", "AdamW8bit", "Lion8bit", "Adafactor", "CAME", "Prodigy"]
PRECISIONS = ["fp32", "bf16", "fp16"]


def _import(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def setup() -> None:
    """The package as `headroom` (the repo root never goes on sys.path) and ComfyUI in-process on the CPU."""
    _import("headroom", REPO_ROOT / "__init__.py", package=True)
    _import("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py").import_comfyui_in_process()


def data(family: str, resolution: int):
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, clip, vae = build_tiny_models(family, 0)
    images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(4, resolution, 0).args
    dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, resolution, resolution, "center", False,
                                                            0).args[0]
    latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
    texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, latents, texts, captions.splitlines()


def headroom_step_time(model, latents, texts, optimizer: str, precision: str, checkpointing: bool, args,
                       name: str) -> tuple[float, float]:
    """(seconds per step, seconds of set-up + warm-up steps) of our trainer."""
    from headroom.nodes import train_lora as T

    lr = 1.0 if optimizer == "Prodigy" else args.lr
    started = time.perf_counter()
    lora = T.HeadroomLoraConfig.execute("lora", args.rank, float(args.rank), "all_layers", False, 0.0, 0).args[0]
    opt = T.HeadroomOptimizerConfig.execute(optimizer, lr, 0.0, "constant", 0, 1000).args[0]
    run = T.HeadroomTrainLoraInit.execute(
        model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt, run_name=name,
        seed=0, batch_size=args.batch, grad_accumulation=1, precision=precision, max_grad_norm=0.0,
        caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
        gradient_checkpointing=checkpointing, checkpoint_depth=1, holdout=0).args[0]
    T.HeadroomTrainSteps.execute(run, args.warmup)
    setup_seconds = time.perf_counter() - started
    started = time.perf_counter()
    T.HeadroomTrainSteps.execute(run, args.warmup + args.steps)
    return (time.perf_counter() - started) / args.steps, setup_seconds


def native_train(model, samples: torch.Tensor, positive: list, *, steps: int, batch: int, lr: float, rank: int,
                 dtype: str = "fp32", checkpointing: bool = False, offloading: bool = False) -> dict[str, float]:
    """Train once with ComfyUI's TrainLoraNode (AdamW, MSE, fp32 LoRA weights, checkpoint depth 1) and time it.

    `samples` [N, C, h, w] are the latents, `positive` one ComfyUI conditioning entry per latent. Returns the
    wall seconds of the whole call ("total") and, for steps >= 2, the wall and CPU seconds of the process per
    step after the first ("step_wall", "step_cpu"): measured between the progress updates ComfyUI always sends
    after the first and after the last step, so the node's set-up (deep copy of the model, loading) and the
    first step are left out.
    """
    import comfy.utils
    from comfy_extras.nodes_train import TrainLoraNode

    marks = {}

    def on_progress(value, total, preview, node_id=None):
        if total == steps:
            marks[value] = (time.perf_counter(), time.process_time())

    previous_hook = comfy.utils.PROGRESS_BAR_HOOK
    comfy.utils.set_progress_bar_global_hook(on_progress)
    started = time.perf_counter()
    try:
        with torch.inference_mode():  # as ComfyUI runs nodes
            TrainLoraNode.execute(
                model=[model], latents=[{"samples": samples}], positive=[positive], batch_size=[batch],
                steps=[steps], grad_accumulation_steps=[1], learning_rate=[lr], rank=[rank], optimizer=["AdamW"],
                loss_function=["MSE"], seed=[0], training_dtype=[dtype], lora_dtype=["fp32"],
                quantized_backward=[False], algorithm=["LoRA"], gradient_checkpointing=[checkpointing],
                checkpoint_depth=[1], offloading=[offloading], existing_lora=["[None]"], bucket_mode=[False],
                bypass_mode=[False])
    finally:
        comfy.utils.set_progress_bar_global_hook(previous_hook)
    timing = {"total": time.perf_counter() - started}
    if steps >= 2:
        (wall_first, cpu_first), (wall_last, cpu_last) = marks[1], marks[steps]
        timing["step_wall"] = (wall_last - wall_first) / (steps - 1)
        timing["step_cpu"] = (cpu_last - cpu_first) / (steps - 1)
    return timing


def failure_text(error: Exception) -> str:
    """The first sentence of an error, short enough for a table cell."""
    return str(error).split(".")[0][:90]


def native_step_time(model, clip, latents, captions, dtype: str, checkpointing: bool, args) -> tuple[float, float]:
    """(seconds per step, seconds of set-up + warm-up steps) of ComfyUI's TrainLoraNode on the same data."""
    import nodes

    samples = torch.stack([latents.latent(i).float() for i in range(len(latents))])
    positive = [entry for caption in captions for entry in nodes.CLIPTextEncode().encode(clip, caption)[0]]

    def run(steps: int) -> float:
        return native_train(model, samples, positive, steps=steps, batch=args.batch, lr=args.lr, rank=args.rank,
                            dtype=dtype, checkpointing=checkpointing)["total"]

    short = run(args.warmup)
    long = run(args.warmup + args.steps)
    return (long - short) / args.steps, short


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="sd15,sd3,flux")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", type=Path,
                        help="write the Markdown section into this file (docs/benchmarks/cpu_step_time.md), "
                        "replacing its previous version")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup()
    import comfy.model_management
    import comfyui_version
    import bitsandbytes
    import diffusers
    import peft

    lines = [
        "## LoRA training step time (`bench/bench_train_step.py`)",
        "",
        f"- Date: {datetime.date.today().isoformat()}; machine: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch thread(s), device {comfy.model_management.get_torch_device()}",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, ComfyUI {comfyui_version.__version__}, "
        f"peft {peft.__version__}, diffusers {diffusers.__version__}, bitsandbytes {bitsandbytes.__version__}",
        f"- Command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`",
        f"- Data: 4 synthetic {args.resolution} px images per family, batch {args.batch}, LoRA rank {args.rank}, "
        f"lr {args.lr} (Prodigy 1.0); {args.steps} timed steps after {args.warmup} warm-up steps. Headroom targets "
        "`all_layers`; the native node adapts every weight and also trains bias/norm offsets.",
        f"- CPU cores: {os.cpu_count()}; load average when the run started: "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg()) + " (other jobs share the machine: compare within one run)",
        "",
        "| family | trainer | optimizer | precision | grad. checkpointing | s/step | vs native (same precision and "
        "checkpointing) | set-up + warm-up s |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: |",
    ]

    def row(family, trainer, optimizer, precision, checkpointing, timing, native_timing):
        if isinstance(timing, str):
            lines.append(f"| {family} | {trainer} | {optimizer} | {precision} | {checkpointing} | fails: {timing} | | |")
        else:
            ratio = f"{timing[0] / native_timing[0]:.2f}" if isinstance(native_timing, tuple) else ""
            lines.append(f"| {family} | {trainer} | {optimizer} | {precision} | {checkpointing} | {timing[0]:.4f} | "
                         f"{ratio} | {timing[1]:.1f} |")
        print(lines[-1], flush=True)

    with torch.inference_mode():  # as ComfyUI runs nodes
        for family in args.families.split(","):
            model, clip, vae, latents, texts, captions = data(family, args.resolution)
            native = {}
            for precision, checkpointing in (("fp32", False), ("bf16", False), ("fp32", True)):
                try:
                    native[precision, checkpointing] = native_step_time(model, clip, latents, captions, precision,
                                                                        checkpointing, args)
                except RuntimeError as error:  # ComfyUI's own trainer on models whose blocks update inputs in place
                    native[precision, checkpointing] = failure_text(error)
                row(family, "ComfyUI TrainLoraNode", "AdamW", precision, checkpointing, native[precision, checkpointing],
                    native[precision, checkpointing])
            combos = [("AdamW", p, False) for p in PRECISIONS] + [("AdamW", "fp32", True)]
            combos += [(o, "fp32", False) for o in OPTIMIZERS if o != "AdamW"]
            for optimizer, precision, checkpointing in combos:
                try:
                    timing = headroom_step_time(model, latents, texts, optimizer, precision, checkpointing, args,
                                                f"bench_{family}_{optimizer}_{precision}_{int(checkpointing)}")
                except RuntimeError as error:  # e.g. a bitsandbytes build without CPU kernels
                    timing = str(error)[:90]
                row(family, "Headroom", optimizer, precision, checkpointing, timing, native.get((precision, checkpointing)))
    section = "\n".join(lines) + "\n"
    print(section)
    if args.write:
        write_section(args.write, section)


def write_section(path: Path, section: str) -> None:
    """Put `section` (a "## " heading, lines, one table) into `path`: in place of the previous version (from the
    same heading to the end of its table; the notes written below the table stay), or at the end. Atomic."""
    lines = path.read_text().splitlines() if path.exists() else []
    heading = section.splitlines()[0]
    if heading in lines:
        start = lines.index(heading)
        end = start + 1
        while end < len(lines) and not lines[end].startswith("|"):  # down to the old table...
            end += 1
        while end < len(lines) and lines[end].startswith("|"):  # ...and past it
            end += 1
        lines[start:end] = section.rstrip("\n").splitlines()
    else:
        lines += ["", *section.rstrip("\n").splitlines()]
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("\n".join(lines) + "\n")
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
