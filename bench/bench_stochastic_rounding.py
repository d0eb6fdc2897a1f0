"""Nanoseconds per weight of rounding an fp32 tensor to bf16 stochastically on the CPU (a bf16 full fine-tune's
fused step does it once per trained weight per step: training/memory/stochastic_rounding.py): the noise from torch's
CPU randint (single-threaded; the engine's generator before issue 42) against the counter-based hash it uses now.

    python bench/bench_stochastic_rounding.py [--numel 37748736] [--repeats 5]

Prints the figures, the machine's threads, the versions and the date (docs/benchmarks/full_finetune.md)."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import pathlib
import platform
import time

import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "training" / "memory" / "stochastic_rounding.py"
_spec = importlib.util.spec_from_file_location("stochastic_rounding", _PATH)  # torch only: no package import
rounding = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rounding)


def with_randint(value: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The same rounding with torch.randint's noise (what the engine did on a CPU before)."""
    bits = value.view(torch.int32)
    noise = torch.randint(0, 1 << 16, value.shape, dtype=torch.int32, generator=generator)
    rounded = ((bits + noise) & -(1 << 16)).view(torch.float32)
    return torch.where(torch.isfinite(value), rounded, value).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=3072 * 12288, help="default: one Flux-dev MLP weight")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    value = torch.randn(args.numel, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(0)
    timings = {"torch.randint noise": [], "counter-based hash": []}
    for fn in (with_randint, rounding.stochastic_round_to_bf16):  # warm-up (allocations, the hash's table)
        fn(value, generator)
    for _ in range(args.repeats):  # alternated, so a busy moment of a shared machine hits both
        for name, fn in zip(timings, (with_randint, rounding.stochastic_round_to_bf16)):
            started = time.perf_counter()
            fn(value, generator)
            timings[name].append((time.perf_counter() - started) / args.numel * 1e9)
    print(f"{args.numel} fp32 weights -> bf16, {args.repeats} runs each, {torch.get_num_threads()} threads "
          f"(load average {open('/proc/loadavg').read().split()[0] if pathlib.Path('/proc/loadavg').exists() else '?'}):")
    for name, values in timings.items():
        values.sort()
        print(f"  {name:<22} best {values[0]:6.2f} ns per weight, median {values[len(values) // 2]:6.2f}")
    print(f"machine: {platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"torch {torch.__version__}; {datetime.date.today().isoformat()}")


if __name__ == "__main__":
    main()
