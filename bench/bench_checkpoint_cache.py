"""What a run's checkpoints do to the files users' programs keep in Linux's page cache.

Linux keeps the pages a process writes in its page cache until memory is wanted, and then reclaims the oldest pages
first: a model file ComfyUI read (or maps) when it loaded it is older than a checkpoint written during training, so a
few checkpoints of some GB each (a full fine-tune's optimizer state) push the model out, and its next use reads it
from disk again. RunDir.save_checkpoint's large files leave the cache as they reach the disk
(os_compat.open_to_write). Each round, with a "model" file read into the cache first, a fresh process holds some
memory of its own (the training), saves checkpoints through RunDir, then reports how much of the model is still cached
and how long reading it again takes. Three ways: "kept" (Linux's default, the drop turned off), "at-close" (each file
dropped whole once written and fsynced: a file is cached whole while it is written), "written" (as shipped: every
os_compat.DROP_BEHIND_BYTES as it is written):

    python bench/bench_checkpoint_cache.py [--model-gib 6] [--own-gib 6] [--checkpoint-gib 4] [--checkpoints 3]

Sizes are for a 24 GiB machine: together they pass its RAM only when the checkpoints stay cached (with
`--own-gib 4 --checkpoint-gib 8 --checkpoints 1`: when a 6 GiB file is cached whole while it is written). Prints
per round the saves' seconds (fsyncs included), the page cache they added, the model's share still cached and its
read's seconds; then the machine, versions and date (docs/BENCHMARKS.md). Linux only; it writes under --folder (default: a temp folder) and removes what it
wrote."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

MODES = ("kept", "at-close", "written")
REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _page_cache_bytes() -> int:
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("Cached:"))


def cached_share(path: str) -> float:
    """The share of the file's pages in the page cache now (tests/page_cache.py: mincore)."""
    spec = importlib.util.spec_from_file_location("page_cache", REPO_ROOT / "tests" / "page_cache.py")
    page_cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_cache)
    return page_cache.cached_bytes(path) / os.path.getsize(path)


def read_seconds(path: str) -> float:
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(64 << 20)
        while handle.readinto(buffer):
            pass
    return time.perf_counter() - started


def one_round(mode: str, folder: str, model: str, own_gib: float, checkpoint_gib: float, checkpoints: int) -> dict:
    from headroom_package import import_headroom

    import_headroom()
    from headroom.training import os_compat
    from headroom.training.core.run_dir import Checkpoint, RunDir

    if mode == "kept":
        os_compat._can_drop_cached = lambda: False
    elif mode == "at-close":
        os_compat.DROP_BEHIND_BYTES = 1 << 62
    own = torch.empty(int(own_gib * (1 << 30)), dtype=torch.uint8).fill_(1)  # the training's own memory
    quarter = int(checkpoint_gib * (1 << 30)) // 16  # fp32 elements: the adapter a quarter, optimizer state 3/4
    state = {"exp_avg": torch.ones(quarter), "exp_avg_sq": torch.ones(quarter), "extra": torch.ones(quarter)}
    before, run, started = _page_cache_bytes(), RunDir(folder, "bench"), time.perf_counter()
    for step in range(1, checkpoints + 1):  # RunDir keeps the last two
        run.save_checkpoint(Checkpoint(step=step, micro_step=step, adapter={"w": torch.ones(quarter)},
                                       optimizer={"state": {0: state}, "param_groups": []}, scheduler=None,
                                       scaler=None, rng={}, loss_history=[], validation_history=[]))
    added, saves_s = _page_cache_bytes() - before, time.perf_counter() - started
    del own, state
    share = cached_share(model)
    return {"mode": mode, "saves_s": saves_s, "cache_added_gib": added / (1 << 30), "model_cached": share,
            "read_s": read_seconds(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-gib", type=float, default=6.0, help="the model file read into the cache first")
    parser.add_argument("--own-gib", type=float, default=6.0, help="the training process's own memory")
    parser.add_argument("--checkpoint-gib", type=float, default=4.0, help="each checkpoint's size")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints saved per round")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (kept, at-close, written)")
    parser.add_argument("--folder", default=None, help="where the files are written (default: a temp folder)")
    parser.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="headroom_bench_")
    model = os.path.join(folder, "model.bin")
    if args.one:
        print(json.dumps(one_round(args.one, folder, model, args.own_gib, args.checkpoint_gib, args.checkpoints)))
        return
    try:
        with open(model, "wb") as handle:  # not sparse: pages a read really caches
            chunk = os.urandom(64 << 20)
            for _ in range(int(args.model_gib * 16)):
                handle.write(chunk)
        for _ in range(args.rounds):
            for mode in MODES:
                shutil.rmtree(os.path.join(folder, "bench"), ignore_errors=True)
                with open(model, "rb") as handle:  # from disk, then into the cache as a model's load reads it
                    os.fsync(handle.fileno())
                    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                disk_s = read_seconds(model)
                out = subprocess.run([sys.executable, __file__, "--one", mode, "--folder", folder,
                                      "--own-gib", str(args.own_gib), "--checkpoint-gib", str(args.checkpoint_gib),
                                      "--checkpoints", str(args.checkpoints)],
                                     check=True, capture_output=True, text=True).stdout
                row = json.loads(out.strip().splitlines()[-1])
                print(f"{row['mode']:8s} {args.checkpoints} checkpoints saved in {row['saves_s']:5.1f} s, added "
                      f"{row['cache_added_gib']:5.2f} GiB of page cache; the model still cached {100 * row['model_cached']:5.1f} %, read again in "
                      f"{row['read_s']:5.2f} s (from disk: {disk_s:5.2f} s)", flush=True)
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            shutil.rmtree(os.path.join(folder, "bench"), ignore_errors=True)
            os.unlink(model) if os.path.exists(model) else None
    print(f"model {args.model_gib:g} GiB, own memory {args.own_gib:g} GiB, {args.checkpoints} checkpoints of "
          f"{args.checkpoint_gib:g} GiB; RAM {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / (1 << 30):.1f} "
          f"GiB; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, "
          f"Python {platform.python_version()}; {datetime.date.today()}")


if __name__ == "__main__":
    main()
