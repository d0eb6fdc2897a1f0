"""The CPU's copy bandwidth into a staging buffer: what a full fine-tune's trained weights in host RAM and its streamed
optimizer state pass through at each crossing (training/memory/trained_weights_on_host.Crossings), and what the
planner's time model prices those copies at (time_model.host_copy_bytes_per_s, measured once per process on CUDA:
the same probe). Into a pinned buffer where CUDA is there, else a pageable one (a machine without CUDA cannot pin).

    python bench/bench_host_copy.py [--threads 1 2]

Prints GB/s per thread count, the versions and the date (docs/BENCHMARKS.md)."""
from __future__ import annotations

import argparse
import datetime
import platform

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch's CPU threads, each measured")
    args = parser.parse_args()
    from headroom_package import import_headroom

    import_headroom()
    from headroom.training.memory import time_model

    pinned = torch.cuda.is_available()
    for threads in args.threads:
        torch.set_num_threads(threads)
        rate = time_model.measured_host_copy.__wrapped__(pinned)  # not the per-process cache: each thread count
        print(f"{threads} threads: {rate / 1e9:.1f} GB/s ({time_model.H2D_PROBE_BYTES >> 20} MiB into a "
              f"{'pinned' if pinned else 'pageable'} buffer)")
    print(f"{platform.processor() or platform.machine()}; torch {torch.__version__}, Python "
          f"{platform.python_version()}; {datetime.date.today()}")


if __name__ == "__main__":
    main()
