"""Benchmark: ControlNet training against LoRA training on the same tiny model, and (on a GPU) the peak
memory of ControlNet training against its validation.

On one built-in tiny model (real ComfyUI SD1.5 / SD3 / Flux classes, random weights) with synthetic shape
images and their control images, cached through the caching nodes, it trains a rank-16 LoRA
(HeadroomTrainLoraInit) and a ControlNet (HeadroomTrainControlNetInit) with the same optimizer, batch and
precision, through the same engine, and reports the median seconds per step of each and their ratio.
On a CUDA device it also measures the peak allocated memory of training steps and of one validation (the
validation loss plus one sample with the ControlNet applied by the stock ControlNetApplyAdvanced): the
validation shares the training weights, so its peak must not exceed training's. Without a GPU it says so.

    OMP_NUM_THREADS=2 python bench/bench_controlnet.py [--family sd15] [--steps 10] [--batch 2]

Needs a ComfyUI checkout (found like the tests do: $COMFYUI_PATH or ~/comfy/ComfyUI); runs it on the CPU
unless a GPU is present. Prints Markdown tables to paste into docs/benchmarks/cpu_step_time.md.
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent


def _import(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def setup(cpu: bool):
    """The package as `headroom` (the repo root is never put on sys.path) and ComfyUI in-process."""
    _import("headroom", REPO_ROOT / "__init__.py", package=True)
    harness = _import("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py")
    if cpu:
        harness.import_comfyui_in_process()
        return
    # On a GPU: the same throw-away base directory, without forcing the CPU.
    import tempfile

    sys.path.insert(0, str(harness.COMFYUI_PATH))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.base_directory = tempfile.mkdtemp(prefix="headroom-bench-")
    import comfy.model_management  # noqa: F401
    import folder_paths  # noqa: F401


def caches(family: str, count: int, seed: int = 0):
    """(model, clip, vae, latent cache with pixel or latent controls, text cache) through the caching nodes."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.families import controlnet_type_of
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data.synthetic import generate_shapes

    model, clip, vae = build_tiny_models(family, seed)
    shapes = generate_shapes(count, 64, seed)
    dataset = cache_nodes.HeadroomDatasetFromImages.execute(
        shapes.images, "\n".join(shapes.captions), resolution=64, step=64 if family == "sd15" else 16, crop="center",
        flip=False, seed=seed, control_images=shapes.control_images).args[0]
    encoding = controlnet_type_of(model).hint
    latent_cache = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, encoding).args[0]
    text_cache = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, clip, vae, latent_cache, text_cache


def common_inputs(model, latent_cache, text_cache, optimizer, batch: int, name: str) -> dict:
    return dict(model=model, latent_cache=latent_cache, text_cache=text_cache, optimizer_config=optimizer,
                run_name=name, seed=0, batch_size=batch, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
                caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
                noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0)


def step_times(session, steps: int, warmup: int = 2) -> list[float]:
    """Seconds of each engine step (the run's model loaded once, as in TrainingRun.train_to, without its
    progress events and end-of-call checkpoint)."""
    import comfy.model_management

    times = []
    with session.attached():
        comfy.model_management.in_training = True
        try:
            session.trainer.train_to(session.step + warmup)
            for _ in range(steps):
                started = time.perf_counter()
                session.trainer.train_to(session.step + 1)
                times.append(time.perf_counter() - started)
        finally:
            comfy.model_management.in_training = False
    return times


def trainable_count(session) -> int:
    return sum(p.numel() for p in session.trainer.params)


def gpu_peaks(session, clip, vae, steps: int) -> tuple[float, float]:
    """Peak allocated MiB of `steps` training steps, then of one validation (loss + one controlled sample)."""
    from headroom.nodes.train_lora import HeadroomValidate, validate

    device = session.denoiser.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    session.train_to(session.step + steps)
    torch.cuda.synchronize(device)
    training = torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    validate(HeadroomValidate, session, clip, vae, prompts="a shape", sample_steps=4, cfg=1.0, width=64, height=64)
    torch.cuda.synchronize(device)
    validation = torch.cuda.max_memory_allocated(device) / 2**20
    return training, validation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="sd15", choices=["sd15", "sd3", "flux"])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per trainer")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--items", type=int, default=8)
    options = parser.parse_args()

    use_gpu = torch.cuda.is_available()
    setup(cpu=not use_gpu)
    from headroom.nodes import train_controlnet, train_lora

    model, clip, vae, latent_cache, text_cache = caches(options.family, options.items)
    optimizer = train_lora.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
    lora_config = train_lora.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
    stamp = f"{time.time():.0f}"

    lora = train_lora.HeadroomTrainLoraInit.execute(
        lora_config=lora_config, **common_inputs(model, latent_cache, text_cache, optimizer, options.batch, f"bench_lora_{stamp}")).args[0]
    lora_times = step_times(lora, options.steps)
    lora.release()
    controlnet = train_controlnet.HeadroomTrainControlNetInit.execute(
        **common_inputs(model, latent_cache, text_cache, optimizer, options.batch, f"bench_cn_{stamp}")).args[0]
    controlnet_times = step_times(controlnet, options.steps)

    device = torch.cuda.get_device_name(0) if use_gpu else f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    print(f"\nfamily {options.family}, batch {options.batch}, 64x64 px, fp32, AdamW, {options.steps} timed steps, {device}; "
          f"torch {torch.__version__}, Python {platform.python_version()}\n")
    print("| trainer | trainable params | median s/step | min s/step | ratio to LoRA |")
    print("|---|---|---|---|---|")
    lora_median = statistics.median(lora_times)
    for name, session, times in (("LoRA r16 (preset targets)", lora, lora_times),
                                 (f"ControlNet ({controlnet.controlnet.type_name}, blocks={controlnet.controlnet.blocks})",
                                  controlnet, controlnet_times)):
        median = statistics.median(times)
        print(f"| {name} | {trainable_count(session):,} | {median:.3f} | {min(times):.3f} | {median / lora_median:.2f} |")

    if not use_gpu:
        print("\nNo CUDA GPU here: peak memory of training vs validation not measured (run this on a GPU).")
        return
    training, validation = gpu_peaks(controlnet, clip, vae, options.steps)
    print("\n| phase | peak allocated MiB |")
    print("|---|---|")
    print(f"| ControlNet training ({options.steps} steps) | {training:.1f} |")
    print(f"| validation (loss + 1 controlled sample) | {validation:.1f} |")
    print(f"\nvalidation peak <= training peak: {validation <= training}")


if __name__ == "__main__":
    main()
