"""Nodes that take only one kind of run (Save LoRA / Apply Trained LoRA: LoRA runs; Save ControlNet: ControlNet runs)
given the other kind: a ValueError naming the node to use instead, before anything is written. Real tiny runs
(sd15, in-process ComfyUI, CPU)."""
import json
import time

import pytest
import torch

pytestmark = pytest.mark.comfyui


_INPUTS = {}  # the LoRA Init inputs the fixture used (but run_name)


@pytest.fixture(scope="module")
def runs(comfyui):
    """(model, a LoRA run, a ControlNet run) on the tiny sd15 model, both at step 0."""
    from family_checks import control_data, init_inputs
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.nodes.train_lora import HeadroomLoraConfig, HeadroomTrainLoraInit

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, clip, vae = build_tiny_models("sd15", 0)
        common = init_inputs(model, *control_data(model, clip, vae, count=2))
        lora_config = HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        _INPUTS.update(common, lora_config=lora_config)
        lora_run = HeadroomTrainLoraInit.execute(lora_config=lora_config, run_name=f"kind_lora_{time.time_ns()}",
                                                 **common).args[0]
        controlnet_run = HeadroomTrainControlNetInit.execute(run_name=f"kind_cn_{time.time_ns()}", **common).args[0]
        yield model, lora_run, controlnet_run
    finally:
        _INPUTS.clear()  # a module global holding the MODEL would outlive ComfyUI's modules at interpreter exit
        torch.set_num_threads(previous)


def _saved(folder: str) -> list:
    import folder_paths

    return sorted(folder_paths.get_filename_list(folder))


def test_lora_only_nodes_refuse_a_controlnet_run_naming_the_node_to_use(runs):
    from headroom.nodes.train_lora import HeadroomApplyTrainedLora, HeadroomExtractLora, HeadroomSaveLora

    model, _, controlnet_run = runs
    assert controlnet_run.trains == "controlnet"
    before = _saved("loras")
    with pytest.raises(ValueError, match=r"^Save LoRA \(Headroom\): run 'kind_cn_\d+' is a ControlNet run and this node "
                                         r"takes LoRA runs only; for a ControlNet run use Save ControlNet \(Headroom\)$"):
        HeadroomSaveLora.execute(controlnet_run, "kinds", "", "fp32")
    with pytest.raises(ValueError, match=r"^Extract LoRA from Full Fine-tune \(Headroom\): run 'kind_cn_\d+' is a ControlNet run and this node "
                                         r"takes LoRA runs only; for a ControlNet run use Save ControlNet \(Headroom\)$"):
        HeadroomExtractLora.execute(controlnet_run, 8, 0.0, "kinds", "", "fp32")
    assert _saved("loras") == before
    with pytest.raises(ValueError, match=r"^Apply Trained LoRA \(Headroom\): run 'kind_cn_\d+' is a ControlNet run .* use "
                                         r"the control_net output of its Init / Train ControlNet node"):
        HeadroomApplyTrainedLora.execute(model, controlnet_run, 1.0)
    # The LoRA-only parts say the same when asked for directly (a ControlNet run once inherited LoRA-only methods,
    # which failed with AttributeError); and the ControlNet-only parts of a LoRA run.
    with pytest.raises(ValueError, match="is a ControlNet run, not a LoRA run"):
        controlnet_run.adapters  # noqa: B018
    with pytest.raises(ValueError, match="is a ControlNet run, not a LoRA run"):
        controlnet_run.trained_as("lora")
    with pytest.raises(ValueError, match="is a LoRA run, not a ControlNet run"):
        runs[1].controlnet  # noqa: B018
    assert not hasattr(controlnet_run.trained, "patched_model") and not hasattr(runs[1].trained, "comfy_controlnet")


def test_controlnet_only_nodes_refuse_a_lora_run_naming_the_node_to_use(runs):
    from headroom.nodes.train_controlnet import HeadroomSaveControlNet

    _, lora_run, _ = runs
    assert lora_run.trains == "lora"
    before = _saved("controlnet")
    with pytest.raises(ValueError, match=r"^Save ControlNet \(Headroom\): run 'kind_lora_\d+' is a LoRA run and this node "
                                         r"takes ControlNet runs only; for a LoRA run use Save LoRA \(Headroom\)$"):
        HeadroomSaveControlNet.execute(lora_run, "kinds", "")
    assert _saved("controlnet") == before


def test_nodes_given_something_else_say_what_they_take(runs):
    from headroom.nodes.train_controlnet import HeadroomSaveControlNet
    from headroom.nodes.train_lora import HeadroomApplyTrainedLora, HeadroomSaveLora

    model = runs[0]
    with pytest.raises(ValueError, match=r"Save LoRA \(Headroom\): the run input must be a TRAINING_RUN .*, not str"):
        HeadroomSaveLora.execute("run", "kinds", "", "fp32")
    with pytest.raises(ValueError, match=r"Apply Trained LoRA \(Headroom\): the run input must be a TRAINING_RUN"):
        HeadroomApplyTrainedLora.execute(model, None, 1.0)
    with pytest.raises(ValueError, match=r"Save ControlNet \(Headroom\): the run input must be a TRAINING_RUN"):
        HeadroomSaveControlNet.execute(object(), "kinds", "")


def test_the_right_runs_still_save(runs):
    from headroom.nodes.train_controlnet import HeadroomSaveControlNet
    from headroom.nodes.train_lora import HeadroomApplyTrainedLora, HeadroomSaveLora

    model, lora_run, controlnet_run = runs
    assert HeadroomSaveLora.execute(lora_run, "kinds", "", "fp32").args[0] in _saved("loras")
    assert HeadroomApplyTrainedLora.execute(model, lora_run, 1.0).args[0] is not model
    assert HeadroomSaveControlNet.execute(controlnet_run, "kinds", "").args[0] in _saved("controlnet")


def test_stored_family_names_are_unchanged(runs):
    """Run folders and files keep the names they had before the family registry, so existing runs resume: a LoRA
    run stores its family (sd15), a ControlNet run its ControlNet type under the key "family" (unet for SD1.x)."""
    _, lora_run, controlnet_run = runs
    lora_config, controlnet_config = lora_run.run_dir.read_config(), controlnet_run.run_dir.read_config()
    assert lora_config["session"]["family"] == "sd15"
    assert lora_run.metadata()["headroom.family"] == "sd15"
    assert set(controlnet_config["session"]) == {"family", "blocks", "init_seed", "optimizer", "train", "holdout",
                                                 "controlnet_precision"}
    assert controlnet_config["session"]["family"] == "unet" and "controlnet_type" not in controlnet_config["session"]
    assert controlnet_run.controlnet.type_name == "unet"
    assert ", unet ControlNet, " in repr(controlnet_run)


def test_controlnet_runs_stored_before_controlnet_precision_resume_as_fp32(runs):
    """A ControlNet run folder written before the setting existed trained fp32 weights: it resumes with fp32 (the
    default), and another value is refused naming the stored one."""
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit

    _, _, controlnet_run = runs
    path = controlnet_run.run_dir.path / "config.json"
    stored = json.loads(path.read_text())
    assert stored["session"].pop("controlnet_precision") == "fp32"
    path.write_text(json.dumps(stored))  # as older versions wrote it
    inputs = {key: value for key, value in _INPUTS.items() if key != "lora_config"}
    again = HeadroomTrainControlNetInit.execute(**inputs, run_name=controlnet_run.run_dir.name).args[0]
    assert again.run_dir.path == controlnet_run.run_dir.path and again.controlnet.dtype == torch.float32
    with pytest.raises(ValueError, match=r"session.controlnet_precision: stored 'fp32', now 'bf16_stochastic'"):
        HeadroomTrainControlNetInit.execute(**{**inputs, "precision": "bf16"}, run_name=controlnet_run.run_dir.name,
                                            controlnet_precision="bf16_stochastic",
                                            policy=_fused_policy())


def _fused_policy():
    from headroom.training.memory.policy import OffloadPolicy

    return OffloadPolicy(fused_backward=True)


def test_runs_stored_with_the_nodes_checkpointing_settings_resume(runs):
    """Run folders written when the run's TrainConfig held gradient_checkpointing / checkpoint_depth (now mapped into
    the offload policy, which is no part of a run's identity) resume, with any checkpointing."""
    from headroom.nodes.train_lora import HeadroomTrainLoraInit

    _, lora_run, _ = runs
    path = lora_run.run_dir.path / "config.json"
    stored = json.loads(path.read_text())
    assert "gradient_checkpointing" not in stored["session"]["train"]
    stored["session"]["train"].update(gradient_checkpointing=True, checkpoint_depth=2)  # as older versions wrote it
    path.write_text(json.dumps(stored))
    again = HeadroomTrainLoraInit.execute(**{**_INPUTS, "gradient_checkpointing": False},
                                          run_name=lora_run.run_dir.name).args[0]
    assert again.run_dir.path == lora_run.run_dir.path and again.policy.checkpointing == "off"
    assert again.run_dir.read_config()["session"]["train"]["checkpoint_depth"] == 2  # the stored file is kept
