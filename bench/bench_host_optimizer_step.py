"""Nanoseconds per weight of one optimizer step in host RAM: what fused backward does per trained tensor with the
Offload Policy's optimizer_state "cpu" (an fp32 tensor, its gradient and its state on the CPU; one optimizer per
tensor: training/memory/fused_backward.py), for torch's AdamW and transformers' Adafactor with the settings
training/core/optimizers.create_optimizer gives them (and torch's AdamW as it steps CPU tensors by default, unfused):
the optimizer's own step on a tensor stepped in place. Then the step as fused backward runs it (the fp32 copy of
weight and gradient made per step; bf16 weights rounded back), which is what the planner's time model is given,
measured once per process (training/core/optimizers.host_step_s_per_weight, on its smaller probe tensor) and prices
the host step at.

    python bench/bench_host_optimizer_step.py [--numel 37748736] [--repeats 5] [--threads 1]

Prints the figures, the machine's threads, the versions and the date (docs/benchmarks/full_finetune.md)."""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch


def _optimizers():
    from headroom_package import import_headroom

    import_headroom()
    from headroom.training.core import optimizers

    return optimizers


def make(name: str, param: torch.nn.Parameter) -> torch.optim.Optimizer:
    """The optimizer as create_optimizer makes it (AdamW: torch's fused kernel); "AdamW (torch's default)": torch's
    AdamW as it steps CPU tensors by default (tensor by tensor, no fused kernel), for comparison."""
    if name == "AdamW (torch's default)":
        return torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01)
    optimizers = _optimizers()
    decay = 0.01 if name == "AdamW" else 0.0  # as before: AdamW with decay, Adafactor without
    return optimizers.create_optimizer([param], optimizers.OptimizerConfig(name=name, weight_decay=decay))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=3072 * 12288, help="default: one Flux-dev MLP weight")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = args.numel // 3072 if args.numel % 3072 == 0 else 1
    shape = (rows, args.numel // rows)  # a matrix: Adafactor factors its second moment
    optimizers = _optimizers()
    generator = torch.Generator().manual_seed(0)
    for name in ("AdamW (torch's default)", "AdamW", "Adafactor"):
        param = torch.nn.Parameter(torch.randn(shape, generator=generator))
        param.grad = torch.randn(shape, generator=generator) * 1e-3
        optimizer = make(name, param)
        optimizer.step()  # the first step makes the state
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            optimizer.step()
            times.append(time.perf_counter() - started)
        per_weight = [t / args.numel * 1e9 for t in times]
        print(f"{name}: best {min(per_weight):.1f} / median {statistics.median(per_weight):.1f} ns per weight "
              f"({args.numel} weights, {torch.get_num_threads()} threads)")
        for bf16 in (False, True) if name in optimizers.OPTIMIZERS else ():
            optimizers.HOST_STEP_PROBE_SHAPE = shape
            optimizers.host_step_s_per_weight.cache_clear()
            rate = optimizers.host_step_rate(name, bf16)
            print(f"{name} as fused backward steps it ({'bf16 weights, stochastic rounding' if bf16 else 'fp32'}): "
                  f"best {rate * 1e9:.1f} ns per weight")
    import transformers

    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads; torch "
          f"{torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}; "
          f"{datetime.date.today()}")


if __name__ == "__main__":
    main()
