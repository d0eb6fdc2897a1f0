"""Files another program holds (Explorer's preview, an image viewer, a second ComfyUI, an antivirus scan) on the user
paths of the LoRA tool nodes and of keep_saves, in process on a real ComfyUI with Windows imitated
(tests/windows_imitation.py): Windows neither replaces nor removes a held file. A tool node writing over one waits,
then names the file and the holders and keeps the file as it was; Inspect LoRA reads a held file and holds none
after it returns; a step save keep_saves cannot remove is named, the run goes on, and the next prune removes it."""
from __future__ import annotations

import os
import pathlib
import threading

import pytest
import torch

from headroom.training import os_compat
from headroom.training.data.files import WriteError

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

HELD_WAIT_S = 0.3  # os_compat.REPLACE_WAIT_S in the tests that wait it out: a held file is never released there


@pytest.fixture(scope="module")
def sd15(comfyui):
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        return build_tiny_models("sd15", 0)


def _loras(subfolder: str) -> pathlib.Path:
    import folder_paths

    folder = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / subfolder
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _lora_file(model, subfolder: str, name: str, seed: int, suffix: str = ".safetensors") -> str:
    """A rank-4 kohya-named LoRA on two of the tiny model's Linear weights, written as another program writes it
    (not through the pack); returns the name Load LoRA lists."""
    import comfy.lora
    import folder_paths

    weights = model.model.state_dict()
    layers = [(key, weights[weight].shape) for key, weight in comfy.lora.model_lora_keys_unet(model.model, {}).items()
              if key.startswith("lora_unet_") and weight in weights and weights[weight].dim() == 2][:2]
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for layer, (out, inner) in layers:
        state[f"{layer}.lora_up.weight"] = torch.randn(out, 4, generator=generator) * 0.1
        state[f"{layer}.lora_down.weight"] = torch.randn(4, inner, generator=generator) * 0.1
        state[f"{layer}.alpha"] = torch.tensor(4.0)
    path = _loras(subfolder) / (name + suffix)
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(path))
    else:
        torch.save(state, path)
    folder_paths.filename_list_cache.pop("loras", None)
    return f"{subfolder}/{name}{suffix}"


def _ranks(path: pathlib.Path) -> set[int]:
    from safetensors.torch import load

    return {tensor.shape[0] for key, tensor in load(path.read_bytes()).items() if key.endswith(".lora_down.weight")}


def _resize(model, rank: int):
    from headroom.nodes import train_lora as T

    source = _lora_file(model, "held_resize", "source", seed=1)
    with torch.inference_mode():
        return T.HeadroomResizeLora.execute(source, rank, 0.0, "held_resize", "resized", "auto")


def _merge(model, rank: int):
    from headroom.nodes import train_lora as T

    first, second = (_lora_file(model, "held_merge", f"source_{seed}", seed) for seed in (1, 2))
    with torch.inference_mode():
        return T.HeadroomMergeLoras.execute(model, rank, 0.0, "held_merge", "merged", "auto", "comfyui",
                                            lora_1=first, strength_1=1.0, lora_2=second, strength_2=1.0)


@pytest.mark.parametrize("tool, what, node", [(_resize, "resized LoRA", "Resize LoRA (Headroom)"),
                                              (_merge, "merged LoRA", "Merge LoRAs (Headroom)")],
                         ids=["resize", "merge"])
def test_a_lora_tool_saving_over_a_file_another_program_holds_waits_then_names_it_and_keeps_the_old_one(
        windows, sd15, monkeypatch, tool, what, node):
    """Resize LoRA / Merge LoRAs queued again with the same filename while the earlier result is open in another
    program (a Load LoRA of a second ComfyUI, an antivirus scan): Windows refuses to replace it. A holder that lets
    go within the wait is waited for; one that does not is named with what to do, by the node (its own error type,
    which ComfyUI's report shows), and the earlier file stays whole beside no half-written temp."""
    import folder_paths

    model = sd15[0]
    name = tool(model, 2).args[0]
    output = pathlib.Path(folder_paths.get_full_path("loras", name))
    assert _ranks(output) == {2}
    earlier = output.read_bytes()

    monkeypatch.setattr(os_compat, "REPLACE_WAIT_S", HELD_WAIT_S)
    with windows.hold_open(output), pytest.raises(WriteError) as raised:
        tool(model, 1)
    message = str(raised.value)
    assert message.startswith(f"{node}: {what} could not be written to models/loras/{name}"), message
    assert "in use by another program" in message and "antivirus" in message and "Load LoRA" in message
    assert "Close it, then queue again" in message and "everything written before is kept" in message
    assert output.read_bytes() == earlier
    assert not [path.name for path in output.parent.iterdir() if path.name.startswith(".")]

    monkeypatch.setattr(os_compat, "REPLACE_WAIT_S", 5.0)
    with windows.hold_open(output):  # the scan ends 0.2 s into the save: the save waits for it
        threading.Timer(0.2, windows.held.clear).start()
        assert tool(model, 1).args[0] == name
    assert _ranks(output) == {1}
    assert not [path.name for path in output.parent.iterdir() if path.name.startswith(".")]
    for path in output.parent.iterdir():  # the result and the files read, as Explorer deletes them: refused while
        os.remove(path)  # this process still has one open or mapped (the imitation)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_inspect_lora_reads_a_file_another_program_holds_and_holds_it_no_longer_than_the_node_runs(
        windows, sd15, monkeypatch, suffix):
    """Inspect LoRA on a file open in another program (Explorer's preview, a second ComfyUI) reads it, since
    Windows lets a held file be read; once the node returns, nothing in ComfyUI's process has it open or mapped,
    so the user can delete it in Explorer (its header read of a .safetensors file maps it, as the stock loader's read
    of a .pt file does with ComfyUI's --mmap-torch-files)."""
    import comfy.utils
    import folder_paths

    from headroom.nodes import train_lora as T

    monkeypatch.setattr(comfy.utils, "MMAP_TORCH_FILES", True)  # ComfyUI's --mmap-torch-files: a .pt file mapped
    model = sd15[0]
    name = _lora_file(model, "held_inspect", "inspected", seed=3, suffix=suffix)
    path = folder_paths.get_full_path("loras", name)
    with windows.hold_open(path), torch.inference_mode():
        report, _ = T.HeadroomInspectLora.execute(name, model).args
    assert "Load LoRA patches 2 weights" in report and "layers: LoRA 2, rank 4" in report, report
    os.remove(path)  # as Explorer deletes it: refused while this process still has it open or mapped
    assert not os.path.exists(path)


def test_keep_saves_names_a_step_save_another_program_holds_goes_on_and_removes_it_once_let_go(
        windows, sd15, cache_dir):
    """Train LoRA keep_saves 2, saving every step, while another program (an image viewer's LoRA preview, a Load
    LoRA of a second ComfyUI) holds step 1's save: Windows refuses to remove it. The node names it once and the run
    trains on, nothing else is lost; once it is let go the next prune removes it. The run's outputs are kept
    between queues, as ComfyUI keeps them: they hold no save either (else Windows would refuse every prune)."""
    from family_checks import cached_data
    from headroom.nodes import train_lora as T

    model, clip, vae = sd15
    latents, texts = cached_data(model, clip, vae, resolution=32)
    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
    inputs = dict(model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
                  run_name="held_keep", seed=0, batch_size=2, grad_accumulation=1, precision="fp32",
                  max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
                  min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0,
                  validate_every=0, save_every=1, lora_subfolder="held_keep", keep_saves=2)
    folder = _loras("held_keep")

    def saves():
        return sorted(path.name for path in folder.iterdir())

    kept = []  # each queue's outputs, as ComfyUI keeps them
    with torch.inference_mode():
        kept.append(T.HeadroomTrainLora.execute(steps=2, **inputs))
    assert saves() == ["held_keep_step000001.safetensors", "held_keep_step000002.safetensors"]
    with windows.hold_open(folder / "held_keep_step000001.safetensors"), torch.inference_mode():
        kept.append(T.HeadroomTrainLora.execute(steps=4, **inputs))
    held = kept[-1]
    assert held.args[1].step == 4
    assert saves() == ["held_keep_step000001.safetensors", "held_keep_step000003.safetensors",
                       "held_keep_step000004.safetensors"]  # step 2 pruned past the held one
    warnings = [line for line in held.ui["text"] if line.startswith("Warning:")]
    assert warnings == ["Warning: older save held_keep_step000001.safetensors not removed (The process cannot access "
                        "the file because it is being used by another process; open in a loader or another program? "
                        "Once it is closed, the run's next save removes it)"], held.ui["text"]
    assert "1 older save(s) removed (keep_saves 2): held_keep_step000002.safetensors" in held.ui["text"]

    with torch.inference_mode():  # let go: the next save's prune removes it with the one now older
        kept.append(T.HeadroomTrainLora.execute(steps=5, **inputs))
    assert saves() == ["held_keep_step000004.safetensors", "held_keep_step000005.safetensors"]
    assert not [line for line in kept[-1].ui["text"] if line.startswith("Warning:")]
    assert ("2 older save(s) removed (keep_saves 2): held_keep_step000001.safetensors, "
            "held_keep_step000003.safetensors") in kept[-1].ui["text"]
