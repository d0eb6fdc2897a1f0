"""What every model family must do, asked of every family with a tiny model (nodes/bridge/families/<family>.py `tiny`, and
each of its `TINY_VARIANTS`): a new family file or variant is tested here without touching this file.

- overfit: 4 images, the loss on them halves within 300 steps (the trainer learns through the family's model);
- round trip: cache -> train -> validate through stock samplers -> save -> the stock LoraLoader + KSampler reproduce
  the validation image (<= 1e-3), with zero "lora key not loaded", and the base weights unchanged;
- Headroom's own layers (OFT, full fine-tuning) in place of every layer: a training step through the family's model.
"""
from __future__ import annotations

import ast
import math
import pathlib

import pytest
import torch

from family_checks import cached_data, check_stock_round_trip, init_run, overfit

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]


def _variant_names(source: str) -> list[str]:
    """The keys of a family module's `TINY_VARIANTS = {...}` dict literal (none: [])."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TINY_VARIANTS" for t in node.targets):
            return [key.value for key in node.value.keys]
    return []


def _tiny_families() -> list[str]:
    # Read from the registry's files without importing ComfyUI at collection time: module names are family names,
    # variants are the keys of a module's TINY_VARIANTS.
    folder = pathlib.Path(__file__).resolve().parents[2] / "nodes" / "bridge" / "families"
    names = sorted(p.stem for p in folder.glob("*.py") if p.stem not in ("__init__", "base") and not p.stem.startswith("_"))
    found = []
    for name in names:
        source = (folder / f"{name}.py").read_text()
        found += ([name] if "\nTINY = TinyModel(" in source else []) + _variant_names(source)
    return found


TINY_FAMILIES = _tiny_families()


def _tiny(family):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, vae = build_tiny_models(family, 0)
    return (model, clip, vae, *cached_data(model, clip, vae))


def _overfit_targets(family: str) -> tuple[str, bool]:
    """UNet families train their preset with convolutions; the tiny DiTs' random frozen embedders and output layers
    are not the near-identity paths of trained models, so those train every layer."""
    from headroom.nodes.bridge import families, tiny_models

    preset = families.get(tiny_models.tiny_family(family)).lora_preset
    return ("preset", True) if preset.conv is not None else ("all_layers", False)


def test_every_registry_family_is_listed_here(comfyui):
    from headroom.nodes.bridge import families, tiny_models

    assert sorted(tiny_models.FAMILIES) == sorted(TINY_FAMILIES)
    # Registry order, each family's variants after it.
    order = list(families.FAMILIES)
    assert [order.index(tiny_models.tiny_family(name)) for name in tiny_models.FAMILIES] == sorted(
        order.index(tiny_models.tiny_family(name)) for name in tiny_models.FAMILIES)


# The families test_train_lora_nodes.test_overfit_four_images overfits with the settings here (and a held-out item
# whose validation loss must fall too): not overfitted twice (test_the_families_overfit_there_use_these_settings).
OVERFIT_IN_NODE_TESTS = ("sd15", "sd3", "flux", "zimage", "qwen_image")


def test_the_families_overfit_there_use_these_settings(comfyui):
    import test_train_lora_nodes as node_tests

    assert sorted(node_tests.FAMILIES) == sorted(OVERFIT_IN_NODE_TESTS)
    for family in OVERFIT_IN_NODE_TESTS:
        targets, include_conv = _overfit_targets(family)
        assert node_tests.OVERFIT[family] == dict(targets=targets, include_conv=include_conv), family


@pytest.mark.parametrize("family", [family for family in TINY_FAMILIES if family not in OVERFIT_IN_NODE_TESTS])
def test_overfits_four_images(comfyui, family):
    model, _, _, latents, texts = _tiny(family)
    targets, include_conv = _overfit_targets(family)
    run = init_run(model, latents, texts, f"conformance_overfit_{family}", 16, 1e-2, targets, include_conv, "cosine",
                   300)
    initial, final = overfit(run)
    print(f"{family}: {run.step} steps; loss {initial:.4f} -> {final:.4f} ({1 - final / initial:.0%} lower)")
    assert final <= 0.5 * initial


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_saved_lora_reproduces_validation_through_stock_nodes(comfyui, family, caplog):
    model, clip, vae, latents, texts = _tiny(family)
    run = init_run(model, latents, texts, f"conformance_roundtrip_{family}", 8, 2e-2, "preset", False)
    check_stock_round_trip(run, model, clip, vae, caplog, label=family)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_headroom_layers_in_place_of_every_layer_take_a_training_step(comfyui, family):
    """OFT and full fine-tuning put Headroom's own modules where the family's layers were (the other kinds, peft's).
    ComfyUI's model code reads attributes of the layers it calls: Wan's feed-forward reads `.weight` before calling its
    down-projection (comfy.ops.linear_input_act), and both kinds stopped there at the first step."""
    from headroom.nodes import train_lora as T

    model, _, _, latents, texts = _tiny(family)
    # OFT on every Linear of the blocks (a layer outside them may have an odd width: krea2's text projector has 1)
    for kind, rank, targets in (("oft", 2, "all_linear"), ("full", 1, "all_layers")):
        run = init_run(model, latents, texts, f"conformance_{kind}_{family}", rank, 1e-4, targets, False, kind=kind)
        with torch.inference_mode():
            _, loss, step = T.HeadroomTrainSteps.execute(run, 1).args
        assert step == 1 and math.isfinite(loss), (kind, loss)
