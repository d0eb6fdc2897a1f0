#!/usr/bin/env python3
"""Train a LoRA data-parallel on several GPUs / nodes (or CPU processes), headless, with ComfyUI as a library.

    torchrun --nproc-per-node N workflows/headroom_train_distributed.py --checkpoint MODEL.safetensors \\
        --dataset IMAGE_FOLDER --run-name NAME --steps 1000 [--comfyui PATH] [--base-directory DIR] ...
    accelerate launch --multi_gpu --num_processes N workflows/headroom_train_distributed.py ...   (GPUs; the same
    arguments; on CPUs use torchrun: accelerate's multi-CPU mode goes through mpirun, whose variables this does not read)
    (multi-node: torchrun --nnodes M --node-rank K --rdzv-endpoint HOST:PORT ..., every node seeing the same
    --base-directory, e.g. on a shared file system)

Every rank loads the checkpoint file with ComfyUI's own loader (comfy.sd.load_checkpoint_guess_config) and runs the
same Headroom nodes a workflow runs: Dataset From Folder -> Cache Latents / Cache Text -> Train LoRA: Init -> Train
Steps. Rank 0 goes first (it fills the caches and creates the run folder under <base>/output/headroom_runs/), the
other ranks then open the same caches (all hits) and run folder; only rank 0 writes checkpoints and saves the LoRA
(<base>/models/loras/<subfolder>/). The run is an ordinary run: ComfyUI's Train LoRA: Init with the same run name
continues it on one GPU, and this script continues it at any number of ranks with the same global batch.

Each rank trains batch_size / world_size items of every batch (docs/DISTRIBUTED.md). CUDA: NCCL, rank on
cuda:LOCAL_RANK; otherwise gloo on the CPU. ComfyUI is found as the tests find it ($COMFYUI_PATH, ~/comfy/ComfyUI)
unless --comfyui names it.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--checkpoint", help="a checkpoint file (model + CLIP + VAE), loaded by ComfyUI's own "
                       "comfy.sd.load_checkpoint_guess_config as Load Checkpoint does")
    model.add_argument("--tiny-model", help="a family's built-in tiny model with its shipped weights (tests, demos)")
    p.add_argument("--dataset", required=True, help="a folder of images with .txt captions")
    p.add_argument("--run-name", required=True)
    p.add_argument("--steps", type=int, required=True, help="train the run to this step")
    p.add_argument("--comfyui", default=None, help="the ComfyUI checkout (default: $COMFYUI_PATH, ~/comfy/ComfyUI)")
    p.add_argument("--base-directory", default=None, help="ComfyUI's base directory (models/, output/); default: "
                   "the ComfyUI checkout's own")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--bucket-step", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4, help="the global batch of a micro-step (all ranks together)")
    p.add_argument("--grad-accumulation", type=int, default=1)
    p.add_argument("--rank-batch", type=int, default=None, help="at most this many items per forward / backward on "
                   "a rank (default: its whole share, batch_size / world size); the rest of its share accumulates")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--schedule-steps", type=int, default=1000, help="the LR schedule's length (part of the run's "
                   "configuration: keep it when continuing a run)")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--kind", default="lora", help="the LoRA Config's kind: lora, ..., or full (a full fine-tune: each "
                   "rank keeps the optimizer state of its share of the weights, docs/FULL_FINETUNE.md)")
    p.add_argument("--shard-weights", action="store_true", help="a full fine-tune (--kind full, --optimizer AdamW): "
                   "each rank keeps 1/N of the trained weights, their gradients and optimizer state (torch's FSDP2, "
                   "docs/DISTRIBUTED.md); without it only the optimizer state is shared out")
    p.add_argument("--optimizer", default="AdamW", help="the Optimizer Config's optimizer")
    p.add_argument("--targets", default="preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: off)")
    p.add_argument("--checkpoint-minutes", type=float, default=10.0, help="minutes between checkpoints (0: off)")
    p.add_argument("--save-subfolder", default="headroom", help="under models/loras/; '' to skip saving the LoRA")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a rank waits for a silent one")
    return p.parse_args(argv)


def import_comfyui(comfyui: str | None, base_directory: str | None, cpu: bool) -> None:
    if comfyui is None:
        sys.path.insert(0, str(REPO / "tests"))
        from comfy_harness import find_comfyui

        path, how = find_comfyui()
        if path is None:
            sys.exit(f"headroom_train_distributed: {how}")
        comfyui = str(path)
    sys.path.insert(0, comfyui)
    import comfy.options

    comfy.options.enable_args_parsing(False)
    from comfy.cli_args import args

    args.cpu = cpu
    if base_directory:
        args.base_directory = base_directory
    import comfy.model_management
    import folder_paths

    if "headroom" not in sys.modules:  # this repository as the package ComfyUI would load it as
        spec = importlib.util.spec_from_file_location("headroom", REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["headroom"] = module
        spec.loader.exec_module(module)


def load_models(options):
    """(MODEL, CLIP, VAE) through ComfyUI's loader, or a tiny model through ComfyUI's classes."""
    import comfy.sd
    import folder_paths

    if options.tiny_model:
        from headroom.nodes.bridge.tiny_models import WEIGHTS, build_tiny_models

        return build_tiny_models(options.tiny_model, 0, "pretrained" if options.tiny_model == "sd15" else WEIGHTS[0])
    path = str(pathlib.Path(options.checkpoint).resolve())
    model, clip, vae, _ = comfy.sd.load_checkpoint_guess_config(
        path, output_vae=True, output_clip=True, embedding_directory=folder_paths.get_folder_paths("embeddings"))
    return model, clip, vae


def open_run(options):
    """Load the model, cache the dataset and open the run, through ComfyUI's loader and Headroom's nodes."""
    import torch
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes import train_lora as T

    with torch.inference_mode():  # as ComfyUI runs nodes
        model, clip, vae = load_models(options)
        dataset = cache_nodes.HeadroomDatasetFromFolder.execute(options.dataset, options.resolution,
                                                                options.bucket_step, "center", False, options.seed,
                                                                False).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        lora = T.HeadroomLoraConfig.execute(options.kind, options.lora_rank, float(options.lora_rank), options.targets,
                                            False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute(options.optimizer, options.lr, 0.0, "constant", 0, options.schedule_steps).args[0]
        return T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=optimizer,
            run_name=options.run_name, seed=options.seed, batch_size=options.batch_size,
            grad_accumulation=options.grad_accumulation, precision=options.precision, max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0).args[0]


def train_and_save(options, rank: int, world: int, device, parallel, say) -> None:
    """Open the run (rank 0 first), train it to options.steps and save what it trained: the run and everything
    holding it end with this call."""
    import torch
    from headroom.nodes import train_lora as T

    # Rank 0 first: it writes the caches and the run folder; the others then read them.
    if parallel is not None and rank != 0:
        parallel.barrier("wait for rank 0 to open the run")
    run = open_run(options)
    if parallel is not None and rank == 0:
        parallel.barrier("wait for rank 0 to open the run")
    run.trainer.rank_batch = options.rank_batch
    state = (f"; weights, gradients and optimizer state sharded over {world} ranks (FSDP2)"
             if run.trainer.shards_weights else
             f"; optimizer state sharded over {world} ranks" if run.trainer.sharded else "")
    say(f"run '{options.run_name}' at step {run.step} on {device}; training to {options.steps}{state}")
    first, train_started = run.step, time.perf_counter()
    with torch.inference_mode():
        _, loss, step = T.HeadroomTrainSteps.execute(run, options.steps, options.checkpoint_every,
                                                     options.checkpoint_minutes).args
    seconds = time.perf_counter() - train_started
    say(f"step {step}, loss {loss:.9g}; {step - first} steps in {seconds:.2f} s "
        f"({seconds / max(step - first, 1):.4f} s/step, with the final checkpoint)")
    if options.save_subfolder:
        from headroom.training.memory import sharded_weights

        # Sharded weights (FSDP2): every rank gathers the whole difference for rank 0 to write.
        layers = run.adapters.layers.values() if run.trainer.shards_weights else ()
        with sharded_weights.whole(layers), torch.inference_mode():
            if rank == 0:
                path = T.HeadroomSaveLora.execute(run, options.save_subfolder, "", "fp32").args[0]
                say(f"saved {path}")
        if run.trainer.shards_weights:
            parallel.barrier("wait for rank 0 to save the difference")


def main(argv=None) -> int:
    options = parse_args(argv)
    if os.path.isabs(options.dataset):  # the command line's owner allows its own folder (nodes/cache.py roots)
        roots = os.environ.get("HEADROOM_DATASET_ROOTS", "")
        os.environ["HEADROOM_DATASET_ROOTS"] = os.pathsep.join(filter(None, [roots, os.path.dirname(options.dataset)]))
    rank, world, local_rank = (int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)))
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)  # before ComfyUI picks its device (the current one)
    import_comfyui(options.comfyui, options.base_directory, cpu=not cuda)
    from headroom.training import os_compat

    problem = os_compat.several_devices_problem("Run one process, or train in ComfyUI on one GPU") if world > 1 else None
    if problem:  # torch's own error would be about NCCL
        print(f"headroom_train_distributed: {problem}", file=sys.stderr)
        return 2
    from headroom.training.core import distributed

    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world > 1:
        distributed.init(rank, world, device, timeout_s=options.timeout, shard_weights=options.shard_weights)
    parallel = distributed.DataParallel.current()
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[rank {rank}/{world} {time.monotonic() - started:7.1f}s] {message}", flush=True)

    train_and_save(options, rank, world, device, parallel, say)
    if world > 1:
        # FSDP2's per-layer state sits in reference cycles with the run's modules: left to the interpreter's teardown,
        # what holds the group's tensors was destroyed while Python was shutting down, and a rank that had finished
        # could abort there ("terminate called without an active exception", once in ~200 runs on a loaded machine),
        # so torchrun failed a finished run. Collected here, while the group and the interpreter are whole.
        gc.collect()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Everything is saved and said: a rank of several ends without the interpreter's teardown, where a finished
        # rank could still abort now and then (C++ threads destroyed at exit: "terminate called without an active
        # exception", seen in the tests' own rank worker, tests/distributed_worker.py) and torchrun would fail the
        # run. A rank whose run raised exits through its traceback as before.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
