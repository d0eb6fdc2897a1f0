"""A family's LoRA key names at real width, in a process of its own:

    python tests/realsize_keys.py chroma --depth 1,1 --out result.json
    python tests/realsize_keys.py sdxl --meta-only --out result.json
    python tests/realsize_keys.py --cases cases.json   # several in one process: [{"arch", "depth", "meta_only", "out"}]

1. the diffusion model at real width (tests/realsize_models.py: ComfyUI's classes from the unet_config its
   model_detection derives from the released checkpoint; checked here by detecting it back from the full-depth
   model's keys), bf16, seeded random weights, with reduced depth where given;
2. the layers a LoRA trains there (the trainer's own selection: targets=preset), saved in the comfyui, kohya and
   diffusers formats as HeadroomSaveLora writes them, each loaded with the stock LoraLoaderModelOnly: the weights it
   patches and every "lora key not loaded" it logs;
3. the full-depth model on the meta device (no memory): its layers under the same preset, the names of every format
   through ComfyUI's LoRA key map (comfy.lora.model_lora_keys_unet), and the per-block name patterns, which must be
   the reduced model's.

--meta-only: step 3 alone (SDXL: its full-size model, 5 GiB of bf16, is trained, saved and loaded by the stock
LoraLoader in tests/realsize_worker.py already).
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import re
import sys
import time
import types

import torch

TESTS_DIR = pathlib.Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.append(str(TESTS_DIR))

import realsize_worker as W  # noqa: E402


def _pattern(name: str) -> str:
    """A layer name with its block numbers replaced (the same layer in every block)."""
    return re.sub(r"(?<=[._])\d+(?=[._]|$)", "N", name)


def _full_depth_model(arch: str):
    import comfy.model_detection
    import realsize_models as R

    config = comfy.model_detection.model_config_from_unet_config(R.unet_config(arch))
    config.set_inference_dtype(torch.bfloat16, None)
    model = config.get_model({}, "", device=torch.device("meta"))
    # What ComfyUI's loaders make of a file with these keys (model_config_from_unet: detection, then the matching
    # supported_models config with its fixed settings, e.g. SD2's 64-wide heads).
    detected = comfy.model_detection.model_config_from_unet(model.diffusion_model.state_dict(), "").unet_config
    expected = R.unet_config(arch)
    mismatched = sorted(k for k in expected if expected[k] != detected.get(k))
    return model, mismatched


def _diffusers_refused(model, paths, family: str) -> str | None:
    """Why HeadroomSaveLora refuses the diffusers format for this family (ComfyUI's key map has no diffusers names
    for it: Wan), or None."""
    from headroom.nodes.bridge import lora_formats

    try:
        lora_formats.diffusers_names(types.SimpleNamespace(model=model), paths, family)
    except ValueError as error:
        return str(error)
    return None


def _names(model, paths, family: str) -> dict[str, list[str]]:
    """{format: the file's layer names} for these module paths, as HeadroomSaveLora names them (the formats it
    writes for the family)."""
    from headroom.nodes.bridge import lora_formats

    patcher = types.SimpleNamespace(model=model)
    names = {"comfyui": [f"diffusion_model.{p}" for p in paths],
             "kohya": list(lora_formats.kohya_names(patcher, paths, family).values())}
    if lora_formats.diffusers_component(family) is not None:  # HunyuanImage 2.1: ComfyUI maps no diffusers names
        diffusers = lora_formats.diffusers_names(patcher, paths, family)
        names["diffusers"] = [name for layers in diffusers.values() for name, _ in layers]
    return names


def _save_and_load(patcher, adapters, paths, family: str, arch: str) -> dict:
    """Each format saved into models/loras and loaded by the stock LoraLoaderModelOnly."""
    import folder_paths
    import nodes
    from safetensors.torch import save_file

    from headroom.nodes.bridge import lora_formats

    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / "realsize_keys"
    folder.mkdir(parents=True, exist_ok=True)
    comfy_state = adapters.comfy_state_dict()
    files = {"comfyui": comfy_state,
             "kohya": lora_formats.to_kohya(comfy_state, lora_formats.kohya_names(patcher, paths, family))}
    if lora_formats.diffusers_component(family) is not None:
        names = lora_formats.diffusers_names(patcher, paths, family)
        files["diffusers"] = lora_formats.to_diffusers(comfy_state, names, family, torch.float32)[0]
    out = {}
    for file_format, state in files.items():
        name = f"{arch}_{file_format}.safetensors"
        save_file({k: v.clone() for k, v in state.items()}, str(folder / name))  # diffusers: shared down weights
        folder_paths.filename_list_cache.pop("loras", None)
        capture = W._Capture()
        logging.getLogger().addHandler(capture)
        try:
            loaded = nodes.LoraLoaderModelOnly().load_lora_model_only(patcher, f"realsize_keys/{name}", 1.0)[0]
        finally:
            logging.getLogger().removeHandler(capture)
        out[file_format] = {"tensors": len(state), "patched_weights": len(loaded.patches),
                            "not_loaded": [m for m in capture.messages if "lora key not loaded" in m]}
        del loaded
    return out


def _reduced(arch: str, depth, adapter) -> dict:
    """Steps 1 and 2 (module docstring) at real width."""
    import realsize_models as R

    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.planning import lora_target_paths
    from headroom.training.core.adapters import AdapterSet

    with torch.inference_mode():  # as ComfyUI's loaders make models
        patcher = R.build_model(arch, depth)
    model = patcher.model
    family = families.family_name(model)
    paths = lora_target_paths(patcher, adapter)
    with torch.inference_mode(False):
        adapters = AdapterSet(model.diffusion_model, paths, adapter)
    return {"family": family, "diffusion_params": sum(p.numel() for p in model.diffusion_model.parameters()),
            "diffusion_dtype": str(model.get_dtype()), "trained_layers": len(paths),
            "formats": _save_and_load(patcher, adapters, paths, family, arch),
            "patterns": {fmt: sorted({_pattern(n) for n in names}) for fmt, names in _names(model, paths, family).items()}}


def run(arch: str, depth, meta_only: bool = False) -> dict:
    """One case's report; its peak RSS is the process's if it is the first, else the high-water mark since it began
    (reset: W.Peak)."""
    with W.Peak() as peak:
        report = _run(arch, depth, meta_only)
    report["peak_rss_bytes"] = peak.record("case")["peak_rss_bytes"]
    return report


def _run(arch: str, depth, meta_only: bool = False) -> dict:
    import comfy.lora

    from headroom.nodes.bridge import families
    from headroom.nodes.bridge.comfy_model import model_blocks
    from headroom.training.core.adapters import AdapterConfig

    started = time.perf_counter()
    adapter = AdapterConfig(rank=4, alpha=4.0)
    report = {"arch": arch, "depth": depth, "meta_only": meta_only}
    reduced_patterns = None
    if not meta_only:
        report.update(_reduced(arch, depth, adapter))
        reduced_patterns = report.pop("patterns")

    full, mismatched = _full_depth_model(arch)
    full_paths = families.lora_targets(full.diffusion_model, families.family_name(full), adapter,
                                       [name for name, _ in model_blocks(full.diffusion_model)])
    key_map = comfy.lora.model_lora_keys_unet(full, {})
    full_names = _names(full, full_paths, families.family_name(full))
    report["full_depth"] = {
        "family": families.family_name(full), "params": sum(p.numel() for p in full.diffusion_model.parameters()),
        "detection_mismatches": mismatched, "trained_layers": len(full_paths),
        "refused": {"diffusers": _diffusers_refused(full, full_paths, families.family_name(full))},
        "names": {fmt: len(names) for fmt, names in full_names.items()},
        # the names ComfyUI's key map does not know, per format
        "unmapped": {fmt: [n for n in names if n not in key_map] for fmt, names in full_names.items()},
        "patterns_differ": {} if reduced_patterns is None else {
            fmt: sorted(set(reduced_patterns[fmt]) ^ {_pattern(n) for n in names}) for fmt, names in full_names.items()},
    }
    report["seconds"] = time.perf_counter() - started
    return report


def _depth(text: str):
    depth = tuple(int(d) for d in text.split(",")) if text else None
    return depth[0] if depth is not None and len(depth) == 1 else depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arch", nargs="?", help="tests/realsize_models.ARCHITECTURES name")
    parser.add_argument("--depth", default="", help="reduced depth (comma-separated for (double, single) blocks)")
    parser.add_argument("--meta-only", action="store_true", help="the full-depth names on the meta device only")
    parser.add_argument("--out", help="where the report goes")
    parser.add_argument("--cases", help="a JSON list of cases ({arch, depth, meta_only, out}) run one after another "
                                        "in this process (ComfyUI is imported once); a case that fails writes its "
                                        "traceback as {arch, error} and the next one runs")
    args = parser.parse_args()
    if (args.cases is None) == (args.arch is None) or (args.arch is not None and args.out is None):
        parser.error("give an arch and --out, or --cases")
    W.setup()
    if args.arch is not None:
        W.write_report(args.out, run(args.arch, _depth(args.depth), args.meta_only))
    else:
        W.run_cases(args.cases, lambda case: run(case["arch"], _depth(case.get("depth", "")),
                                                 bool(case.get("meta_only", False))))


if __name__ == "__main__":
    main()
