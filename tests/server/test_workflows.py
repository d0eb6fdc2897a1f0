"""Every shipped workflow against a real ComfyUI server with Headroom (the `comfy_server` fixture).

- Both formats agree with the server's /object_info: every node type and input exists, required inputs
  are given, links join declared output and input types, values fit their widgets (combo choices,
  number ranges), except model file names and Load Image's input image, which the bare test server does not have.
- The shipped files are exactly what workflows/build_workflows.py builds from this server's /object_info.
- The server's own validation (POST /prompt) rejects the real-model workflows for missing model files and input
  images only (a bare test server has none), so everything else in them passes ComfyUI's checks.
- The tiny workflows run to completion headless (the one on the user's folder on a folder of generated images; without
  its folder it stops with Dataset From Folder's message), and so do the video workflows with their loaders swapped for a tiny
  model of their family (and sizes, steps and optimizer shrunk for a CPU): the shipped graph itself trains,
  validates a clip and saves.
"""
import json
import pathlib
import urllib.error
import urllib.request
import uuid

import pytest

from headroom.workflows import build_workflows

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS = REPO_ROOT / "workflows"
API = WORKFLOWS / build_workflows.API_FOLDER
API_FILES = sorted(API.glob("*_api.json"))
UI_FILES = sorted(WORKFLOWS.glob("*.json"))
MODEL_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin", ".sft", ".gguf")
IMAGE_FILE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
DATASET_FOLDER_NODES = ("HeadroomDatasetFromFolder", "HeadroomDatasetFromVideos")
MATCH_TYPE = "COMFY_MATCHTYPE_V3"  # a V3 input/output whose type follows what is connected


@pytest.fixture(scope="module")
def object_info(comfy_server) -> dict:
    return comfy_server.object_info()


def ids(paths):
    return [p.name for p in paths]


# --- type and value rules (as ComfyUI's validation applies them) ---------------------------------------------
def types_match(output_type: str, input_type: str) -> bool:
    if output_type == "*" or input_type == "*":
        return True
    return bool(set(output_type.split(",")) & set(input_type.split(",")))


def resolved_output_type(prompt: dict, object_info: dict, node_id: str, slot: int) -> str:
    """The type an output carries; a match-type output carries whatever its node's match-type input gets."""
    node = prompt[node_id]
    declared = object_info[node["class_type"]]["output"][slot]
    if declared != MATCH_TYPE:
        return declared
    for name, _, spec in build_workflows.input_specs(object_info[node["class_type"]]):
        value = node["inputs"].get(name)
        if spec[0] == MATCH_TYPE and isinstance(value, list):
            return resolved_output_type(prompt, object_info, value[0], value[1])
    return "*"


def accepts(spec: list, output_type: str) -> bool:
    if spec[0] == MATCH_TYPE:
        allowed = build_workflows.spec_options(spec).get("template", {}).get("allowed_types", "*")
        return types_match(output_type, allowed)
    return types_match(output_type, build_workflows.spec_type(spec))


def is_model_file(value) -> bool:
    return isinstance(value, str) and value.lower().endswith(MODEL_FILE_SUFFIXES)


def input_images(prompt: dict) -> set[str]:
    """The images the workflow's Load Image nodes read from ComfyUI's input/ folder (the user's own files), and the
    dataset folders its dataset nodes read there (a choice of input/'s subfolders)."""
    return {node["inputs"]["image"] for node in prompt.values()
            if node["class_type"] == "LoadImage" and str(node["inputs"]["image"]).lower().endswith(IMAGE_FILE_SUFFIXES)
            } | dataset_folders(prompt)


def dataset_folders(prompt: dict) -> set[str]:
    return {node["inputs"]["folder"] for node in prompt.values() if node["class_type"] in DATASET_FOLDER_NODES}


def value_problem(spec: list, value, user_files: frozenset = frozenset()) -> str | None:
    """Why `value` does not fit the widget `spec` (None if it fits)."""
    kind = build_workflows.spec_type(spec)
    options = build_workflows.spec_options(spec)
    if kind == "COMBO":
        choices = build_workflows.combo_choices(spec)
        # The bare test server has no model files or input images: those names may be missing from the list.
        if value in choices or is_model_file(value) or value in user_files:
            return None
        return f"{value!r} is not one of {choices}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{value!r} is not a boolean"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{value!r} is not a string"
    if kind in ("INT", "FLOAT"):
        number_types = int if kind == "INT" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number_types):
            return f"{value!r} is not an {kind}"
        if ("min" in options and value < options["min"]) or ("max" in options and value > options["max"]):
            return f"{value!r} is outside [{options.get('min')}, {options.get('max')}]"
    return None


# --- API format -------------------------------------------------------------------------------------------------
def api_problems(prompt: dict, object_info: dict) -> list[str]:
    problems = []
    user_images = frozenset(input_images(prompt))
    for node_id, node in prompt.items():
        kind = node.get("class_type")
        if kind not in object_info:
            problems.append(f"node {node_id}: {kind} is not a node type of this server")
            continue
        specs = {name: (section, spec) for name, section, spec in build_workflows.input_specs(object_info[kind])}
        for name, value in node["inputs"].items():
            where = f"node {node_id} ({kind}) input {name!r}"
            if name not in specs:
                problems.append(f"{where}: no such input; inputs: {sorted(specs)}")
                continue
            section, spec = specs[name]
            if isinstance(value, list):
                source_id, slot = value
                if source_id not in prompt:
                    problems.append(f"{where}: links to missing node {source_id}")
                    continue
                source_outputs = object_info.get(prompt[source_id]["class_type"], {}).get("output", [])
                if not 0 <= slot < len(source_outputs):
                    problems.append(f"{where}: links to output {slot} of node {source_id}, which has {len(source_outputs)}")
                    continue
                output_type = resolved_output_type(prompt, object_info, source_id, slot)
                if not accepts(spec, output_type):
                    problems.append(f"{where}: gets {output_type} from node {source_id}, wants {build_workflows.spec_type(spec)}")
            elif not build_workflows.is_widget(spec):
                problems.append(f"{where}: a {build_workflows.spec_type(spec)} input needs a link, got {value!r}")
            elif (problem := value_problem(spec, value, user_images)) is not None:
                problems.append(f"{where}: {problem}")
        for name, (section, _) in specs.items():
            if section == "required" and name not in node["inputs"]:
                problems.append(f"node {node_id} ({kind}): required input {name!r} missing")
    return problems


@pytest.mark.parametrize("path", API_FILES, ids=ids(API_FILES))
def test_api_workflow_matches_object_info(object_info, path):
    prompt = json.loads(path.read_text())
    assert prompt, f"{path.name} is empty"
    assert api_problems(prompt, object_info) == []


# --- UI format --------------------------------------------------------------------------------------------------
def ui_problems(workflow: dict, object_info: dict) -> list[str]:
    problems = []
    links = {link[0]: link for link in workflow["links"]}
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for node in workflow["nodes"]:
        kind = node["type"]
        if kind in build_workflows.FRONTEND_ONLY_TYPES:
            continue
        where = f"node {node['id']} ({kind})"
        if kind not in object_info:
            problems.append(f"{where}: not a node type of this server")
            continue
        info = object_info[kind]
        specs = {name: spec for name, _, spec in build_workflows.input_specs(info)}
        widget_count = sum(1 + build_workflows.has_control_widget(name, spec)
                           for name, spec in specs.items() if build_workflows.is_widget(spec))
        if len(node.get("widgets_values", [])) != widget_count:
            problems.append(f"{where}: {len(node.get('widgets_values', []))} widget values, the node has {widget_count} widgets")
        for slot, socket in enumerate(node.get("inputs", [])):
            if socket["name"] not in specs:
                problems.append(f"{where}: no input {socket['name']!r}")
                continue
            if socket.get("link") is None:
                continue
            link = links.get(socket["link"])
            if link is None or link[3] != node["id"] or link[4] != slot:
                problems.append(f"{where} input {socket['name']!r}: link {socket['link']} does not end here")
                continue
            source = nodes.get(link[1])
            if source is None or source["type"] not in object_info:
                problems.append(f"{where} input {socket['name']!r}: link from unknown node {link[1]}")
                continue
            outputs = object_info[source["type"]]["output"]
            if not 0 <= link[2] < len(outputs) or link[5] != outputs[link[2]]:
                problems.append(f"{where} input {socket['name']!r}: link type {link[5]} is not output {link[2]} of {source['type']}")
            elif outputs[link[2]] != MATCH_TYPE and not accepts(specs[socket["name"]], outputs[link[2]]):
                problems.append(f"{where} input {socket['name']!r}: gets {outputs[link[2]]}, wants {build_workflows.spec_type(specs[socket['name']])}")
        for name, spec in specs.items():
            required = name in info["input"].get("required", {})
            linked = any(s["name"] == name and s.get("link") is not None for s in node.get("inputs", []))
            if required and not build_workflows.is_widget(spec) and not linked:
                problems.append(f"{where}: required input {name!r} is not connected")
    return problems


@pytest.mark.parametrize("path", UI_FILES, ids=ids(UI_FILES))
def test_ui_workflow_matches_object_info(object_info, path):
    workflow = json.loads(path.read_text())
    assert workflow.get("version") == 0.4 and workflow["nodes"], f"{path.name} is not a UI-format workflow"
    assert ui_problems(workflow, object_info) == []


def test_every_ui_workflow_has_its_api_twin():
    assert UI_FILES, "no UI-format workflow shipped"
    missing = [p.name for p in UI_FILES if not (API / f"{p.stem}_api.json").exists()]
    assert missing == []


@pytest.mark.parametrize("make", build_workflows.WORKFLOWS, ids=[m.__name__ for m in build_workflows.WORKFLOWS])
def test_shipped_files_are_what_the_generator_builds(object_info, make):
    workflow = make()
    ui, api = build_workflows.build(workflow, object_info)
    hint = "re-run `python workflows/build_workflows.py --server <url>` and review the diff"
    assert json.loads((WORKFLOWS / f"{workflow.name}.json").read_text()) == ui, hint
    assert json.loads((API / f"{workflow.name}_api.json").read_text()) == api, hint


# --- the server's own validation and real runs -----------------------------------------------------------------
REAL_MODEL_WORKFLOWS = [m for m in build_workflows.WORKFLOWS
                        if m.__name__ not in build_workflows.TINY_WORKFLOWS | build_workflows.FOLDER_WORKFLOWS]


def post_prompt(server, prompt: dict) -> tuple[int, dict]:
    """POST /prompt; (HTTP status, ComfyUI's JSON answer)."""
    request = urllib.request.Request(server.url + "/prompt", data=json.dumps({"prompt": prompt}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("make", REAL_MODEL_WORKFLOWS, ids=[m.__name__ for m in REAL_MODEL_WORKFLOWS])
def test_server_rejects_real_model_workflow_only_for_missing_model_files(comfy_server, make):
    name = make().name
    prompt = json.loads((API / f"{name}_api.json").read_text())
    model_files = {v for node in prompt.values() for v in node["inputs"].values() if is_model_file(v)}
    assert model_files, f"{name} names no model file"
    images = input_images(prompt)
    status, answer = post_prompt(comfy_server, prompt)
    if status == 200:  # it would start a real-model run: stop it, then fail
        comfy_server.delete_queued(answer["prompt_id"])
        comfy_server.interrupt(answer["prompt_id"])
        pytest.fail(f"{name}: the server accepted a workflow whose model files it does not have")
    errors = [(node_id, error) for node_id, node in answer.get("node_errors", {}).items() for error in node["errors"]]
    assert errors, answer
    def missing_file(node_id, error) -> bool:
        if error["type"] == "value_not_in_list":
            return error["extra_info"]["received_value"] in model_files
        # Load Image's own check (VALIDATE_INPUTS): "Invalid image file: <name>".
        return (error["type"] == "custom_validation_failed" and prompt[node_id]["class_type"] == "LoadImage"
                and prompt[node_id]["inputs"]["image"] in images)

    unexpected = [(node_id, error) for node_id, error in errors if not missing_file(node_id, error)]
    assert unexpected == []


@pytest.mark.parametrize("name", sorted(build_workflows.TINY_WORKFLOWS))
def test_tiny_workflow_runs_to_completion(comfy_server, name):
    prompt = json.loads((API / f"{name}_api.json").read_text())
    # A run name of its own, so a run left by an earlier test does not make this one resume.
    run_name = f"{name}_{uuid.uuid4().hex[:8]}"
    for node in prompt.values():
        if "run_name" in node["inputs"]:
            node["inputs"]["run_name"] = run_name
    execution = comfy_server.run_workflow(prompt, timeout=900)
    assert execution.status == "success"
    monitors = [node_id for node_id, node in prompt.items() if node["class_type"] == "HeadroomVRAMMonitor"]
    assert monitors, f"{name} has no memory monitor"
    for node_id in monitors:
        assert execution.outputs[node_id]["headroom_vram"], f"monitor {node_id} reported nothing"
    # What the run trained was saved where the stock loaders look (file names start with the run name).
    saved = [path for folder in ("loras", "controlnet")
             for path in (comfy_server.base_dir / "models" / folder).rglob(f"{run_name}*.safetensors")]
    assert saved, f"no models/loras or models/controlnet file of run {run_name}"


# --- the tiny workflow on the user's own folder -------------------------------------------------------------------
def write_image_folder(folder: pathlib.Path, count: int) -> None:
    """`count` 80x64 pictures (not the model's 64 x 64: the bucket crops them) with same-name captions."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True)
    for index in range(count):
        image = Image.new("RGB", (80, 64), (30 * index, 90, 160))
        ImageDraw.Draw(image).ellipse((20, 12, 60, 52), fill=(250, 200 - 40 * index, 40))
        image.save(folder / f"photo{index}.png")
        (folder / f"photo{index}.txt").write_text(f"a yellow circle number {index}")


@pytest.mark.parametrize("name", sorted(build_workflows.FOLDER_WORKFLOWS))
def test_folder_workflow_trains_on_a_folder_of_images(comfy_server, name):
    """The shipped API form on a folder of generated images with captions, as a user fills input/<folder>: only the
    folder, run name and lengths changed; the run trains, validates (before/after grid) and saves the LoRA."""
    prompt = json.loads((API / f"{name}_api.json").read_text())
    nodes = {node["class_type"]: node["inputs"] for node in prompt.values()}
    assert nodes["HeadroomDatasetFromFolder"]["resolution"] == 64  # the tiny model's size, not the node's 512
    assert nodes["HeadroomDatasetFromFolder"]["trigger_word"], "the template shows an example trigger word"
    run_name = f"{name}_{uuid.uuid4().hex[:8]}"
    write_image_folder(comfy_server.base_dir / "input" / run_name, 3)
    nodes["HeadroomDatasetFromFolder"]["folder"] = run_name
    nodes["HeadroomTrainLoraInit"]["run_name"] = run_name
    nodes["HeadroomTrainSteps"]["steps"] = 3
    nodes["HeadroomValidate"].update(sample_steps=2, loss_timesteps=1)
    execution = comfy_server.run_workflow(prompt, timeout=900)
    assert execution.status == "success"
    saved = list((comfy_server.base_dir / "models" / "loras" / "headroom").glob(f"{run_name}_step*.safetensors"))
    assert [path.name for path in saved] == [f"{run_name}_step000003.safetensors"], saved
    validation = comfy_server.base_dir / "output" / "headroom_runs" / run_name / "validation"
    assert list(validation.glob("*_before_after.png")), f"no before/after grid in {validation}"


@pytest.mark.parametrize("name", sorted(build_workflows.FOLDER_WORKFLOWS))
def test_folder_workflow_without_its_folder_says_which_folder_to_create(comfy_server, name):
    """Shipped as it is, on a server whose input/ lacks the template's folder: ComfyUI's validation lets the prompt
    through (no "value not in list" about a folder the editor's list may not have yet), and Dataset From Folder
    stops it naming the folder, input/ and the folders there."""
    prompt = json.loads((API / f"{name}_api.json").read_text())
    folder = dataset_folders(prompt).pop()
    assert folder == build_workflows.YOUR_FOLDER and folder != "3d"  # not a folder ComfyUI makes itself
    assert not (comfy_server.base_dir / "input" / folder).exists()
    prompt_id = comfy_server.queue(prompt)  # raises WorkflowError with ComfyUI's text if validation refuses it
    execution = comfy_server.wait(prompt_id, timeout=600)
    assert execution.status == "error"
    assert execution.error["node_type"] == "HeadroomDatasetFromFolder", execution.error
    message = execution.error["exception_message"]
    assert message.startswith(f"Dataset From Folder (Headroom): folder '{folder}' is not a folder in ComfyUI's "
                              "input directory"), message
    assert "press R in the editor" in message, message


# --- the video workflows on tiny models of their families ------------------------------------------------------
LOADER_TYPES = {"UNETLoader", "CheckpointLoaderSimple", "CLIPLoader", "DualCLIPLoader", "VAELoader",
                "LTXAVTextEncoderLoader"}
TINY_MODEL_OUTPUTS = ["MODEL", "CLIP", "VAE"]  # HeadroomTinyModel's outputs, in order


def with_tiny_model(prompt: dict, object_info: dict, family: str) -> dict:
    """The workflow with its loaders replaced by one HeadroomTinyModel of `family`: every link to a loader's MODEL,
    CLIP or VAE comes from the tiny model's output of that type."""
    loaders = {node_id for node_id, node in prompt.items() if node["class_type"] in LOADER_TYPES}
    assert loaders, "no stock loader in the workflow"
    tiny_id = "900"
    swapped = {node_id: node for node_id, node in prompt.items() if node_id not in loaders}
    for node in swapped.values():
        for name, value in node["inputs"].items():
            if isinstance(value, list) and value[0] in loaders:
                output_type = object_info[prompt[value[0]]["class_type"]]["output"][value[1]]
                node["inputs"][name] = [tiny_id, TINY_MODEL_OUTPUTS.index(output_type)]
    swapped[tiny_id] = {"class_type": "HeadroomTinyModel", "inputs": {"family": family, "seed": 0}}
    return swapped


def write_clips(folder: pathlib.Path, count: int, size: int, frames: int) -> None:
    """`count` moving-shape clips as frame folders with their captions (clip_0/ + clip_0.txt)."""
    import numpy as np
    from PIL import Image

    from headroom.training.data.synthetic import generate_moving_shapes

    clips = generate_moving_shapes(count, size, frames, 0)
    for index, (clip, caption) in enumerate(zip(clips.clips, clips.captions)):
        frame_folder = folder / f"clip_{index}"
        frame_folder.mkdir(parents=True)
        for frame_index, frame in enumerate(clip):
            pixels = (frame.numpy() * 255).round().astype(np.uint8)
            Image.fromarray(pixels).save(frame_folder / f"frame_{frame_index:04d}.png")
        (folder / f"clip_{index}.txt").write_text(caption)


# (workflow, family, clip side in pixels (the datasets' smallest), frames (two latent frames by the family's rule))
VIDEO_WORKFLOWS = [("hunyuan_video15_lora", "hunyuan_video15", 64, 5), ("ltx2_lora", "ltx2", 64, 9)]


@pytest.mark.parametrize("name, family, size, frames", VIDEO_WORKFLOWS, ids=[w[0] for w in VIDEO_WORKFLOWS])
def test_video_workflow_runs_on_a_tiny_model_of_its_family(comfy_server, object_info, name, family, size, frames):
    prompt = with_tiny_model(json.loads((API / f"{name}_api.json").read_text()), object_info, family)
    nodes = {node["class_type"]: node["inputs"] for node in prompt.values()}
    run_name = f"{name}_{uuid.uuid4().hex[:8]}"
    write_clips(comfy_server.base_dir / "input" / run_name, 2, size, frames)
    nodes["HeadroomDatasetFromVideos"].update(folder=run_name, resolution=size, max_frames=frames)
    nodes["HeadroomOptimizerConfig"].update(optimizer="AdamW")  # bitsandbytes' 8-bit AdamW needs a GPU
    nodes["HeadroomTrainLoraInit"].update(run_name=run_name, precision="fp32")
    nodes["HeadroomTrainSteps"].update(steps=2)
    nodes["HeadroomValidate"].update(width=size, height=size, frames=frames, sample_steps=2, loss_timesteps=1)
    execution = comfy_server.run_workflow(prompt, timeout=900)
    assert execution.status == "success"
    saved = list((comfy_server.base_dir / "models" / "loras").rglob(f"{run_name}*.safetensors"))
    assert saved, f"no LoRA of run {run_name} in models/loras"
    validation = comfy_server.base_dir / "output" / "headroom_runs" / run_name / "validation"
    assert list(validation.glob("*.webp")), f"no validation clip in {validation}"


# (workflow, family, image side in pixels: the tiny model's smallest sample with whole patches). The full fine-tune
# templates run with their memory options (kind full, fused backward, bf16 weights, Adafactor, the card's auto fit).
IMAGE_WORKFLOWS = [("hidream_o1_lora", "hidream_o1", 64), ("sdxl_full_finetune", "sdxl", 64),
                   ("flux_full_finetune", "flux", 64)]


@pytest.mark.parametrize("name, family, size", IMAGE_WORKFLOWS, ids=[w[0] for w in IMAGE_WORKFLOWS])
def test_image_workflow_runs_on_a_tiny_model_of_its_family(comfy_server, object_info, name, family, size):
    """The shipped graph (its one Train LoRA node, its validation sampler and scheduler, its bucket step) with the
    loader swapped for a tiny model of its family: it trains, validates and saves."""
    prompt = with_tiny_model(json.loads((API / f"{name}_api.json").read_text()), object_info, family)
    nodes = {node["class_type"]: node["inputs"] for node in prompt.values()}
    run_name = f"{name}_{uuid.uuid4().hex[:8]}"
    write_image_folder(comfy_server.base_dir / "input" / run_name, 2)
    nodes["HeadroomDatasetFromFolder"].update(folder=run_name, resolution=size)
    if nodes["HeadroomOptimizerConfig"]["optimizer"] == "AdamW8bit":
        nodes["HeadroomOptimizerConfig"].update(optimizer="AdamW")  # bitsandbytes' 8-bit AdamW needs a GPU
    nodes["HeadroomTrainLora"].update(run_name=run_name, precision="fp32", steps=2, validate_every=2, save_every=2,
                                      width=size, height=size, sample_steps=2)
    execution = comfy_server.run_workflow(prompt, timeout=900)
    assert execution.status == "success"
    saved = list((comfy_server.base_dir / "models" / "loras").rglob(f"{run_name}*.safetensors"))
    assert saved, f"no LoRA of run {run_name} in models/loras"
    if nodes["HeadroomLoraConfig"]["kind"] == "full":  # the differences to the base, under the base's keys
        from safetensors import safe_open

        with safe_open(str(saved[0]), framework="pt") as handle:
            keys = list(handle.keys())
        assert keys and all(key.endswith((".diff", ".diff_b")) for key in keys), keys[:5]
    validation = comfy_server.base_dir / "output" / "headroom_runs" / run_name / "validation"
    assert list(validation.iterdir()), f"no validation image in {validation}"


# (workflow, family, image side): the ControlNet templates on a tiny model of their family.
CONTROLNET_WORKFLOWS = [("sd15_controlnet", "sd15", 64), ("sdxl_controlnet", "sdxl", 64),
                        ("flux_controlnet", "flux", 64)]


@pytest.mark.parametrize("name, family, size", CONTROLNET_WORKFLOWS, ids=[w[0] for w in CONTROLNET_WORKFLOWS])
def test_controlnet_workflow_runs_on_a_tiny_model_of_its_family(comfy_server, object_info, name, family, size):
    """The shipped ControlNet graph (its Offload Policy, fused backward and bf16 weights for SDXL's and Flux's, its
    validation sampler) with the loader swapped for a tiny model of its family and a control folder beside the images,
    as the Note asks: it trains, validates with the held-out item's control and saves a ControlNet where the stock
    Load ControlNet Model node lists it."""
    import torch
    from PIL import Image, ImageDraw

    prompt = with_tiny_model(json.loads((API / f"{name}_api.json").read_text()), object_info, family)
    nodes = {node["class_type"]: node["inputs"] for node in prompt.values()}
    fused = name != "sd15_controlnet"  # sd15's trains in fp16, which fused backward refuses
    assert nodes["HeadroomOffloadPolicy"]["fused_backward"] == fused
    trained = nodes["HeadroomTrainControlNet"]
    assert trained["controlnet_precision"] == ("bf16_stochastic" if fused else "fp32")
    run_name = f"{name}_{uuid.uuid4().hex[:8]}"
    write_image_folder(comfy_server.base_dir / "input" / run_name, 3)
    control = comfy_server.base_dir / "input" / f"{run_name}_control"
    control.mkdir()
    for index in range(3):  # each image's control: the outline of its circle, under the image's name
        image = Image.new("RGB", (80, 64))
        ImageDraw.Draw(image).ellipse((20, 12, 60, 52), outline=(255, 255, 255), width=3)
        image.save(control / f"photo{index}.png")
    nodes["HeadroomDatasetFromFolder"].update(folder=run_name, control_folder=control.name, resolution=size)
    if nodes["HeadroomOptimizerConfig"]["optimizer"] == "AdamW8bit":
        nodes["HeadroomOptimizerConfig"].update(optimizer="AdamW")  # bitsandbytes' 8-bit AdamW needs a GPU
    # bf16 weights train in bf16 (the template's precision); the others in fp32, faster on a CPU
    trained.update(run_name=run_name, precision="bf16" if fused else "fp32", steps=2, validate_every=2,
                   save_every=2, width=size, height=size, sample_steps=2)
    execution = comfy_server.run_workflow(prompt, timeout=900)
    assert execution.status == "success", execution.error
    saved = list((comfy_server.base_dir / "models" / "controlnet" / "headroom").glob(f"{run_name}*.safetensors"))
    assert saved, f"no ControlNet of run {run_name} in models/controlnet/headroom"
    validation = comfy_server.base_dir / "output" / "headroom_runs" / run_name / "validation"
    assert list(validation.iterdir()), f"no validation image in {validation}"
    # fused backward's optimizer state: one parameter group per trained tensor (the plain optimizer's: one group)
    states = sorted((validation.parent / "checkpoints").glob("step_*/optimizer.pt"))
    groups = torch.load(states[-1], map_location="cpu", weights_only=True)["optimizer"]["param_groups"]
    assert (len(groups) > 1) == fused, len(groups)
    from safetensors import safe_open

    with safe_open(str(saved[0]), framework="pt") as handle:  # (less the Control-LoRA layout's empty marker)
        dtypes = {handle.get_slice(key).get_dtype() for key in handle.keys() if key != "lora_controlnet"}
    assert dtypes == ({"BF16"} if fused else {"F32"}), dtypes
