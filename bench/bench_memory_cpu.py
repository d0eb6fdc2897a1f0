"""Benchmark: CPU step time of each offload-policy option against the plain run and against ComfyUI's native
TrainLoraNode, on the tiny models, in one run.

Trains a rank-4 LoRA on every Linear and Conv2d (`all_layers`, as the native node adapts every weight) of each
built-in tiny model (real ComfyUI SD1.5 / SD3 / Flux classes, random weights) with the engine's Trainer through the
ComfyUI bridge, per option, and ComfyUI's own TrainLoraNode on the same model and data (same latents, same
conditioning, batch, rank, learning rate, AdamW, fp32) with gradient checkpointing off / on and offloading off / on;
everything interleaved over rounds. Reports the median CPU time per step of this process (both threads; what the
step costs, little disturbed by other load on a shared machine), the best wall time, and the ratios to the plain
run (resident base, no checkpointing, optimizer on the device) and to the native node. The native reference of a
row is the native run with the same gradient-checkpointing setting (off for plain / host optimizer / low-bit, on for
the checkpointing options), offloading off in one column and on in the other; where the native node cannot train
without checkpointing (Flux), the reference is the native run with checkpointing, marked *. The native node is timed
per run (between its progress updates after the first and the last step), ours per step.

On a CPU the memory options have nothing to move, so the ratios show what each option costs in compute and
bookkeeping: recomputation (checkpointing), the hook and copy machinery (streaming exercised with CPU->CPU copies),
the host optimizer's copies, on-the-fly dequantisation (low-bit storage), and the time to park and restore
optimizer state around one validation.

    OMP_NUM_THREADS=1 python bench/bench_memory_cpu.py [--rounds 3] [--steps 3] [--families sd15,sd3,flux]

Needs a ComfyUI checkout (found like the tests do: $COMFYUI_PATH or ~/comfy/ComfyUI). Prints a Markdown
table to paste into docs/benchmarks/cpu_step_time.md.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_train_step import failure_text, native_train  # the native node's runner, shared

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCH, LEARNING_RATE = 2, 1e-4  # both trainers


def _import(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def setup():
    """The package as `headroom` (the repo root is never put on sys.path) and ComfyUI in-process on the CPU."""
    _import("headroom", REPO_ROOT / "__init__.py", package=True)
    harness = _import("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py")
    harness.import_comfyui_in_process()


def bench_data(model, latent_side=16):
    """4 random latents and 4 random conditionings (key k<i> goes with latent i) shaped for `model`, plus an
    empty-prompt conditioning; the same for every run of a family."""
    from headroom.nodes.bridge.comfy_model import expected_cond_dims

    g = torch.Generator().manual_seed(0)
    channels = model.model.latent_format.latent_channels
    latents = [torch.randn(channels, latent_side, latent_side, generator=g) for _ in range(4)]
    dims = expected_cond_dims(model.model)

    def cond():
        return {n: torch.randn(*((16, w) if n == "cross_attn" else (w,)), generator=g) for n, w in dims.items()}

    conds = {f"k{i}": cond() for i in range(4)}
    return latents, conds, cond()


def session_for(family, run_root, storage=None, latent_side=16):
    from headroom.nodes.bridge.run_lora import LoraRunConfig, open_lora_run
    from headroom.nodes.bridge.comfy_model import model_family, training_blocks
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.memory.lowbit import LowBitBase
    from headroom.training.core.optimizers import OptimizerConfig
    from headroom.training.core.trainer import TrainConfig

    model, _, _ = build_tiny_models(family)
    base = None
    if storage is not None:
        blocks = [name for name, _ in training_blocks(model.model.diffusion_model)]
        base = LowBitBase(model.model.diffusion_model, storage, "cpu", prefixes=blocks)
    latents, conds, empty = bench_data(model, latent_side)
    config = LoraRunConfig(family=model_family(model.model), adapter=AdapterConfig(rank=4, alpha=4, targets="all_layers"),
                           optimizer=OptimizerConfig(lr=LEARNING_RATE), train=TrainConfig(batch_size=BATCH, seed=1),
                           holdout=0)
    memory_caches = _import("memory_caches", REPO_ROOT / "tests" / "memory_caches.py")  # the tests' in-memory caches
    caches = (memory_caches.MemoryLatentCache(latents, list(conds), {(latent_side * 8, latent_side * 8): [0, 1, 2, 3]}),
              memory_caches.MemoryTextCache(conds, empty))
    return open_lora_run(model, *caches, config, run_root, f"{family}-{storage}"), base


def native_step(family, checkpointing: bool, offloading: bool, steps: int) -> tuple[float, float]:
    """(wall, CPU seconds of this process) per step of ComfyUI's TrainLoraNode on the data `session_for` trains on:
    the mean over `steps` steps after one warm-up step."""
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    model, _, _ = build_tiny_models(family)
    latents, conds, _ = bench_data(model)
    # ComfyUI conditioning: one [cross_attn [1, T, D], {extras [1, ...]}] entry per latent, in latent order.
    positive = [[cond["cross_attn"][None], {name: value[None] for name, value in cond.items() if name != "cross_attn"}]
                for cond in conds.values()]
    timing = native_train(model, torch.stack(latents), positive, steps=1 + steps, batch=BATCH, lr=LEARNING_RATE,
                          rank=4, checkpointing=checkpointing, offloading=offloading)
    return timing["step_wall"], timing["step_cpu"]


@contextlib.contextmanager
def prepared(family, option, run_root):
    """A training session set up for `option`, inside which `step()` runs one timed training step."""
    import comfy.model_management

    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.training.memory.optimizer_parking import HostOptimizer
    from headroom.training.core.optimizers import create_optimizer, create_scheduler
    from headroom.training.memory.policy import OffloadPolicy, memory_features

    storage = option if option in ("fp8", "int8", "nf4") else None
    session, base = session_for(family, run_root, storage)
    trainer = session.trainer
    blocks = [m for _, m in training_blocks(session.patcher.model.diffusion_model)]
    policy = {"checkpointing": OffloadPolicy(checkpointing="blocks"),
              "checkpointing + CPU offload": OffloadPolicy(checkpointing="blocks_cpu_offload"),
              "streamed (exercised) + checkpointing": OffloadPolicy(base_placement="streamed", checkpointing="blocks"),
              }.get(option, OffloadPolicy())
    if option == "optimizer state on host":
        config = session.config.optimizer
        trainer.optimizer = HostOptimizer(trainer.params, lambda host: create_optimizer(host, config, device="cpu"))
        trainer.scheduler = create_scheduler(trainer.optimizer, config)

    def step() -> tuple[float, float]:
        """(wall seconds, CPU seconds of this process) of one training step."""
        wall, cpu = time.perf_counter(), time.process_time()
        trainer.train_step()
        return time.perf_counter() - wall, time.process_time() - cpu

    comfy.model_management.in_training = True
    try:
        with session.attached(), torch.inference_mode(False):
            trainer.trainable.train(True)
            with memory_features(policy, blocks, session.denoiser.device, exercise_on_cpu=True,
                                 inplace_inputs=session.denoiser.inplace_blocks):
                step()  # warm-up: allocator, ComfyUI's lazy set-up
                yield step, trainer
    finally:
        comfy.model_management.in_training = False
        session.release()
        if base is not None:
            base.detach()


def park_milliseconds(family, run_root) -> float:
    from headroom.training.memory.optimizer_parking import parked

    with prepared(family, "plain", run_root) as (step, trainer):
        step()
        started = time.perf_counter()
        for _ in range(20):
            with parked(trainer.optimizer, trainer.params, exercise_on_cpu=True):
                pass
        return (time.perf_counter() - started) / 20 * 1000


OPTIONS = ["plain", "checkpointing", "checkpointing + CPU offload", "streamed (exercised) + checkpointing",
           "optimizer state on host", "fp8", "int8", "nf4"]
CHECKPOINTING_OPTIONS = {"checkpointing", "checkpointing + CPU offload", "streamed (exercised) + checkpointing"}
NATIVE = [(checkpointing, offloading) for checkpointing in (False, True) for offloading in (False, True)]


def native_label(checkpointing: bool, offloading: bool) -> str:
    return (f"ComfyUI TrainLoraNode, checkpointing {'on' if checkpointing else 'off'}, "
            f"offloading {'on' if offloading else 'off'}")


def print_rows(family: str, cpu: dict, wall: dict, failed: dict) -> None:
    """The family's table rows: the native runs, then each option (`cpu` / `wall`: seconds per step by run, a run
    being an option name or a native (checkpointing, offloading) pair; `failed`: error text by native run)."""

    def versus_native(checkpointing: bool, offloading: bool, seconds: float) -> str:
        """The ratio to the native run with this checkpointing setting, or with checkpointing where the native
        node fails without it (marked *)."""
        if (checkpointing, offloading) not in failed:
            return f"{seconds / cpu[checkpointing, offloading]:.2f}x"
        if (True, offloading) not in failed:
            return f"{seconds / cpu[True, offloading]:.2f}x*"
        return "native fails"

    def row(label, run, checkpointing):
        if run in failed:
            print(f"| tiny {family} | {label} | fails: {failed[run]} | | | | | |", flush=True)
            return
        print(f"| tiny {family} | {label} | {cpu[run]:.3f} | {cpu[run] / cpu['plain']:.2f}x | "
              f"{versus_native(checkpointing, False, cpu[run])} | {versus_native(checkpointing, True, cpu[run])} | "
              f"{wall[run]:.3f} | {wall[run] / wall['plain']:.2f}x |", flush=True)

    for native in NATIVE:
        row(native_label(*native), native, native[0])
    for option in OPTIONS:
        row(option if option not in ("fp8", "int8", "nf4") else f"low-bit base: {option}", option,
            option in CHECKPOINTING_OPTIONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds over all options (interleaved)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per option and round")
    parser.add_argument("--families", default="sd15,sd3,flux")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads; 1 by default: on a loaded 2-core VM two OpenMP threads spin-wait "
                        "for each other and single steps took 60x longer at random (measured)")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # as the trainer does on a CPU: denormal moments are ~100x slower on x86
    setup()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads; "
          f"torch {torch.__version__}; python {platform.python_version()}; load average at start: "
          + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    print()
    print("| model | run | CPU s/step | vs plain (CPU time) | vs native, offloading off (CPU time) | "
          "vs native, offloading on (CPU time) | wall s/step (best) | vs plain (wall) |")
    print("|---|---|---|---|---|---|---|---|")
    notes = []
    with tempfile.TemporaryDirectory() as run_root:
        for family in args.families.split(","):
            # Everything interleaved over rounds and the best wall time kept: on a shared machine the minimum
            # is the figure least disturbed by other load.
            wall, cpu, failed = {}, {}, {}
            for _ in range(args.rounds):
                for option in OPTIONS:
                    with prepared(family, option, Path(run_root)) as (step, _trainer):
                        times = [step() for _ in range(args.steps)]
                    wall[option] = min(wall.get(option, float("inf")), *(w for w, _ in times))
                    cpu.setdefault(option, []).extend(c for _, c in times)
                for native in NATIVE:
                    if native in failed:
                        continue
                    try:
                        step_wall, step_cpu = native_step(family, *native, args.steps)
                    except RuntimeError as error:  # Flux without checkpointing: its blocks add into their inputs
                        failed[native] = failure_text(error)
                        continue
                    wall[native] = min(wall.get(native, float("inf")), step_wall)
                    cpu.setdefault(native, []).append(step_cpu)
            print_rows(family, {run: statistics.median(values) for run, values in cpu.items()}, wall, failed)
            notes.append(f"tiny {family}: park + restore optimizer state and gradients: "
                         f"{park_milliseconds(family, Path(run_root)):.2f} ms")
    print()
    for note in notes:
        print(note)
    print(f"total wall time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
