"""The nodes' messages start with the node's name as users see it in the editor, its display name (issue 44): the
error a node raises shows on the node and in ComfyUI's error dialog, where "HeadroomTrainLoraInit" named nothing
the user could find. The all-in-one nodes name themselves, not the Init node whose checks they share."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.comfyui

RUN_INPUTS = dict(model=None, latent_cache=None, text_cache=None, optimizer_config=None, run_name="named_run", seed=0,
                  batch_size=1, grad_accumulation=1, precision="fp32", max_grad_norm=1.0, caption_dropout=0.0,
                  timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0, noise_offset=0.0,
                  gradient_checkpointing=False, checkpoint_depth=1, holdout=0)


def test_node_name_is_the_display_name(comfyui):
    from headroom.nodes import _NODE_MODULES
    from headroom.nodes.bridge.comfy_bridge import node_name
    from headroom.nodes.bridge.tiny_models import NODE as TINY_NODE
    from headroom.nodes.tiny import HeadroomTinyModel

    for node in (node for module in _NODE_MODULES for node in module.NODES):
        assert node_name(node) == node.define_schema().display_name and node_name(node).endswith(" (Headroom)")
    assert TINY_NODE == node_name(HeadroomTinyModel)  # the bridge's copy of the name, for its messages


def test_errors_of_the_init_and_all_in_one_nodes_name_the_node_that_failed(comfyui):
    from headroom.nodes import train_controlnet as C, train_lora as T

    with pytest.raises(ValueError, match=r"^Train LoRA: Init \(Headroom\): lora_config must come from a LoRA Config "
                                         r"\(Headroom\) node$"):
        T.HeadroomTrainLoraInit.execute(**RUN_INPUTS, lora_config="rank 4")
    with pytest.raises(ValueError, match=r"^Train LoRA \(Headroom\): lora_config must come from a LoRA Config "):
        T.HeadroomTrainLora.execute(steps=2, validate_every=0, save_every=0, lora_subfolder="headroom",
                                    **RUN_INPUTS, lora_config="rank 4")
    with pytest.raises(ValueError, match=r"^Train ControlNet: Init \(Headroom\): optimizer_config must come from an "
                                         r"Optimizer Config \(Headroom\) node$"):
        C.HeadroomTrainControlNetInit.execute(**RUN_INPUTS)
    with pytest.raises(ValueError, match=r"^Train ControlNet \(Headroom\): optimizer_config must come from "):
        C.HeadroomTrainControlNet.execute(steps=2, validate_every=0, save_every=0, controlnet_subfolder="headroom",
                                          **RUN_INPUTS)
    with pytest.raises(ValueError, match=r"^Train LoRA: Steps \(Headroom\): checkpoint_every=-1 and "):
        T.HeadroomTrainSteps.execute(None, 5, checkpoint_every=-1)
    # Sample prompts copied from an ai-toolkit config: refused before the run is touched (the all-in-one node: before
    # any step, not at its first validation)
    placeholder = r"prompt line 2 \('\[trigger\] holding a sign'\) holds ai-toolkit's \[trigger\] placeholder"
    with pytest.raises(ValueError, match=r"^Validate LoRA \(Headroom\): " + placeholder):
        T.HeadroomValidate.execute(None, clip=None, vae=None, prompts="a cat\n[trigger] holding a sign", negative="",
                                   sample_seed=0, sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="normal",
                                   width=64, height=64, loss_timesteps=1)
    with pytest.raises(ValueError, match=r"^Train LoRA \(Headroom\): " + placeholder):
        T.HeadroomTrainLora.execute(steps=2, validate_every=0, save_every=0, lora_subfolder="headroom", **RUN_INPUTS,
                                    prompts="a cat\n[trigger] holding a sign")


def test_errors_of_data_and_model_nodes_name_the_node(comfyui):
    from headroom.nodes.data import HeadroomSyntheticDataset
    from headroom.nodes.memory import HeadroomMemoryPlan
    from headroom.nodes.tiny import HeadroomTinyModel

    assert HeadroomSyntheticDataset.validate_inputs(resolution=36) == (
        "Synthetic Dataset (Headroom): resolution=36 must be a multiple of 8")
    with pytest.raises(ValueError, match=r"^Synthetic Dataset \(Headroom\): sizes='huge'; choose one of "):
        HeadroomSyntheticDataset.execute(2, 32, 0, sizes="huge")
    with pytest.raises(ValueError, match=r"^Tiny Model \(Headroom\): unknown family 'sd99'; choose one of "):
        HeadroomTinyModel.execute("sd99", 0)
    with pytest.raises(ValueError, match=r"^Tiny Model \(Headroom\): weights='pretrained' exists for the sd15 family"):
        HeadroomTinyModel.execute("flux", 0, "pretrained")
    with pytest.raises(ValueError, match=r"^Memory Plan \(Headroom\): policy must come from an Offload Policy "
                                         r"\(Headroom\) node$"):
        HeadroomMemoryPlan.execute(None, "estimate", 1, 64, 64, 4, "preset", "AdamW", "fp32", 0, policy="resident")
