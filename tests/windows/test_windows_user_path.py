"""A Windows user's path, in process on a real ComfyUI, with Windows imitated (tests/windows_imitation.py): the tiny
LoRA template with a dataset folder made in Explorer (a name with spaces and an umlaut) -> caches -> train -> cancel
-> queue again (the run resumes from its checkpoint, as after a restart) -> validate -> save -> the stock Load LoRA
node. And the pack loads where `resource` does not exist."""
from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from comfy_harness import queue_prompt
from windows_imitation import mapped_files

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS, CANCEL_AT = 6, 3


def _explorer_dataset(folder: pathlib.Path, count: int = 4) -> None:
    """Pictures and captions as a Windows user saves them: Notepad's UTF-8 with BOM and CR-LF, Explorer's
    Thumbs.db and desktop.ini beside them."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        image = Image.new("RGB", (64, 64), (20, 20, 20))
        ImageDraw.Draw(image).ellipse((8 + 4 * index, 8, 40 + 4 * index, 40), fill=(30, 200, 40))
        image.save(folder / f"photo {index:02d}.png")
        (folder / f"photo {index:02d}.txt").write_bytes(f"\ufeffa green circle number {index}\r\n".encode("utf-8"))
    (folder / "Thumbs.db").write_bytes(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1")
    (folder / "desktop.ini").write_bytes(b"[.ShellClassInfo]\r\nIconResource=C:\\Windows\\system32\\imageres.dll\r\n")


def _template_prompt(dataset: str) -> dict:
    """workflows/api/tiny_lora_api.json, its synthetic data replaced by a dataset folder, made short."""
    prompt = json.loads((REPO / "workflows" / "api" / "tiny_lora_api.json").read_text(encoding="utf-8"))
    assert prompt["2"]["class_type"] == "HeadroomSyntheticDataset" and prompt["3"]["class_type"] == "HeadroomDatasetFromImages"
    del prompt["2"], prompt["13"]  # PreviewAny shows the monitor's text: not what this test looks at
    prompt["3"] = {"class_type": "HeadroomDatasetFromFolder", "inputs": {
        "folder": dataset, "resolution": 64, "step": 64, "crop": "center", "flip": False, "seed": 0, "skip_bad": False,
        "trigger_word": ""}}
    prompt["8"]["inputs"]["run_name"] = "windows_user"
    prompt["9"]["inputs"]["steps"] = STEPS
    prompt["10"]["inputs"]["prompts"] = "a green circle number 1"
    prompt["10"]["inputs"]["sample_steps"] = 2
    return prompt


def _queue(prompt: dict, prompt_id: str):
    """One queue of `prompt` through ComfyUI's own validation and PromptExecutor (a fresh executor: nothing kept in
    memory from an earlier queue, as after a restart of ComfyUI)."""
    return queue_prompt(prompt, prompt_id)


@pytest.mark.min_torch
def test_a_windows_user_trains_cancels_resumes_and_loads_the_lora(windows, comfyui, cache_dir, monkeypatch, caplog):
    import comfy.model_management
    import folder_paths
    import nodes

    import headroom.nodes as headroom_nodes
    from headroom.nodes.bridge import comfy_bridge
    from headroom.nodes.tiny import HeadroomTinyModel

    for module in headroom_nodes._NODE_MODULES:
        for node in module.NODES:
            monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.GET_SCHEMA().node_id, node)
    _explorer_dataset(pathlib.Path(folder_paths.get_input_directory()) / "Fotos von Jürgen")
    prompt = _template_prompt("Fotos von Jürgen")

    steps_seen = []
    real_send_event = comfy_bridge.send_event

    def cancel_once(event, data):  # the user presses Cancel while step CANCEL_AT is shown
        real_send_event(event, data)
        if event == comfy_bridge.STEP_EVENT:
            steps_seen.append(data["step"])
            if data["step"] == CANCEL_AT and len(steps_seen) == CANCEL_AT:
                comfy.model_management.interrupt_current_processing(True)

    monkeypatch.setattr(comfy_bridge, "send_event", cancel_once)
    first = _queue(prompt, "first")
    comfy.model_management.interrupt_current_processing(False)
    assert not first.success and steps_seen == [1, 2, 3]
    run_folder = pathlib.Path(folder_paths.get_output_directory()) / "headroom_runs" / "windows_user"
    assert json.loads((run_folder / "latest.json").read_text(encoding="utf-8"))["step"] == CANCEL_AT

    with caplog.at_level(logging.WARNING):
        second = _queue(prompt, "second")
    assert second.success, second.status_messages
    assert steps_seen == [1, 2, 3, 4, 5, 6]  # resumed at the saved step, not started over
    # Nothing the run read stays mapped: safetensors before 0.8 (the portable build's 0.6.2, the min_torch venv's)
    # returns views of a mapping of the file, which Windows would keep from being pruned, replaced or deleted.
    output = os.path.realpath(folder_paths.get_output_directory()) + os.sep
    assert not [path for path in mapped_files() if path.startswith(output)]
    outputs = second.history_result["outputs"]
    assert outputs["10"]["images"], "validation shows its images"
    lora_name = "headroom/windows_user_step000006.safetensors"
    lora_path = pathlib.Path(folder_paths.get_folder_paths("loras")[0]) / lora_name
    assert lora_path.is_file() and not [p for p in lora_path.parent.iterdir() if p.name.startswith(".")]
    assert json.loads((run_folder / "latest.json").read_text(encoding="utf-8"))["step"] == STEPS

    # The stock Load LoRA node loads every key of the saved file.
    with torch.inference_mode():
        model, clip, _ = HeadroomTinyModel.execute("sd15", 0, "pretrained").args
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        patched_model, patched_clip = nodes.LoraLoader().load_lora(model, clip, lora_name, 1.0, 1.0)
    assert not [r for r in caplog.records if "lora key not loaded" in r.getMessage()]
    assert len(patched_model.patches) > 0


@pytest.mark.min_torch
def test_the_pack_loads_where_resource_does_not_exist(headroom_nodes, tmp_path):
    """In a fresh Python whose `resource` / `fcntl` / `termios` cannot be imported by the pack (Windows), ComfyUI's V3
    entry point lists every node (before training/os_compat.py: IMPORT FAILED, no node at all)."""
    script = f"""
import sys
sys.path[:0] = [{str(REPO / 'tests')!r}]
import conftest  # registers the repo as the package `headroom`
import pytest
from comfy_harness import import_comfyui_in_process
from windows_imitation import WindowsImitation
patch = pytest.MonkeyPatch()
import headroom.training.os_compat  # the imitation switches its branch; nothing else of the pack is imported yet
WindowsImitation(patch).install()
import_comfyui_in_process()
import asyncio, headroom
extension = asyncio.run(headroom.comfy_entrypoint())
nodes = asyncio.run(extension.get_node_list())
from headroom.training.memory import memory_stats
assert memory_stats.device_memory_snapshot("cpu")["process_peak_rss_bytes"] > 0
print("NODES", len(nodes))
"""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    count = int(done.stdout.split("NODES")[-1])
    assert count == sum(len(module.NODES) for module in headroom_nodes._NODE_MODULES) and count > 20


@pytest.mark.min_torch
def test_between_calls_a_run_holds_no_cache_file_so_the_cache_folder_can_be_deleted(windows, comfyui, cache_dir):
    """ComfyUI keeps a node's outputs, so a run lives on between queues with the caches it read. Windows deletes no
    file mapped or open: after Train Steps and Validate return, none of the cache's shards is held, and the user can
    delete the cache folder in Explorer while ComfyUI runs (before: the shards the run read last stayed mapped; and
    after Validate with prompts, as_saved_file and compare_base sampling, which never attach the run's model: the
    shard of the empty caption read for the prompts' width check)."""
    import shutil

    import windows_imitation
    from family_checks import cached_data, init_run
    from headroom.nodes import train_lora as T
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
    latents, texts = cached_data(model, clip, vae, resolution=32)
    run = init_run(model, latents, texts, "windows_cache_folder", rank=4, lr=1e-3, targets="preset",
                   include_conv=False)
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 2)
        T.HeadroomValidate.execute(run, loss_timesteps=1)
        T.HeadroomValidate.execute(run, clip=clip, vae=vae, prompts="a red circle", negative="", sample_seed=0,
                                   sample_steps=1, cfg=1.0, sampler_name="euler", scheduler="normal", width=32,
                                   height=32, loss_timesteps=1, lora_application="as_saved_file", compare_base=True)
    shards = [str(path.resolve()) for path in cache_dir.rglob("*.safetensors")]
    assert shards
    held = windows_imitation.mapped_files() | windows_imitation.open_files()
    assert not [shard for shard in shards if shard in held]
    shutil.rmtree(cache_dir)  # as Explorer deletes it: refused for a held file (tests/windows_imitation.py)
    assert not cache_dir.exists() and run.step == 2



def _held_shards(cache_dir: pathlib.Path) -> list[str]:
    """The cache's shard files this process holds mapped or open now (Windows would refuse to delete them)."""
    import windows_imitation

    held = windows_imitation.mapped_files() | windows_imitation.open_files()
    return [path.name for path in cache_dir.rglob("*.safetensors") if str(path.resolve()) in held]


def test_the_caching_and_init_nodes_return_holding_no_cache_shard(windows, comfyui, cache_dir):
    """Before a run trains, the user caches and opens it; ComfyUI keeps those nodes' outputs. None of them returns
    with a shard mapped (before: Cache Latents kept the shard it read the latent channels from, and both Init nodes
    the one their checks read the first caption from), so the cache folder can be deleted in Explorer before the
    first step, also after an Init that refused its inputs."""
    import shutil

    from family_checks import control_data, init_inputs
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_controlnet import HeadroomTrainControlNetInit
    from headroom.nodes.train_lora import HeadroomLoraConfig, HeadroomTrainLoraInit

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        latents, texts = control_data(model, clip, vae)
        assert not _held_shards(cache_dir)
        lora = HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        common = init_inputs(model, latents, texts, batch_size=2)
        HeadroomTrainLoraInit.execute(**common, lora_config=lora, run_name="windows_held_lora",
                                      prior_latent_cache=latents, prior_text_cache=texts)
        assert not _held_shards(cache_dir)
        with pytest.raises(ValueError, match="reference"):  # SD1.5 takes no reference latents: refused after reading
            HeadroomTrainLoraInit.execute(**common, lora_config=lora, run_name="windows_held_refused",
                                          reference="control latents")
        assert not _held_shards(cache_dir)
        HeadroomTrainControlNetInit.execute(**common, run_name="windows_held_controlnet")
        assert not _held_shards(cache_dir)
    shutil.rmtree(cache_dir)  # as Explorer deletes it: refused for a held file (tests/windows_imitation.py)
    assert not cache_dir.exists()


def test_a_plan_that_finds_a_cache_shard_unreadable_leaves_none_of_the_others_mapped(windows, comfyui, cache_dir,
                                                                                   monkeypatch):
    """The planner reads every caption's cached text length (cache_run_shape) shard by shard. A shard that turns
    unreadable meanwhile (deleted, truncated by a disk tool) stops the plan with an error naming it and the caching
    node; the shards it had read before stay unmapped all the same, so the user can delete the cache folder and cache
    again while ComfyUI runs."""
    import shutil

    from family_checks import cached_data
    from headroom.nodes.bridge import planning
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.training.data import cache_store

    # One entry per shard (shard_bytes 1), so the plan maps one shard per caption before it meets the bad one.
    monkeypatch.setattr(cache_store.ShardStore.__init__, "__defaults__", (1, None))
    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
    latents, texts = cached_data(model, clip, vae, resolution=32)
    assert len(list((cache_dir / "text").rglob("*.safetensors"))) >= 4
    read, seen = texts.text_length, []

    def length_after_the_next_shard_turned_bad(key):
        if len(seen) == 1:  # the second caption's shard is cut short on disk before the plan reads it
            shard = texts._entries[key][0][1]
            (cache_dir / "text" / "shards" / shard).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
        seen.append(key)
        return read(key)

    monkeypatch.setattr(texts, "text_length", length_after_the_next_shard_turned_bad)
    with pytest.raises(cache_store.CacheStoreError, match=r"unreadable.*Cache Text \(Headroom\) again"):
        planning.cache_run_shape(model, latents, texts, 2, "Train LoRA: Init (Headroom)")
    assert len(seen) == 2 and not _held_shards(cache_dir)
    shutil.rmtree(cache_dir)
    assert not cache_dir.exists()
