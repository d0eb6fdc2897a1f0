"""One real-size model through Headroom's nodes, in a process of its own, as a workflow runs them.

    python tests/realsize_worker.py sdxl --out result.json [--size 64 --steps 2 --no-checkpointing --planner]

Run by the real-size tier (tests/realsize/test_realsize.py) and bench/bench_realsize.py, each model in a fresh process so
that its peak RSS is its own. The flow:

1. the MODEL / CLIP / VAE at real size (tests/realsize_models.py), made under inference mode as ComfyUI's loaders
   make them; SDXL and Flux are written with ComfyUI's own save code (comfy.sd.save_checkpoint) into the throw-away
   base directory and loaded back with the stock CheckpointLoaderSimple (SDXL: UNet + CLIP-L/G + VAE) or
   UNETLoader (Flux), the path users take from a file on disk. ComfyUI runs as with `--cpu --bf16-unet`: bf16
   storage, computed in fp32 through its manual cast;
2. HeadroomSyntheticDataset -> HeadroomDatasetFromImages -> HeadroomCacheLatents + HeadroomCacheText ->
   HeadroomTrainLoraInit (precision auto) -> HeadroomTrainSteps -> HeadroomValidate (a tiny sample) ->
   HeadroomSaveLora -> the stock LoraLoader;
3. the report: weight bytes, the RSS before the nodes ran (every model resident), each phase's peak RSS (the run's
   own memory record, plus init and the stock loaders), s/step, the LoRA keys the stock loader mapped and the ones
   it did not, whether the base weights are bitwise unchanged, and optionally the planner's estimate per phase.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import logging
import os
import pathlib
import platform
import time

import torch

from comfy_harness import import_comfyui_in_process, register_module

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
GIB = 1024 ** 3
# The environment the real-size tier starts its scripts with (this worker, realsize_full.py, realsize_flux2.py,
# realsize_keys.py). They allocate and free GiBs per step (fp32 casts of bf16 weights, gradients, optimizer
# temporaries), each a fresh mmap page-faulting per 4 KiB: the lean SD1.5 full fine-tune spent as long in the kernel as
# in torch. torch's CPU allocator asks for transparent huge pages for tensors of 2 MiB or more with THP_MEM_ALLOC_ENABLE
# (the kernel's default mode, madvise, honours it; where it offers none the variable does nothing): that run took 137 s
# instead of 168 with the same memory ratio (1.011), the ideogram4 nodes case 105 s instead of 115 with the same phase
# peaks.
SCRIPT_ENV = {"PYTHONUNBUFFERED": "1", "THP_MEM_ALLOC_ENABLE": "1"}


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str  # tests/realsize_models.ARCHITECTURES
    depth: object  # None: full size; SD3.5: joint blocks; Flux: (double, single) blocks
    t5_layers: int  # T5-XXL encoder layers at real width (ignored without T5)
    loader: str | None  # "checkpoint" (CheckpointLoaderSimple), "unet" (UNETLoader) or None (built in memory)


CASES = {
    "sdxl": Case("sdxl", None, 0, "checkpoint"),
    "flux_dev": Case("flux_dev", (2, 2), 2, "unet"),
    "sd35_large": Case("sd35_large", 3, 2, None),
    # Real width: Z-Image one main block (and its 2 + 2 refiner blocks), Qwen-Image two blocks; their Qwen LLM encoders
    # at real width with 3 layers (Z-Image reads the penultimate, which ComfyUI allows from 3 layers) / 1 layer
    # (Qwen-Image reads the last).
    "zimage": Case("zimage", 1, 3, None),
    "qwen_image": Case("qwen_image", 2, 1, None),
    # Krea 2: real width (6144, 48 + 12 KV heads of 128; text fusion at 2560), one of its 28 blocks; Qwen3-VL-4B at real
    # width with 1 layer, its 12 taps repeated from the 2 hidden states it has (tests/realsize_models.py).
    "krea2": Case("krea2", 1, 1, None),
    # Ideogram 4: real width (4608 = 18 heads of 256, FFN 12288, the 53248-wide text projection), two of its 34 blocks
    # (at one, the fp32 cast of the 245 M-entry text projection alone is as large as all the bf16 weights: the "second
    # copy" bound); Qwen3-VL-8B's language model at real width with 1 layer, its 13 taps repeated from the 2 hidden
    # states it has.
    "ideogram4": Case("ideogram4", 2, 1, None),
    # HiDream-O1: real width (Qwen3-VL-8B's 4096, 32 + 8 KV heads of 128, its full vocabulary), 1 of 36 decoder layers
    # and 1 of 27 vision blocks; no text encoder weights, no VAE (pixels).
    "hidream_o1": Case("hidream_o1", 1, 0, None),
}


def setup() -> pathlib.Path:
    """ComfyUI in-process on the CPU with a throw-away base directory, as `main.py --cpu --bf16-unet`; the
    package as `headroom` (as tests/conftest.py registers it)."""
    base = import_comfyui_in_process()
    from comfy.cli_args import args

    args.bf16_unet = True  # a CPU otherwise loads bf16 files as fp32 (twice the RAM): what low-RAM users pass
    register_module("headroom", REPO_ROOT / "__init__.py", package=True)
    register_module("realsize_models", TESTS_DIR / "realsize_models.py")
    return base


def rss() -> int:
    from headroom.training.memory.memory_stats import process_rss_bytes

    return int(process_rss_bytes())


class Peak:
    """Peak RSS of a stretch of work (the kernel's high-water mark, reset at the start)."""

    def __enter__(self):
        from headroom.training.memory.memory_stats import reset_peak

        gc.collect()
        self.start_rss = rss()
        if not reset_peak("cpu"):
            raise RuntimeError("this kernel cannot reset the peak RSS (/proc/self/clear_refs): no per-phase peaks")
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc):
        from headroom.training.memory.memory_stats import process_peak_rss_bytes

        self.seconds = time.perf_counter() - self.started
        self.peak_rss = process_peak_rss_bytes()
        return False

    def record(self, phase: str) -> dict:
        return {"phase": phase, "seconds": self.seconds, "peak_rss_bytes": self.peak_rss, "start_rss_bytes": self.start_rss}


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of every weight's name, dtype, shape and bytes (no copy of the weights is made)."""
    from headroom.training.data.cache_store import tensor_digest

    hasher = hashlib.sha256()
    for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
        hasher.update(f"{name}|{tensor_digest(tensor)}\n".encode())
    return hasher.hexdigest()


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def load_models(case: Case, base: pathlib.Path, seed: int = 0):
    """(MODEL, CLIP, VAE, records of the build / save / load phases)."""
    import comfy.sd
    import folder_paths
    import nodes
    import realsize_models as R

    records = []
    spec = R.ARCHITECTURES[case.arch]
    with torch.inference_mode():
        if case.loader == "checkpoint":
            with Peak() as peak:
                model, clip, vae = R.build_family(case.arch, case.depth, case.t5_layers, seed)
            records.append(peak.record("build (realsize_models)"))
            path = pathlib.Path(folder_paths.get_folder_paths("checkpoints")[0]) / f"realsize_{case.arch}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            with Peak() as peak:
                comfy.sd.save_checkpoint(str(path), model, clip, vae)
            records.append({**peak.record("save (comfy.sd.save_checkpoint)"), "file_bytes": path.stat().st_size})
            del model, clip, vae
            gc.collect()
            with Peak() as peak:
                model, clip, vae = nodes.CheckpointLoaderSimple().load_checkpoint(path.name)[:3]
            records.append(peak.record("load (stock CheckpointLoaderSimple)"))
        elif case.loader == "unet":
            with Peak() as peak:
                model = R.build_model(case.arch, case.depth, seed)
            records.append(peak.record("build (realsize_models)"))
            path = pathlib.Path(folder_paths.get_folder_paths("diffusion_models")[0]) / f"realsize_{case.arch}.safetensors"
            path.parent.mkdir(parents=True, exist_ok=True)
            with Peak() as peak:
                comfy.sd.save_checkpoint(str(path), model)  # what the stock ModelSave node writes
            records.append({**peak.record("save (comfy.sd.save_checkpoint)"), "file_bytes": path.stat().st_size})
            del model
            gc.collect()
            with Peak() as peak:
                model = nodes.UNETLoader().load_unet(path.name, "default")[0]
            records.append(peak.record("load (stock UNETLoader)"))
            clip = R.build_clip(spec["text_encoder"], case.t5_layers, seed + 1)
            vae = R.build_vae(spec["latent_channels"], seed + 2, spec.get("vae"))
        else:
            with Peak() as peak:
                model, clip, vae = R.build_family(case.arch, case.depth, case.t5_layers, seed)
            records.append(peak.record("build (realsize_models)"))
    return model, clip, vae, records


def run_case(name: str, size: int, steps: int, checkpointing: bool, planner_estimate: bool, count: int = 2) -> dict:
    base = setup()
    import comfy.model_management as mm
    import nodes
    import realsize_models as R
    from headroom.nodes import cache as cache_nodes, data as data_nodes, train_lora as T
    from headroom.nodes.bridge import families

    case = CASES[name]
    torch.manual_seed(0)
    model, clip, vae, records = load_models(case, base)
    diffusion = model.model.diffusion_model
    report = {
        "case": name, "arch": case.arch, "depth": case.depth, "t5_layers": case.t5_layers, "loader": case.loader,
        "size": size, "steps": steps, "gradient_checkpointing": checkpointing, "images": count,
        "diffusion_params": sum(p.numel() for p in diffusion.parameters()),
        "diffusion_bytes": R.tensor_bytes(diffusion), "diffusion_dtype": str(model.model.get_dtype()),
        "manual_cast_dtype": str(model.model.manual_cast_dtype),
        "text_encoder_bytes": R.tensor_bytes(clip.cond_stage_model), "vae_bytes": R.tensor_bytes(vae.first_stage_model),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
        "phases": records,
    }
    base_digest = weights_digest(diffusion)
    gc.collect()
    report["baseline_rss_bytes"] = rss()  # every model resident, before any Headroom node ran

    captions = []
    with torch.inference_mode():  # as ComfyUI runs nodes
        images, caption_text, shapes = data_nodes.HeadroomSyntheticDataset.execute(count, size, 0).args
        tagged = name in TAG_CASES
        if tagged:  # tag captions ('ohwx, a, red, circle, ...'), cached in several tag orders (some tags left out)
            caption_text = "\n".join(", ".join(["ohwx", *line.split()]) for line in caption_text.splitlines())
        captions = caption_text.splitlines()
        if name in ALPHA_CASES:
            dataset = cutout_dataset(images, captions, shapes[..., 0], name)
        else:
            dataset = cache_nodes.HeadroomDatasetFromImages.execute(
                images, caption_text, size, 64, "center", False, 0,
                extra_resolutions=str(EXTRA_SIZE_CASES.get(name, "")),
                upscale_small_images=name not in NO_UPSCALE_CASES,
                min_bucket_side=BUCKET_SIDES_CASES.get(name, (0, 0))[0],
                max_bucket_side=BUCKET_SIDES_CASES.get(name, (0, 0))[1]).args[0]
            report["bucket_sides"] = list(dataset.bucket_sides)
        latents, summary = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args
        report["enlarged_note"] = [line for line in summary.splitlines() if "smaller than their bucket" in line]
        if name in ALPHA_CASES:  # each cached mask at the latent's size, its mean the alpha's (area averaging)
            report["alpha_masks"] = [
                {"mask": list(latents.mask(i).shape), "latent": list(latents.latent(i).shape),
                 "mean": float(latents.mask(i).mean()), "alpha_mean": float(shapes[i, ..., 0].mean())}
                if latents.mask(i) is not None else None for i in range(len(latents))]
        report["buckets"] = {"x".join(map(str, bucket)): len(items) for bucket, items in latents.buckets.items()}
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip, tag_shuffles=TAG_SHUFFLES if tagged else 0,
                                                      tag_dropout=TAG_DROPOUT if tagged else 0.0).args[0]
        if tagged:
            report["tag_orders"] = tag_orders_report(clip, latents, texts, captions)
        lora = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
        if name in LAYERS_CASES:
            report["layers_filter"] = layers_report(model, LAYERS_CASES[name])
        optimizer = T.HeadroomOptimizerConfig.execute(
            "AdamW", 1e-4, 0.0, "constant", 0, 100, loraplus_lr_ratio=LORAPLUS_RATIO if name in LORAPLUS_CASES else 1.0,
            scale_weight_norms=SCALE_NORMS_CASES.get(name, 0.0)).args[0]
        with Peak() as peak:
            init = T.HeadroomTrainLoraInit.execute(
                model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=optimizer,
                run_name=f"realsize_{name}", seed=0, batch_size=1, grad_accumulation=1, precision="auto",
                max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
                min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=checkpointing, checkpoint_depth=1,
                holdout=0, masked_out_weight=ALPHA_MASKED_OUT_WEIGHT if name in ALPHA_CASES else 0.0)
        init_record = peak.record("init (HeadroomTrainLoraInit)")
        run = init.args[0]
        report["precision"] = run.trainer.config.precision
        report["masked_out_weight"] = run.trainer.config.objective.masked_out_weight
        # LoRA+: the optimizer's groups (rate, tensors, of them the up matrices) over the real layer names
        ups = _up_matrices(run)
        report["lr_groups"] = [(group["lr"], len(group["params"]), sum(id(p) in ups for p in group["params"]))
                               for group in run.trainer.optimizer.param_groups]
        # The Init node's text: the run it opened, then its notes, the precision note among them.
        report["precision_note"] = next(line for line in init.ui.as_dict()["text"][0].splitlines() if "precision" in line)
        started = time.perf_counter()
        loss = T.HeadroomTrainSteps.execute(run, steps).args[1]
        report["train_seconds"] = time.perf_counter() - started
        report["loss"] = float(loss)
        if name in SCALE_NORMS_CASES:
            report["norms"] = {"shown": run.trainer.last_norms.tolist(), "formed": formed_norms(run)}
        # One sampling step without CFG: the validation path (placement, sampler, VAE decode) at real width once; each
        # further step or CFG pass is another full forward on the CPU and shows nothing new about memory.
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts=captions[0], negative="", sample_seed=0,
                                   sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="simple", width=size,
                                   height=size, loss_timesteps=1)
        lora_name = T.HeadroomSaveLora.execute(run, "realsize", "", "fp32").args[0]
        capture = _Capture()
        logging.getLogger().addHandler(capture)
        try:
            with Peak() as peak:
                lora_model = nodes.LoraLoader().load_lora(model, clip, lora_name, 1.0, 0.0)[0]
        finally:
            logging.getLogger().removeHandler(capture)
        loader_record = peak.record("stock LoraLoader")
        # Each other format the family has names in (ComfyUI maps no diffusers names for some: Ideogram 4).
        formats = {fmt: _other_format(run, model, clip, fmt, name) for fmt in ("kohya", "diffusers")
                   if fmt != "diffusers" or families.family_of(model.model).diffusers_component}
    # The run's own memory record (caching, training, validation, save), with init and the stock loader in order.
    recorded = json.loads(run.run_dir.memory_record_path.read_text())["phases"]
    caching = [p for p in recorded if p["phase"].startswith("caching")]
    report["phases"] += [*caching, init_record, *[p for p in recorded if p not in caching], loader_record]
    steps_seconds = [p["seconds"] for p in report["phases"] if p["phase"] == "training"]
    report["s_per_step"] = sum(steps_seconds) / steps
    saved = run.adapters.comfy_state_dict()
    modules = {key.rsplit(".lora_", 1)[0].rsplit(".alpha", 1)[0] for key in saved}
    report["lora"] = {
        "file": lora_name, "tensors": len(saved), "modules": len(modules), "layers": len(run.adapters.layers),
        "patched_weights": len(lora_model.patches), "not_loaded": [m for m in capture.messages if "lora key not loaded" in m],
        "formats": formats,
    }
    del lora_model
    mm.unload_all_models()
    run.release()
    gc.collect()
    # Another adapter kind at real width, on the two families with the fastest CPU steps (the OFT code is family-blind;
    # the key mapping of every family is covered on the tiny models and at full depth by the keys tests).
    if name in OFT_CASES:
        report["oft"] = _oft_run(model, clip, latents, texts, name)
    report["base_unchanged"] = weights_digest(diffusion) == base_digest

    if planner_estimate:  # last: measuring runs forwards of the model (training/memory/planner.py)
        report["planner"] = estimate(model, clip, vae, size, texts, latents, lora)
    return report


# The diffusers pipeline whose lora_state_dict reads each family's files (SD3 has no kohya reader in diffusers).
_DIFFUSERS_PIPELINES = {"sdxl": "StableDiffusionXLPipeline", "flux_dev": "FluxPipeline", "sd35_large": "StableDiffusion3Pipeline",
                        "zimage": "ZImagePipeline", "qwen_image": "QwenImagePipeline",
                        "krea2": "Krea2Pipeline"}


def _other_format(run, model, clip, file_format: str, case: str) -> dict:
    """The same run saved in another file format: what the stock LoraLoader maps of it, and what diffusers' own
    reader (the pipeline's lora_state_dict, which converts kohya names at real widths) makes of it."""
    import diffusers
    import folder_paths
    import nodes
    from headroom.nodes import train_lora as T

    name = T.HeadroomSaveLora.execute(run, "realsize", f"realsize_{case}_{file_format}", "fp32", file_format).args[0]
    capture = _Capture()
    logging.getLogger().addHandler(capture)
    try:
        lora_model = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)[0]
    finally:
        logging.getLogger().removeHandler(capture)
    result = {"file": name, "patched_weights": len(lora_model.patches),
              "not_loaded": [m for m in capture.messages if "lora key not loaded" in m]}
    del lora_model
    # diffusers has no kohya reader for SD3, nor for Krea 2 (its Krea 2 loader converts "diffusion_model." keys only);
    # Ideogram 4 and HiDream-O1 have no diffusers pipeline.
    if case in _DIFFUSERS_PIPELINES and not (file_format == "kohya" and case in ("sd35_large", "krea2")):
        pipeline = getattr(diffusers, _DIFFUSERS_PIPELINES[case])
        state = pipeline.lora_state_dict(folder_paths.get_full_path("loras", name))
        state = state[0] if isinstance(state, tuple) else state
        result["diffusers_down_weights"] = sum(1 for k in state if k.endswith((".lora_A.weight", ".lora.down.weight",
                                                                              "_lora.down.weight")))
    return result


OFT_CASES = ("zimage", "qwen_image")
# Cases whose captions are tags cached in TAG_SHUFFLES other orders (Cache Text's tag_shuffles), leaving tags out at
# TAG_DROPOUT (tag_dropout), at real width
TAG_CASES, TAG_SHUFFLES, TAG_DROPOUT = ("sdxl",), 2, 0.3
# Cases also cached and trained at a second size (the dataset nodes' extra_resolutions): case -> the size
EXTRA_SIZE_CASES = {"sdxl": 128, "zimage": 128}
# Cases whose dataset node has upscale_small_images off: their images (the training size) are not enlarged to the
# extra size, which then adds no bucket
NO_UPSCALE_CASES = ("zimage",)
LORAPLUS_CASES, LORAPLUS_RATIO = ("sdxl",), 4.0  # Optimizer Config loraplus_lr_ratio
# Cases whose dataset limits bucket sides (min_bucket_side, max_bucket_side) as kohya's min / max_bucket_reso do, here
# to the step and the largest size: the square images keep their square buckets at every size
BUCKET_SIDES_CASES = {"sdxl": (64, 128)}
# Cases trained with Optimizer Config scale_weight_norms at this cap: below every layer's update after a step, so every
# layer is scaled back to it (its norm from the rank x rank Gram matrices), checked against the formed products
SCALE_NORMS_CASES = {"sdxl": 1e-6}
# Cases whose LoRA Config `layers` selection and `layer_lr_scales` are checked over the real model's layer names (the
# run itself trains all at one rate)
LAYERS_CASES = {"sdxl": "output_blocks !attn2"}
LAYER_LR_SCALES = "input_blocks=0.5 middle_block=1 output_blocks=1.5"  # kohya's down / mid / up block weights
LAYER_RANKS = "input_blocks=8 output_blocks=32"  # kohya's block_dims; the middle block at the config's 16
LAYER_ALPHAS = "input_blocks=4 attn2=32"  # kohya's block_alphas; the rest at the config's 16
# Cases whose images are transparent cut-outs read from a folder, their alpha the loss mask (transparency: loss_mask)
ALPHA_CASES = ("flux_dev",)
ALPHA_MASKED_OUT_WEIGHT = 0.1  # what the alpha leaves out still counts a little (masked_out_weight)


def formed_norms(run) -> list[float]:
    """Each LoRA layer's update scale * up @ down formed in full, its Frobenius norm (what scale_weight_norms caps)."""
    norms = []
    with torch.no_grad():
        for layer in run.adapters.layers.values():
            up, down = layer.lora_B["default"].weight, layer.lora_A["default"].weight
            product = up.reshape(up.shape[0], -1).double() @ down.reshape(down.shape[0], -1).double()
            norms.append(float(product.norm() * layer.scaling["default"]))
    return norms


def layers_report(model, layers: str) -> dict:
    """The layers LoRA Config's `layers` keeps of the preset's, what a diffusers-scheme name gets (refused), and each
    preset layer's LAYER_LR_SCALES scale; with LAYER_RANKS and LAYER_ALPHAS, each preset layer's rank and scale in
    adapters built on the real model, their trainable elements and the Memory Plan's count of them."""
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.planning import lora_target_paths, lora_trainable
    from headroom.training.core.adapters import AdapterSet, layer_lr_scales

    def targets(layers: str) -> list[str]:
        config = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0, layers=layers).args[0]
        return lora_target_paths(model, config)

    try:
        targets("down_blocks.1")
        refused = None
    except ValueError as error:
        refused = str(error)
    preset = targets("")
    scaled = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0,
                                          layer_lr_scales=LAYER_LR_SCALES).args[0]
    ranked = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0, layer_ranks=LAYER_RANKS,
                                          layer_alphas=LAYER_ALPHAS).args[0]
    adapters = AdapterSet(model.model.diffusion_model, preset, ranked)
    return {"preset": preset, "chosen": targets(layers), "diffusers_name": refused,
            "scales": layer_lr_scales(preset, scaled),
            "ranks": {path: layer.r["default"] for path, layer in adapters.layers.items()},
            "lora_scales": {path: layer.scaling["default"] for path, layer in adapters.layers.items()},
            "ranked_elements": adapters.parameter_count(),
            "planned_elements": lora_trainable(model, ranked, "AdamW", preset).param_count}


def cutout_dataset(images, captions: list[str], alpha, name: str):
    """The synthetic images as RGBA PNGs (alpha: each image's shape mask) with captions in ComfyUI's input folder,
    read by Dataset From Folder with transparency loss_mask."""
    import folder_paths
    import numpy as np
    from PIL import Image
    from headroom.nodes import cache as cache_nodes

    folder = pathlib.Path(folder_paths.get_input_directory()) / f"realsize_cutouts_{name}"
    folder.mkdir(parents=True, exist_ok=True)
    for index, caption in enumerate(captions):
        rgba = torch.cat([images[index], alpha[index, ..., None]], dim=-1)
        Image.fromarray((rgba.float().numpy() * 255).round().astype(np.uint8), "RGBA").save(folder / f"{index}.png")
        (folder / f"{index}.txt").write_text(caption, encoding="utf-8")
    return cache_nodes.HeadroomDatasetFromFolder.execute(
        folder=folder.name, resolution=images.shape[1], step=64, crop="center", flip=False, seed=0, skip_bad=False,
        transparency="loss_mask").args[0]


def _up_matrices(run) -> set[int]:
    return {id(p) for layer in run.adapters.layers.values() for n, p in layer.named_parameters()
            if n.startswith("lora_B")}


def tag_orders_report(clip, latents, texts, captions: list[str]) -> dict:
    """The tag orders cached per caption, and whether each caption's last order is exactly stock CLIP Text Encode of
    its text (every tensor the encoder gives)."""
    import nodes
    from headroom.training.data.cache_store import text_key
    from headroom.training.data.caption_tags import tag_orders

    orders, equal = [], []
    for caption in captions:
        key = text_key(caption)
        assert any(latents.text_key(i) == key for i in range(len(latents)))
        texts_of = tag_orders(caption, TAG_SHUFFLES, 1, TAG_DROPOUT)
        orders.append(texts.tag_orders(key))
        (cond, extras), = nodes.CLIPTextEncode().encode(clip, texts_of[-1])[0]
        cached = texts.conditioning(key, len(texts_of) - 1)
        stock = {"cross_attn": cond[0], **{k: v[0] for k, v in extras.items() if isinstance(v, torch.Tensor)}}
        equal.append(set(cached) == set(stock) and all(torch.equal(cached[k], stock[k]) for k in stock))
    return {"orders": orders, "stock_equal": equal}


def _oft_run(model, clip, latents, texts, case: str) -> dict:
    """A second run with kind oft (ComfyUI's OFT, block size 16) at real width: one step, saved, then the stock
    LoraLoader: what it maps and the loss."""
    import comfy.model_management as mm
    import nodes
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        oft = T.HeadroomLoraConfig.execute("oft", 16, 1.0, "preset", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 100).args[0]
        run = T.HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=oft, optimizer_config=optimizer,
            run_name=f"realsize_{case}_oft", seed=0, batch_size=1, grad_accumulation=1, precision="auto",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1, holdout=0).args[0]
        loss = T.HeadroomTrainSteps.execute(run, 1).args[1]
        name = T.HeadroomSaveLora.execute(run, "realsize", f"realsize_{case}_oft", "fp32").args[0]
        capture = _Capture()
        logging.getLogger().addHandler(capture)
        try:
            lora_model = nodes.LoraLoader().load_lora(model, clip, name, 1.0, 0.0)[0]
        finally:
            logging.getLogger().removeHandler(capture)
    result = {"loss": float(loss), "layers": len(run.adapters.layers), "patched_weights": len(lora_model.patches),
              "not_loaded": [m for m in capture.messages if "lora key not loaded" in m]}
    del lora_model
    mm.unload_all_models()
    run.release()
    gc.collect()
    return result


def replace_case(arch: str, depth) -> dict:
    """nodes/bridge/comfy_model.replace_inference_tensors on a real-size model made under inference mode (as ComfyUI's
    loaders make it), every other block then moved outside inference mode as a GPU load moves it (a dtype round trip
    takes the same Module.to path: the Parameters keep no version counter): peak RSS growth against the model's
    weight bytes, and no weight left that autograd would refuse."""
    setup()
    import realsize_models as R
    from headroom.nodes.bridge.comfy_model import made_in_inference_mode, replace_inference_tensors, training_blocks

    with torch.inference_mode():
        model = R.build_model(arch, depth)
    diffusion = model.model.diffusion_model
    assert all(p.is_inference() for p in diffusion.parameters())
    for _, block in training_blocks(diffusion)[::2]:
        block.to(torch.float32).to(torch.bfloat16)
    weights = [*diffusion.parameters(), *diffusion.buffers()]
    moved = sum(not t.is_inference() and made_in_inference_mode(t) for t in weights)
    assert moved and all(made_in_inference_mode(t) for t in weights)
    largest = max(t.numel() * t.element_size() for t in weights)
    del weights
    with Peak() as peak:
        replace_inference_tensors(diffusion)
    assert not any(made_in_inference_mode(t) for t in [*diffusion.parameters(), *diffusion.buffers()])
    return {"arch": arch, "depth": depth, "weight_bytes": R.tensor_bytes(diffusion), "largest_tensor_bytes": largest,
            "moved_tensors": moved, **peak.record("replace_inference_tensors")}


def host_ram_case(arch: str) -> dict:
    """What a run adds to host RAM, measured against the plan (training/memory/host_ram.py): a rank-16 LoRA of each
    model at full depth (its target shapes from the model built on the meta device), optimizer state on the host
    (optimizer_parking.HostOptimizer: fp32 masters + AdamW state after its first step) and the EMA copy (core/ema.py).
    RSS growth after the step, with the EMA swapped in as validation samples it, against the plan's validation figure
    for that policy (masters + state + EMA + the trained weights kept meanwhile). On a CPU
    the step's fp32 gradient copies and parked state are the device's own tensors (`.to` returns them), so the
    training-step figure (which adds the gradients' host copies on a GPU) is not measured here. One model per
    process: memory freed by a previous one would be reused unseen by the RSS."""
    setup()
    import realsize_models as R
    from headroom.nodes.bridge.planning import lora_trainable
    from headroom.training.core.adapters import AdapterConfig
    from headroom.training.core.ema import WeightEMA
    from headroom.training.core.optimizers import OptimizerConfig, create_optimizer
    from headroom.training.memory import host_ram, optimizer_parking

    trainable = lora_trainable(R.build_model(arch, None, device="meta"), AdapterConfig(rank=16, alpha=16.0), "AdamW")
    cost = optimizer_parking.optimizer_cost("cpu", True, "AdamW", trainable.optimizer_bytes(), trainable.param_bytes())
    planned = host_ram.added_by_phase([cost], True, trainable.param_bytes())
    params = [torch.nn.Parameter(torch.randn(shape) * 0.01) for shape in trainable.shapes]
    for param in params:
        param.grad = torch.randn_like(param)
    with Peak() as peak:
        optimizer = optimizer_parking.HostOptimizer(params, lambda host: create_optimizer(
            host, OptimizerConfig(name="AdamW", lr=1e-4), device="cpu"))
        optimizer.step()
        ema = WeightEMA(params, 0.99)
        ema.update(params)
        with ema.swapped_in(params):
            gc.collect()
            after = rss()
    return {"arch": arch, "trainable_params": trainable.param_count, "planned": planned,
            "planned_validation_bytes": sum(planned["validation"].values()),
            "measured_growth_bytes": after - peak.start_rss, **peak.record("host optimizer + EMA")}


def estimate(model, clip, vae, size: int, texts, latents, lora) -> dict:
    """The planner's estimate per phase for this run's shape, with and without gradient checkpointing."""
    from headroom.nodes.bridge.planning import describe_comfy_model, lora_target_paths
    from headroom.training.memory import planner
    from headroom.training.memory.policy import OffloadPolicy

    tokens = int(texts.conditioning(latents.text_key(0))["cross_attn"].shape[0])
    with Peak() as peak:
        description = describe_comfy_model(model, lora, "fp32", tokens, clip, vae)
    diffusion = model.model.diffusion_model
    trainable = planner.TrainableSpec.lora([diffusion.get_submodule(p) for p in lora_target_paths(model, lora)], lora.rank)
    shape = planner.RunShape(1, size, size, tokens)
    out = {"describe": peak.record("planner describe"), "text_tokens": tokens}
    for label, checkpointing in (("checkpointing", "blocks"), ("no_checkpointing", "off")):
        plan = planner.estimate(description, trainable, shape, OffloadPolicy(checkpointing=checkpointing))
        out[label] = {p.phase: {"total_bytes": p.total, "items": dict(p.items)} for p in plan.phases}
    return out


# planner phase -> (the run's memory-record phase, the resident weights that phase works with)
COMPARED = {
    "caching (text encoders)": ("caching text", "text_encoder_bytes"),
    "caching (VAE encode)": ("caching latents", "vae_bytes"),
    "training step": ("training", "diffusion_bytes"),
    "validation": ("validation", "diffusion_bytes"),
    "save": ("save", "diffusion_bytes"),
}


def compare(report: dict, planner_key: str = "checkpointing") -> dict:
    """Per phase: measured = the weights the phase works with + its peak RSS growth over the baseline (every model
    resident before the nodes ran); the planner's estimate of that phase (device bytes: on a CPU, host RAM); ratio."""
    phases = {p["phase"]: p for p in report["phases"]}
    out = {}
    for planned, (measured_phase, weights_key) in COMPARED.items():
        if measured_phase not in phases:
            continue
        growth = phases[measured_phase]["peak_rss_bytes"] - report["baseline_rss_bytes"]
        row = {"growth_bytes": growth, "measured_bytes": report[weights_key] + growth}
        plan = report.get("planner", {}).get(planner_key, {}).get(planned)
        if plan is not None:
            row["planner_bytes"] = plan["total_bytes"]
            row["planner_over_measured"] = plan["total_bytes"] / row["measured_bytes"]
        out[measured_phase] = row
    return out


def write_report(out: str | pathlib.Path, report: dict) -> None:
    """A script's JSON report, its folder made."""
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))


def run_cases(cases_file: str, run_one) -> None:
    """Each case of a JSON list ({arch, ..., out}) through run_one(case) -> its report, one after another in this
    process (ComfyUI is imported once: ~10 s a process); a case that fails writes its traceback as {arch, error} and
    the next one runs."""
    import traceback

    for case in json.loads(pathlib.Path(cases_file).read_text()):
        try:
            report = run_one(case)
        except Exception:  # noqa: BLE001 - written for the case's own test to show; the next case still runs
            report = {"arch": case["arch"], "error": traceback.format_exc()}
        write_report(case["out"], report)
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("case", choices=[*CASES, "replace", "host_ram"], help="a model case, or replace: "
                        "replace_inference_tensors alone on Flux-dev at real width (one double + one single block), or "
                        "host_ram: the host optimizer and EMA of full-depth LoRAs against the plan")
    parser.add_argument("--out", required=True, help="where the JSON report goes")
    parser.add_argument("--arch", default="flux_dev", help="host_ram: the model (tests/realsize_models.ARCHITECTURES)")
    parser.add_argument("--size", type=int, default=64, help="square training / sampling resolution in pixels")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-checkpointing", action="store_true", help="train without gradient checkpointing")
    parser.add_argument("--planner", action="store_true", help="also report the planner's estimate (runs forwards)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: $HEADROOM_TORCH_THREADS, set by the test suite per pytest-xdist worker, else every core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or int(os.environ.get("HEADROOM_TORCH_THREADS", 0)) or os.cpu_count() or 1)
    if args.case == "replace":
        report = replace_case("flux_dev", (1, 1))
    elif args.case == "host_ram":
        report = host_ram_case(args.arch)
    else:
        report = run_case(args.case, args.size, args.steps, not args.no_checkpointing, args.planner)
    if args.case in CASES:
        report["compared"] = compare(report, "checkpointing" if not args.no_checkpointing else "no_checkpointing")
    write_report(args.out, report)


if __name__ == "__main__":
    main()
