"""Benchmark: real-size models through Headroom's nodes on a CPU: peak RSS per phase, s/step, planner vs measured.

Per model (full-size SDXL from a checkpoint file through the stock CheckpointLoaderSimple; Flux-dev at real width
through the stock UNETLoader; SD3.5-Large at real width), with and without gradient checkpointing, one fresh
process each (tests/realsize_worker.py, the flow the real-size test tier runs): synthetic images cached through
HeadroomCacheLatents / HeadroomCacheText, HeadroomTrainLoraInit (precision auto: fp32 on a CPU, LoRA rank 16,
preset targets), HeadroomTrainSteps, HeadroomValidate (2 sampling steps), HeadroomSaveLora, the stock LoraLoader.
Reported: peak RSS of each phase (the kernel's high-water mark, reset at each phase start), its growth over the RSS
with every model resident, s/step, the planner's estimate of each phase against the measured memory (the weights
the phase works with + its growth), and the LoRA keys the stock loader mapped. Then the CPU precision check behind
precision "auto": one convolution and one matmul at fp32, bf16 and fp16.

    python bench/bench_realsize.py [--models sdxl,flux_dev,sd35_large] [--size 128] [--steps 3]
        [--checkpointing both|on|off] [--planner-models sdxl,flux_dev,sd35_large]
        [--write docs/benchmarks/realsize_cpu.md]

Needs a ComfyUI checkout (found like the tests do) and RAM: SDXL peaks at ~14 GiB loading its checkpoint and
~18 GiB training without checkpointing; the planner's description runs forwards of each model (its measurement
keeps nothing alive), so it is measured only for --planner-models. Run it alone on the machine (here: under
`flock /tmp/headroom-heavy.lock`). --write puts the sections into the file in place of their previous versions.

RSS stands in for the device's allocated bytes on a CPU. glibc keeps freed heap pages in the process, so later phases
also show what earlier ones freed; with MALLOC_MMAP_THRESHOLD_=131072 in the environment large tensors come from mmap
and go back when freed, and RSS follows the live tensors (the run notes which allocator setting it had).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKER = REPO_ROOT / "tests" / "realsize_worker.py"
GIB = 1024 ** 3
HEADING = "## Real size on a CPU (`bench/bench_realsize.py`)"
PRECISION_HEADING = "### CPU compute precision (`bench/bench_realsize.py`)"



def _command_line() -> str:
    """The command as run, with the allocator setting that changes the RSS figures."""
    env = [f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"] if os.environ.get("MALLOC_MMAP_THRESHOLD_") else []
    return " ".join(shlex.quote(a) for a in [*env, "python", *sys.argv])

def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run(model: str, size: int, steps: int, checkpointing: bool, planner: bool, threads: int) -> dict:
    """One model in a fresh process; its report, or {"failed": why}."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [sys.executable, str(WORKER), model, "--out", str(out), "--size", str(size), "--steps", str(steps),
                   "--threads", str(threads)]
        command += [] if checkpointing else ["--no-checkpointing"]
        command += ["--planner"] if planner else []
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            killed = done.returncode in (-9, 137)
            return {"failed": "killed (out of RAM)" if killed else done.stderr.strip().splitlines()[-1][:120]}
        return json.loads(out.read_text())


def _gib(value) -> str:
    return "n/a" if value is None else f"{value / GIB:.2f}"


def row(model: str, checkpointing: bool, report: dict) -> str:
    if "failed" in report:
        return f"| {model} | | | {'on' if checkpointing else 'off'} | {report['failed']} |" + " |" * 12
    phases = {p["phase"]: p for p in report["phases"]}
    load = next((p for name, p in phases.items() if name.startswith("load")), None)
    caching = max(phases["caching latents"]["peak_rss_bytes"], phases["caching text"]["peak_rss_bytes"])
    compared = report["compared"]

    def ratio(phase):
        value = compared.get(phase, {}).get("planner_over_measured")
        return "n/a" if value is None else f"{value:.2f}"

    lora = report["lora"]
    return (f"| {model} | {report['diffusion_params'] / 1e9:.2f} B, {_gib(report['diffusion_bytes'])} GiB | "
            f"{_gib(report['text_encoder_bytes'])} + {_gib(report['vae_bytes'])} | {'on' if checkpointing else 'off'} | "
            f"{report['s_per_step']:.1f} | {_gib(load['peak_rss_bytes']) if load else 'built'} | "
            f"{_gib(report['baseline_rss_bytes'])} | {_gib(caching)} | {_gib(phases['training']['peak_rss_bytes'])} "
            f"(+{_gib(compared['training']['growth_bytes'])}) | {_gib(phases['validation']['peak_rss_bytes'])} | "
            f"{_gib(phases['save']['peak_rss_bytes'])} | {ratio('caching text')} | {ratio('caching latents')} | "
            f"{ratio('training')} | {ratio('validation')} | {ratio('save')} | "
            f"{lora['patched_weights']}/{lora['modules']}, {len(lora['not_loaded'])} not loaded |")


def precision_rows(threads: int) -> list[str]:
    """Forward time of one SDXL-sized convolution and one matmul per dtype on this CPU."""
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 320, 64, 64, generator=generator), torch.randn(320, 320, 3, 3, generator=generator)
    a, b = torch.randn(1024, 1280, generator=generator), torch.randn(1280, 5120, generator=generator)
    ops = {"conv2d 320->320 3x3 on 64x64": lambda d: torch.nn.functional.conv2d(x.to(d), w.to(d), padding=1),
           "matmul 1024x1280 @ 1280x5120": lambda d: a.to(d) @ b.to(d)}
    rows = []
    for name, op in ops.items():
        times = {}
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            op(dtype)
            started = time.perf_counter()
            op(dtype)
            times[dtype] = time.perf_counter() - started
        fp32 = times[torch.float32]
        rows.append(f"| {name} | {fp32 * 1e3:.0f} | {times[torch.bfloat16] * 1e3:.0f} ({times[torch.bfloat16] / fp32:.0f}x) | "
                    f"{times[torch.float16] * 1e3:.0f} ({times[torch.float16] / fp32:.0f}x) |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="sdxl,flux_dev,sd35_large")
    parser.add_argument("--size", type=int, default=128, help="square image size in pixels (training and samples)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", choices=["both", "on", "off"], default="both")
    parser.add_argument("--planner-models", default="sdxl,flux_dev,sd35_large",
                        help="models whose planner estimate is measured (its description runs forwards of the model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--write", type=Path,
                        help="write the Markdown sections into this file (docs/benchmarks/realsize_cpu.md), "
                        "replacing their old versions")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    harness = _import("comfy_harness", REPO_ROOT / "tests" / "comfy_harness.py")
    if harness.COMFYUI_PATH is None:
        sys.exit(f"bench_realsize: {harness.COMFYUI_FOUND_BY}")
    sys.path.insert(0, str(harness.COMFYUI_PATH))
    import comfyui_version

    settings = {"both": (True, False), "on": (True,), "off": (False,)}[args.checkpointing]
    lines = [
        HEADING, "",
        f"- Date: {datetime.date.today().isoformat()}; machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB RAM, no GPU; "
        f"{args.threads} torch threads",
        f"- Versions: Python {platform.python_version()}, torch {torch.__version__}, ComfyUI {comfyui_version.__version__}",
        f"- Command: `{_command_line()}`",
        f"- Run: {args.size} px, 2 images, batch 1, LoRA rank 16 (preset targets), AdamW, precision auto (fp32 on a CPU; "
        f"bf16 weights cast per layer by ComfyUI), {args.steps} steps; validation: 1 prompt, 2 euler steps, cfg 2.",
        "- Peak RSS in GiB, per phase (load: the stock loader reading the file ComfyUI's save code wrote; resident: every "
        "model loaded, before the nodes; growth over resident in brackets). Planner / measured: the planner's phase "
        "estimate over (the weights the phase works with + its RSS growth); goal: within 15 %. Allocator: "
        + (f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']} (large tensors mmapped, RSS follows live "
           "tensors)." if os.environ.get("MALLOC_MMAP_THRESHOLD_") else "glibc default (freed pages stay in RSS)."),
        "",
        "| model | diffusion (bf16) | text encoders + VAE GiB | checkpointing | s/step | load | resident | caching | "
        "training (growth) | validation | save | planner / measured: caching text | caching latents | training | "
        "validation | save | "
        "LoRA keys patched / saved |",
        "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    planner_models = set(args.planner_models.split(",")) if args.planner_models else set()
    for model in args.models.split(","):
        for checkpointing in settings:
            report = run(model, args.size, args.steps, checkpointing, model in planner_models, args.threads)
            lines.append(row(model, checkpointing, report))
            print(lines[-1], flush=True)
    lines += [
        "",
        "Reading the ratios: caching latents sits at ~1.19 because the planner takes ComfyUI's own VAE-encode "
        "estimate (`memory_used_encode`), which is deliberately generous (~70 MB too much at 128 px). Without "
        "the allocator setting, freed blocks stay in RSS and a phase looks larger than what it holds "
        "(SDXL training with checkpointing: 0.79).",
    ]
    precision = [PRECISION_HEADING, "",
                 f"- Forward time in ms of one op on this CPU ({torch.backends.cpu.get_cpu_capability()}, "
                 f"{args.threads} threads); the slowdown against fp32 in brackets. This is why precision auto computes "
                 "in fp32 on a CPU.", "",
                 "| op | fp32 ms | bf16 ms | fp16 ms |", "| --- | ---: | ---: | ---: |", *precision_rows(args.threads)]
    sections = ["\n".join(lines) + "\n", "\n".join(precision) + "\n"]
    print("\n".join(sections))
    if args.write:
        write_section = _import("bench_train_step", REPO_ROOT / "bench" / "bench_train_step.py").write_section
        for section in sections:
            write_section(args.write, section)


if __name__ == "__main__":
    main()
