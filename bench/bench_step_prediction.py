"""Benchmark: the planner's predicted s/step against the measured one, on a CPU, through the nodes.

Per model (tests/realsize_models.py: real width, a selectable depth) and checkpointing off / on: the predicted step
of the run's own policy with the block times as the planner takes them (a) fitted from the calibration forwards
(16-32 latent px, extrapolated as a line in the latent area) and (b) timed at the run's latent size
(planner.time_blocks, what the nodes use where it fits), beside (c) the measured median s/step of HeadroomTrainSteps
after a warm-up step (HeadroomTrainLoraInit: LoRA rank 16, preset targets, AdamW, precision fp32, batch 1; with
`--kind controlnet` HeadroomTrainControlNetInit, the type's default blocks, planned from its own step's calibration
(planning._ControlNetStep), and (d) the prediction from a LoRA's calibration, as made before; and (e) the plan's
activations against what the run's training forward keeps for backward (the planner's counter on the run's step:
saved without checkpointing, the held blocks' inputs with), from its own step's calibration and a LoRA's). On a CPU
nothing crosses a link, so this checks the compute part of the time model (forward times, backward taken as 1.5x
the forward, the recompute, the optimizer step); the GPU kit (bench/gpu/suite.py) records the same prediction beside
each measured row on a card.

    python bench/bench_step_prediction.py [--models sd15,flux_dev,sd35_large] [--depth 1] [--size 256]
        [--steps 3] [--threads 2] [--kind lora|controlnet]

Needs a ComfyUI checkout (found like the tests do) and ~10 GiB of RAM for Flux-width blocks. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import shlex
import statistics
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RUNS = itertools.count()


def setup() -> None:
    """The package as `headroom` (the repo root never goes on sys.path) and ComfyUI in-process on the CPU."""
    from headroom_package import import_headroom_and_comfyui

    import_headroom_and_comfyui()
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # realsize_models


def data(arch: str, depth, size: int, kind: str = "lora"):
    import realsize_models as R
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.families import controlnet_type_of

    model, clip, vae = R.build_family(arch, depth, 2, 0)
    with torch.inference_mode():
        images, captions, controls = data_nodes.HeadroomSyntheticDataset.execute(2, size, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(
            images, captions, size, 64, "center", False, 0,
            control_images=controls if kind == "controlnet" else None).args[0]
        encoding = controlnet_type_of(model).hint if kind == "controlnet" else None
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae, *([encoding] if encoding else [])).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    return model, latents, texts


def measure(model, latents, texts, checkpointing: bool, steps: int, kind: str = "lora") -> dict:
    """Predicted (fitted, timed at the run's size) and measured s/step of one run."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.controlnet_build import controlnet_trainable
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    with torch.inference_mode():  # as ComfyUI runs nodes
        lora = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 1000).args[0]
        shape = planning.cache_run_shape(model, latents, texts, 1, "bench")
        policy = OffloadPolicy(checkpointing="blocks" if checkpointing else "off")
        controlnet = None
        if kind == "controlnet":  # planned as the ControlNet Init node plans: its own step's calibration
            lora, controlnet = planning.AdapterConfig(), 0
            trainable = planning.with_host_step(controlnet_trainable(model, 0, "AdamW"))
        else:
            trainable = planning.with_host_step(planning.lora_trainable(model, lora, "AdamW"))
        predicted, descriptions = {}, {}
        planning.TIMING_BUDGET_S = float("inf")  # a real-width forward on a CPU takes seconds: timed all the same
        for name, timing in (("fitted", None), ("at_run_size", shape)):
            description = descriptions[name] = planning.describe_comfy_model(model, lora, "fp32", timing=timing,
                                                                             controlnet=controlnet)
            predicted[name] = planner.estimate(description, trainable, shape, policy).predicted_s_per_step
        if kind == "controlnet":  # as planned before: from a LoRA's calibration (activations and block times)
            description = descriptions["before"] = planning.describe_comfy_model(model, lora, "fp32", timing=shape)
            predicted["before"] = planner.estimate(description, trainable, shape, policy).predicted_s_per_step
        inputs = dict(model=model, latent_cache=latents, text_cache=texts, optimizer_config=optimizer,
                      run_name=f"bench_step_prediction_{os.getpid()}_{next(RUNS)}",  # a new run each: nothing resumed
                      seed=0, batch_size=1, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
                      caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
                      noise_offset=0.0, gradient_checkpointing=checkpointing, checkpoint_depth=1, holdout=0)
        if kind == "controlnet":
            run = HeadroomTrainControlNetInit.execute(**inputs).args[0]
        else:
            run = T.HeadroomTrainLoraInit.execute(lora_config=lora, **inputs).args[0]
        if kind == "controlnet":  # the plan's activations over what the step keeps (tests/family_checks.py)
            from family_checks import controlnet_plan_over_step

            predicted["activations"] = {}
            for name in ("at_run_size", "before"):
                planned, kept = controlnet_plan_over_step(run, descriptions[name])[checkpointing]
                predicted["activations"][name] = planned / kept
        T.HeadroomTrainSteps.execute(run, 1)  # warm-up
        seconds = []
        for step in range(2, steps + 2):
            T.HeadroomTrainSteps.execute(run, step)  # one step per call: its figure is that step's seconds
            seconds.append(run.step_figures[max(run.step_figures)][1])
        run.release()
    measured = statistics.median(seconds)
    return {**predicted, "measured": measured}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sd15,flux_dev,sd35_large")
    parser.add_argument("--depth", type=int, default=1, help="blocks of each kind for the transformer models")
    parser.add_argument("--size", type=int, default=256, help="image size in px")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kind", choices=("lora", "controlnet"), default="lora")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup()
    rows = []
    for arch in args.models.split(","):
        depth = None if arch in ("sd15", "sdxl") else (args.depth if arch != "flux_dev" else (args.depth, args.depth))
        model, latents, texts = data(arch, depth, args.size, args.kind)
        for checkpointing in (False, True):
            r = measure(model, latents, texts, checkpointing, args.steps, args.kind)
            before = f" {r['before']:.2f} ({r['before'] / r['measured']:.2f}x) |" if "before" in r else ""
            if "activations" in r:
                before += f" {r['activations']['at_run_size']:.2f}x ({r['activations']['before']:.2f}x) |"
            rows.append(f"| {arch} (depth {depth}) | {'on' if checkpointing else 'off'} | {r['measured']:.2f} | "
                        f"{r['fitted']:.2f} ({r['fitted'] / r['measured']:.2f}x) | "
                        f"{r['at_run_size']:.2f} ({r['at_run_size'] / r['measured']:.2f}x) |{before}")
            print(rows[-1], flush=True)
    print(f"\n{platform.processor() or platform.machine()}, {args.threads} threads, torch {torch.__version__}, "
          f"{datetime.date.today()}, {args.size} px, batch 1, "
          f"{'ControlNet (default blocks)' if args.kind == 'controlnet' else 'LoRA rank 16 (preset)'}, AdamW, fp32: "
          f"`{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`\n")
    before = (" predicted from a LoRA's calibration, timed at run size | planned / kept activations (from a LoRA's) |"
              if args.kind == "controlnet" else "")
    print("| model | checkpointing | measured s/step | predicted, calibration fit | predicted, timed at run size |"
          + before)
    print("|---|---|---:|---:|---:|" + ("---:|---:|" if before else ""))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
