"""Benchmark: data-parallel scaling of a LoRA run under torchrun (workflows/headroom_train_distributed.py).

Writes a synthetic dataset (random images with captions) to a temp folder, then for each world size runs
`torchrun --nproc-per-node N workflows/headroom_train_distributed.py` with the same global batch and reports the
training time per step (rank 0's, final checkpoint included), images per second and the scaling efficiency against
the first world size. The first launch also fills the latent / text caches (outside the timed part).

    python bench/bench_distributed.py [--ranks 1,2,4] [--tiny-model sd15 | --checkpoint FILE] [--steps 20]
        [--batch-size 8] [--resolution 32] [--images 16] [--base-directory DIR]

On CUDA every rank takes one GPU (NCCL); without CUDA the ranks are CPU processes (gloo), which share the
machine's cores: CPU figures say what the collectives cost, not how GPUs scale. Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile

import numpy as np
from PIL import Image

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LAUNCHER = REPO_ROOT / "workflows" / "headroom_train_distributed.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--tiny-model", default=None)
    model.add_argument("--checkpoint", default=None)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--images", type=int, default=16)
    p.add_argument("--base-directory", default=None)
    options = p.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="headroom-bench-dist-"))
    data = work / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for i in range(options.images):
        pixels = (rng.random((options.resolution, options.resolution, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(data / f"img{i:04d}.png")
        (data / f"img{i:04d}.txt").write_text(f"a picture number {i}")
    model = ["--checkpoint", options.checkpoint] if options.checkpoint else ["--tiny-model", options.tiny_model or "sd15"]
    base = options.base_directory or str(work / "base")
    rows, first = [], None
    for ranks in map(int, options.ranks.split(",")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                   str(port), str(LAUNCHER), *model, "--dataset", str(data), "--run-name", f"bench_{ranks}",
                   "--steps", str(options.steps), "--batch-size", str(options.batch_size), "--resolution",
                   str(options.resolution), "--bucket-step", "16", "--base-directory", base, "--save-subfolder", ""]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if done.returncode != 0:
            sys.exit(f"{ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        per_step = float(re.search(r"\[rank 0/\d+ .*\(([\d.]+) s/step", done.stdout).group(1))
        first = first or (ranks, per_step)
        efficiency = first[1] * first[0] / (per_step * ranks)
        rows.append(f"| {ranks} | {options.batch_size} | {per_step:.4f} | {options.batch_size / per_step:.1f} | "
                    f"{efficiency:.0%} |")
    print("| ranks | global batch | s/step | images/s | scaling efficiency |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
