"""The child process of the kill -9 and full-disk tests (tests/comfy/test_reliability_faults.py).

It imports the real ComfyUI (on the CPU, with the given base directory) and Headroom once, builds the tiny SD1.5
MODEL / CLIP / VAE and a cached 4-image dataset, then forks one job process per request: every job the test kills
with SIGKILL is a real process with the real ComfyUI imported, started in milliseconds instead of a 15 s import.

    python fault_worker.py <ComfyUI base dir>

Protocol, JSON lines: stdin {"op": "start", "job": name, "log": path, "args": {...}} -> stdout {"pid": n};
{"op": "wait", "pid": n} -> {"code": exit code or null, "signal": signal or null}; {"op": "quit"}.
A job appends JSON lines to its log, each flushed before it goes on: {"e": event, "t": time.monotonic(), ...}
(CLOCK_MONOTONIC: the same clock the test reads when it kills). Jobs:
  cache       cache `items` distinct images through HeadroomCacheLatents into `cache_dir` (commits every
              `commit_seconds`); logs "encoded" after each item the VAE encoded.
  train       HeadroomTrainLoraInit + HeadroomTrainSteps to `steps` with `checkpoint_every` / `checkpoint_minutes`;
              logs "opened" (the step it resumed at) and "step" for every step trained.
  disk_full   (root only) the full-disk scenarios of disk_full_cases.py on a real tmpfs mounted in a mount
              namespace of the job's own; logs one "case" line per scenario.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import time
import traceback

TESTS = pathlib.Path(__file__).resolve().parent
sys.path += [str(TESTS), str(TESTS / "comfy")]  # helpers, and test_train_lora_nodes (comfy/)

STATE: dict = {}


def _log_to(path: str):
    handle = open(path, "a", buffering=1)

    def log(**event):
        handle.write(json.dumps({"t": time.monotonic(), **event}) + "\n")
        handle.flush()
    return log


def setup(base: str) -> None:
    import conftest  # noqa: F401  (registers the package alias `headroom`)
    from comfy_harness import COMFYUI_PATH

    sys.path.insert(0, str(COMFYUI_PATH))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = True
    args.base_directory = base
    import comfy.model_management  # noqa: F401  (reads args.cpu)
    import folder_paths  # noqa: F401  (reads args.base_directory)
    import torch

    import headroom.nodes  # noqa: F401  (registers the cache folder)
    import peft  # noqa: F401  (the pack imports it at a run's first adapter layer: here once, not in every job)
    from headroom.nodes import data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from test_train_lora_nodes import _data

    torch.set_num_threads(1)
    with torch.inference_mode():
        STATE["model"], STATE["clip"], STATE["vae"], STATE["latents"], STATE["texts"] = _data("sd15")
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(640, 32, 1).args
    # Every image distinct (the synthetic shapes repeat), so every item is its own cache entry.
    images = images.clone()
    images[:, 0, 0, 0] = torch.arange(images.shape[0]) / images.shape[0]
    STATE["images"], STATE["captions"] = images, captions
    STATE["build_tiny_models"] = build_tiny_models


def job_cache(args: dict, log) -> None:
    import folder_paths
    import torch

    from headroom.nodes import cache as C
    from headroom.nodes.bridge.cache_folders import CACHE_FOLDER_NAME
    from headroom.training.data import cache_store

    cache_store.COMMIT_SECONDS = args["commit_seconds"]
    folder_paths.folder_names_and_paths[CACHE_FOLDER_NAME] = ([args["cache_dir"]], set())
    count = args["items"]
    vae = STATE["vae"]
    real_encode = vae.encode

    def encode(pixels):
        latents = real_encode(pixels)
        time.sleep(args["item_seconds"])  # a steadier pace than the tiny VAE's: kills land at known progress
        log(e="encoded")
        return latents

    vae.encode = encode
    captions = "\n".join(STATE["captions"].splitlines()[:count])
    with torch.inference_mode():
        dataset = C.HeadroomDatasetFromImages.execute(STATE["images"][:count], captions, 32, 32, "center", False,
                                                      0).args[0]
        C.HeadroomCacheLatents.execute(dataset, vae)
    log(e="done")


def job_train(args: dict, log) -> None:
    import torch

    from headroom.nodes.bridge import comfy_bridge
    from headroom.nodes import train_lora as T
    from test_train_lora_nodes import _init

    def send_event(event, data):
        if event == comfy_bridge.STEP_EVENT:
            log(e="step", step=data["step"])

    comfy_bridge.send_event = send_event
    run = _init(STATE["model"], STATE["latents"], STATE["texts"], args["run_name"], rank=args.get("rank", 8),
                batch_size=2)
    log(e="opened", step=run.step)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, args["steps"], checkpoint_every=args.get("checkpoint_every", 0),
                                     checkpoint_minutes=args.get("checkpoint_minutes", 0.0))
    log(e="done", step=run.step)


def job_disk_full(args: dict, log) -> None:
    import disk_full_cases

    disk_full_cases.run_on_tmpfs(STATE, args, log)


JOBS = {"cache": job_cache, "train": job_train, "disk_full": job_disk_full}


def start(request: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the job: its own output file, never the protocol pipe
        out = os.open(request["log"] + ".out", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        log = _log_to(request["log"])
        try:
            JOBS[request["job"]](request.get("args", {}), log)
            code = 0
        except BaseException:
            log(e="error", traceback=traceback.format_exc())
    finally:
        os._exit(code)


def main() -> None:
    setup(sys.argv[1])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "start":
            reply = {"pid": start(request)}
        elif request["op"] == "wait":
            _, status = os.waitpid(request["pid"], 0)
            reply = {"code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                     "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}
        else:
            break
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
