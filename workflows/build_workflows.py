"""Builds the shipped workflows, each in both formats, from one description each.

    python workflows/build_workflows.py --server http://127.0.0.1:8188      # a running ComfyUI with Headroom
    python workflows/build_workflows.py --object-info object_info.json

For every workflow below it writes `<name>.json` (UI format: what the graph editor opens, with node
positions, links and widget values; ComfyUI lists the .json files in this folder as the package's templates) and
`api/<name>_api.json` (API format, in a folder of its own so the editor's template list shows the UI ones only: what `POST /prompt`,
`comfy run --workflow` and workflows/headroom_run.py take). Widget order, output slots and types come
from the server's /object_info, so both files always say the same thing. Re-run it after a node's
inputs change; tests/server/test_workflows.py fails when the shipped files differ from what this builds.
It talks to the server over HTTP only and never imports ComfyUI.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import urllib.request
import uuid

HERE = pathlib.Path(__file__).resolve().parent
API_FOLDER = "api"  # the API-format files: ComfyUI lists only this folder's own .json files as templates

# Node types the graph editor provides itself: they have no /object_info entry and no API form.
FRONTEND_ONLY_TYPES = {"Note", "MarkdownNote", "Reroute", "PrimitiveNode"}
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
SEED_NAMES = {"seed", "noise_seed"}  # the editor gives these INT widgets a "control after generate" widget

# The room (px) kept under the nodes that show a text once they run, so a node that shows it does not grow over the
# node below: Headroom's (js/headroom_notes.js: where a file was saved, how the run was set up; the Offload Policy's
# budget and host RAM, up to four long lines, about 13 wrapped lines at 340 px), and the stock Preview Any's text box
# and preview_mode widget, added when it first shows a text (a memory report covered the Validation History below it
# in 21 templates).
TEXT_ROOM = {**dict.fromkeys(["HeadroomTrainLoraInit", "HeadroomTrainControlNetInit", "HeadroomTrainSteps",
                              "HeadroomTrainLora", "HeadroomTrainControlNet", "HeadroomSaveLora",
                              "HeadroomSaveControlNet"], 70),
             "HeadroomOffloadPolicy": 210, "PreviewAny": 60}
GAP = 40
TITLE_HEIGHT = 30


# --- the description of a workflow --------------------------------------------------------------------------
@dataclasses.dataclass
class Node:
    id: int
    type: str
    column: int  # layout: nodes are stacked top to bottom in columns, left to right
    values: dict = dataclasses.field(default_factory=dict)  # widget values by input name (else the default)
    links: dict = dataclasses.field(default_factory=dict)  # input name -> (source node id, output name or index)
    title: str | None = None
    width: int = 340
    extra_height: int = 0  # room for what a frontend extension draws (the live training chart)


@dataclasses.dataclass
class Note:
    id: int
    column: int
    text: str
    title: str = "Read me"
    width: int = 380
    height: int = 220


@dataclasses.dataclass
class Workflow:
    name: str
    nodes: list  # Node and Note, in layout order


# --- object_info helpers --------------------------------------------------------------------------------------
def input_specs(info: dict) -> list[tuple[str, str, list]]:
    """(name, "required"/"optional", spec) in the node's declared order."""
    order = info.get("input_order") or {k: list(v) for k, v in info["input"].items()}
    specs = []
    for section in ("required", "optional"):
        for name in order.get(section, []):
            specs.append((name, section, info["input"][section][name]))
    return specs


def spec_type(spec: list) -> str:
    return "COMBO" if isinstance(spec[0], list) else spec[0]


def spec_options(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def combo_choices(spec: list) -> list:
    return spec[0] if isinstance(spec[0], list) else spec_options(spec).get("options", [])


def is_widget(spec: list) -> bool:
    return spec_type(spec) in WIDGET_TYPES and not spec_options(spec).get("forceInput")


def has_control_widget(name: str, spec: list) -> bool:
    """Whether the editor adds a "control after generate" widget right after this one (saved in widgets_values)."""
    control = spec_options(spec).get("control_after_generate")
    if control is None:
        return spec_type(spec) == "INT" and name in SEED_NAMES
    return bool(control)


def default_value(spec: list):
    options = spec_options(spec)
    if "default" in options:
        return options["default"]
    kind = spec_type(spec)
    if kind == "COMBO":
        choices = combo_choices(spec)
        return choices[0] if choices else ""
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}[kind]


def output_index(info: dict, node: Node, output) -> int:
    if isinstance(output, int):
        return output
    names = info["output_name"]
    if output in names:
        return names.index(output)
    raise ValueError(f"{node.type} (node {node.id}) has no output {output!r}; outputs: {names}")


# --- layout ---------------------------------------------------------------------------------------------------
def estimated_height(item, info: dict | None) -> int:
    if isinstance(item, Note):
        return item.height
    # Advanced widgets are folded when a workflow opens (js/headroom_advanced.js): they take no room.
    specs = [(n, k, s) for n, k, s in input_specs(info) if not (is_widget(s) and spec_options(s).get("advanced"))]
    widgets = sum(1 + has_control_widget(n, s) for n, _, s in specs if is_widget(s))
    text_boxes = sum(1 for _, _, s in specs if is_widget(s) and spec_options(s).get("multiline"))
    sockets = sum(1 for _, _, s in specs if not is_widget(s))
    return (46 + 22 * max(sockets, len(info["output"])) + 26 * widgets + 60 * text_boxes + TEXT_ROOM.get(item.type, 0)
            + item.extra_height)


def layout(workflow: Workflow, object_info: dict) -> dict[int, tuple[list, list]]:
    """pos and size per node id: columns of stacked nodes, each column as wide as its widest node."""
    columns = sorted({item.column for item in workflow.nodes})
    widths = {c: max(item.width for item in workflow.nodes if item.column == c) for c in columns}
    column_x = {}
    x = 0
    for column in columns:
        column_x[column] = x
        x += widths[column] + GAP
    next_y: dict[int, int] = {}
    placed = {}
    for item in workflow.nodes:
        info = None if isinstance(item, Note) else object_info[item.type]
        height = estimated_height(item, info)
        y = next_y.get(item.column, TITLE_HEIGHT)
        placed[item.id] = ([column_x[item.column], y], [item.width, height])
        next_y[item.column] = y + height + GAP + TITLE_HEIGHT  # the title bar sits above the node's body
    return placed


# --- the two formats ------------------------------------------------------------------------------------------
def check_description(workflow: Workflow, object_info: dict) -> None:
    ids = [item.id for item in workflow.nodes]
    if len(ids) != len(set(ids)):
        raise ValueError(f"{workflow.name}: node ids repeat: {ids}")
    by_id = {item.id: item for item in workflow.nodes}
    for node in (n for n in workflow.nodes if isinstance(n, Node)):
        if node.type not in object_info:
            raise ValueError(f"{workflow.name}: node {node.id}: {node.type} is not in /object_info; is its package loaded?")
        names = {name for name, _, _ in input_specs(object_info[node.type])}
        for name in [*node.values, *node.links]:
            if name not in names:
                raise ValueError(f"{workflow.name}: node {node.id} ({node.type}) has no input {name!r}; inputs: {sorted(names)}")
        for name, (source, _) in node.links.items():
            if not isinstance(by_id.get(source), Node):
                raise ValueError(f"{workflow.name}: node {node.id} input {name!r} links to missing node {source}")


def api_format(workflow: Workflow, object_info: dict) -> dict:
    prompt = {}
    by_id = {item.id: item for item in workflow.nodes}
    for node in (n for n in workflow.nodes if isinstance(n, Node)):
        info = object_info[node.type]
        inputs = {}
        for name, _, spec in input_specs(info):
            if name in node.links:
                source, output = node.links[name]
                source_node = by_id[source]
                inputs[name] = [str(source), output_index(object_info[source_node.type], source_node, output)]
            elif is_widget(spec):
                inputs[name] = node.values.get(name, default_value(spec))
        prompt[str(node.id)] = {
            "class_type": node.type,
            "inputs": inputs,
            "_meta": {"title": node.title or info.get("display_name") or node.type},
        }
    return prompt


def ui_format(workflow: Workflow, object_info: dict) -> dict:
    placed = layout(workflow, object_info)
    by_id = {item.id: item for item in workflow.nodes}
    links = []  # [link id, source id, source slot, target id, target slot, type]
    outgoing: dict[tuple[int, int], list[int]] = {}
    nodes = []
    for order, item in enumerate(workflow.nodes):
        pos, size = placed[item.id]
        if isinstance(item, Note):
            nodes.append({
                "id": item.id, "type": "Note", "pos": pos, "size": size, "flags": {}, "order": order, "mode": 0,
                "title": item.title, "properties": {}, "widgets_values": [item.text],
                "color": "#432", "bgcolor": "#653",
            })
            continue
        info = object_info[item.type]
        inputs = []
        widgets_values = []
        for name, section, spec in input_specs(info):
            linked = name in item.links
            if is_widget(spec):
                widgets_values.append(item.values.get(name, default_value(spec)))
                if has_control_widget(name, spec):
                    widgets_values.append("fixed")  # shipped workflows repeat exactly
            if not linked and is_widget(spec):
                continue  # unconnected widget inputs have no socket entry in the saved format
            slot = {"name": name, "type": spec_type(spec), "link": None}
            if is_widget(spec):
                slot["widget"] = {"name": name}
            if section == "optional":
                slot["shape"] = 7  # the editor draws optional sockets hollow
            if linked:
                source, output = item.links[name]
                source_node = by_id[source]
                source_slot = output_index(object_info[source_node.type], source_node, output)
                link_id = len(links) + 1
                links.append([link_id, source, source_slot, item.id, len(inputs),
                              object_info[source_node.type]["output"][source_slot]])
                outgoing.setdefault((source, source_slot), []).append(link_id)
                slot["link"] = link_id
            inputs.append(slot)
        node = {
            "id": item.id, "type": item.type, "pos": pos, "size": size, "flags": {}, "order": order, "mode": 0,
            "inputs": inputs,
            "outputs": [{"name": name, "type": kind, "links": None}
                        for name, kind in zip(info["output_name"], info["output"])],
            "properties": {"Node name for S&R": item.type},
            "widgets_values": widgets_values,
        }
        if item.title:
            node["title"] = item.title
        nodes.append(node)
    for node in nodes:
        for slot_index, output in enumerate(node.get("outputs", [])):
            output["links"] = outgoing.get((node["id"], slot_index), [])
    return {
        # A stable id: the live view matches a reloaded graph with its runs in /history by it.
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"comfyui-headroom/workflows/{workflow.name}")),
        "revision": 0,
        "last_node_id": max(item.id for item in workflow.nodes),
        "last_link_id": len(links),
        "nodes": nodes,
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 0.8, "offset": [120, 60]}},
        "version": 0.4,
    }


def build(workflow: Workflow, object_info: dict) -> tuple[dict, dict]:
    """(UI format, API format) of one workflow."""
    check_description(workflow, object_info)
    return ui_format(workflow, object_info), api_format(workflow, object_info)


def render(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def write_atomically(path: pathlib.Path, text: str) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
        handle.write(text)
    os.replace(temp, path)


# --- the shipped workflows ------------------------------------------------------------------------------------
LIVE_CHART_HEIGHT = 260  # the live loss/VRAM chart js/headroom_live.js draws on training nodes
# The demo's LoRA run (tests/server/test_demo.py checks what it teaches; docs/benchmarks/pretrain_demo.md has its
# time). The dataset uses the sizes the pretrained model was trained on (docs/benchmarks/pretrain_demo.md: with the
# default sizes and 16 images the LoRA drew green in 25-62 % of the samples).
TINY_DEMO = {"count": 64, "sizes": "large", "rank": 8, "learning_rate": 5e-3, "batch_size": 4, "steps": 400,
             "sample_steps": 4}

TINY_NOTE = """Tiny demo LoRA: runs anywhere, even on a CPU, in a minute or two.

A built-in tiny SD1.5-style model, pretrained (weights shipped in the package, no download) on synthetic coloured shapes in every colour but green, learns green from shapes in green only.
Data -> cached latents and text -> LoRA + optimizer settings -> train -> validate (loss, preview images and a before/after grid: the pretrained model on top, with the LoRA below, same prompts and seeds) -> save -> memory report.

Watch the loss and memory chart on the Train steps node. The LoRA lands in models/loras/headroom/, the grid in output/headroom_runs/<run>/validation/."""

TINY_VALIDATION_PROMPTS = "\n".join(f"a green {shape} at the {position}" for shape, position in [
    ("circle", "center"), ("square", "top left"), ("triangle", "bottom right"), ("cross", "middle left"),
    ("circle", "top right"), ("square", "bottom center"), ("triangle", "top center"), ("cross", "bottom left")])


def history_node(train: int, node_id: int = 18) -> Node:
    """Validation History on the run of the all-in-one Train node `train`: what ends the templates that train with one
    (every validation so far, a row per step)."""
    return Node(node_id, "HeadroomValidationHistory", 4, links={"run": (train, "run")},
                title="Validations over the steps", width=460, extra_height=300)


def tiny_lora() -> Workflow:
    return Workflow("tiny_lora", [
        Note(100, 0, TINY_NOTE, width=380, height=300),
        Node(1, "HeadroomTinyModel", 0, {"family": "sd15", "seed": 0, "weights": "pretrained"},
             title="Tiny SD1.5 model (pretrained)"),
        Node(2, "HeadroomSyntheticDataset", 0, {"count": TINY_DEMO["count"], "resolution": 64, "seed": 0,
                                                "colours": "green", "sizes": TINY_DEMO["sizes"]},
             title="Synthetic shapes (green only)"),
        Node(3, "HeadroomDatasetFromImages", 1, {"resolution": 64, "step": 64},
             links={"images": (2, "images"), "captions": (2, "captions")}, title="Dataset"),
        Node(4, "HeadroomCacheLatents", 1, links={"dataset": (3, "dataset"), "vae": (1, "VAE")}, title="Cache latents"),
        Node(5, "HeadroomCacheText", 1, links={"dataset": (3, "dataset"), "clip": (1, "CLIP")}, title="Cache text"),
        Node(6, "HeadroomLoraConfig", 2, {"rank": TINY_DEMO["rank"], "alpha": float(TINY_DEMO["rank"])}, title="LoRA"),
        Node(7, "HeadroomOptimizerConfig", 2, {"learning_rate": TINY_DEMO["learning_rate"]}, title="Optimizer"),
        Node(8, "HeadroomTrainLoraInit", 3, {"run_name": "tiny_demo", "precision": "fp32",
                                             "batch_size": TINY_DEMO["batch_size"]},
             links={"model": (1, "MODEL"), "latent_cache": (4, "latent_cache"), "text_cache": (5, "text_cache"),
                    "lora_config": (6, "lora_config"), "optimizer_config": (7, "optimizer_config")},
             title="Start (or resume) run"),
        Node(9, "HeadroomTrainSteps", 4, {"steps": TINY_DEMO["steps"]}, links={"run": (8, "run")}, title="Train steps",
             width=440, extra_height=LIVE_CHART_HEIGHT),
        Node(10, "HeadroomValidate", 5,
             {"prompts": TINY_VALIDATION_PROMPTS, "sample_steps": TINY_DEMO["sample_steps"],
              "width": 64, "height": 64, "loss_timesteps": 2, "compare_base": True},
             links={"run": (9, "run"), "clip": (1, "CLIP"), "vae": (1, "VAE")}, title="Validate (before / after)"),
        Node(11, "HeadroomSaveLora", 6, {"subfolder": "headroom"}, links={"run": (10, "run")}, title="Save LoRA"),
        Node(12, "HeadroomVRAMMonitor", 6, links={"value": (11, "lora_name")}, title="Memory after the run"),
        # The monitor is not an output node: ComfyUI runs it because this one shows its report.
        Node(13, "PreviewAny", 6, links={"source": (12, "report")}, title="Memory report"),
    ])


YOUR_FOLDER = "my_dataset"  # the folder the Note asks for: never one ComfyUI makes itself (input/3d), so a run
# without the user's folder stops with Dataset From Folder's "not a folder" message, which lists the folders there
YOUR_FOLDER_TRIGGER = "sks_thing"

YOUR_FOLDER_NOTE = f"""Tiny LoRA on your own folder of images. The demo's pipeline on the built-in tiny model (runs anywhere, even on a CPU, in a minute or two), reading a folder of yours: try the steps before a real model.

1. Create the folder ComfyUI/input/{YOUR_FOLDER} and put your images in it, each with a same-name .txt caption (cat1.png + cat1.txt: "a cat on a sofa"). Any sizes: they are cropped to 64 x 64 here, the tiny model's size.
2. Created it while ComfyUI runs? Press R in the editor (or reload the page): the folder list of Dataset From Folder is read when the editor loads the node definitions.
3. Pick the folder on Dataset From Folder ({YOUR_FOLDER} is already set), and set trigger_word to a word of your own: it goes in front of every caption; the validation prompts start with it.
4. Run.

Preview Dataset shows the first 8 images as they are cropped for training, each with its caption. Latents and captions are cached once, the LoRA trains 400 steps (the chart on Train steps shows loss and memory), the before/after grid (the model alone on top, with the LoRA below) lands in output/headroom_runs/your_folder/validation/, the LoRA in models/loras/headroom/. The tiny model knows only coloured shapes: expect colours and rough shapes, not your photos. For a real model, open sd15_lora, sdxl_lora, flux_lora, ... with the same folder."""

YOUR_FOLDER_PROMPTS = "\n".join(f"{YOUR_FOLDER_TRIGGER}, a {what}" for what in [
    "red circle at the center", "blue square at the top left", "yellow triangle at the bottom right", "photo"])


def your_folder_lora() -> Workflow:
    """tiny_lora's graph (Init -> Train steps -> Validate -> Save) on the user's folder instead of synthetic shapes:
    Dataset From Folder feeds both caches, at 64 px (the tiny model's size; the node's default 512 would cache latents
    the model was never trained at and take far longer)."""
    return Workflow("your_folder_lora", [
        Note(100, 0, YOUR_FOLDER_NOTE, width=420, height=420),
        Node(1, "HeadroomTinyModel", 0, {"family": "sd15", "seed": 0, "weights": "pretrained"},
             title="Tiny SD1.5 model (pretrained)"),
        Node(3, "HeadroomDatasetFromFolder", 1,
             {"folder": YOUR_FOLDER, "resolution": 64, "step": 64, "seed": 0, "trigger_word": YOUR_FOLDER_TRIGGER},
             title="Your folder (input/<folder>)"),
        Node(4, "HeadroomCacheLatents", 1, links={"dataset": (3, "dataset"), "vae": (1, "VAE")}, title="Cache latents"),
        Node(5, "HeadroomCacheText", 1, links={"dataset": (3, "dataset"), "clip": (1, "CLIP")}, title="Cache text"),
        Node(6, "HeadroomLoraConfig", 2, {"rank": TINY_DEMO["rank"], "alpha": float(TINY_DEMO["rank"])}, title="LoRA"),
        Node(7, "HeadroomOptimizerConfig", 2, {"learning_rate": TINY_DEMO["learning_rate"]}, title="Optimizer"),
        Node(8, "HeadroomTrainLoraInit", 3, {"run_name": "your_folder", "precision": "fp32",
                                             "batch_size": TINY_DEMO["batch_size"]},
             links={"model": (1, "MODEL"), "latent_cache": (4, "latent_cache"), "text_cache": (5, "text_cache"),
                    "lora_config": (6, "lora_config"), "optimizer_config": (7, "optimizer_config")},
             title="Start (or resume) run"),
        Node(9, "HeadroomTrainSteps", 4, {"steps": TINY_DEMO["steps"]}, links={"run": (8, "run")},
             title="Train steps", width=440, extra_height=LIVE_CHART_HEIGHT),
        Node(10, "HeadroomValidate", 5,
             {"prompts": YOUR_FOLDER_PROMPTS, "sample_steps": TINY_DEMO["sample_steps"], "width": 64, "height": 64,
              "loss_timesteps": 2, "compare_base": True},
             links={"run": (9, "run"), "clip": (1, "CLIP"), "vae": (1, "VAE")}, title="Validate (before / after)"),
        Node(11, "HeadroomSaveLora", 6, {"subfolder": "headroom"}, links={"run": (10, "run")}, title="Save LoRA"),
        Node(12, "HeadroomVRAMMonitor", 6, links={"value": (11, "lora_name")}, title="Memory after the run"),
        Node(13, "PreviewAny", 6, links={"source": (12, "report")}, title="Memory report"),
        Node(14, "HeadroomPreviewDataset", 2, {"count": 8}, links={"dataset": (3, "dataset")},
             title="What it trains on (crops, captions)"),
    ])


@dataclasses.dataclass
class RealModel:
    """What differs between the real-model LoRA workflows."""
    name: str
    label: str
    loaders: list  # Node list producing the MODEL, CLIP and VAE
    model: tuple
    clip: tuple
    vae: tuple
    downloads: str  # what to put where, for the Note
    resolution: int
    bucket_step: int  # 64 for UNets, 16 for DiTs
    rank: int
    optimizer: str
    learning_rate: float
    precision: str
    timestep_sampling: str
    sampling: dict  # validation sampler settings
    policy: dict  # HeadroomOffloadPolicy settings that suit the model on a 12-24 GB card


def real_model_lora(spec: RealModel) -> Workflow:
    note = f"""{spec.label} LoRA with cached latents and text, validation and a memory report.

Download (file -> ComfyUI folder):
{spec.downloads}

Your images: a folder inside ComfyUI's input/ folder (here input/my_dataset), each image with a same-name .txt caption (photo1.png + photo1.txt). kohya's layout works as it is: subfolders named <repeats>_<name> (my_dataset/10_ohwx dog, my_dataset/1_style), each image trained that many times per epoch. Tag captions (ohwx, red hair, smiling): Cache text's tag_shuffles (advanced) trains on shuffled tag orders.

Memory: the Offload policy node's card is "this GPU (auto)": when the run opens, the planner measures the model and picks the fastest settings whose planned peak fits this card, and the Train node shows them. Pick 8 / 12 / 16 / 24 / 48 GB to fit another card, or custom to set them yourself. workflows/memory_plan.json shows a model's plan per phase without training.

Queue it: latents and text embeddings are cached once (the text encoders and VAE are unloaded before training), then the LoRA trains with a validation every 250 steps (loss + preview images) and a save every 500 steps to models/loras/headroom/. The chart on the Train LoRA node shows loss and memory live. Queue again with more steps to continue the same run."""
    sampling = {"sample_seed": 0, **spec.sampling}
    return Workflow(spec.name, [
        Note(100, 0, note, width=420, height=330),
        *spec.loaders,
        Node(5, "HeadroomOffloadPolicy", 0, spec.policy, title="Offload policy"),
        Node(10, "HeadroomDatasetFromFolder", 1,
             {"folder": "my_dataset", "resolution": spec.resolution, "step": spec.bucket_step}, title="Dataset folder"),
        Node(11, "HeadroomCacheLatents", 1, links={"dataset": (10, "dataset"), "vae": spec.vae, "policy": (5, "policy")},
             title="Cache latents"),
        Node(12, "HeadroomCacheText", 1, links={"dataset": (10, "dataset"), "clip": spec.clip, "policy": (5, "policy")},
             title="Cache text"),
        Node(13, "HeadroomLoraConfig", 2, {"rank": spec.rank, "alpha": float(spec.rank)}, title="LoRA"),
        Node(14, "HeadroomOptimizerConfig", 2,
             {"optimizer": spec.optimizer, "learning_rate": spec.learning_rate, "schedule_steps": 2000}, title="Optimizer"),
        Node(15, "HeadroomTrainLora", 3,
             {"run_name": spec.name, "precision": spec.precision, "timestep_sampling": spec.timestep_sampling,
              "gradient_checkpointing": gradient_checkpointing(spec.policy), "steps": 2000, "validate_every": 250,
              "save_every": 500, "lora_subfolder": "headroom",
              "prompts": "a photo of sks person smiling\na photo of sks person in a forest", **sampling},
             links={"model": spec.model, "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "lora_config": (13, "lora_config"), "optimizer_config": (14, "optimizer_config"),
                    "clip": spec.clip, "vae": spec.vae, "policy": (5, "policy")},
             title=f"Train LoRA ({spec.label})", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(16, "HeadroomVRAMMonitor", 4, links={"value": (15, "lora_name")}, title="Memory after the run"),
        Node(17, "PreviewAny", 4, links={"source": (16, "report")}, title="Memory report"),
        history_node(15),
    ])


THIS_GPU = "this GPU (auto)"  # training/memory/policy.py THIS_GPU (this file imports no Headroom code)


def policy(base_placement: str, checkpointing: str) -> dict:
    """The card is this GPU: when a run opens, the planner picks the fastest settings that fit it. The placement and
    checkpointing given are what suits the model on a 12-24 GB card: the settings if the user picks card custom."""
    return {"vram_budget_gb": 0.0, "base_placement": base_placement, "checkpointing": checkpointing, "card": THIS_GPU}


def gradient_checkpointing(policy: dict) -> bool:
    """The training node's gradient_checkpointing: off where the planner chooses checkpointing for the card."""
    return policy["checkpointing"] != "off" and policy.get("card", "custom") == "custom"


def checkpoint(file: str) -> Node:
    return Node(1, "CheckpointLoaderSimple", 0, {"ckpt_name": file}, title="Load checkpoint")


def sd15_lora() -> Workflow:
    return real_model_lora(RealModel(
        "sd15_lora", "SD1.5", [checkpoint("v1-5-pruned-emaonly.safetensors")], (1, "MODEL"), (1, "CLIP"), (1, "VAE"),
        "- v1-5-pruned-emaonly.safetensors -> models/checkpoints/",
        resolution=512, bucket_step=64, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="fp16",
        timestep_sampling="uniform", policy=policy("resident", "off"),
        sampling={"sample_steps": 20, "cfg": 7.0, "sampler_name": "euler", "scheduler": "normal", "width": 512, "height": 512},
    ))


FULL_NOTE = """SD1.5 full fine-tune: trains the model's own weights (every layer), not an adapter.

Download (file -> ComfyUI folder):
- v1-5-pruned-emaonly.safetensors -> models/checkpoints/

Your images: a folder inside ComfyUI's input/ folder (here input/my_dataset), each image with a same-name .txt caption.

LoRA Config kind "full": each layer trains its own copy of its weights; the shared model stays unchanged for the rest of the graph, and on a GPU a trained layer's base weights wait in host RAM during the step (one copy on the card). Memory: about 10 bytes per trained weight with 8-bit AdamW (the copy, its gradient, the optimizer state), 8 GiB for SD1.5's 0.86 B weights, plus the activations: a 12-16 GB card. Learning rate about 100x below a LoRA's.

The file in models/loras/headroom/ holds the differences to the base (trained minus base, what stock loaders read): stock Load LoRA applies it; stock Save Model / Save Checkpoint after it write a model file for Load Diffusion Model / Load Checkpoint. docs/FULL_FINETUNE.md."""


def as_full_finetune(workflow: Workflow, name: str, label: str, note: str, lora: dict, lora_title: str,
                     optimizer: dict, policy_values: dict | None = None, save_at_end: bool = False) -> Workflow:
    """A LoRA template turned into a full fine-tune: its LoRA Config, optimizer and policy values, its own Note;
    `save_at_end`: the differences saved once, at the end (a large model's file is tens of GB: one per 500 steps
    would fill a disk), the run's checkpoints keeping it resumable."""
    workflow.name = name
    train = {"run_name": name, **({"save_every": 0} if save_at_end else {})}
    changes = {"HeadroomLoraConfig": lora, "HeadroomOptimizerConfig": optimizer, "HeadroomOffloadPolicy": policy_values or {},
               "HeadroomTrainLora": train}
    titles = {"HeadroomLoraConfig": lora_title, "HeadroomTrainLora": f"Train ({label} full fine-tune)"}
    for item in workflow.nodes:
        if isinstance(item, Note):
            item.text = note
            continue
        item.values = {**item.values, **changes.get(item.type, {})}
        item.title = titles.get(item.type, item.title)
    return workflow


def saved_at_end(size: str, stock_save: str) -> str:
    """The Note's last paragraph for a large full fine-tune (as_full_finetune's save_at_end)."""
    return ("\n\nSaved once, at the end of the steps, to models/loras/headroom/ (about " + size + ": the differences to "
            "the base in fp32, so base + file is the trained model exactly); the run's checkpoints keep it resumable; "
            "the Train node's save_dtype bf16 (advanced) saves it at half the size, not exact (its validation samples "
            "that file). Stock Load LoRA applies the file; " + stock_save + ". docs/FULL_FINETUNE.md.")


def lean_full_finetune(workflow: Workflow, name: str, label: str, note: str, targets: str, lora_title: str,
                       learning_rate: float) -> Workflow:
    """A large model's LoRA template as a full fine-tune with the options that fit it on one card: kind full on
    `targets` with bf16 trained weights (stochastic rounding), Adafactor, fused backward; saved once, at the end."""
    return as_full_finetune(workflow, name, label, note,
                            {"kind": "full", "targets": targets, "full_precision": "bf16_stochastic"}, lora_title,
                            {"optimizer": "Adafactor", "learning_rate": learning_rate}, {"fused_backward": True},
                            save_at_end=True)


def sd15_full_finetune() -> Workflow:
    """The SD1.5 LoRA template with LoRA Config kind full (every layer), its learning rate and its own Note."""
    return as_full_finetune(sd15_lora(), "sd15_full_finetune", "SD1.5", FULL_NOTE,
                            {"kind": "full", "targets": "all_layers"}, "Full fine-tune (every layer)",
                            {"learning_rate": 2e-6})


SD35_FULL_NOTE = """SD3.5 Large full fine-tune: trains the model's own weights (every linear layer of its blocks, 8 B weights), not an adapter, on a 24 GB card.

Download (file -> ComfyUI folder):
- sd3.5_large.safetensors -> models/checkpoints/
- clip_l.safetensors, clip_g.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/

Your images: a folder inside ComfyUI's input/ folder (here input/my_dataset), each image with a same-name .txt caption.

What makes it fit: one copy of each trained weight on the card (the run's own bf16 copy; the trained layers' base weights wait in host RAM during the step), the Offload policy's fused_backward (each weight tensor is stepped as soon as its gradient is ready, so no full set of gradients exists), the LoRA Config's full_precision bf16_stochastic (the trained copy in bf16, updated with stochastic rounding), Adafactor (small optimizer state), and the card "this GPU (auto)": on a 24 GB card at 1024 px the planner keeps everything else on the card, nothing streamed (22.2 GiB planned, docs/BENCHMARKS.md). On a 16 GB card it also keeps the trained weights in host RAM (each layer crosses to the card as it runs and is stepped there, where Adafactor's small state stays; about 30 GiB of host RAM). Learning rate about 100x below a LoRA's.""" + saved_at_end("32 GB", "stock Save Model after it writes a model file for Load Diffusion Model")


def sd35_full_finetune() -> Workflow:
    """The SD3.5 Large LoRA template as a full fine-tune with the memory options that fit it on a 24 GB card."""
    return lean_full_finetune(sd35_lora(), "sd35_full_finetune", "SD3.5 Large", SD35_FULL_NOTE, "all_linear",
                              "Full fine-tune (every linear layer, bf16)", 1e-6)


SDXL_FULL_NOTE = """SDXL full fine-tune: trains the model's own weights (every layer of the UNet, 2.6 B weights), not an adapter.

Download (file -> ComfyUI folder):
- sd_xl_base_1.0.safetensors -> models/checkpoints/

Your images: a folder inside ComfyUI's input/ folder (here input/my_dataset), each image with a same-name .txt caption.

What makes it fit: one copy of each trained weight on the card (the run's own bf16 copy; the trained layers' base weights wait in host RAM during the step), the Offload policy's fused_backward (each weight tensor is stepped as soon as its gradient is ready, so no full set of gradients exists), the LoRA Config's full_precision bf16_stochastic (the trained copy in bf16, updated with stochastic rounding) and Adafactor (small optimizer state). With the card "this GPU (auto)" the planner fits it at 1024 px (planned, not yet measured on a GPU: docs/benchmarks/full_finetune.md): on a 16 GB or larger card everything stays on the card, nothing checkpointed (11.9 GiB); on a 12 GB card some blocks are checkpointed (10.7 GiB); on an 8 GB card most blocks' trained weights wait in host RAM and cross to the card as their layers run (7.0 GiB, about 5 GiB of host RAM). Learning rate about 100x below a LoRA's.""" + saved_at_end("10 GB", "stock Save Checkpoint after it writes a model file for Load Checkpoint")


def sdxl_full_finetune() -> Workflow:
    """The SDXL LoRA template as a full fine-tune of every layer with the memory options that fit it on 8-16 GB."""
    return lean_full_finetune(sdxl_lora(), "sdxl_full_finetune", "SDXL", SDXL_FULL_NOTE, "all_layers",
                              "Full fine-tune (every layer, bf16)", 1e-6)


def sdxl_model() -> RealModel:
    return RealModel(
        "sdxl_lora", "SDXL", [checkpoint("sd_xl_base_1.0.safetensors")], (1, "MODEL"), (1, "CLIP"), (1, "VAE"),
        "- sd_xl_base_1.0.safetensors -> models/checkpoints/",
        resolution=1024, bucket_step=64, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="uniform", policy=policy("resident", "blocks"),
        sampling={"sample_steps": 25, "cfg": 6.0, "sampler_name": "euler", "scheduler": "normal", "width": 1024, "height": 1024},
    )


def sdxl_lora() -> Workflow:
    return real_model_lora(sdxl_model())


def sd35_lora() -> Workflow:
    return real_model_lora(RealModel(
        "sd35_lora", "SD3.5 Large",
        [checkpoint("sd3.5_large.safetensors"),
         Node(2, "TripleCLIPLoader", 0, {"clip_name1": "clip_l.safetensors", "clip_name2": "clip_g.safetensors",
                                          "clip_name3": "t5xxl_fp16.safetensors"}, title="Load text encoders")],
        (1, "MODEL"), (2, "CLIP"), (1, "VAE"),
        "- sd3.5_large.safetensors -> models/checkpoints/\n"
        "- clip_l.safetensors, clip_g.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="logit_normal", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 28, "cfg": 4.5, "sampler_name": "euler", "scheduler": "sgm_uniform", "width": 1024, "height": 1024},
    ))


def flux_lora() -> Workflow:
    return real_model_lora(flux_model())


def flux_model() -> RealModel:
    return RealModel(
        "flux_lora", "Flux.1 dev",
        [Node(1, "UNETLoader", 0, {"unet_name": "flux1-dev.safetensors"}, title="Load diffusion model"),
         Node(2, "DualCLIPLoader", 0, {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                                        "type": "flux"}, title="Load text encoders"),
         Node(3, "VAELoader", 0, {"vae_name": "ae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- flux1-dev.safetensors -> models/diffusion_models/\n"
        "- clip_l.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/\n"
        "- ae.safetensors -> models/vae/",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    )


FLUX_FULL_NOTE = """Flux.1 dev full fine-tune: trains the model's own weights (every linear layer of its 57 blocks, 11.8 B weights), not an adapter, on a 24 GB card.

Download (file -> ComfyUI folder):
- flux1-dev.safetensors -> models/diffusion_models/
- clip_l.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/
- ae.safetensors -> models/vae/

Your images: a folder inside ComfyUI's input/ folder (here input/my_dataset), each image with a same-name .txt caption.

What makes it fit: the run's own bf16 copy of each trained weight (stochastic rounding), fused_backward (no full set of gradients) and Adafactor (small state, stepped on the card). The bf16 copy alone is 22 GiB, so with the card "this GPU (auto)" on a 24 GB card the planner keeps the trained weights of the blocks that fit on the card (38 of 57) and the rest in host RAM, each layer's crossing to the card as it runs and stepped there: 22.9 GiB on the card, about 28 GiB of host RAM, predicted 1.6 s/step; on a 16 GB card 15 blocks' stay (14.7 GiB, about 35 GiB of host RAM, predicted 4 s/step). Planned, not yet measured on a GPU (docs/benchmarks/full_finetune.md). Learning rate far below a LoRA's.""" + saved_at_end("47 GB", "stock Save Model after it writes a model file for Load Diffusion Model")


def flux_full_finetune() -> Workflow:
    """The Flux.1 dev LoRA template as a full fine-tune of every linear layer with the memory options for 24 GB."""
    return lean_full_finetune(flux_lora(), "flux_full_finetune", "Flux.1 dev", FLUX_FULL_NOTE, "all_linear",
                              "Full fine-tune (every linear layer, bf16)", 1e-5)


TINY_CONTROLNET_NOTE = """Tiny demo ControlNet: runs anywhere, even on a CPU.

The built-in tiny SD1.5-style model (random weights, no download) and synthetic shapes with their masks as control images. Latents, control images and text are cached; a ControlNet of ComfyUI's own class trains next to the frozen model, is validated with the stock ControlNet apply path and saved to models/controlnet/headroom/, where the stock Load ControlNet Model node finds it.

Watch the loss and memory chart on the Train ControlNet node."""


def tiny_controlnet() -> Workflow:
    return Workflow("tiny_controlnet", [
        Note(100, 0, TINY_CONTROLNET_NOTE, width=380, height=280),
        Node(1, "HeadroomTinyModel", 0, {"family": "sd15", "seed": 0}, title="Tiny SD1.5 model"),
        Node(2, "HeadroomSyntheticDataset", 0, {"count": 8, "resolution": 64, "seed": 0}, title="Synthetic shapes + masks"),
        Node(3, "HeadroomDatasetFromImages", 1, {"resolution": 64, "step": 64},
             links={"images": (2, "images"), "captions": (2, "captions"), "control_images": (2, "control_images")},
             title="Dataset with control images"),
        Node(4, "HeadroomCacheLatents", 1, {"control_encoding": "pixels"},
             links={"dataset": (3, "dataset"), "vae": (1, "VAE")}, title="Cache latents + control"),
        Node(5, "HeadroomCacheText", 1, links={"dataset": (3, "dataset"), "clip": (1, "CLIP")}, title="Cache text"),
        Node(6, "HeadroomOptimizerConfig", 2, {"learning_rate": 1e-3}, title="Optimizer"),
        Node(7, "HeadroomTrainControlNet", 3,
             {"run_name": "tiny_controlnet", "precision": "fp32", "steps": 20, "controlnet_subfolder": "headroom",
              "prompts": "a red circle in the center", "sample_steps": 4, "width": 64, "height": 64,
              "loss_timesteps": 2},
             links={"model": (1, "MODEL"), "latent_cache": (4, "latent_cache"), "text_cache": (5, "text_cache"),
                    "optimizer_config": (6, "optimizer_config"), "clip": (1, "CLIP"), "vae": (1, "VAE")},
             title="Train ControlNet", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(8, "HeadroomVRAMMonitor", 4, links={"value": (7, "control_net_name")}, title="Memory after the run"),
        Node(9, "PreviewAny", 4, links={"source": (8, "report")}, title="Memory report"),
        history_node(7, node_id=10),
    ])


SD15_CONTROLNET_NOTE = """SD1.5 ControlNet with cached latents, control images and text, an offload policy, validation and a memory report.

Download (file -> ComfyUI folder):
- v1-5-pruned-emaonly.safetensors -> models/checkpoints/

Your data, inside ComfyUI's input/ folder:
- input/my_dataset: the images, each with a same-name .txt caption (photo1.png + photo1.txt)
- input/my_dataset_control: the control image of each (photo1.png: its edge map, depth map, pose...)

Queue it: the ControlNet (a copy of the UNet encoder, ComfyUI's own class) trains next to the frozen model, is validated every 500 steps with the first held-out control image and saved every 1000 steps to models/controlnet/headroom/ for the stock Load ControlNet Model node. Half of the samples train with the empty prompt (caption_dropout 0.5) so the ControlNet learns to follow the control alone."""


def sd15_controlnet() -> Workflow:
    return Workflow("sd15_controlnet", [
        Note(100, 0, SD15_CONTROLNET_NOTE, width=420, height=330),
        checkpoint("v1-5-pruned-emaonly.safetensors"),
        Node(5, "HeadroomOffloadPolicy", 0, policy("resident", "blocks"), title="Offload policy"),
        Node(10, "HeadroomDatasetFromFolder", 1,
             {"folder": "my_dataset", "control_folder": "my_dataset_control", "resolution": 512, "step": 64},
             title="Dataset + control folders"),
        Node(11, "HeadroomCacheLatents", 1, {"control_encoding": "pixels"},
             links={"dataset": (10, "dataset"), "vae": (1, "VAE"), "policy": (5, "policy")}, title="Cache latents + control"),
        Node(12, "HeadroomCacheText", 1, links={"dataset": (10, "dataset"), "clip": (1, "CLIP"), "policy": (5, "policy")},
             title="Cache text"),
        Node(14, "HeadroomOptimizerConfig", 2,
             {"optimizer": "AdamW8bit", "learning_rate": 1e-5, "schedule_steps": 5000}, title="Optimizer"),
        Node(15, "HeadroomTrainControlNet", 3,
             {"run_name": "sd15_controlnet", "precision": "fp16",
              "gradient_checkpointing": gradient_checkpointing(policy("resident", "blocks")), "holdout": 1,
              "steps": 5000, "validate_every": 500, "save_every": 1000, "controlnet_subfolder": "headroom",
              "prompts": "a photo of a living room\na photo of a city street at night", "sample_steps": 20, "cfg": 7.0,
              "width": 512, "height": 512},
             links={"model": (1, "MODEL"), "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "optimizer_config": (14, "optimizer_config"), "clip": (1, "CLIP"), "vae": (1, "VAE"),
                    "policy": (5, "policy")},
             title="Train ControlNet (SD1.5)", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(16, "HeadroomVRAMMonitor", 4, links={"value": (15, "control_net_name")}, title="Memory after the run"),
        Node(17, "PreviewAny", 4, links={"source": (16, "report")}, title="Memory report"),
        history_node(15),
    ])


def control_data_nodes(spec: RealModel, folder: str, encoding: str, titles: tuple[str, str, str],
                       text_inputs: dict | None = None) -> list:
    """Dataset From Folder on `folder` with its control folder `<folder>_control`, Cache Latents with the controls as
    `encoding` and Cache Text (nodes 10-12), linked to the spec's VAE and CLIP and the policy node 5."""
    return [
        Node(10, "HeadroomDatasetFromFolder", 1,
             {"folder": folder, "control_folder": f"{folder}_control", "resolution": spec.resolution,
              "step": spec.bucket_step}, title=titles[0]),
        Node(11, "HeadroomCacheLatents", 1, {"control_encoding": encoding},
             links={"dataset": (10, "dataset"), "vae": spec.vae, "policy": (5, "policy")}, title=titles[1]),
        Node(12, "HeadroomCacheText", 1, text_inputs or {},
             links={"dataset": (10, "dataset"), "clip": spec.clip, "policy": (5, "policy")}, title=titles[2]),
    ]


def real_model_controlnet(model: RealModel, name: str, memory: str) -> Workflow:
    """A real model's ControlNet template `name`: the dataset with its control folder, controls cached as pixels, the
    ControlNet trained in bf16 with fused backward (no fp32 copy and no full set of its gradients: what fits it on an
    8 GB card without a lower-precision base) at a tenth of the model's LoRA learning rate, validated with the first
    held-out item's control. `memory`: the Note's sentences on what the planner plans."""
    spec = dataclasses.replace(model, name=name, learning_rate=model.learning_rate / 10)
    prompts = "a photo of a living room\na photo of a city street at night"
    note = f"""{spec.label} ControlNet with cached latents, control images and text, validation and a memory report.

Download (file -> ComfyUI folder):
{spec.downloads}

Your data, inside ComfyUI's input/ folder:
- input/my_dataset: the images, each with a same-name .txt caption (photo1.png + photo1.txt)
- input/my_dataset_control: the control image of each (photo1.png: its edge map, depth map, pose...)

Memory: the ControlNet's own weights (a copy of the model's first blocks) are trained in bf16, each update rounded stochastically (controlnet_precision, an advanced input of the training node: half the memory of fp32 weights, no fp32 copy; fp32 is the exact option); the Offload policy's fused_backward steps each of them as soon as its gradient is ready and frees the gradient, so no full set of gradients exists (gradient clipping is then per tensor). {memory} The card is "this GPU (auto)": the planner picks the fastest settings that fit it.

Queue it: the ControlNet (ComfyUI's own class) trains next to the frozen model, is validated every 500 steps with the first held-out control image and saved every 1000 steps to models/controlnet/headroom/ for the stock Load ControlNet Model node. Half of the samples train with the empty prompt (caption_dropout 0.5) so the ControlNet learns to follow the control alone."""
    fused = {**spec.policy, "fused_backward": True}
    return Workflow(spec.name, [
        Note(100, 0, note, width=420, height=330),
        *spec.loaders,
        Node(5, "HeadroomOffloadPolicy", 0, fused, title="Offload policy"),
        *control_data_nodes(spec, "my_dataset", "pixels",
                            ("Dataset + control folders", "Cache latents + control", "Cache text")),
        Node(14, "HeadroomOptimizerConfig", 2,
             {"optimizer": spec.optimizer, "learning_rate": spec.learning_rate, "schedule_steps": 5000},
             title="Optimizer"),
        Node(15, "HeadroomTrainControlNet", 3,
             {"run_name": spec.name, "precision": spec.precision, "timestep_sampling": spec.timestep_sampling,
              "gradient_checkpointing": gradient_checkpointing(fused), "holdout": 1, "steps": 5000,
              "validate_every": 500, "save_every": 1000, "controlnet_subfolder": "headroom", "prompts": prompts,
              "sample_seed": 0, "controlnet_precision": "bf16_stochastic", **spec.sampling},
             links={"model": spec.model, "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "optimizer_config": (14, "optimizer_config"), "clip": spec.clip, "vae": spec.vae,
                    "policy": (5, "policy")},
             title=f"Train ControlNet ({spec.label})", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(16, "HeadroomVRAMMonitor", 4, links={"value": (15, "control_net_name")}, title="Memory after the run"),
        Node(17, "PreviewAny", 4, links={"source": (16, "report")}, title="Memory report"),
        history_node(15),
    ])


# What the planner plans for each ControlNet template (bench/plan_table.py), for its Note.
SDXL_CONTROLNET_MEMORY = (
    "Planned at 1024 px (bench/plan_table.py, not yet measured on a GPU): on an 8 GB card 7.0 GiB (part of the base "
    "streamed from host RAM, blocks recomputed in backward, the optimizer state streamed), 12 GB 11.0 GiB, 16 GB "
    "14.3 GiB (all on the card, 13 of 33 blocks recomputed), 24 GB 16.4 GiB (nothing recomputed).")
FLUX_CONTROLNET_MEMORY = (
    "The ControlNet copies the model's first 2 double blocks (XLabs layout, which the stock Load ControlNet Model node "
    "reads). Planned at 1024 px (bench/plan_table.py, not yet measured on a GPU): on an 8 GB card 7.0 GiB (about "
    "20 GiB of the base streamed from host RAM, checkpoints and the optimizer state there too), 12 / 16 / 24 GB "
    "11.0 / 15.0 / 23.0 GiB (less of the base streamed).")


def sdxl_controlnet() -> Workflow:
    return real_model_controlnet(sdxl_model(), "sdxl_controlnet", SDXL_CONTROLNET_MEMORY)


def flux_controlnet() -> Workflow:
    return real_model_controlnet(flux_model(), "flux_controlnet", FLUX_CONTROLNET_MEMORY)


MEMORY_PLAN_NOTE = """Memory plan only: how much device memory a LoRA run on this model needs, per phase (caching, training step, validation, save), itemised, and, in mode "auto", the fastest offload policy that fits the budget, with the reason. Nothing is trained. The node's advanced input kind plans a full fine-tune or a ControlNet instead.

Pick the card on the policy node to plan for a card other than this one (this GPU (auto): this device, measured). Swap the loaders for your model; the Flux.1 dev files:
- flux1-dev.safetensors -> models/diffusion_models/
- clip_l.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/
- ae.safetensors -> models/vae/

Feed the plan's policy output into the Cache and Train LoRA nodes of a training workflow to use it."""


def memory_plan() -> Workflow:
    return Workflow("memory_plan", [
        Note(100, 0, MEMORY_PLAN_NOTE, width=420, height=330),
        Node(1, "UNETLoader", 0, {"unet_name": "flux1-dev.safetensors"}, title="Load diffusion model"),
        Node(2, "DualCLIPLoader", 0, {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                                       "type": "flux"}, title="Load text encoders"),
        Node(3, "VAELoader", 0, {"vae_name": "ae.safetensors"}, title="Load VAE"),
        Node(4, "HeadroomOffloadPolicy", 1, {"vram_budget_gb": 0.0, "card": THIS_GPU}, title="Card and starting policy"),
        Node(5, "HeadroomMemoryPlan", 2,
             {"mode": "auto", "width": 1024, "height": 1024, "rank": 16, "optimizer": "AdamW8bit", "precision": "bf16"},
             links={"model": (1, "MODEL"), "policy": (4, "policy"), "clip": (2, "CLIP"), "vae": (3, "VAE")},
             title="Memory plan", width=520),  # an output node: the plan shows on it (js/headroom_notes.js)
    ])


def flux2_klein_lora() -> Workflow:
    # The base (undistilled) Klein 4B: what BFL and the trainers recommend training on (the distilled one samples in
    # 4 steps without CFG); Apache-2.0. Validation samples the base model as it is meant to run: CFG, more steps.
    return real_model_lora(RealModel(
        "flux2_klein_lora", "Flux.2 Klein 4B",
        [Node(1, "UNETLoader", 0, {"unet_name": "flux-2-klein-base-4b.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen_3_4b.safetensors", "type": "flux2"}, title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "flux2-vae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- flux-2-klein-base-4b.safetensors -> models/diffusion_models/\n"
        "- qwen_3_4b.safetensors -> models/text_encoders/\n"
        "- flux2-vae.safetensors -> models/vae/\n"
        "(Comfy-Org's Flux.2 Klein 4B repackage on Hugging Face; bucket sides are multiples of 16, the VAE's downscale)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("resident", "blocks"),
        sampling={"sample_steps": 28, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ))



def qwen_image_lora() -> Workflow:
    # Qwen-Image (20 B MMDiT): the bf16 file to train on (the fp8 one is for sampling); its Wan 2.1 VAE makes one-frame
    # video latents, handled as images throughout. Apache-2.0.
    return real_model_lora(RealModel(
        "qwen_image_lora", "Qwen-Image",
        [Node(1, "UNETLoader", 0, {"unet_name": "qwen_image_bf16.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen_2.5_vl_7b.safetensors", "type": "qwen_image"},
              title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "qwen_image_vae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- qwen_image_bf16.safetensors -> models/diffusion_models/\n"
        "- qwen_2.5_vl_7b.safetensors -> models/text_encoders/\n"
        "- qwen_image_vae.safetensors -> models/vae/\n"
        "(Comfy-Org's Qwen-Image repackage on Hugging Face; bucket sides are multiples of 16: VAE 8x, patch 2)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 30, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ))


def zimage_lora() -> Workflow:
    # Z-Image (6 B NextDiT, Qwen3-4B text encoder, Flux VAE): train the base model; the Turbo file is distilled for
    # 8-step sampling without CFG and loses that when trained directly. Apache-2.0.
    return real_model_lora(RealModel(
        "zimage_lora", "Z-Image",
        [Node(1, "UNETLoader", 0, {"unet_name": "z_image_bf16.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen_3_4b.safetensors", "type": "lumina2"}, title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "ae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- z_image_bf16.safetensors (Z-Image base, not Turbo) -> models/diffusion_models/\n"
        "- qwen_3_4b.safetensors -> models/text_encoders/\n"
        "- ae.safetensors (the Flux VAE) -> models/vae/\n"
        "(Comfy-Org's Z-Image repackage on Hugging Face; bucket sides are multiples of 16: VAE 8x, patch 2)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("resident", "blocks"),
        sampling={"sample_steps": 30, "cfg": 4.0, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ))


def krea2_lora() -> Workflow:
    # Krea 2 (12.8 B single-stream DiT, Qwen3-VL-4B text encoder, the Wan 2.1 VAE of Qwen-Image): train Raw, the
    # undistilled model (Turbo is distilled for few-step sampling without CFG and loses that when trained directly);
    # its one-frame video latents are handled as images throughout.
    return real_model_lora(RealModel(
        "krea2_lora", "Krea 2",
        [Node(1, "UNETLoader", 0, {"unet_name": "krea2_raw_bf16.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen3vl_4b_bf16.safetensors", "type": "krea2"},
              title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "qwen_image_vae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- krea2_raw_bf16.safetensors (Krea 2 Raw, not Turbo) -> models/diffusion_models/\n"
        "- qwen3vl_4b_bf16.safetensors -> models/text_encoders/\n"
        "- qwen_image_vae.safetensors (the Wan 2.1 VAE) -> models/vae/\n"
        "(Comfy-Org's Krea 2 repackage on Hugging Face; bucket sides are multiples of 16: VAE 8x, patch 2)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 30, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ))


def ideogram4_lora() -> Workflow:
    # Ideogram 4 (9.3 B single-stream DiT, Qwen3-VL-8B text encoder tapped at 13 layers, the Flux.2 VAE): released in
    # fp8 only (Comfy-Org's repackage: ideogram4_fp8_scaled), whose layers ComfyUI builds as quantized mixed-precision
    # ops: the LoRA trains on them as they are (kinds lora / dora / oft / full; the base stays resident, never
    # streamed: tests/comfy/test_ideogram4_fp8.py). The LoRA trains the conditional model. Its asymmetric CFG runs a second, unconditional model (ideogram4_unconditional_*),
    # which validation here does not load: it samples without CFG. Timesteps logit-normal: its flow shift is 1.0 (where "shifted" is uniform) and its own
    # sampling schedule (comfy_extras/nodes_ideogram4.py Ideogram4Scheduler) is a logit-normal one. Non-commercial
    # licence.
    return real_model_lora(RealModel(
        "ideogram4_lora", "Ideogram 4",
        [Node(1, "UNETLoader", 0, {"unet_name": "ideogram4_fp8_scaled.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen3vl_8b_fp8_scaled.safetensors", "type": "ideogram4"},
              title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "flux2-vae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- ideogram4_fp8_scaled.safetensors (the conditional model; Ideogram 4 is released in fp8 only) -> "
        "models/diffusion_models/\n"
        "- qwen3vl_8b_fp8_scaled.safetensors -> models/text_encoders/\n"
        "- flux2-vae.safetensors -> models/vae/\n"
        "(Comfy-Org's Ideogram 4 repackage on Hugging Face; bucket sides are multiples of 16: the Flux.2 VAE's 16x. "
        "Validation samples without CFG: Ideogram 4's CFG runs its second, unconditional model "
        "(ideogram4_unconditional_fp8_scaled.safetensors), which sampling with the LoRA afterwards may load.)\n"
        "The LoRA trains on the fp8 file's layers as they are (LoRA Config kinds lora, dora, oft or full; the base "
        "resident on a 16 GB card or larger, planned 13.9 GiB there; on a smaller card set the Offload Policy's "
        "base_placement to partial or streamed, or let a Memory Plan choose: the blocks stream as stored, fp8). "
        "Validation as the saved "
        "file samples what Load LoRA + KSampler "
        "sample on this fp8 model.",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="logit_normal", policy=policy("resident", "blocks"),
        sampling={"sample_steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ))


def hidream_o1_lora() -> Workflow:
    # HiDream-O1-Image (8 B pixel-space unified transformer: Qwen3-VL-8B's decoder over the prompt's tokens and 32-px
    # RGB patches): one checkpoint holds MODEL, the tokenizer-only CLIP and the identity pixel-space VAE. Train Full,
    # the undistilled model (Dev is distilled: ComfyUI's own template samples it at cfg 1), text-to-image only
    # (reference images are not cached).
    # Validation as ComfyUI's HiDream-O1 template samples Full (cfg 5, dpmpp_2m_sde_gpu, normal), at the run's 1024
    # px: the planner plans validation at the training size. Its 15.0 GiB of base weights stay resident on a 24 GB
    # card with blocks checkpointed (bench/plan_table.py hidream_o1_lora: the planner's 24 GB plan is resident).
    return real_model_lora(RealModel(
        "hidream_o1_lora", "HiDream-O1",
        [checkpoint("hidream_o1_image_bf16.safetensors")],
        (1, "MODEL"), (1, "CLIP"), (1, "VAE"),
        "- hidream_o1_image_bf16.safetensors (HiDream-O1-Image Full, 16.4 GB) -> models/checkpoints/\n"
        "(Dev, the distilled model, is published as hidream_o1_image_dev_fp8_scaled, a scaled fp8 file: a LoRA of kind "
        "lora, dora, oft or full trains on it too, its base kept resident.)\n"
        "(Comfy-Org/HiDream-O1-Image on Hugging Face, its checkpoints/ folder: one file holds the model, its "
        "tokenizer and the pixel-space VAE; no text encoder or VAE to download, the Gemma 4 of ComfyUI's own template "
        "only rewrites prompts.) Training images: sides multiples of 32 px (the model's pixel patches; the bucket "
        "step is 32). Text-to-image only: reference images (HiDream-O1 Reference Images) are not trained. The model "
        "was trained near 2048x2048; this run trains and validates at 1024: raise resolution, width and height if "
        "the card has room (the planner plans the dataset's largest bucket).",
        resolution=1024, bucket_step=32, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("resident", "blocks"),
        sampling={"sample_steps": 30, "cfg": 5.0, "sampler_name": "dpmpp_2m_sde_gpu", "scheduler": "normal",
                  "width": 1024, "height": 1024},
    ))


WAN21_NOTE = """Wan 2.1 text-to-video LoRA (1.3B; the 14B and Wan 2.2 A14B's experts load and train the same way) with cached clip latents and text, validation clips and a memory report.

Download (file -> ComfyUI folder):
- wan2.1_t2v_1.3B_bf16.safetensors -> models/diffusion_models/
- umt5_xxl_fp8_e4m3fn_scaled.safetensors -> models/text_encoders/
- wan_2.1_vae.safetensors -> models/vae/
(Comfy-Org's Wan 2.1 repackage on Hugging Face)

Your clips: a folder inside ComfyUI's input/ folder (here input/my_clips) of videos (.mp4, .webm, .mov, ...), folders of frames, or images (one-frame clips), each with a same-name .txt caption (walk.mp4 + walk.txt, walk/ + walk.txt). Clips are cut to the Wan VAE's 4k+1 frames (max_frames 33 here: 2 s at 16 fps; every frame_stride-th frame).

Queue it: latents and text embeddings are cached once (UMT5 and the VAE are unloaded before training), then the LoRA trains with a validation clip every 250 steps (an animated WEBP and a frame grid in output/headroom_runs/<run>/validation/) and a save every 500 steps to models/loras/headroom/, which the stock Load LoRA reads (kohya = musubi-tuner names also work; diffusers names do not exist for Wan in ComfyUI)."""


def wan21_lora() -> Workflow:
    # Wan 2.1 T2V 1.3B (Apache-2.0): real-size clips need the memory options (blocks checkpointing keeps a 33-frame
    # 480p clip's activations to a few GB). Validation: 17 frames through the stock samplers, as Wan workflows sample.
    loaders = [Node(1, "UNETLoader", 0, {"unet_name": "wan2.1_t2v_1.3B_bf16.safetensors"}, title="Load diffusion model"),
               Node(2, "CLIPLoader", 0, {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "type": "wan"},
                    title="Load text encoder"),
               Node(3, "VAELoader", 0, {"vae_name": "wan_2.1_vae.safetensors"}, title="Load VAE")]
    return Workflow("wan21_lora", [
        Note(100, 0, WAN21_NOTE, width=440, height=380),
        *loaders,
        Node(5, "HeadroomOffloadPolicy", 0, policy("resident", "blocks"), title="Offload policy"),
        Node(10, "HeadroomDatasetFromVideos", 1,
             {"folder": "my_clips", "resolution": 480, "step": 16, "max_frames": 33, "frame_stride": 1},
             title="Clips folder"),
        Node(11, "HeadroomCacheLatents", 1, links={"dataset": (10, "dataset"), "vae": (3, "VAE"), "policy": (5, "policy")},
             title="Cache latents"),
        Node(12, "HeadroomCacheText", 1, links={"dataset": (10, "dataset"), "clip": (2, "CLIP"), "policy": (5, "policy")},
             title="Cache text"),
        Node(13, "HeadroomLoraConfig", 2, {"rank": 32, "alpha": 32.0}, title="LoRA"),
        Node(14, "HeadroomOptimizerConfig", 2, {"optimizer": "AdamW8bit", "learning_rate": 1e-4, "schedule_steps": 2000},
             title="Optimizer"),
        Node(15, "HeadroomTrainLora", 3,
             {"run_name": "wan21_lora", "precision": "bf16", "timestep_sampling": "shifted",
              "gradient_checkpointing": gradient_checkpointing(policy("resident", "blocks")), "steps": 2000,
              "validate_every": 250, "save_every": 500,
              "lora_subfolder": "headroom", "prompts": "a sks dog running on a beach", "sample_seed": 0,
              "sample_steps": 30, "cfg": 6.0, "sampler_name": "uni_pc", "scheduler": "simple", "width": 480,
              "height": 480, "frames": 17},
             links={"model": (1, "MODEL"), "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "lora_config": (13, "lora_config"), "optimizer_config": (14, "optimizer_config"),
                    "clip": (2, "CLIP"), "vae": (3, "VAE"), "policy": (5, "policy")},
             title="Train LoRA (Wan 2.1)", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(16, "HeadroomVRAMMonitor", 4, links={"value": (15, "lora_name")}, title="Memory after the run"),
        Node(17, "PreviewAny", 4, links={"source": (16, "report")}, title="Memory report"),
        history_node(15),
    ])


@dataclasses.dataclass
class VideoModel:
    """What differs between the video LoRA workflows built from Init, Train Steps, Validate and Save."""
    name: str
    label: str
    loaders: list  # Node list producing the MODEL, CLIP and VAE
    model: tuple
    clip: tuple
    vae: tuple
    note: str
    clips: dict  # HeadroomDatasetFromVideos settings: resolution, step, max_frames (the family's frame rule)
    policy: dict  # HeadroomOffloadPolicy settings: the card to fit, and settings that fit a 24 GB card
    sampling: dict  # Validate's settings: a short clip (frames by the family's rule)


def video_lora(spec: VideoModel) -> Workflow:
    """A video LoRA as separate steps: Init (with the policy) -> Train Steps -> Validate (one short clip) -> Save.
    Queueing again with a higher `steps` continues the run, validates and saves again."""
    return Workflow(spec.name, [
        Note(100, 0, spec.note, width=440, height=560),
        *spec.loaders,
        Node(5, "HeadroomOffloadPolicy", 0, spec.policy, title="Offload policy"),
        Node(10, "HeadroomDatasetFromVideos", 1, {"folder": "my_clips", "frame_stride": 1, **spec.clips},
             title="Clips folder"),
        Node(11, "HeadroomCacheLatents", 1, links={"dataset": (10, "dataset"), "vae": spec.vae, "policy": (5, "policy")},
             title="Cache latents"),
        Node(12, "HeadroomCacheText", 1, links={"dataset": (10, "dataset"), "clip": spec.clip, "policy": (5, "policy")},
             title="Cache text"),
        Node(13, "HeadroomLoraConfig", 2, {"rank": 32, "alpha": 32.0}, title="LoRA"),
        Node(14, "HeadroomOptimizerConfig", 2, {"optimizer": "AdamW8bit", "learning_rate": 1e-4, "schedule_steps": 2000},
             title="Optimizer"),
        Node(15, "HeadroomTrainLoraInit", 3,
             {"run_name": spec.name, "precision": "bf16", "timestep_sampling": "shifted",
              "gradient_checkpointing": gradient_checkpointing(spec.policy)},
             links={"model": spec.model, "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "lora_config": (13, "lora_config"), "optimizer_config": (14, "optimizer_config"),
                    "policy": (5, "policy")},
             title="Start (or resume) run"),
        Node(16, "HeadroomTrainSteps", 3, {"steps": 500}, links={"run": (15, "run")}, title="Train steps",
             width=440, extra_height=LIVE_CHART_HEIGHT),
        Node(17, "HeadroomValidate", 4,
             {"prompts": "a sks dog running on a beach", "sample_seed": 0, **spec.sampling},
             links={"run": (16, "run"), "clip": spec.clip, "vae": spec.vae}, title="Validate (a short clip)"),
        Node(18, "HeadroomSaveLora", 5, {"subfolder": "headroom"}, links={"run": (17, "run")}, title="Save LoRA"),
        Node(19, "HeadroomVRAMMonitor", 5, links={"value": (18, "lora_name")}, title="Memory after the run"),
        Node(20, "PreviewAny", 5, links={"source": (19, "report")}, title="Memory report"),
    ])


VIDEO_QUEUE_NOTE = """Your clips: a folder inside ComfyUI's input/ folder (here input/my_clips) of videos (.mp4, .webm, .mov, ...), folders of frames, or images (one-frame clips), each with a same-name .txt caption (walk.mp4 + walk.txt, walk/ + walk.txt). {frames}

Queue it: latents and text embeddings are cached once (the text encoders and VAE are unloaded before training), the LoRA trains to step 500 (the chart on Train steps shows loss and memory live), one validation clip is sampled with the stock samplers (an animated WEBP and a frame grid in output/headroom_runs/<run>/validation/) and the LoRA is saved to models/loras/headroom/, which the stock Load LoRA reads. Raise steps and queue again to continue the same run.

{memory}"""

HUNYUAN_VIDEO15_NOTE = """HunyuanVideo 1.5 text-to-video LoRA (8.3B, the 480p T2V model; the 720p and image-to-video files load and train the same way) with cached clip latents and text, a validation clip and a memory report.

Download (file -> ComfyUI folder):
- hunyuanvideo1.5_480p_t2v_fp16.safetensors -> models/diffusion_models/
- qwen_2.5_vl_7b_fp8_scaled.safetensors, byt5_small_glyphxl_fp16.safetensors -> models/text_encoders/
- hunyuanvideo15_vae_fp16.safetensors -> models/vae/
(Comfy-Org's HunyuanVideo 1.5 repackage on Hugging Face, as named there: ComfyUI ships no HunyuanVideo 1.5 blueprint to check them against, so check them on the download page. Its DiT files are fp16 conversions; training computes in bf16.)

""" + VIDEO_QUEUE_NOTE.format(
    frames="Clips are cut to the HunyuanVideo 1.5 VAE's 4k+1 frames (max_frames 33 here: about 1.4 s at 24 fps; every frame_stride-th frame); bucket sides are multiples of 16 (VAE 16x, patch 1).",
    memory="Memory: the 8.3B DiT is ~17 GB in fp16. The planner fits the run to the policy's card (on a 24 GB card, expect: what fits kept on the card, the rest of the blocks streamed from host RAM, each block recomputed in backward); workflows/memory_plan.json with these loaders estimates it for your card (set its frames).")

LTX2_NOTE = """LTX-2 text-to-video LoRA (the 19B audio-video model, trained as a video LoRA: the audio branch stays frozen, as ComfyUI samples a silent clip) with cached clip latents and text, a validation clip and a memory report.

Download (file -> ComfyUI folder):
- ltx-2-19b-dev.safetensors (the bf16 dev model to train on; ComfyUI's LTX-2 blueprints sample with ltx-2-19b-dev-fp8) -> models/checkpoints/ (it holds the DiT and the VAEs; the text encoder loader reads its text projection from it too)
- gemma_3_12B_it_fp4_mixed.safetensors (or gemma_3_12B_it.safetensors, full precision) -> models/text_encoders/
(Lightricks' LTX-2 and Comfy-Org's ltx-2 on Hugging Face; the Gemma file is the one ComfyUI's LTX-2 blueprints load. LTX-2.3 files are another text path: not this workflow.)

""" + VIDEO_QUEUE_NOTE.format(
    frames="Clips are cut to the LTX VAE's 8k+1 frames (max_frames 49 here: about 2 s at 25 fps; every frame_stride-th frame); bucket sides are multiples of 32 (VAE 32x). LTX-2 trains each clip at its own frame rate (its video's rate / frame_stride; folders of frames: Dataset From Videos' frame_rate) and validates at the first clip's, as the stock LTXVConditioning node sets it: sample with the LoRA through LTXVConditioning at that frame_rate.",
    memory="Memory: the 19B DiT is ~38 GB in bf16, more than a 24 GB card: the planner fits the run to the policy's card (expect: what fits kept on the card, the other blocks streamed from host RAM every step, so the host needs room for the whole checkpoint, each block recomputed in backward); workflows/memory_plan.json with these loaders estimates it for your card (set its frames).")


def hunyuan_video15_lora() -> Workflow:
    # HunyuanVideo 1.5 480p T2V (8.3B): stock DualCLIPLoader type hunyuan_video_15 (Qwen2.5-VL + byT5). Validation:
    # 17 frames at 848x480, the 480p model's size.
    return video_lora(VideoModel(
        "hunyuan_video15_lora", "HunyuanVideo 1.5",
        [Node(1, "UNETLoader", 0, {"unet_name": "hunyuanvideo1.5_480p_t2v_fp16.safetensors"},
              title="Load diffusion model"),
         Node(2, "DualCLIPLoader", 0, {"clip_name1": "qwen_2.5_vl_7b_fp8_scaled.safetensors",
                                        "clip_name2": "byt5_small_glyphxl_fp16.safetensors", "type": "hunyuan_video_15"},
              title="Load text encoders"),
         Node(3, "VAELoader", 0, {"vae_name": "hunyuanvideo15_vae_fp16.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"), HUNYUAN_VIDEO15_NOTE,
        clips={"resolution": 480, "step": 16, "max_frames": 33},
        policy=policy("partial", "blocks"),
        sampling={"sample_steps": 30, "cfg": 6.0, "sampler_name": "euler", "scheduler": "simple", "width": 848,
                  "height": 480, "frames": 17},
    ))


def ltx2_lora() -> Workflow:
    # LTX-2 19B dev (bf16) through the stock loaders ComfyUI's LTX-2 blueprints use: Load Checkpoint (MODEL, VAE) and
    # the LTXAV text encoder loader (Gemma 3 12B + the checkpoint's text projection). Validation: 25 frames at 768x512.
    return video_lora(VideoModel(
        "ltx2_lora", "LTX-2",
        [Node(1, "CheckpointLoaderSimple", 0, {"ckpt_name": "ltx-2-19b-dev.safetensors"}, title="Load checkpoint"),
         Node(2, "LTXAVTextEncoderLoader", 0, {"text_encoder": "gemma_3_12B_it_fp4_mixed.safetensors",
                                               "ckpt_name": "ltx-2-19b-dev.safetensors", "device": "default"},
              title="Load text encoder")],
        (1, "MODEL"), (2, "CLIP"), (1, "VAE"), LTX2_NOTE,
        clips={"resolution": 512, "step": 32, "max_frames": 49},
        policy=policy("partial", "blocks"),
        sampling={"sample_steps": 30, "cfg": 3.0, "sampler_name": "euler", "scheduler": "simple", "width": 768,
                  "height": 512, "frames": 25},
    ))


EDIT_NOTE = """{label} edit LoRA: reference image + instruction -> edited image, with cached reference latents, validation with a reference image and a memory report.

Download (file -> ComfyUI folder; the file names are the usual ones, check them on the download page):
{downloads}

Your data, inside ComfyUI's input/ folder:
- input/my_edit_dataset: the targets (the edited images), each with a same-name .txt caption = the instruction ("make it night")
- input/my_edit_dataset_control: the reference image of each target (the image before the edit), same file name
- input/edit_reference.png: an image to edit in the validation samples

Queue it: the reference images are cached as latents and passed to the model as the stock {reference_path} passes them; {text_path} The LoRA trains with a validation every 250 steps and a save every 500 steps to models/loras/headroom/. To use it: the stock edit workflow with a LoRA Loader."""


def edit_model_lora(spec: RealModel, reference_encoding: str, text_path: str) -> Workflow:
    """An edit-model LoRA: the dataset's control images are the references (Cache Latents control_encoding 'latents',
    Train LoRA reference 'control latents'), validation samples with Load Image's reference image."""
    reference_path = "Reference Latent node" if reference_encoding == "none" else f"{reference_encoding} node"
    note = EDIT_NOTE.format(label=spec.label, downloads=spec.downloads, reference_path=reference_path,
                            text_path=text_path)
    train = dict(run_name=spec.name, precision=spec.precision, timestep_sampling=spec.timestep_sampling,
                 gradient_checkpointing=gradient_checkpointing(spec.policy), steps=2000, validate_every=250,
                 save_every=500, lora_subfolder="headroom", reference="control latents",
                 prompts="make it night\nturn it into a watercolour painting", sample_seed=0, **spec.sampling)
    return Workflow(spec.name, [
        Note(100, 0, note, width=440, height=380),
        *spec.loaders,
        Node(5, "HeadroomOffloadPolicy", 0, spec.policy, title="Offload policy"),
        Node(6, "LoadImage", 0, {"image": "edit_reference.png"}, title="Validation reference image"),
        *control_data_nodes(spec, "my_edit_dataset", "latents",
                            ("Targets + reference folders", "Cache latents + reference latents", "Cache instructions"),
                            {"reference_encoding": reference_encoding}),
        Node(13, "HeadroomLoraConfig", 2, {"rank": spec.rank, "alpha": float(spec.rank)}, title="LoRA"),
        Node(14, "HeadroomOptimizerConfig", 2,
             {"optimizer": spec.optimizer, "learning_rate": spec.learning_rate, "schedule_steps": 2000}, title="Optimizer"),
        Node(15, "HeadroomTrainLora", 3, train,
             links={"model": spec.model, "latent_cache": (11, "latent_cache"), "text_cache": (12, "text_cache"),
                    "lora_config": (13, "lora_config"), "optimizer_config": (14, "optimizer_config"),
                    "clip": spec.clip, "vae": spec.vae, "policy": (5, "policy"), "reference_images": (6, "IMAGE")},
             title=f"Train edit LoRA ({spec.label})", width=460, extra_height=LIVE_CHART_HEIGHT),
        Node(16, "HeadroomVRAMMonitor", 4, links={"value": (15, "lora_name")}, title="Memory after the run"),
        Node(17, "PreviewAny", 4, links={"source": (16, "report")}, title="Memory report"),
        history_node(15),
    ])


def qwen_image_edit_lora() -> Workflow:
    # Qwen-Image-Edit 2509: the stock workflow encodes the instruction together with the reference image
    # (TextEncodeQwenImageEditPlus: the vision-language encoder sees it) and adds its latent as a reference latent.
    return edit_model_lora(RealModel(
        "qwen_image_edit_lora", "Qwen-Image-Edit",
        [Node(1, "UNETLoader", 0, {"unet_name": "qwen_image_edit_2509_bf16.safetensors"}, title="Load diffusion model"),
         Node(2, "CLIPLoader", 0, {"clip_name": "qwen_2.5_vl_7b.safetensors", "type": "qwen_image"},
              title="Load text encoder"),
         Node(3, "VAELoader", 0, {"vae_name": "qwen_image_vae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- qwen_image_edit_2509_bf16.safetensors -> models/diffusion_models/\n"
        "- qwen_2.5_vl_7b.safetensors -> models/text_encoders/\n"
        "- qwen_image_vae.safetensors -> models/vae/\n"
        "(Comfy-Org's Qwen-Image-Edit and Qwen-Image repackages on Hugging Face; bucket sides are multiples of 16)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 30, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ), "TextEncodeQwenImageEditPlus",
        "each instruction is cached as TextEncodeQwenImageEditPlus encodes it with its item's reference image (the "
        "text encoder sees the image), and validation encodes the prompts with the reference image the same way.")


def flux_kontext_lora() -> Workflow:
    # Flux.1 Kontext dev: the stock workflow adds the reference image's latent with Reference Latent; the text path is
    # plain Flux.1 (CLIP-L + T5). Train on the bf16 file (the fp8 one is for sampling).
    return edit_model_lora(RealModel(
        "flux_kontext_lora", "Flux.1 Kontext dev",
        [Node(1, "UNETLoader", 0, {"unet_name": "flux1-kontext-dev.safetensors"}, title="Load diffusion model"),
         Node(2, "DualCLIPLoader", 0, {"clip_name1": "clip_l.safetensors", "clip_name2": "t5xxl_fp16.safetensors",
                                        "type": "flux"}, title="Load text encoders"),
         Node(3, "VAELoader", 0, {"vae_name": "ae.safetensors"}, title="Load VAE")],
        (1, "MODEL"), (2, "CLIP"), (3, "VAE"),
        "- flux1-kontext-dev.safetensors (FLUX.1 Kontext dev, bf16) -> models/diffusion_models/\n"
        "- clip_l.safetensors, t5xxl_fp16.safetensors -> models/text_encoders/\n"
        "- ae.safetensors -> models/vae/\n"
        "(Black Forest Labs' FLUX.1-Kontext-dev on Hugging Face, Comfy-Org's Flux text encoders; bucket sides are "
        "multiples of 16)",
        resolution=1024, bucket_step=16, rank=16, optimizer="AdamW8bit", learning_rate=1e-4, precision="bf16",
        timestep_sampling="shifted", policy=policy("partial", "blocks"),
        sampling={"sample_steps": 20, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "width": 1024, "height": 1024},
    ), "none", "the instructions are cached as plain text (CLIP Text Encode), as Kontext's stock workflow encodes them.")


WORKFLOWS = [tiny_lora, your_folder_lora, sd15_lora, sd15_full_finetune, sdxl_lora, sdxl_full_finetune, sd35_lora,
             sd35_full_finetune, flux_lora, flux_full_finetune, flux2_klein_lora, qwen_image_lora, zimage_lora,
             krea2_lora, ideogram4_lora, hidream_o1_lora,
             qwen_image_edit_lora, flux_kontext_lora, wan21_lora, hunyuan_video15_lora, ltx2_lora,
             tiny_controlnet, sd15_controlnet, sdxl_controlnet, flux_controlnet,
             memory_plan]
# Workflows small enough to run to completion on a CPU in the test suite (tests/server/test_workflows.py).
TINY_WORKFLOWS = {"tiny_lora", "tiny_controlnet"}
# Tiny workflows that read the user's folder: the test writes one (a bare server has none) and runs them on it.
FOLDER_WORKFLOWS = {"your_folder_lora"}


def fetch_object_info(server: str) -> dict:
    with urllib.request.urlopen(server.rstrip("/") + "/object_info", timeout=120) as response:
        return json.load(response)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--server", help="URL of a running ComfyUI that has Headroom installed")
    source.add_argument("--object-info", type=pathlib.Path, help="a saved /object_info JSON")
    parser.add_argument("--out", type=pathlib.Path, default=HERE, help="folder to write to (default: this one)")
    args = parser.parse_args(argv)
    object_info = fetch_object_info(args.server) if args.server else json.loads(args.object_info.read_text(encoding="utf-8"))
    for make in WORKFLOWS:
        workflow = make()
        ui, api = build(workflow, object_info)
        write_atomically(args.out / f"{workflow.name}.json", render(ui))
        write_atomically(args.out / API_FOLDER / f"{workflow.name}_api.json", render(api))
        print(f"wrote {workflow.name}.json and {API_FOLDER}/{workflow.name}_api.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
