"""Benchmark: peak GPU memory and step time of each offload policy on full-size architectures.

Builds SDXL's UNet, SD3.5-Large's MMDiT and Flux-dev's DiT from ComfyUI's own model classes, with the
configs ComfyUI's model_detection yields for the released checkpoints, random bf16 weights made on the
GPU (nothing is downloaded), and trains a rank-16 LoRA (the family presets), batch 1, 1024x1024, with the
engine's Trainer under each policy. Per policy: median s/step, peak allocated and reserved
(torch.cuda.max_memory_allocated / max_memory_reserved over the timed steps), the planner's training-step
estimate and its ratio to the measured peak, and the peak of a validation forward (cond + uncond) with the
optimizer parked, against the planner's validation estimate. Prints a Markdown table.

    python bench/bench_memory_gpu.py                        # all three models, every policy
    python bench/bench_memory_gpu.py --models flux_dev --steps 3
    python bench/bench_memory_gpu.py --smoke                # CPU: the tiny models, to check the script runs

Needs CUDA and a ComfyUI checkout ($COMFYUI_PATH, the ComfyUI holding this package in custom_nodes/, or
~/comfy/ComfyUI). Without CUDA it says so and exits (status 2). Memory: the largest model, Flux-dev,
holds 24 GB of bf16 weights; its resident no-checkpointing row needs a large card and is reported as
OOM where it does not fit. Training runs on classic (non-dynamic) ModelPatchers, as the training nodes do.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3

SMOKE_FAMILIES = {"sdxl": "sd15", "sd35_large": "sd3", "flux_dev": "flux"}  # --smoke: the tiny stand-ins

POLICIES = {  # name -> OffloadPolicy fields
    "resident": {},
    "resident + checkpointing": {"checkpointing": "blocks"},
    "resident + offloaded checkpoints": {"checkpointing": "blocks_cpu_offload"},
    "resident fp8 + checkpointing": {"base_storage": "fp8", "checkpointing": "blocks"},
    "resident nf4 + checkpointing": {"base_storage": "nf4", "checkpointing": "blocks"},
    "streamed + checkpointing": {"base_placement": "streamed", "checkpointing": "blocks"},
    "streamed + offloaded checkpoints": {"base_placement": "streamed", "checkpointing": "blocks_cpu_offload"},
    "streamed + offloaded checkpoints + host optimizer": {
        "base_placement": "streamed", "checkpointing": "blocks_cpu_offload", "optimizer_state": "cpu"},
}


def _import(name: str, path: Path, package: bool = False):
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=[str(path.parent)] if package else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def import_comfyui(cpu: bool, **options) -> None:
    """ComfyUI in-process (found as the tests find it), with a throw-away base directory; `options`: more of
    ComfyUI's command-line arguments (e.g. use_pytorch_cross_attention=True)."""
    harness = _import("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py")
    if harness.COMFYUI_PATH is None:
        sys.exit(f"bench_memory_gpu: {harness.COMFYUI_FOUND_BY}")
    root = str(harness.COMFYUI_PATH)
    if root not in sys.path:
        sys.path.insert(0, root)
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = cpu
    args.base_directory = tempfile.mkdtemp(prefix="headroom-bench-")
    for name, value in options.items():
        setattr(args, name, value)
    import comfy.model_management  # noqa: F401  (reads args at import)
    import folder_paths  # noqa: F401
    _import("headroom", REPO_ROOT / "__init__.py", package=True)


# --- models ------------------------------------------------------------------------------------------------
def build_model(name: str, smoke: bool):
    """A classic ModelPatcher of the named architecture (random bf16 weights made on the compute device), from the
    builders the real-size test tier uses (tests/realsize_models.py)."""
    import comfy.model_management as mm

    if smoke:
        from headroom.nodes.bridge.tiny_models import build_tiny_model_patcher

        return build_tiny_model_patcher(SMOKE_FAMILIES[name], disable_dynamic=True)
    return realsize_models().build_model(name, device=mm.get_torch_device())


def realsize_models():
    return sys.modules.get("realsize_models") or _import("realsize_models", REPO_ROOT / "tests" / "realsize_models.py")


# --- one policy ---------------------------------------------------------------------------------------------
def place_blocks(blocks, device, streamed: bool) -> None:
    """Streamed: the blocks' frozen tensors in pinned host RAM. Otherwise on the device."""
    with torch.no_grad():
        for block in blocks:
            for tensor in [*block.parameters(), *block.buffers()]:
                if tensor.requires_grad:
                    continue
                if streamed and device.type == "cuda":
                    tensor.data = torch.empty_like(tensor.data, device="cpu", pin_memory=True).copy_(tensor.data)
                else:
                    tensor.data = tensor.data.to(device)


def peaks(device) -> tuple[float | None, float | None]:
    if device.type != "cuda":
        return None, None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def reset_peaks(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def run_policy(patcher, policy, size: int, text_tokens: int, steps: int) -> dict:
    import comfy.model_management as mm

    from headroom.nodes.bridge.comfy_model import ComfyDenoiser, training_blocks
    from headroom.nodes.bridge.planning import calibration_cond, lora_target_paths
    from headroom.training.core.adapters import AdapterConfig, AdapterSet
    from headroom.training.memory.lowbit import LowBitBase
    from headroom.training.core.optimizers import OptimizerConfig
    from headroom.training.memory.policy import memory_features
    from headroom.training.core.trainer import TrainConfig, Trainer

    model = patcher.model
    dm = model.diffusion_model
    device = torch.device(patcher.load_device)
    named_blocks = training_blocks(dm)
    blocks = [m for _, m in named_blocks]
    streamed = policy.base_placement != "resident"
    base = adapters = None
    mm.in_training = True
    try:
        with torch.inference_mode(False):
            dm.to(device)
            if policy.base_storage != "as_loaded":
                base = LowBitBase(dm, policy.base_storage, device, prefixes=[n for n, _ in named_blocks])
                for original in base.originals.values():  # out of the tree now: as in ComfyUI, they stay in RAM
                    original.to("cpu")
            place_blocks(blocks, device, streamed)
            adapter = AdapterConfig(rank=16, alpha=16)
            adapters = AdapterSet(dm, lora_target_paths(patcher, adapter), adapter)
            adapters.to(device)
            adapters.attach(dm)
            denoiser = ComfyDenoiser(patcher)
            channels = model.latent_format.latent_channels
            latent = torch.randn(channels, size // 8, size // 8, generator=torch.Generator().manual_seed(0))
            cond = {k: v.cpu() for k, v in calibration_cond(model, text_tokens, torch.device("cpu")).items()}
            memory_caches = _import("memory_caches", REPO_ROOT / "tests" / "memory_caches.py")  # the tests' in-memory caches
            latent_cache = memory_caches.MemoryLatentCache([latent, latent], ["caption", "caption"], {(size, size): [0, 1]})
            text_cache = memory_caches.MemoryTextCache({"caption": cond}, cond)
            # The policy's optimizer placement and parking come from the trainer; placement is done above.
            trainer = Trainer(denoiser, adapters, latent_cache, text_cache, TrainConfig(batch_size=1, precision="bf16", seed=0),
                              OptimizerConfig(lr=1e-4), policy=policy)
            trainer.trainable.train(True)
            with memory_features(policy, blocks, device, inplace_inputs=denoiser.inplace_blocks):
                trainer.train_step()  # warm-up: kernels, allocator, optimizer state
                reset_peaks(device)
                times = []
                for _ in range(steps):
                    started = time.perf_counter()
                    trainer.train_step()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - started)
                train_alloc, train_reserved = peaks(device)
                with trainer.parked_for_validation():
                    reset_peaks(device)
                    trainer.validation_loss([0], times=2)  # a cond + uncond sized forward, no grad
                    validation_alloc, _ = peaks(device)
        return {"s_per_step": statistics.median(times), "train_alloc": train_alloc, "train_reserved": train_reserved,
                "validation_alloc": validation_alloc}
    except Exception as error:
        from headroom.training.memory.oom import is_out_of_memory
        from headroom.training.core.trainer import NonFiniteLossError

        if isinstance(error, NonFiniteLossError):  # random weights at full depth can overflow in bf16
            return {"failed": "non-finite loss"}
        if not is_out_of_memory(error):
            raise
        return {"failed": "OOM"}
    finally:
        mm.in_training = False
        if adapters is not None:
            adapters.detach()
        if base is not None:
            base.detach()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def describe(patcher, text_tokens: int):
    """The planner's description of the model (measured at small sizes, as the Memory Plan node does)."""
    import comfy.model_management as mm

    from headroom.nodes.bridge.planning import describe_comfy_model, lora_target_paths
    from headroom.training.memory import planner
    from headroom.training.core.adapters import AdapterConfig

    adapter = AdapterConfig(rank=16, alpha=16)
    description = describe_comfy_model(patcher, adapter, "bf16", text_tokens)
    dm = patcher.model.diffusion_model
    trainable = planner.TrainableSpec.lora([dm.get_submodule(p) for p in lora_target_paths(patcher, adapter)], 16)
    mm.unload_all_models()
    return description, trainable


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    architectures = realsize_models().ARCHITECTURES
    parser.add_argument("--models", default=",".join(architectures), help=f"comma list of {', '.join(architectures)}")
    parser.add_argument("--policies", default="all", help="comma list of policy names, or all: " + "; ".join(POLICIES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per policy (after one warm-up step)")
    parser.add_argument("--size", type=int, default=1024, help="square training resolution in pixels")
    parser.add_argument("--smoke", action="store_true", help="run on the CPU with the tiny models (checks the script)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("bench_memory_gpu: no CUDA device here; this benchmark measures GPU memory and needs one. "
              "Run it on a machine with an NVIDIA GPU (or `--smoke` to check the script on the CPU).")
        sys.exit(2)
    size = 64 if args.smoke else args.size
    import_comfyui(cpu=args.smoke)
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    names = list(POLICIES) if args.policies == "all" else [p.strip() for p in args.policies.split(",")]
    unknown = [p for p in names if p not in POLICIES]
    if unknown:
        sys.exit(f"bench_memory_gpu: unknown policies {unknown}; known: {list(POLICIES)}")
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke else "CPU (smoke)"
    print(f"device: {device_name}; torch {torch.__version__}; python {platform.python_version()}; "
          f"LoRA rank 16, batch 1, {size}x{size}, bf16 autocast, AdamW; {args.steps} timed steps after 1 warm-up")
    print()
    print("| model | policy | s/step | peak allocated GiB | peak reserved GiB | planner training GiB | planner / measured "
          "| validation peak GiB | planner validation GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        spec = architectures[name]
        text_tokens = 8 if args.smoke else spec["text_tokens"]
        patcher = build_model(name, args.smoke)
        description, trainable = describe(patcher, text_tokens)
        for policy_name in names:
            policy = OffloadPolicy(**POLICIES[policy_name])
            plan = planner.estimate(description, trainable, planner.RunShape(1, size, size, text_tokens), policy)
            train_estimate = plan.phase("training step").total / GIB
            validation_estimate = plan.phase("validation").total / GIB
            result = run_policy(patcher, policy, size, text_tokens, args.steps)
            if "failed" in result:
                print(f"| {name} | {policy_name} | {result['failed']} | | | {train_estimate:.2f} | | | "
                      f"{validation_estimate:.2f} |", flush=True)
                continue

            ratio = "n/a" if result["train_alloc"] is None else f"{train_estimate / result['train_alloc']:.2f}"
            print(f"| {name} | {policy_name} | {result['s_per_step']:.3f} | {_gib(result['train_alloc'])} | "
                  f"{_gib(result['train_reserved'])} | {train_estimate:.2f} | {ratio} | "
                  f"{_gib(result['validation_alloc'])} | {validation_estimate:.2f} |", flush=True)
        del patcher
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
