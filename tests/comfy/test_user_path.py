"""A new user's path through the nodes (issue 25) on a real in-process ComfyUI: the everyday training node is small,
a batch larger than the data says so, the dataset folder is a list with helpful errors, a trigger word re-encodes
the captions, and results are shown where the user looks."""
from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

pytestmark = [pytest.mark.comfyui, pytest.mark.usefixtures("one_torch_thread")]

WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
EVERYDAY_WIDGETS = 15
SEED_NAMES = {"seed", "noise_seed"}
# Inputs only some families or expert set (video, edit / reference, noise range, prior images, several devices...).
FAMILY_SPECIFIC = {"frames", "frame_rate", "start_image", "reference", "reference_images", "noise_min", "noise_max",
                   "devices", "prior_latent_cache", "prior_text_cache", "prior_ratio", "huber_delta", "loss_type",
                   "ema_decay", "min_snr_gamma", "checkpoint_depth", "checkpoint_every", "checkpoint_minutes"}


def _inputs(node_cls) -> list[tuple[str, str, dict]]:
    info = json.loads(json.dumps(node_cls.GET_NODE_INFO_V1()))
    found = []
    for section in ("required", "optional"):
        specs = info["input"].get(section) or {}
        for name in (info.get("input_order") or {}).get(section) or list(specs):
            spec = specs[name]
            kind = "COMBO" if isinstance(spec[0], list) else spec[0]
            found.append((name, kind, spec[1] if len(spec) > 1 else {}))
    return found


@pytest.mark.parametrize("node", ["HeadroomTrainLora", "HeadroomTrainControlNet"])
def test_everyday_training_node_shows_at_most_15_widgets(headroom_nodes, node):
    from headroom.nodes.train_controlnet import HeadroomTrainControlNet
    from headroom.nodes.train_lora import HeadroomTrainLora

    node_cls = {"HeadroomTrainLora": HeadroomTrainLora, "HeadroomTrainControlNet": HeadroomTrainControlNet}[node]
    inputs = _inputs(node_cls)
    shown = [name for name, kind, options in inputs if kind in WIDGET_TYPES and not options.get("advanced")]
    # The editor gives seed inputs a second widget (control after generate).
    shown += [f"{name}: control_after_generate" for name in shown if name in SEED_NAMES]
    assert len(shown) <= EVERYDAY_WIDGETS, f"{node} shows {len(shown)} widgets by default: {shown}"
    assert {"run_name", "steps", "prompts", "batch_size"} <= set(shown), shown
    advanced = {name for name, _, options in inputs if options.get("advanced")}
    present = {name for name, _, _ in inputs}
    assert FAMILY_SPECIFIC & present <= advanced, sorted((FAMILY_SPECIFIC & present) - advanced)


def _data(count, resolution=32, seed=0, trigger_word=""):
    from headroom.nodes import cache as cache_nodes, data as data_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        images, captions, _ = data_nodes.HeadroomSyntheticDataset.execute(count, resolution, seed).args
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(images, captions, resolution, 64 if resolution % 64 == 0
                                                                else 32, "center", False, 0,
                                                                trigger_word=trigger_word).args[0]
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts, summary = cache_nodes.HeadroomCacheText.execute(dataset, clip).args
    return model, clip, vae, latents, texts, dataset, summary


def _all_in_one(model, latents, texts, run_name, batch_size, steps=2):
    from headroom.nodes import train_lora as T

    with torch.inference_mode():
        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
        return T.HeadroomTrainLora.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name=run_name, seed=0, batch_size=batch_size, grad_accumulation=1, precision="fp32",
            max_grad_norm=1.0, caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none",
            min_snr_gamma=5.0, noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0,
            steps=steps, validate_every=0, save_every=0, lora_subfolder="headroom")


def test_batch_larger_than_the_data_warns_and_config_records_the_batch_trained(comfyui, caplog):
    model, clip, vae, latents, texts, _, _ = _data(2)
    with caplog.at_level("WARNING"):
        output = _all_in_one(model, latents, texts, "batch_too_big", batch_size=8)
    run = output.args[1]
    text = "\n".join(output.ui["text"])
    assert "batch_size=8" in text and "training with batch 2" in text, text
    assert any("training with batch 2" in record.getMessage() for record in caplog.records)
    assert run.trainer.config.batch_size == 2
    stored = json.loads(run.run_dir.config_path.read_text())
    assert stored["session"]["train"]["batch_size"] == 2

    # A run folder stored before batches were cut (batch_size 8 recorded) trains the same batches: it resumes.
    stored["session"]["train"]["batch_size"] = 8
    run.run_dir.config_path.write_text(json.dumps(stored))
    output = _all_in_one(model, latents, texts, "batch_too_big", batch_size=8, steps=3)
    resumed = output.args[1]
    assert resumed.step == 3 and resumed.trainer.config.batch_size == 8
    assert "training with batch 2 (config.json of this older run says 8)" in "\n".join(output.ui["text"])

    # A batch that fits every bucket says nothing.
    quiet = _all_in_one(model, latents, texts, "batch_fits", batch_size=2)
    assert not any("batch_size" in line for line in quiet.ui["text"]), quiet.ui["text"]
    # The save is said on the node too: the run and step saved, where the file went, relative to models/.
    assert quiet.ui["text"][-1] == ("run 'batch_fits', step 2: LoRA saved to "
                                    "models/loras/headroom/batch_fits_step000002.safetensors")


def test_batch_larger_than_a_bucket_warns_on_the_node(comfyui):
    """Two aspect-ratio buckets of 3 and 1 items: batch 2 fits the larger, the smaller gives batches of 1."""
    from headroom.nodes import cache as cache_nodes
    from headroom.nodes.bridge.tiny_models import build_tiny_models
    from headroom.nodes.train_lora import HeadroomTrainLoraInit

    with torch.inference_mode():
        model, clip, vae = build_tiny_models("sd15", 0)
        square = torch.rand(3, 64, 64, 3)
        wide = torch.rand(1, 32, 128, 3)
        dataset = cache_nodes.HeadroomDatasetFromImages.execute(square, "a\nb\nc", 64, 32, "center", False, 0).args[0]
        wide_set = cache_nodes.HeadroomDatasetFromImages.execute(wide, "d", 64, 32, "center", False, 0).args[0]
        dataset = type(dataset)(**{**dataset.__dict__, "items": dataset.items + wide_set.items})
        latents = cache_nodes.HeadroomCacheLatents.execute(dataset, vae).args[0]
        texts = cache_nodes.HeadroomCacheText.execute(dataset, clip).args[0]
        assert sorted(map(len, latents.buckets.values())) == [1, 3]
        from headroom.nodes import train_lora as T

        lora = T.HeadroomLoraConfig.execute("lora", 4, 4.0, "preset", False, 0.0, 0).args[0]
        opt = T.HeadroomOptimizerConfig.execute("AdamW", 1e-3, 0.0, "constant", 0, 100).args[0]
        init = HeadroomTrainLoraInit.execute(
            model=model, latent_cache=latents, text_cache=texts, lora_config=lora, optimizer_config=opt,
            run_name="bucket_small", seed=0, batch_size=2, grad_accumulation=1, precision="fp32", max_grad_norm=1.0,
            caption_dropout=0.0, timestep_sampling="uniform", loss_weighting="none", min_snr_gamma=5.0,
            noise_offset=0.0, gradient_checkpointing=False, checkpoint_depth=1, holdout=0)
    [text] = init.ui.as_dict()["text"]
    assert text.startswith("run 'bucket_small', step 0: started\n"), text  # the run it opened, and its step
    assert "batch_size=2 is larger than 1 of the 2 aspect-ratio buckets (sizes 1, 3)" in text, text
    assert init.args[0].trainer.config.batch_size == 2


def _encoded(summary: str) -> tuple[int, int]:
    """(hits, encoded) of a Cache Text summary."""
    hits, encoded = re.search(r"(\d+) hits / (\d+) encoded", summary).groups()
    return int(hits), int(encoded)


def test_trigger_word_prefixes_captions_and_re_encodes_the_text_cache(comfyui, cache_dir):
    *_, plain, plain_summary = _data(2)
    *_, dataset, summary = _data(2, trigger_word=" sks_shape ")
    assert [item.caption for item in dataset.items] == [f"sks_shape, {item.caption}" for item in plain.items]
    assert _encoded(plain_summary) == (0, 3)  # two captions and the empty prompt
    assert _encoded(summary) == (1, 2), summary  # the captions changed: encoded again (the empty prompt is reused)
    assert _encoded(_data(2, trigger_word="sks_shape")[-1]) == (3, 0)  # the same word: all reused
    assert _encoded(_data(2, trigger_word="zz_other")[-1]) == (1, 2)
    # A caption that starts with the word already keeps it once.
    from headroom.training.data.dataset import with_trigger_word

    assert [item.caption for item in with_trigger_word(dataset, "sks_shape").items] == [
        item.caption for item in dataset.items]
    from headroom.nodes.cache import HeadroomDatasetFromImages

    with pytest.raises(ValueError, match=r"Dataset From Images \(Headroom\): trigger_word .* control characters"):
        HeadroomDatasetFromImages.execute(torch.rand(1, 64, 64, 3), "a", 64, 64, "center", False, 0,
                                          trigger_word="a\nb")


def _write_dataset(folder, count=2):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (64, 64), (40 * index, 90, 200)).save(folder / f"img{index}.png")
        (folder / f"img{index}.txt").write_text(f"a photo number {index}")


def test_dataset_folder_is_a_list_of_input_folders_that_still_takes_typed_values(comfyui):
    import folder_paths
    from headroom.nodes.cache import HeadroomDatasetFromFolder, HeadroomDatasetFromVideos

    root = pathlib.Path(folder_paths.get_input_directory())
    _write_dataset(root / "my_photos")
    _write_dataset(root / "old" / "typed" / "deep" / "set")  # deeper than the list goes
    (root / ".hidden").mkdir(exist_ok=True)
    for node_cls in (HeadroomDatasetFromFolder, HeadroomDatasetFromVideos):
        [(kind, options)] = [(kind, options) for name, kind, options in _inputs(node_cls) if name == "folder"]
        assert kind == "COMBO" and "my_photos" in options["options"] and "old/typed" in options["options"]
        assert ".hidden" not in options["options"] and "old/typed/deep/set" not in options["options"]

    # A value typed in an older workflow (not in the list) passes validation and runs.
    assert HeadroomDatasetFromFolder.validate_inputs(folder="old/typed/deep/set") is True
    with torch.inference_mode():
        dataset = HeadroomDatasetFromFolder.execute("old/typed/deep/set", 64, 64, "center", False, 0, False,
                                                    trigger_word="sks").args[0]
    assert [item.caption for item in dataset.items] == ["sks, a photo number 0", "sks, a photo number 1"]

    # A typo: the node's error names it and the closest existing folders.
    with pytest.raises(ValueError, match=r"^Dataset From Folder \(Headroom\): folder 'my_photo' is not a folder in "
                       r"ComfyUI's input directory \(.*closest existing: 'my_photos'"):
        HeadroomDatasetFromFolder.execute("my_photo", 64, 64, "center", False, 0, False)
    with pytest.raises(ValueError, match="outside the folders this server reads datasets from"):
        HeadroomDatasetFromFolder.execute("../../etc", 64, 64, "center", False, 0, False)
    assert HeadroomDatasetFromFolder.validate_inputs(folder=None) is True  # linked: checked when it runs
    assert "must be a folder name" in HeadroomDatasetFromFolder.validate_inputs(folder=3)


def test_save_and_validate_name_the_run_and_step_and_validate_shows_the_before_after_grid(comfyui):
    """Each result a node shows on itself names the run and step it belongs to (issue 44): a result of an earlier
    step or another run never reads as current."""
    import folder_paths
    from headroom.nodes import train_lora as T

    model, clip, vae, latents, texts, _, _ = _data(2)
    run = _all_in_one(model, latents, texts, "shown_results", batch_size=2).args[1]
    with torch.inference_mode():
        saved = T.HeadroomSaveLora.execute(run, "mine", "shown", "fp16")
        sampling = dict(clip=clip, vae=vae, prompts="a red circle", negative="", sample_seed=0, sample_steps=2,
                        cfg=1.0, sampler_name="euler", scheduler="normal", width=32, height=32, loss_timesteps=2)
        plain = T.HeadroomValidate.execute(run, **sampling)
        compared = T.HeadroomValidate.execute(run, **sampling, compare_base=True)
    assert saved.ui["text"] == ["run 'shown_results', step 2: LoRA saved to models/loras/mine/shown.safetensors"]
    grid = "output/headroom_runs/shown_results/validation/step_00000002.png"
    [said] = plain.ui["text"]
    assert re.fullmatch(rf"run 'shown_results', step 2: validation loss [\d.e-]+; grid saved to {grid}", said), said
    assert compared.ui["text"][0].startswith("run 'shown_results', step 2: validation loss ")
    with torch.inference_mode():
        T.HeadroomTrainSteps.execute(run, 3)
        later = T.HeadroomSaveLora.execute(run, "mine", "", "fp16")
        no_prompts = T.HeadroomValidate.execute(run, **{**sampling, "prompts": ""})
    assert later.ui["text"] == ["run 'shown_results', step 3: LoRA saved to "
                                "models/loras/mine/shown_results_step000003.safetensors"]
    assert re.fullmatch(r"run 'shown_results', step 3: validation loss [\d.e-]+", no_prompts.ui["text"][0])
    assert [image["type"] for image in plain.ui["images"]] == ["temp"]  # the samples
    [image] = compared.ui["images"]  # the before/after grid, from the run folder under output/
    assert image["filename"] == "step_00000002_before_after.png" and image["type"] == "output", image
    path = pathlib.Path(folder_paths.get_output_directory(), image["subfolder"], image["filename"])
    assert path.is_file() and path == run.run_dir.validation_dir / image["filename"]


def test_the_longest_run_name_still_saves_under_its_default_file_names(comfyui):
    """A run name of the full 100 characters trains; the default file names add "_step000123" (and "_extracted"), which
    a 100-character limit on file names refused only at the save, after the training."""
    from types import SimpleNamespace

    from headroom.nodes.bridge.model_files import models_file
    from headroom.training.core.run_dir import check_name

    name = check_name("n" * 100)
    run = SimpleNamespace(run_dir=SimpleNamespace(name=name), step=123)
    _, path = models_file("loras", "headroom", "", run, "LoRA")
    assert path.name == f"{name}_step000123.safetensors"
    _, path = models_file("loras", "headroom", f"{name}_step000123_extracted", run, "LoRA")
    assert path.name == f"{name}_step000123_extracted.safetensors"
    with pytest.raises(ValueError, match=r"run name 'n{101}' is not allowed: use 1-100 letters"):
        check_name("n" * 101)
