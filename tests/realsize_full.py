"""A full fine-tune (LoRA Config kind "full") of Flux-dev at real width (3072; one double and one single block), in a
process of its own, from a file on disk back to a file on disk through stock nodes only:

    THP_MEM_ALLOC_ENABLE=1 python tests/realsize_full.py --out result.json
    THP_MEM_ALLOC_ENABLE=1 MALLOC_MMAP_THRESHOLD_=131072 python tests/realsize_full.py --lean sdxl --out result.json
    THP_MEM_ALLOC_ENABLE=1 MALLOC_MMAP_THRESHOLD_=131072 python tests/realsize_full.py --lean sd35_large --depth 2 \
        --out result.json

(--lean: the lean options alone on a whole model; THP_MEM_ALLOC_ENABLE: huge pages for torch's large CPU tensors, as
the real-size tier runs it: tests/realsize_worker.py SCRIPT_ENV.)

stock ModelSave writes the base (as it would be downloaded) -> stock UNETLoader -> HeadroomTrainLoraInit (kind full,
every Linear inside the blocks) -> two HeadroomTrainSteps steps -> HeadroomSaveLora (the differences, "diff" keys) ->
stock LoraLoaderModelOnly -> stock ModelSave (the fine-tuned model) -> stock UNETLoader. Reported: per phase the peak
RSS; the second step's peak (the model's weights + the growth over the resident models) against the planner's
training step for this run (its trained state from planner.TrainableSpec.of_full_layers); every key of the fine-tuned file
against the base + the difference; the base file's and the shared MODEL's digests before and after. Then the lean
options on the same model (policy fused_backward, LoRA Config full_precision bf16_stochastic): two steps, the peak
against the planner's.
The captions are cached with a seeded random encoder of Flux's context width (the keys under test are the DiT's).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pathlib
import shutil
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import page_cache  # noqa: E402
from realsize_flux2 import W  # noqa: E402  (tests/realsize_worker.py, loaded once)

ARCH, DEPTH = "flux_dev", (1, 1)


def file_digest(path: pathlib.Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def release_run(run) -> None:
    """Release the run, then delete its folder: at real width it keeps two checkpoints (fp32 differences + AdamW state:
    5.4 GiB each), and the runs of one process would otherwise pile up in ComfyUI's base until it exits (24 GiB)."""
    folder = run.run_dir.path
    run.release()
    shutil.rmtree(folder)


def init_run(model, latents, texts, config, optimizer, run_name: str, policy=None):
    """HeadroomTrainLoraInit with this file's settings: batch 1, precision auto, gradient checkpointing."""
    from headroom.nodes import train_lora as T

    return T.HeadroomTrainLoraInit.execute(
        model=model, latent_cache=latents, text_cache=texts, lora_config=config, optimizer_config=optimizer,
        run_name=run_name, seed=0, batch_size=1, grad_accumulation=1, precision="auto", max_grad_norm=1.0,
        caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
        gradient_checkpointing=True, checkpoint_depth=1, holdout=0, policy=policy).args[0]


def train_two_steps(model, latents, texts, config, optimizer, run_name: str, policy, report: dict, phase: str = ""
                    ) -> dict:
    """Init + one step, then a second step, each phase's peak in report["phases"] (named after `phase`); the second
    step holds what every later one does (fused backward makes each tensor's optimizer state as its gradient arrives,
    so the first step never holds all of it beside the activations). Returns the run's figures; the run is released."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.planning import lora_trainable

    with W.Peak() as peak:
        run = init_run(model, latents, texts, config, optimizer, run_name, policy)
        T.HeadroomTrainSteps.execute(run, 1)
    report["phases"].append(peak.record(f"{phase}init + first step"))
    with W.Peak() as peak:
        loss = float(T.HeadroomTrainSteps.execute(run, 2).args[1])
    report["phases"].append(peak.record(f"{phase}second step"))
    params = list(run.adapters.parameters())
    latest = run.run_dir.path / json.loads((run.run_dir.path / "latest.json").read_text())["checkpoint"]
    figures = {"checkpoint_bytes": sum(f.stat().st_size for f in latest.iterdir()),
               "planned_checkpoint_bytes": lora_trainable(model, config, optimizer.name).checkpoint_bytes(),
               "loss": loss, "s_per_step": peak.seconds, "dtypes": sorted({str(p.dtype) for p in params}),
               "trained_params": run.adapters.parameter_count(), "tensors": len(params),
               "trained_tensors": sum(int(bool(torch.any(p != 0))) for p in params),
               "most_gradients_alive": run.trainer.optimizer.most_gradients_alive,
               "param_devices": sorted({p.device.type for p in params}),
               # the trained weights the run keeps in host RAM (trained_weights host: all but the card blocks')
               "params_in_host_ram": sum(p.numel() for p in run.adapters.parameters_in_host_ram())
               if policy.trained_weights == "host" else 0}
    release_run(run)
    del run
    gc.collect()
    return figures


def run(size: int = 64) -> dict:
    import comfy.model_management as mm
    import folder_paths
    import nodes
    import realsize_models as R
    from comfy_extras.nodes_model_merging import ModelSave
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T
    from headroom.nodes.bridge.cache_folders import open_store
    from headroom.nodes.bridge.planning import describe_comfy_model, lora_trainable
    from headroom.training.data.cache_store import cache_text
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    spec = R.ARCHITECTURES[ARCH]
    report = {"arch": ARCH, "depth": list(DEPTH), "size": size, "phases": []}
    models = pathlib.Path(folder_paths.get_folder_paths("diffusion_models")[0])
    models.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        with W.Peak() as peak:
            built = R.build_model(ARCH, DEPTH)
            ModelSave().save(built, "diffusion_models/realsize_full_base")
            base_file = next(pathlib.Path(folder_paths.get_output_directory()).glob(
                "diffusion_models/realsize_full_base_*.safetensors"))
            base_file = base_file.replace(models / base_file.name)  # where a downloaded model lives
            del built
        report["phases"].append(peak.record("build + stock ModelSave (base file)"))
        gc.collect()
        base_digest = file_digest(base_file)
        with W.Peak() as peak:
            model = nodes.UNETLoader().load_unet(base_file.name, "default")[0]
            vae = R.build_vae(spec["latent_channels"])
        report["phases"].append(peak.record("load (stock UNETLoader)"))
    diffusion = model.model.diffusion_model
    base = {k: v.detach().clone() for k, v in diffusion.state_dict().items()}
    model_digest = W.weights_digest(diffusion)
    report.update(diffusion_params=sum(p.numel() for p in diffusion.parameters()),
                  diffusion_bytes=R.tensor_bytes(diffusion), diffusion_dtype=str(model.model.get_dtype()))
    context = spec["unet_config"]["context_in_dim"]

    def encode(text: str) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(len(text))
        return {"cross_attn": torch.randn(spec["text_tokens"], context, generator=generator),
                "pooled_output": torch.randn(spec["unet_config"]["vec_in_dim"], generator=generator)}

    with torch.inference_mode():
        images, caption_text, _ = data_nodes.HeadroomSyntheticDataset.execute(2, size, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, caption_text, size, 64, "center", False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts, _ = cache_text(caption_text.splitlines(), open_store("text"), encode, f"random-{ARCH}-{context}",
                              {"tokens": spec["text_tokens"]})
        del vae
        gc.collect()
        config = T.HeadroomLoraConfig.execute("full", 16, 16.0, "all_linear", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-5, 0.0, "constant", 0, 100).args[0]
        report["baseline_rss_bytes"] = W.rss()
        with W.Peak() as peak:
            run = init_run(model, latents, texts, config, optimizer, "realsize_full")
        report["phases"].append(peak.record("init (HeadroomTrainLoraInit)"))
        with W.Peak() as peak:
            T.HeadroomTrainSteps.execute(run, 1)
        report["phases"].append(peak.record("training"))
        # The second step holds what every later one does: AdamW's state (made in the first step's optimizer step,
        # after its activations were gone) beside the activations and gradients: the step the planner plans.
        with W.Peak() as peak:
            loss = T.HeadroomTrainSteps.execute(run, 2).args[1]
        report["phases"].append(peak.record("second step"))
        report["loss"], report["s_per_step"] = float(loss), peak.seconds
        # The checkpoint that call ended with (GB of AdamW state and trained weights): left the page cache as written
        latest = run.run_dir.path / json.loads((run.run_dir.path / "latest.json").read_text())["checkpoint"]
        report["checkpoint_bytes"] = sum(f.stat().st_size for f in latest.iterdir())
        report["checkpoint_cached_bytes"] = sum(page_cache.cached_bytes(f) for f in latest.iterdir())
        # A disk with room for these two checkpoints but not a third: the next save removes the older first, sized
        # from the latest folder (run_dir.RunDir._make_room; GBs here). Asked with the free space faked, no third
        # checkpoint written.
        from headroom.training.core import run_dir as R
        real_free, R.free_bytes = R.free_bytes, lambda path: report["checkpoint_bytes"] // 2
        try:
            run.run_dir._make_room(latest.parent, 3, report["checkpoint_bytes"])
        finally:
            R.free_bytes = real_free
        report["made_room"] = [sorted(p.name for p in latest.parent.iterdir()), latest.name, run.run_dir.room_note]
        adapter = run.config.adapter
        report["trained_params"] = run.adapters.parameter_count()
        report["planned_params"] = lora_trainable(model, adapter, "AdamW").param_count
        # what Init checked the disk's room with (nodes/bridge/model_files.check_disk_room)
        report["planned_checkpoint_bytes"] = lora_trainable(model, adapter, "AdamW").checkpoint_bytes()
        report["planned_save_bytes"] = lora_trainable(model, adapter, "AdamW").save_bytes()  # the Memory Plan's
        report["layers"] = len(run.adapters.layers)
        # what the all-in-one nodes size their saves with before one is on disk (model_files.saves_room_note)
        report["save_bytes_estimate"] = run.trained.save_bytes(run)
        with W.Peak() as peak:
            name = T.HeadroomSaveLora.execute(run, "realsize", "realsize_full_difference", "fp32").args[0]
        report["phases"].append(peak.record("save (differences)"))
        report["saved_bytes"] = os.path.getsize(folder_paths.get_full_path("loras", name))
        differences = dict(run.adapters.differences())  # {"<layer>.weight" | "<layer>.bias": W' - W}, fp32
        release_run(run)
        del run
        gc.collect()
        # The lean options on the same model: fused backward (policy) and the bf16 difference (LoRA Config).
        lean_config = T.HeadroomLoraConfig.execute("full", 16, 16.0, "all_linear", False, 0.0, 0,
                                                   full_precision="bf16_stochastic").args[0]
        report["lean_baseline_rss_bytes"] = W.rss()
        lean = train_two_steps(model, latents, texts, lean_config, optimizer, "realsize_full_lean",
                               OffloadPolicy(fused_backward=True), report, "fused backward + bf16 difference: ")
        report.update({f"lean_{name}": value for name, value in lean.items()})
        with W.Peak() as peak:
            patched = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
            report["patched_weights"] = len(patched.patches)
            ModelSave().save(patched, "diffusion_models/realsize_full_tuned")
            del patched
            mm.unload_all_models()
        report["phases"].append(peak.record("stock LoraLoaderModelOnly + ModelSave"))
        gc.collect()
        tuned_file = next(pathlib.Path(folder_paths.get_output_directory()).glob(
            "diffusion_models/realsize_full_tuned_*.safetensors"))
        tuned_file = tuned_file.replace(models / tuned_file.name)
        with W.Peak() as peak:
            tuned = nodes.UNETLoader().load_unet(tuned_file.name, "default")[0]
        report["phases"].append(peak.record("load the fine-tuned file (stock UNETLoader)"))
    weights = tuned.model.diffusion_model.state_dict()
    changed, unchanged, worst = 0, 0, 0.0
    for key, weight in weights.items():
        difference = differences.get(key)
        if difference is None:
            unchanged += int(torch.equal(weight, base[key]))
            continue
        expected = base[key].float() + difference
        # ComfyUI rounds the patched fp32 weight to the stored bf16 stochastically: within one bf16 step of it.
        step = expected.abs().clamp_min(torch.finfo(torch.float32).tiny) * 2.0 ** -7
        worst = max(worst, ((weight.float() - expected).abs() / step).max().item())
        changed += 1
    report.update(keys_match=weights.keys() == base.keys(), total_keys=len(weights), changed_keys=changed, unchanged_keys=unchanged,
                  difference_keys=len(differences), worst_error_in_bf16_steps=worst,
                  tuned_dtype=str(tuned.model.get_dtype()),
                  base_file_unchanged=file_digest(base_file) == base_digest,
                  base_model_unchanged=W.weights_digest(diffusion) == model_digest)
    del tuned, weights
    gc.collect()
    # Last, as it runs forwards of the model: the planner's training step for this run (what the Init node plans with).
    tokens = int(texts.conditioning(latents.text_key(0))["cross_attn"].shape[0])
    description = describe_comfy_model(model, adapter, "fp32", tokens)
    plan = planner.estimate(description, lora_trainable(model, adapter, "AdamW"), planner.RunShape(1, size, size, tokens),
                            OffloadPolicy(checkpointing="blocks"))
    step = next(p for p in plan.phases if p.phase == "training step")
    report["planned_training_bytes"], report["planned_training_items"] = step.total, dict(step.items)
    lean_plan = planner.estimate(description, lora_trainable(model, lean_config, "AdamW"),
                                 planner.RunShape(1, size, size, tokens),
                                 OffloadPolicy(checkpointing="blocks", fused_backward=True))
    step = next(p for p in lean_plan.phases if p.phase == "training step")
    report["lean_planned_training_bytes"], report["lean_planned_training_items"] = step.total, dict(step.items)
    return report


def run_lean(arch: str, depth: int | None = None, size: int = 64, trained_weights: str = "device",
             card_blocks: str = "") -> dict:
    """The lean full fine-tune alone on a whole model (`--lean sdxl`: SDXL at full size, 2.6 B weights, every one of
    its Linear and Conv2d layers inside the blocks trained): policy fused_backward, LoRA Config full_precision
    bf16_stochastic, Adafactor; two steps, the second's peak (weights + RSS growth) against the planner's step.
    `trained_weights` host: the difference and the optimizer state in host RAM (policy trained_weights host,
    optimizer_state cpu); on a CPU the device is the host, so the planned step is the device's plus the host RAM the
    plan adds in it. In the real-size tier (tests/realsize/test_full_finetune_pieces.py) and
    docs/benchmarks/full_finetune.md."""
    import realsize_models as R
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T
    from headroom.nodes.bridge.planning import describe_comfy_model, lora_trainable
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    report = {"arch": arch, "depth": depth, "size": size, "trained_weights": trained_weights,
              "card_blocks": card_blocks, "phases": []}
    with W.Peak() as peak:
        model, clip, vae = R.build_family(arch, depth, 2, 0)
    report["phases"].append(peak.record("build (realsize_models)"))
    diffusion = model.model.diffusion_model
    report.update(diffusion_params=sum(p.numel() for p in diffusion.parameters()),
                  diffusion_bytes=R.tensor_bytes(diffusion), diffusion_dtype=str(model.model.get_dtype()))
    with torch.inference_mode():
        images, caption_text, _ = data_nodes.HeadroomSyntheticDataset.execute(2, size, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, caption_text, size, 64, "center", False, 0).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
    del clip, vae
    gc.collect()
    with torch.inference_mode():
        config = T.HeadroomLoraConfig.execute("full", 16, 16.0, "all_layers", False, 0.0, 0,
                                              full_precision="bf16_stochastic").args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("Adafactor", 1e-6, 0.0, "constant", 0, 100).args[0]
        policy = OffloadPolicy(fused_backward=True, **({} if trained_weights == "device" else dict(
            optimizer_state="cpu", trained_weights="host", trained_weights_card_blocks=card_blocks)))
        report["baseline_rss_bytes"] = W.rss()
        report.update(train_two_steps(model, latents, texts, config, optimizer, f"realsize_full_lean_{arch}", policy,
                                      report))
    tokens = int(texts.conditioning(latents.text_key(0))["cross_attn"].shape[0])
    description = describe_comfy_model(model, config, "fp32", tokens)
    trainable = lora_trainable(model, config, "Adafactor")
    plan = planner.estimate(description, trainable, planner.RunShape(1, size, size, tokens),
                            policy.replace(checkpointing="blocks"))
    step = next(p for p in plan.phases if p.phase == "training step")
    host_added = plan.host_added.get("training step", {}) if trained_weights == "host" else {}
    report.update(planned_params=trainable.param_count, planned_training_bytes=step.total + sum(host_added.values()),
                  planned_device_bytes=step.total, planned_training_items=dict(step.items),
                  planned_host_added_items=dict(host_added))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--lean", metavar="ARCH", help="only the lean full fine-tune of this whole model (run_lean)")
    parser.add_argument("--depth", type=int, default=None, help="--lean: the model's blocks at real width (default: "
                        "all of them; realsize_models.build_model)")
    parser.add_argument("--trained-weights", choices=("device", "host"), default="device",
                        help="--lean: the Offload Policy's trained_weights (host: with optimizer_state cpu)")
    parser.add_argument("--card-blocks", default="", help="--lean with --trained-weights host: the Offload Policy's "
                        "trained_weights_card_blocks (these blocks' trained weights kept on the device)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or int(os.environ.get("HEADROOM_TORCH_THREADS", 0)) or os.cpu_count() or 1)
    W.setup()
    started = time.perf_counter()
    report = run_lean(args.lean, args.depth, trained_weights=args.trained_weights, card_blocks=args.card_blocks) \
        if args.lean else run()
    report["seconds"] = time.perf_counter() - started
    W.write_report(args.out, report)


if __name__ == "__main__":
    main()
