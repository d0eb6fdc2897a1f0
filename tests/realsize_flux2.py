"""Flux.2 (dev / Klein 4B / Klein 9B) at real width, in a process of its own: the LoRA key names Headroom trains
and saves, through the stock loader, at reduced depth and at full depth.

    python tests/realsize_flux2.py flux2_klein_4b --out result.json [--depth 1 1 | --meta-only]
    python tests/realsize_flux2.py --cases cases.json   # several in one process: [{"arch", "depth", "out"}]

1. Full depth on the meta device (no memory): the unet_config of tests/realsize_models.py is the one
   comfy/model_detection.py derives from the model's key layout (read back from the meta state dict), the model has
   the released parameter count, and every layer the flux2 preset selects has a key in ComfyUI's LoRA key map
   (comfy.lora.model_lora_keys_unet), in ComfyUI's and kohya's naming.
2. Reduced depth, real width, bf16 storage (unless --meta-only): the real-size Flux.2 VAE caches 64 px images through
   HeadroomCacheLatents (128 channels, 16x); the captions are cached with a seeded random encoder of the model's
   real context width (dev's Mistral tokenizer is not shipped with ComfyUI and a real-width Qwen3 needs all 28
   layers ComfyUI reads, 5.6 GB: the keys under test are the DiT's); HeadroomTrainLoraInit -> one
   HeadroomTrainSteps step -> HeadroomSaveLora in the comfyui / kohya / diffusers formats -> the stock
   LoraLoaderModelOnly: what it maps, what it reports not loaded.
3. The same names at full depth: Headroom's own adapter (training/core/adapters.AdapterSet, rank 1, only its own weights
   made real) on every preset layer of the full-depth meta model, exported as the save node exports (comfyui / kohya /
   diffusers names), through the stock LoraLoaderModelOnly on the meta model: every target patched, none not loaded.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import os
import pathlib
import re
import sys
import time

import torch

TESTS_DIR = pathlib.Path(__file__).resolve().parent


def _worker():
    spec = importlib.util.spec_from_file_location("realsize_worker", TESTS_DIR / "realsize_worker.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["realsize_worker"] = module
    spec.loader.exec_module(module)
    return module


W = _worker()


def _patcher(model):
    import comfy.model_patcher

    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


def _stock_load(model, name: str) -> tuple[int, list[str]]:
    """(weights the stock LoraLoaderModelOnly patches, its "lora key not loaded" messages)."""
    import nodes

    capture = W._Capture()
    logging.getLogger().addHandler(capture)
    try:
        lora_model = nodes.LoraLoaderModelOnly().load_lora_model_only(model, name, 1.0)[0]
    finally:
        logging.getLogger().removeHandler(capture)
    patched = len(lora_model.patches)
    del lora_model
    return patched, [m for m in capture.messages if "lora key not loaded" in m]


def _write(name: str, state: dict, metadata: dict) -> str:
    import folder_paths
    from safetensors.torch import save_file

    path = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "realsize" / f"{name}.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata=metadata)
    folder_paths.filename_list_cache.pop("loras", None)
    return f"realsize/{name}.safetensors"


def _full_depth_files(arch: str, patcher, dm, targets: list[str]) -> dict:
    """Headroom's adapter on every target of the full-depth meta model, saved in each format, through the stock
    loader on that model."""
    from headroom.nodes.bridge import lora_formats
    from headroom.training.core.adapters import AdapterConfig, AdapterSet

    adapters = AdapterSet(dm, targets, AdapterConfig(kind="lora", rank=1, alpha=1.0))
    generator = torch.Generator().manual_seed(0)
    for layer in adapters.layers.values():  # the base weights stay on the meta device; the adapter's are made real
        for name, param in AdapterSet._own_parameters(layer):
            parent, _, leaf = name.rpartition(".")
            made = torch.nn.Parameter(torch.randn(param.shape, generator=generator) * 0.01)
            setattr(layer.get_submodule(parent), leaf, made)
    state = adapters.comfy_state_dict()
    diffusers_state, config = lora_formats.to_diffusers(state, lora_formats.diffusers_names(patcher, targets, "flux2"),
                                                        "flux2", torch.float32)
    files = {"comfyui": (state, {}),
             "kohya": (lora_formats.to_kohya(state, lora_formats.kohya_names(patcher, targets, "flux2")), {}),
             # q / k / v parts share one down weight: separate copies in the file, as the save node writes them
             "diffusers": ({k: v.clone() for k, v in diffusers_state.items()}, lora_formats.diffusers_metadata(config))}
    out = {}
    for file_format, (tensors, metadata) in files.items():
        name = _write(f"realsize_{arch}_full_depth_{file_format}", tensors, metadata)
        with torch.inference_mode():
            patched, not_loaded = _stock_load(patcher, name)
        out[file_format] = {"tensors": len(tensors), "patched_weights": patched, "not_loaded": not_loaded}
    return out


def full_depth(arch: str) -> tuple[object, dict]:
    """The full-depth model on the meta device and what it shows about key names."""
    import comfy.lora
    import comfy.model_detection
    import comfy.supported_models
    import realsize_models as R
    from headroom.nodes.bridge import families, lora_formats
    from headroom.nodes.bridge.comfy_model import training_blocks
    from headroom.training.core.adapters import AdapterConfig

    ours = R.unet_config(arch)
    config = comfy.model_detection.model_config_from_unet_config(ours)
    model = config.get_model({}, "", device=torch.device("meta"))
    dm = model.diffusion_model
    state = model.state_dict()
    detected = comfy.model_detection.model_config_from_unet(state, "diffusion_model.")
    differing = {k: (v, detected.unet_config.get(k)) for k, v in ours.items() if detected.unet_config.get(k) != v}
    targets = families.lora_targets(dm, "flux2", AdapterConfig(), [n for n, _ in training_blocks(dm)])
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    mapped = set(key_map.values())
    patcher = _patcher(model)
    kohya = lora_formats.kohya_names(patcher, targets, "flux2")
    return patcher, {
        "params": sum(p.numel() for p in dm.parameters()),
        "detected_class": type(detected).__name__, "detected_is_flux2": isinstance(detected, comfy.supported_models.Flux2),
        "detection_differs": differing, "targets": len(targets),
        "double_blocks": len(dm.double_blocks), "single_blocks": len(dm.single_blocks),
        "target_suffixes": sorted({re.sub(r"^(double|single)_blocks\.\d+\.", r"\1.", t) for t in targets}),
        "unmapped_comfyui": [t for t in targets if f"diffusion_model.{t}.weight" not in mapped],
        "unmapped_kohya": [t for t in targets if key_map.get(kohya[t]) != f"diffusion_model.{t}.weight"],
        "files": _full_depth_files(arch, patcher, dm, targets),
    }


def reduced_depth(arch: str, depth, report: dict, size: int = 64, steps: int = 1) -> None:
    import realsize_models as R
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.cache_folders import open_store
    from headroom.nodes import data as data_nodes
    from headroom.nodes import train_lora as T
    from headroom.training.data.cache_store import cache_text

    spec = R.ARCHITECTURES[arch]
    context = spec["unet_config"]["context_in_dim"]
    with torch.inference_mode():
        with W.Peak() as peak:
            model = R.build_model(arch, depth)
            vae = R.build_vae(spec["latent_channels"])
        report["phases"].append(peak.record("build (realsize_models)"))
    diffusion = model.model.diffusion_model
    report.update(diffusion_params=sum(p.numel() for p in diffusion.parameters()),
                  diffusion_bytes=R.tensor_bytes(diffusion), diffusion_dtype=str(model.model.get_dtype()),
                  vae_bytes=R.tensor_bytes(vae.first_stage_model))
    digest = W.weights_digest(diffusion)
    gc.collect()
    report["baseline_rss_bytes"] = W.rss()

    def encode(text: str) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(len(text))
        return {"cross_attn": torch.randn(spec["text_tokens"], context, generator=generator)}

    with torch.inference_mode():
        images, caption_text, _ = data_nodes.HeadroomSyntheticDataset.execute(2, size, 0).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, caption_text, size, 64, "center", False, 0).args[0]
        with W.Peak() as peak:
            latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        report["phases"].append(peak.record("caching latents"))
        report["latent_shape"] = list(latents.latent(0).shape)
        texts, _ = cache_text(caption_text.splitlines(), open_store("text"), encode,
                              f"random-{arch}-{context}", {"tokens": spec["text_tokens"]})
        lora = T.HeadroomLoraConfig.execute("lora", 16, 16.0, "preset", False, 0.0, 0).args[0]
        optimizer = T.HeadroomOptimizerConfig.execute("AdamW", 1e-4, 0.0, "constant", 0, 100).args[0]
        with W.Peak() as peak:
            run = T.HeadroomTrainLoraInit.execute(
                model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=optimizer,
                run_name=f"realsize_{arch}", seed=0, batch_size=1, grad_accumulation=1, precision="auto",
                max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
                min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=True, checkpoint_depth=1,
                holdout=0).args[0]
        report["phases"].append(peak.record("init (HeadroomTrainLoraInit)"))
        with W.Peak() as peak:
            loss = T.HeadroomTrainSteps.execute(run, steps).args[1]
        report["phases"].append(peak.record("training"))
        report["loss"], report["s_per_step"] = float(loss), peak.seconds / steps
        report["layers"] = len(run.adapters.layers)
        saved = {}
        with W.Peak() as peak:
            for file_format in ("comfyui", "kohya", "diffusers"):
                name = T.HeadroomSaveLora.execute(run, "realsize", f"realsize_{arch}_{file_format}", "fp32",
                                                  file_format).args[0]
                patched, not_loaded = _stock_load(model, name)
                saved[file_format] = {"file": name, "patched_weights": patched, "not_loaded": not_loaded}
        report["phases"].append(peak.record("save + stock LoraLoaderModelOnly"))
        report["formats"] = saved
        run.release()
    report["base_unchanged"] = W.weights_digest(diffusion) == digest



def run(arch: str, depth, meta_only: bool) -> dict:
    started = time.perf_counter()
    report = {"arch": arch, "depth": list(depth), "meta_only": meta_only, "phases": []}
    with W.Peak() as peak:
        patcher, full = full_depth(arch)
    report["phases"].append(peak.record("full depth on the meta device"))
    report["full_depth"] = full
    if not meta_only:
        del patcher
        gc.collect()
        reduced_depth(arch, tuple(depth), report)
    report["seconds"] = time.perf_counter() - started
    report["peak_rss_bytes"] = max(p["peak_rss_bytes"] for p in report["phases"])
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arch", nargs="?", choices=["flux2_dev", "flux2_klein_4b", "flux2_klein_9b"])
    parser.add_argument("--out", help="where the report goes")
    parser.add_argument("--depth", type=int, nargs=2, default=(1, 1), help="double and single blocks at real width")
    parser.add_argument("--meta-only", action="store_true", help="only the full-depth key map on the meta device")
    parser.add_argument("--cases", help="a JSON list of cases ({arch, depth, out}) run one after another in this "
                                        "process (ComfyUI is imported once); a case that fails writes its traceback "
                                        "as {arch, error} and the next one runs")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (0: $HEADROOM_TORCH_THREADS, set by the test suite, else every core)")
    args = parser.parse_args()
    if (args.cases is None) == (args.arch is None) or (args.arch is not None and args.out is None):
        parser.error("give an arch and --out, or --cases")
    torch.set_num_threads(args.threads or int(os.environ.get("HEADROOM_TORCH_THREADS", 0)) or os.cpu_count() or 1)
    W.setup()
    if args.arch is not None:
        W.write_report(args.out, run(args.arch, args.depth, args.meta_only))
    else:
        W.run_cases(args.cases, lambda case: run(case["arch"], case.get("depth", (1, 1)), False))


if __name__ == "__main__":
    main()
