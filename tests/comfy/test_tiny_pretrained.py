"""The shipped pretrained tiny SD1.5 model draws what the prompt names: 20 prompts sampled through ComfyUI's own
KSampler path (comfy.sample) and decoded with its VAE, then read by the pixel classifier."""
import pathlib

import pytest
import torch

pytestmark = pytest.mark.comfyui

HELD_OUT = "green"
SAMPLE_STEPS, CFG = 20, 4.0


def pretrain_shape_sizes() -> dict:
    """The shape sizes the shipped weights were trained on (workflows/pretrain_tiny.py --shape-sizes, named in the
    file's settings metadata), as generate_shapes keyword arguments."""
    import json

    from headroom.nodes.bridge.tiny_models import PRETRAINED_FILES
    from headroom.training.data.synthetic import SIZE_PRESETS
    from safetensors import safe_open

    with safe_open(str(PRETRAINED_FILES["sd15"]), "pt") as file:
        settings = json.loads(file.metadata()["headroom_settings"])
    return SIZE_PRESETS[settings["shape_sizes"]]


def prompt_labels(count: int = 20):
    """`count` labels over the colours the model was trained on (never the held-out one), seeded."""
    from headroom.training.data.synthetic import generate_shapes

    labels = [label for label in generate_shapes(216, 64, seed=123).labels if label.colour != HELD_OUT]
    return labels[:count]


def sample(model, clip, vae, prompts: list[str], seed: int = 0, steps: int = SAMPLE_STEPS, cfg: float = CFG):
    import nodes

    negative = nodes.CLIPTextEncode().encode(clip, "")[0]
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    images = []
    with torch.inference_mode():
        for i, prompt in enumerate(prompts):
            positive = nodes.CLIPTextEncode().encode(clip, prompt)[0]
            samples = nodes.common_ksampler(model, seed + i, steps, cfg, "euler", "normal", positive, negative, latent)[0]
            images.append(nodes.VAEDecode().decode(vae, samples)[0])
    return torch.cat(images)


def test_pretrained_weights_load_through_comfyui_and_match_the_file(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models, pretrained_state_dict

    model, clip, vae = build_tiny_models("sd15", weights="pretrained")
    unet = pretrained_state_dict("sd15", "model.diffusion_model.")
    for key, value in model.model.diffusion_model.state_dict().items():
        assert torch.equal(value.float(), unet["model.diffusion_model." + key].float()), key
    first = pretrained_state_dict("sd15", "first_stage_model.")
    for key, value in vae.first_stage_model.state_dict().items():
        assert torch.equal(value.float(), first["first_stage_model." + key].float()), key
    text = pretrained_state_dict("sd15", "cond_stage_model.")
    for key, value in clip.cond_stage_model.state_dict().items():
        assert torch.allclose(value.float(), text["cond_stage_model." + key].float()), key
    # A deep clone (cached_patcher_init) rebuilds the pretrained weights, not random ones.
    rebuilt = model.cached_patcher_init[0](*model.cached_patcher_init[1], disable_dynamic=True)
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.model.diffusion_model.state_dict().values(),
                                                   model.model.diffusion_model.state_dict().values()))


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").is_file(), reason="reads the process's file mappings (Linux)")
def test_the_pretrained_file_is_not_kept_mapped(comfyui):
    """On Windows a mapped file cannot be replaced: an update of the pack (ComfyUI-Manager's git pull while ComfyUI
    runs) that changes the shipped weights would fail. The weights are copied out of the map, which then closes."""
    import gc

    from headroom.nodes.bridge.tiny_models import PRETRAINED_FILES, build_tiny_models

    models = build_tiny_models("sd15", weights="pretrained")
    gc.collect()
    mapped = pathlib.Path("/proc/self/maps").read_text()
    assert models[0] is not None and str(PRETRAINED_FILES["sd15"].resolve()) not in mapped
    # nor is any other file of the pack held open or mapped (docs/WINDOWS.md says updating while ComfyUI runs works)
    pack = pathlib.Path(__file__).resolve().parents[2]
    held = [str(p.resolve()) for p in pathlib.Path("/proc/self/fd").iterdir() if p.exists()]
    held += [line.split(maxsplit=5)[-1] for line in mapped.splitlines() if len(line.split()) == 6]
    ours = [h for h in held if h.startswith(str(pack) + "/")
            and not h[len(str(pack)):].startswith(("/.venv", "/tests/"))]
    assert ours == []


def test_pretrained_only_for_sd15_with_a_clear_error(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with pytest.raises(ValueError, match="pretrained.*sd15"):
        build_tiny_models("sd3", weights="pretrained")
    with pytest.raises(ValueError, match="choose one of random, pretrained"):
        build_tiny_models("sd15", weights="trained")


def test_vae_reconstructs_shapes(comfyui):
    """The autoencoder alone: synthetic images encoded and decoded keep colour, position and shape."""
    from headroom.nodes.bridge.tiny_models import build_tiny_vae
    from headroom.training.core.shape_classifier import score
    from headroom.training.data.synthetic import generate_shapes

    vae = build_tiny_vae("sd15", weights="pretrained")
    trained = generate_shapes(216, 64, seed=5, **pretrain_shape_sizes())  # the sizes it was trained on
    small = generate_shapes(216, 64, seed=5)  # generate_shapes' default sizes: shape reported, not asserted
    with torch.inference_mode():
        figures = score(vae.decode(vae.encode(trained.images)), trained.labels)
        small_figures = score(vae.decode(vae.encode(small.images)), small.labels)
    print(f"VAE round trip, 216 images at the pretraining sizes: {figures}; at the default sizes: {small_figures}")
    assert figures["colour"] >= 0.95 and figures["position"] >= 0.95 and figures["shape"] >= 0.9, figures
    assert small_figures["colour"] >= 0.95 and small_figures["position"] >= 0.95, small_figures


def test_pretrained_model_draws_the_prompt(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.shape_classifier import score

    model, clip, vae = build_tiny_models("sd15", weights="pretrained")
    labels = prompt_labels()
    images = sample(model, clip, vae, [label.caption() for label in labels])
    figures = score(images, labels)
    print(f"pretrained tiny sd15, {len(labels)} prompts, {SAMPLE_STEPS} euler steps, cfg {CFG}: {figures}")
    assert figures["colour"] >= 0.8 and figures["position"] >= 0.8 and figures["shape"] >= 0.8, figures


def test_held_out_colour_is_not_drawn(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.core.shape_classifier import colour_fraction

    model, clip, vae = build_tiny_models("sd15", weights="pretrained")
    labels = prompt_labels(8)
    images = sample(model, clip, vae, [f"a {HELD_OUT} {label.shape} at the {label.position}" for label in labels])
    fraction = colour_fraction(images, HELD_OUT)
    print(f"held-out colour {HELD_OUT!r} drawn in {fraction:.0%} of 8 samples")
    assert fraction <= 0.2


def test_pretrain_script_is_deterministic(comfyui, tmp_path):
    """workflows/pretrain_tiny.py, a few steps of each stage, twice: bit-identical files with the tiny model's keys.

    The second run sees a loaded machine (psutil reports 300 MB available): ComfyUI sizes its attention chunks and
    VAE batches from that figure, which changed the weights (a CI run under load)."""
    import os
    import subprocess
    import sys

    import safetensors.torch
    from headroom.nodes.bridge.tiny_models import pretrained_state_dict

    script = pathlib.Path(__file__).resolve().parents[2] / "workflows" / "pretrain_tiny.py"
    outs = [tmp_path / f"run{i}.safetensors" for i in range(2)]
    temp = tmp_path / "temp"  # the script's temp folder: its throw-away ComfyUI base goes there, and is removed
    temp.mkdir()
    loaded_machine = ("import psutil, runpy, sys\n"
                      "real = psutil.virtual_memory\n"
                      "psutil.virtual_memory = lambda: real()._replace(available=300 << 20)\n"
                      "sys.argv = sys.argv[1:]\n"
                      "runpy.run_path(sys.argv[0], run_name='__main__')\n")
    for out, launch in zip(outs, ([], ["-c", loaded_machine])):
        subprocess.run([sys.executable, *launch, str(script), "--vae-steps", "3", "--steps", "3", "--images", "432",
                        "--vae-images", "64", "--out", str(out)], check=True, capture_output=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(temp)})
    assert list(temp.iterdir()) == []
    first, second = (safetensors.torch.load_file(str(out)) for out in outs)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
    shipped = {key for prefix in ("model.diffusion_model.", "cond_stage_model.", "first_stage_model.")
               for key in pretrained_state_dict("sd15", prefix)}
    assert set(first) == shipped and all(value.dtype == torch.float16 for value in first.values())
