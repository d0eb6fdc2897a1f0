"""The real-size tier: every node on full-size models, on a CPU, on every run of the suite.

Full-size SDXL (2.57 B, from a checkpoint file written by ComfyUI's save code and read by the stock
CheckpointLoaderSimple), Flux-dev (real width 3072, 2 double + 2 single blocks, through the stock UNETLoader) and
SD3.5-Large (real width 2432, 3 joint blocks), with real-size CLIP-L / CLIP-G, T5-XXL at real width (2 layers) and
the real VAEs, random bf16 weights from ComfyUI's own classes (tests/realsize_models.py), driven through the node
classes as a workflow runs them (tests/realsize_worker.py), each model in a fresh process so its peak RSS is its own.

Checked per model: the stock LoraLoader maps every key of the saved LoRA; the base weights are bitwise unchanged;
no phase holds a second copy of the weights (peak RSS growth over the resident models stays below the weights it
works with). Reported (test-artifacts/realsize/<model>.json, and printed): peak RSS per phase, s/step, and the
planner's estimate against the measured memory. 64 px images and two steps keep the tier to a few minutes per model.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH, REPO_ROOT
from realsize_worker import SCRIPT_ENV

pytestmark = [pytest.mark.realsize, pytest.mark.skipif(COMFYUI_PATH is None, reason=COMFYUI_FOUND_BY)]

WORKER = REPO_ROOT / "tests" / "realsize_worker.py"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "realsize"
GIB = 1024 ** 3


def run_worker(case: str, *args: str, timeout: int = 1800, report: str | None = None) -> dict:
    out = ARTIFACTS / f"{report or case}.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, str(WORKER), case, "--out", str(out), *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **SCRIPT_ENV})
    assert done.returncode == 0, f"realsize worker {case} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return json.loads(out.read_text())


def _print_report(report: dict) -> None:
    lines = [f"{report['case']}: {report['diffusion_params'] / 1e9:.2f} B params, {report['diffusion_bytes'] / GIB:.2f} GiB "
             f"{report['diffusion_dtype']}, {report['s_per_step']:.1f} s/step, baseline RSS "
             f"{report['baseline_rss_bytes'] / GIB:.2f} GiB"]
    for phase in report["phases"]:
        lines.append(f"  {phase['phase']:<40} {phase['seconds']:7.1f} s  peak RSS {phase['peak_rss_bytes'] / GIB:6.2f} GiB")
    for phase, row in report["compared"].items():
        planner = f", planner {row['planner_bytes'] / GIB:.2f} GiB = {row['planner_over_measured']:.2f} x measured" \
            if "planner_bytes" in row else ""
        lines.append(f"  {phase:<16} measured {row['measured_bytes'] / GIB:.2f} GiB (growth {row['growth_bytes'] / GIB:.2f})"
                     + planner)
    lora = report["lora"]
    lines.append(f"  LoRA: {lora['modules']} modules, {lora['patched_weights']} weights patched by the stock loader; "
                 + "; ".join(f"{fmt}: {saved['patched_weights']} patched, {len(saved['not_loaded'])} not loaded"
                             + (f", diffusers reads {saved['diffusers_down_weights']} layers"
                                if "diffusers_down_weights" in saved else "")
                             for fmt, saved in lora.get("formats", {}).items()))
    if "oft" in report:
        lines.append(f"  OFT (block 16): {report['oft']['layers']} layers, {report['oft']['patched_weights']} patched by "
                     f"the stock loader, {len(report['oft']['not_loaded'])} not loaded, loss {report['oft']['loss']:.4f}")
    print("\n".join(lines))


# (case, worker arguments, expected diffusion parameters)
CASES = [
    ("sdxl", [], 2_567_463_684),  # full size
    ("flux_dev", [], 1_026_971_200),  # 3072 wide, 2 + 2 blocks
    ("sd35_large", ["--planner"], 601_638_720),  # 2432 wide, 3 joint blocks
    ("zimage", [], 908_508_992),  # 3840 wide, 1 main + 2 + 2 refiner blocks; Qwen3-4B at real width, 3 layers
    # 3072 wide, 2 blocks (at 1 the weights are so small that the training step's fp32 casts of the 56 M-entry
    # modulation weights alone come near the "second copy" bound); Qwen2.5-VL-7B at real width, 1 layer; Wan 2.1 VAE
    ("qwen_image", [], 720_185_920),
    # 6144 wide, 1 of 28 blocks (+ the text-fusion blocks at 2560); Qwen3-VL-4B at real width, 1 layer; Wan 2.1 VAE;
    # the planner's estimate against the measured phases (its block structure measured at real width)
    ("krea2", ["--planner"], 1_097_756_492),
    # 4608 wide (18 heads of 256), 2 of 34 blocks (+ the 53248-wide text projection, 245 M entries: at 1 block its
    # fp32 cast alone nears the "second copy" bound); Qwen3-VL-8B's language model at real width, 1 layer; Flux.2
    # VAE; comfyui and kohya formats (ComfyUI maps no diffusers names); the planner's estimate per phase
    ("ideogram4", ["--planner"], 822_375_552),
    # 4096 wide, 1 of 36 decoder layers (+ its 151936 x 4096 token embedding), 1 vision block; pixels, no encoder
    # weights; the planner's estimate against the measured phases
    ("hidream_o1", ["--planner"], 912_827_856),
]


@pytest.mark.parametrize("case, args, params", CASES, ids=[c[0] for c in CASES])
def test_nodes_on_a_real_size_model(case, args, params):
    report = run_worker(case, *args)
    _print_report(report)
    assert report["diffusion_params"] == params and report["diffusion_dtype"] == "torch.bfloat16"
    assert report["precision"] == "fp32", report["precision_note"]  # auto on a CPU
    assert report["loss"] == report["loss"] and report["s_per_step"] > 0  # finite loss, steps done

    lora = report["lora"]
    assert lora["not_loaded"] == [], f"the stock LoraLoader did not map: {lora['not_loaded'][:5]}"
    assert lora["modules"] == lora["layers"] == lora["patched_weights"] > 0
    # The same run saved as kohya and diffusers files: the stock loader maps all of it to the same weights, and
    # diffusers' own reader converts it at real width (a diffusers layer per fused part: at least one per module).
    for file_format, saved in lora["formats"].items():
        assert saved["not_loaded"] == [], f"{file_format}: the stock LoraLoader did not map {saved['not_loaded'][:5]}"
        assert saved["patched_weights"] == lora["patched_weights"], file_format
        if "diffusers_down_weights" in saved:
            assert saved["diffusers_down_weights"] >= lora["modules"], (file_format, saved)
    assert report["base_unchanged"], "the base MODEL's weights changed"
    from realsize_worker import OFT_CASES

    assert ("oft" in report) == (case in OFT_CASES)
    if "oft" in report:  # kind oft at real width: a finite step, every layer saved and mapped by the stock loader
        oft = report["oft"]
        assert oft["loss"] == oft["loss"] and oft["not_loaded"] == [], oft
        assert oft["patched_weights"] == oft["layers"] > 0, oft

    # No second copy of the weights in any phase: each phase's peak RSS growth over the resident models stays below
    # the weights it works with (a copy of them would add exactly that much).
    phases = {p["phase"]: p for p in report["phases"]}
    limits = {"caching text": "text_encoder_bytes", "caching latents": "vae_bytes"}
    for name in ["caching text", "caching latents", "init (HeadroomTrainLoraInit)", "training", "validation", "save",
                 "stock LoraLoader"]:
        growth = phases[name]["peak_rss_bytes"] - report["baseline_rss_bytes"]
        limit = report[limits.get(name, "diffusion_bytes")]
        if limit < 2 ** 20:  # HiDream-O1's tokenizer-only "text encoder" and identity VAE: no weights to copy
            continue
        assert growth < limit, f"{name}: peak RSS grew {growth / GIB:.2f} GiB, a second copy of {limit / GIB:.2f} GiB"
    if case == "sdxl":  # the path from a file on disk: ComfyUI's save code, then the stock loader
        assert "load (stock CheckpointLoaderSimple)" in phases and phases["save (comfy.sd.save_checkpoint)"]["file_bytes"] > 0
    if case == "flux_dev":
        assert "load (stock UNETLoader)" in phases
    from realsize_worker import EXTRA_SIZE_CASES, TAG_CASES, TAG_SHUFFLES

    from realsize_worker import ALPHA_CASES, BUCKET_SIDES_CASES, NO_UPSCALE_CASES

    # each image at each size; with upscale_small_images off, not at the larger extra size (never enlarged); on, the
    # images enlarged for it are named
    sizes = [report["size"], *([EXTRA_SIZE_CASES[case]] if case in EXTRA_SIZE_CASES and case not in NO_UPSCALE_CASES
                               else [])]
    assert report["buckets"] == {f"{size}x{size}": report["images"] for size in sizes}
    if case not in ALPHA_CASES:
        assert report["bucket_sides"] == list(BUCKET_SIDES_CASES.get(case, (0, 0)))
    factor = max(sizes) / report["size"]
    assert report["enlarged_note"] == ([f"{report['images']} image(s) smaller than their bucket, enlarged 1.25x or "
                                        f"more (most: image 0, {factor:.2f}x); enlarged images teach softness: turn "
                                        "upscale_small_images off on the dataset node to train them in smaller "
                                        "buckets, or lower resolution"] if factor >= 1.25 else [])

    if case in TAG_CASES:  # tag captions in 1 + TAG_SHUFFLES orders each, as stock CLIP Text Encode encodes each
        assert report["tag_orders"] == {"orders": [1 + TAG_SHUFFLES] * report["images"],
                                        "stock_equal": [True] * report["images"]}, report["tag_orders"]
    from realsize_worker import ALPHA_MASKED_OUT_WEIGHT

    # transparent cut-outs: every alpha cached as the loss mask at the real VAE's latent size, trained with what it
    # leaves out counting a little
    assert report["masked_out_weight"] == (ALPHA_MASKED_OUT_WEIGHT if case in ALPHA_CASES else 0.0)
    if case in ALPHA_CASES:
        for masked in report["alpha_masks"]:
            assert masked is not None and masked["mask"] == [1, *masked["latent"][-2:]], masked
            assert 0 < masked["alpha_mean"] < 1 and abs(masked["mean"] - masked["alpha_mean"]) < 1e-4, masked

    from realsize_worker import LORAPLUS_CASES, LORAPLUS_RATIO

    layers = report["lora"]["layers"]
    # one group at the rate; with LoRA+ the up matrices (one per layer) in a second at LORAPLUS_RATIO times it
    expected = [[1e-4, 2 * layers, layers]] if case not in LORAPLUS_CASES else \
        [[1e-4, layers, 0], [pytest.approx(1e-4 * LORAPLUS_RATIO, rel=1e-12), layers, layers]]
    assert [list(group) for group in report["lr_groups"]] == expected

    from realsize_worker import SCALE_NORMS_CASES

    if case in SCALE_NORMS_CASES:  # every layer's update scaled back to the cap: the formed products say so
        cap, norms = SCALE_NORMS_CASES[case], report["norms"]
        assert norms["formed"] == [pytest.approx(cap, rel=1e-4)] * layers, max(norms["formed"])
        assert norms["shown"] == [layers, pytest.approx(cap, rel=1e-4), pytest.approx(cap, rel=1e-4)]
    if "layers_filter" in report:  # LAYERS_CASES: the self-attention of SDXL's output blocks, of its 560 layers
        chosen = report["layers_filter"]
        assert len(chosen["preset"]) == 560
        assert chosen["chosen"] == [p for p in chosen["preset"] if p.startswith("output_blocks.") and ".attn2." not in p]
        assert 0 < len(chosen["chosen"]) < 560
        assert chosen["diffusers_name"].startswith(
            "LoRA Config layers: 'down_blocks.1' matches none of the 560 layers targets=preset selects (named like "
            "input_blocks.4.1."), chosen["diffusers_name"]
        block_scale = {"input_blocks": 0.5, "middle_block": 1.0, "output_blocks": 1.5}  # LAYER_LR_SCALES
        assert chosen["scales"] == {p: block_scale[p.split(".")[0]] for p in chosen["preset"]}
        assert set(chosen["scales"].values()) == {0.5, 1.0, 1.5}
        block_rank = {"input_blocks": 8, "middle_block": 16, "output_blocks": 32}  # LAYER_RANKS, rank 16
        assert chosen["ranks"] == {p: block_rank[p.split(".")[0]] for p in chosen["preset"]}
        alphas = {p: 4.0 if p.startswith("input_blocks.") else 32.0 if ".attn2." in p else 16.0  # LAYER_ALPHAS, alpha 16
                  for p in chosen["preset"]}
        assert chosen["lora_scales"] == {p: alphas[p] / chosen["ranks"][p] for p in chosen["preset"]}
        assert set(chosen["lora_scales"].values()) == {0.5, 1.0, 2.0}  # each alpha / its rank
        assert chosen["planned_elements"] == chosen["ranked_elements"] > 0  # the Memory Plan counts each layer's rank
    if "planner" in report:
        for name, row in report["compared"].items():
            # HiDream-O1's weightless "text encoder" (a tokenizer) is planned at 0 bytes, which is what it holds
            assert row["planner_bytes"] > 0 or report[limits.get(name, "diffusion_bytes")] < 2 ** 20, (name, row)


def test_first_load_replaces_inference_weights_one_at_a_time():
    """nodes/bridge/comfy_model.replace_inference_tensors on Flux-dev's real width (1.1 GB of bf16 weights made under
    inference mode, as ComfyUI's loaders make them; every other block then moved as a GPU load moves it): every
    weight is replaced, and peak RSS grows by about one tensor, not by the weights."""
    report = run_worker("replace")
    growth = report["peak_rss_bytes"] - report["start_rss_bytes"]
    print(f"replace_inference_tensors: weights {report['weight_bytes'] / GIB:.2f} GiB, largest tensor "
          f"{report['largest_tensor_bytes'] / GIB:.2f} GiB, peak RSS growth {growth / GIB:.2f} GiB")
    assert growth < report["largest_tensor_bytes"] + report["weight_bytes"] // 4
    assert report["moved_tensors"] > 0


@pytest.mark.parametrize("arch", ["sdxl", "flux_dev", "wan21_14b"])
def test_host_ram_a_run_adds_is_what_the_plan_says(arch):
    """training/memory/host_ram.py at full depth: a rank-16 LoRA's optimizer state and fp32 masters on the host
    and its EMA copy grow the process's RSS by the plan's figure, within 15 % (the issue's bound)."""
    report = run_worker("host_ram", "--arch", arch, report=f"host_ram_{arch}")
    ratio = report["measured_growth_bytes"] / report["planned_validation_bytes"]
    print(f"host RAM {arch}: {report['trainable_params'] / 1e6:.1f} M trainable, planned "
          f"{report['planned_validation_bytes'] / GIB:.3f} GiB, measured {report['measured_growth_bytes'] / GIB:.3f} GiB "
          f"({ratio:.3f}x)")
    assert 0.85 <= ratio <= 1.15, report


# Flux.2 at real width (tests/realsize_flux2.py): (case, worker arguments, full-depth parameters and LoRA targets,
# reduced-depth parameters and trained layers). Dev keeps one single block at real width (6144): with its double
# block too the bf16 weights alone are 4.6 GB and a CPU training step passes the tier's ~6 GB; its double blocks are
# covered at full depth on the meta device (names, shapes, the stock loader) instead.
FLUX2_CASES = [
    ("flux2_klein_4b", ["--depth", "1", "1"], (3_875_544_576, 80), (563_086_080, 10)),
    ("flux2_klein_9b", ["--depth", "1", "1"], (9_078_581_248, 112), (1_008_730_880, 10)),
    ("flux2_dev", ["--depth", "0", "1"], (32_223_281_152, 160), (1_307_050_240, 2)),
]


def run_cases(script: str, cases: list[dict], timeout: int = 1800) -> dict:
    """`cases` ({arch, ..., out}) in one run of tests/<script> --cases (ComfyUI imported once: ~10 s a process):
    {arch: its report}, or the process's output where it wrote none."""
    for case in cases:
        pathlib.Path(case["out"]).unlink(missing_ok=True)
    listed = ARTIFACTS / f"{pathlib.Path(script).stem}_cases.json"
    listed.parent.mkdir(parents=True, exist_ok=True)
    listed.write_text(json.dumps(cases))
    done = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / script), "--cases", str(listed)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **SCRIPT_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    output = f"{script} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    return {case["arch"]: json.loads(pathlib.Path(case["out"]).read_text()) if pathlib.Path(case["out"]).exists()
            else {"error": output} for case in cases}


@pytest.fixture(scope="module")
def flux2_reports():
    """Every FLUX2_CASES case in one tests/realsize_flux2.py process."""
    return run_cases("realsize_flux2.py", [{"arch": case, "depth": [int(d) for d in args[1:3]],
                                            "out": str(ARTIFACTS / f"{case}.json")} for case, args, _, _ in FLUX2_CASES])


@pytest.mark.parametrize("case, args, full, reduced", FLUX2_CASES, ids=[c[0] for c in FLUX2_CASES])
def test_flux2_lora_keys_map_at_real_width_and_full_depth(flux2_reports, case, args, full, reduced):
    report = flux2_reports[case]
    assert "error" not in report, f"{case} failed:\n{report['error']}"
    deep = report["full_depth"]
    print(f"{case}: full depth {deep['params'] / 1e9:.2f} B, {deep['targets']} preset layers; "
          + "; ".join(f"{fmt}: {f['patched_weights']} patched, {len(f['not_loaded'])} not loaded" for fmt, f in deep["files"].items())
          + f". Reduced depth {report['diffusion_params'] / 1e9:.2f} B bf16: {report['layers']} layers, loss "
          f"{report['loss']:.3f}, {report['s_per_step']:.0f} s/step, latents {report['latent_shape']}; "
          + "; ".join(f"{fmt}: {f['patched_weights']} patched, {len(f['not_loaded'])} not loaded" for fmt, f in report["formats"].items())
          + f". Peak RSS {report['peak_rss_bytes'] / GIB:.2f} GiB, {report['seconds']:.0f} s")
    # Full depth: the config is what ComfyUI's detection derives from the key layout, at the released size.
    assert deep["detected_is_flux2"] and deep["detection_differs"] == {}
    assert (deep["params"], deep["targets"]) == full
    assert deep["unmapped_comfyui"] == deep["unmapped_kohya"] == []
    for file_format, loaded in deep["files"].items():
        assert loaded["not_loaded"] == [] and loaded["patched_weights"] == deep["targets"], file_format
    # Reduced depth, real width: trained through the nodes, saved in every format, all of it mapped.
    assert report["diffusion_params"] == reduced[0] and report["diffusion_dtype"] == "torch.bfloat16"
    assert report["latent_shape"] == [128, 4, 4]  # 64 px through the Flux.2 VAE: 128 channels at 16x
    assert report["loss"] == report["loss"] and report["layers"] == reduced[1]
    for file_format, saved in report["formats"].items():
        assert saved["not_loaded"] == [] and saved["patched_weights"] == report["layers"], file_format
    assert report["base_unchanged"]
    assert report["peak_rss_bytes"] < 6.5 * GIB


# The released depths (tests/realsize_models.py ARCHITECTURES) of the families whose real-size case is reduced to one
# block: (family, the LoRA modules the preset picks per block, those it picks outside the blocks). HiDream-O1: 7
# Linears per decoder layer, plus the pixel patch embedding (x_embedder.proj1 / proj2) and final_layer2.linear.
FULL_DEPTH = {"zimage": ("zimage", 5, 0), "qwen_image": ("qwen_image", 12, 0), "krea2": ("krea2", 8, 0),
              "ideogram4": ("ideogram4", 5, 0), "hidream_o1": ("hidream_o1", 7, 3)}


@pytest.mark.parametrize("arch", list(FULL_DEPTH))
def test_preset_key_names_hold_at_full_depth(comfyui, arch):
    """The full-depth model, built on the meta device from the same unet_config (no memory): the preset picks the
    same names per block as at the real-size case's one block, and every one of them maps through ComfyUI's LoRA key
    map (comfyui, kohya and diffusers names; a family ComfyUI maps no diffusers names for refuses that format), so a
    file of the reduced model's names is a file of the real one's."""
    import comfy.lora
    import comfy.model_detection

    import realsize_models as R
    from headroom.nodes.bridge import families, lora_formats
    from headroom.nodes.bridge.comfy_model import model_blocks
    from headroom.training.core.adapters import AdapterConfig

    family, per_block, outside = FULL_DEPTH[arch]
    with_diffusers = families.get(family).diffusers_component is not None
    picked = {}
    for depth in (1, R.ARCHITECTURES[arch]["depth"]):
        config = comfy.model_detection.model_config_from_unet_config(R.unet_config(arch, depth))
        model = config.get_model({}, "", device="meta")
        assert families.family_of(model).name == family
        dm = model.diffusion_model
        targets = families.lora_targets(dm, family, AdapterConfig(), [n for n, _ in model_blocks(dm)])
        key_map = comfy.lora.model_lora_keys_unet(model, {})
        assert all(key_map.get(f"diffusion_model.{t}") == f"diffusion_model.{t}.weight" for t in targets)
        patcher = type("Patcher", (), {"model": model})()
        kohya = lora_formats.kohya_names(patcher, targets, family)
        assert all(key_map[name] == f"diffusion_model.{t}.weight" for t, name in kohya.items())
        if with_diffusers:
            diffusers = lora_formats.diffusers_names(patcher, targets, family)
            assert set(diffusers) == set(targets)
        else:
            with pytest.raises(ValueError, match="comfyui or kohya format"):
                lora_formats.diffusers_names(patcher, targets, family)
            diffusers = {t: [] for t in targets}
        picked[depth] = (targets, kohya, diffusers)
    (small, small_kohya, small_diffusers), (full, full_kohya, full_diffusers) = picked.values()
    depth = R.ARCHITECTURES[arch]["depth"]
    names = "comfyui, kohya and diffusers names" if with_diffusers else "comfyui and kohya names; diffusers refused"
    print(f"{arch}: {len(small)} preset modules at depth 1, {len(full)} at depth {depth}, all mapped by the stock "
          f"loader ({names})")
    assert len(small) == per_block + outside and len(full) == per_block * depth + outside
    assert set(small) <= set(full)
    assert all(full_kohya[t] == small_kohya[t]
               and [n for n, _ in full_diffusers.get(t, [])] == [n for n, _ in small_diffusers.get(t, [])] for t in small)


# Families whose real-size check is their LoRA key names (tests/realsize_keys.py): (architecture, arguments, family,
# diffusion parameters built). Chroma / HiDream-I1: real width, 1 double + 1 single block; SD2.1: full size;
# SDXL: the full-depth names only (its full-size run above trains, saves and loads through the stock loader).
KEY_CASES = [
    ("chroma", ["--depth", "1,1"], "chroma", 631_086_912),
    ("sd21_768_v", [], "sd2", 865_910_724),
    ("sdxl", ["--meta-only"], "sdxl", None),
    ("hidream_i1", ["--depth", "1,1"], "hidream", 793_443_904),  # 2560 wide, 1 + 1 blocks (17.1 B at full depth)
    # 3584 wide, 1 + 1 blocks (17.4 B at full depth); comfyui and kohya formats (ComfyUI maps no diffusers names)
    ("hunyuan_image_21", ["--depth", "1,1"], "hunyuan_image", 1_121_819_328),
    ("wan21_14b", ["--depth", "1"], "wan21", 584_113_728),  # 5120 wide, 1 block (14 B at full depth; Wan 2.2 A14B experts)
    ("wan21_1_3b", ["--depth", "2"], "wan21", 118_657_088),  # 1536 wide, 2 blocks (1.3 B at full depth)
    # Wan 2.1 I2V 14B: 5120 wide, 1 block, the CLIP-vision projection and image keys / values frozen
    ("wan21_i2v_14b", ["--depth", "1"], "wan21", 645_178_688),
    # 2048 wide, 1 double block and no single ones, as released (8.3 B at full depth: 54 double blocks); the I2V
    # checkpoints have these keys too (one architecture: 65 input channels, the vision input)
    ("hunyuan_video15", ["--depth", "1,0"], "hunyuan_video15", 320_592_672),
    # 4096 wide video / 2048 wide audio, 1 block (19.6 B at full depth: 48 blocks); the connectors and embedders at
    # real size; comfyui and kohya formats (ComfyUI maps no diffusers names)
    ("ltx2", ["--depth", "1"], "ltx2", 1_439_608_064),
]
# Formats HeadroomSaveLora refuses for a family because ComfyUI's key map has no names in them (HunyuanImage, Wan,
# HunyuanVideo 1.5, LTX-2: no diffusers).
REFUSED_FORMATS = {"hunyuan_image": ["diffusers"], "wan21": ["diffusers"], "hunyuan_video15": ["diffusers"],
                   "ltx2": ["diffusers"], "ideogram4": ["diffusers"]}


@pytest.fixture(scope="module")
def key_reports():
    """Every KEY_CASES case in one tests/realsize_keys.py process."""
    return run_cases("realsize_keys.py", [
        {"arch": arch, "depth": args[args.index("--depth") + 1] if "--depth" in args else "",
         "meta_only": "--meta-only" in args, "out": str(ARTIFACTS / f"keys_{arch}.json")} for arch, args, _, _ in KEY_CASES])


@pytest.mark.parametrize("arch, args, family, params", KEY_CASES, ids=[c[0] for c in KEY_CASES])
def test_family_lora_keys_at_real_width(key_reports, arch, args, family, params):
    report = key_reports[arch]
    assert "error" not in report, f"realsize_keys {arch} failed:\n{report['error']}"
    full = report["full_depth"]
    print(f"{arch}: {full['params'] / 1e9:.2f} B params at full depth, {full['trained_layers']} preset layers "
          f"({', '.join(f'{fmt} {n} names' for fmt, n in full['names'].items())}), all in ComfyUI's key map; "
          + (f"built {report['diffusion_params'] / 1e9:.2f} B: " + "; ".join(
              f"{fmt}: {saved['patched_weights']} / {report['trained_layers']} patched, {len(saved['not_loaded'])} not loaded"
              for fmt, saved in report["formats"].items()) if "formats" in report else "names only")
          + f"; {report['seconds']:.0f} s, peak RSS {report['peak_rss_bytes'] / GIB:.2f} GiB")
    assert full["family"] == family and full["detection_mismatches"] == [], full["detection_mismatches"]
    assert [fmt for fmt, why in full["refused"].items() if why] == REFUSED_FORMATS.get(family, []), full["refused"]
    assert sorted(full["names"]) == sorted({"comfyui", "kohya", "diffusers"} - set(REFUSED_FORMATS.get(family, [])))
    assert full["trained_layers"] > 0 and all(n >= full["trained_layers"] for n in full["names"].values())
    assert all(names == [] for names in full["unmapped"].values()), full["unmapped"]
    if params is None:
        return
    assert report["family"] == family and report["diffusion_params"] == params
    assert report["diffusion_dtype"] == "torch.bfloat16" and report["trained_layers"] > 0
    for file_format, saved in report["formats"].items():  # every trained layer through the stock LoraLoader
        assert saved["not_loaded"] == [], (file_format, saved["not_loaded"][:5])
        assert saved["patched_weights"] == report["trained_layers"], file_format
    # the same names at full depth: every layer pattern of the reduced model, and no other
    assert all(differ == [] for differ in full["patterns_differ"].values()), full["patterns_differ"]
    assert report["peak_rss_bytes"] < 6 * GIB
