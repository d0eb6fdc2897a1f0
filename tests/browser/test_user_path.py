"""A new user's path in the real editor (issue 25): headless Chromium, the real ComfyUI frontend package, a real
ComfyUI server with Headroom (the harness of test_browser.py). Each test leaves screenshots in
test-artifacts/browser/user_path_*.png: look at them as a newcomer would.
"""
import json
import pathlib
import uuid

import pytest
from PIL import Image

from test_browser import (ARTIFACTS, WORKFLOWS, browser, browser_page, chart_state, load_workflow,  # noqa: F401
                          open_editor, show_node)

EVERYDAY_WIDGETS = 15
NOTES = "headroom_notes"


def shot(page, name: str) -> pathlib.Path:
    path = ARTIFACTS / f"user_path_{name}.png"
    page.screenshot(path=str(path))
    return path


def add_node(page, node_type: str, pos=(100, 100), alone: bool = True) -> str:
    """A new node of `node_type` (alone: on an empty graph, not over the editor's default workflow)."""
    if alone:
        page.evaluate("() => window.app.graph.clear()")
    return page.evaluate("""([type, pos]) => {
        const node = window.LiteGraph.createNode(type);
        node.pos = pos;
        window.app.graph.add(node);
        return String(node.id);
    }""", [node_type, list(pos)])


def widgets(page, node_id: str) -> dict:
    """{shown: names of the widgets drawn, all: every widget name, height: the node's height in px at 100 %,
    gaps: the empty space above each drawn widget after the one before it}."""
    return page.evaluate("""(id) => {
        const node = window.app.graph.getNodeById(id);
        node.arrange?.();
        const shown = node.widgets.filter((w) => node.isWidgetVisible(w));
        const gaps = shown.slice(1).map((w, i) => w.y - (shown[i].y + (shown[i].computedHeight ?? 24)));
        return {shown: shown.map((w) => w.name), all: node.widgets.map((w) => w.name), height: node.size[1], gaps};
    }""", node_id)


def set_widget(page, node_id: str, name: str, value) -> None:
    page.evaluate("""([id, name, value]) => {
        const widget = window.app.graph.getNodeById(id).widgets.find((w) => w.name === name);
        widget.value = value;
        widget.callback?.(value);
    }""", [node_id, name, value])


def notes(page, node_id: str) -> str:
    return page.evaluate("""([id, name]) => window.app.graph.getNodeById(id).widgets
        ?.find((w) => w.name === name)?.element.textContent ?? ''""", [node_id, NOTES])


def prompts_box(page, node_id: str) -> dict:
    """The node's prompts text box: its prompt lines, the height its text needs and the height it is shown at."""
    return page.evaluate("""(id) => {
        const element = window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'prompts').element;
        const shown = element.clientHeight;
        const height = element.style.height;
        element.style.height = '0px';  // the height its text needs, whatever room it has now
        const needed = element.scrollHeight;
        element.style.height = height;
        return {lines: element.value.split('\\n').length, needed, shown};
    }""", node_id)


def queue_in_editor(page) -> None:
    """Queue the editor's graph; `window.__testOutcome` becomes 'success', 'interrupted' or the error when it ends."""
    page.evaluate("""() => {
        window.__testOutcome = null;
        const api = window.comfyAPI.api.api;
        if (!window.__outcomeListening) {
            window.__outcomeListening = true;
            api.addEventListener('execution_success', () => { window.__testOutcome = 'success'; });
            api.addEventListener('execution_interrupted', () => { window.__testOutcome = 'interrupted'; });
            api.addEventListener('execution_error', (e) => {
                window.__testOutcome = 'error: ' + JSON.stringify(e.detail); });
        }
    }""")
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def wait_outcome(page, timeout=300_000) -> str:
    page.wait_for_function("() => window.__testOutcome !== null", timeout=timeout)
    return page.evaluate("() => window.__testOutcome")


@pytest.mark.parametrize("node_type", ["HeadroomTrainLora", "HeadroomTrainControlNet"])
def test_everyday_training_node_is_small_and_folds_expert_inputs(browser_page, node_type):
    page, log = browser_page
    node = add_node(page, node_type)
    page.evaluate("(id) => { const n = window.app.graph.getNodeById(id); n.setSize(n.computeSize()); }", node)
    folded = widgets(page, node)
    shown = [name for name in folded["shown"] if name != "headroom_live"]
    assert len(shown) <= EVERYDAY_WIDGETS, f"{len(shown)} widgets shown by default: {shown}"
    assert {"run_name", "steps", "batch_size"} <= set(shown), shown
    hidden = set(folded["all"]) - set(folded["shown"])
    assert {"precision", "ema_decay", "devices", "checkpoint_minutes"} <= hidden, hidden
    if node_type == "HeadroomTrainLora":
        assert {"frames", "frame_rate", "noise_min", "noise_max", "reference", "prior_ratio", "huber_delta",
                "text_encoder_lr"} <= hidden
    assert folded["height"] < 1000, f"the folded node is {folded['height']} px tall"
    assert max(folded["gaps"]) <= 8, f"empty space between the widgets drawn: {folded['gaps']}"
    show_node(page, node)
    path = shot(page, f"{node_type}_folded")

    # The per-node toggle the editor offers (litegraph's showAdvanced) shows everything, in the same order.
    page.evaluate("(id) => { const n = window.app.graph.getNodeById(id); n.showAdvanced = true;"
                  " n.setSize(n.computeSize()); n.setDirtyCanvas(true, true); }", node)
    unfolded = widgets(page, node)
    assert unfolded["shown"] == unfolded["all"] and unfolded["all"] == folded["all"]
    assert unfolded["height"] > folded["height"] + 300
    show_node(page, node)
    shot(page, f"{node_type}_advanced")
    assert Image.open(path).size == (1600, 1000)
    assert log.headroom_errors() == []


def test_offload_policy_folds_its_expert_input(browser_page):
    """The Offload Policy shows the everyday choices (the card to fit, or the budget and where things live) and folds
    the expert ones (the reserve, checkpoint depth, parking, tiled decode, the host RAM budget, a full fine-tune's
    weights in host RAM, the blocks to checkpoint, the blocks whose trained weights stay on the card) behind the node's
    advanced toggle; the node is drawn without gaps."""
    page, log = browser_page
    node = add_node(page, "HeadroomOffloadPolicy")  # as the editor sizes a new node
    folded = widgets(page, node)
    hidden = set(folded["all"]) - set(folded["shown"])
    assert hidden == {"reserve_gb", "checkpoint_depth", "park_optimizer_during_validation", "vae_tiled_decode",
                      "host_ram_budget_gb", "trained_weights", "checkpoint_blocks", "trained_weights_card_blocks"}, hidden
    assert {"card", "fused_backward", "optimizer_state"} <= set(folded["shown"]), folded["shown"]
    assert max(folded["gaps"]) <= 8, f"empty space between the widgets drawn: {folded['gaps']}"
    show_node(page, node)
    shot(page, "HeadroomOffloadPolicy_folded")
    page.evaluate("(id) => { const n = window.app.graph.getNodeById(id); n.showAdvanced = true;"
                  " n.setSize(n.computeSize()); n.setDirtyCanvas(true, true); }", node)
    unfolded = widgets(page, node)
    assert unfolded["shown"] == unfolded["all"] and unfolded["shown"][-1] == "trained_weights_card_blocks"
    show_node(page, node)
    shot(page, "HeadroomOffloadPolicy_advanced")
    assert log.headroom_errors() == []


def test_the_learning_rate_widget_keeps_0_and_shows_small_rates(browser_page):
    """Optimizer Config's learning_rate in the real editor (issue 44): a typed 0 stays 0 (min 1e-8 made it 1e-8
    silently, shown as 0.000000, and the run trained nothing), so the node refuses it by name; small rates are kept
    and drawn as they are, not rounded to 0.000000."""
    page, log = browser_page
    node = add_node(page, "HeadroomOptimizerConfig")

    def typed(value: float) -> dict:
        set_widget(page, node, "learning_rate", value)
        return page.evaluate("""(id) => {
            const w = window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'learning_rate');
            return {value: w.value, shown: Number(w.value).toFixed(w.options.precision)};
        }""", node)

    assert typed(0) == {"value": 0, "shown": "0.00000000"}
    assert typed(-1e-4)["value"] == 0  # clamped to min 0, which the node refuses as it refuses 0
    assert typed(1e-5) == {"value": 1e-5, "shown": "0.00001000"}
    assert typed(1e-6) == {"value": 1e-6, "shown": "0.00000100"}
    assert typed(1e-8) == {"value": 1e-8, "shown": "0.00000001"}
    assert typed(1e-4) == {"value": 1e-4, "shown": "0.00010000"}
    show_node(page, node)
    shot(page, "learning_rate_widget")
    assert log.headroom_errors() == []


def write_dataset(folder: pathlib.Path, count: int = 2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (64, 64), (60 * index, 120, 200)).save(folder / f"img{index}.png")
        (folder / f"img{index}.txt").write_text(f"a photo number {index}")


def folder_prompt(folder: str, trigger_word: str = "") -> dict:
    """Dataset From Folder -> Cache Latents (tiny sd15 VAE) -> Preview Any of the summary, in API form."""
    return {
        "1": {"class_type": "HeadroomTinyModel", "inputs": {"family": "sd15", "seed": 0, "weights": "random"}},
        "2": {"class_type": "HeadroomDatasetFromFolder",
              "inputs": {"folder": folder, "resolution": 64, "step": 64, "crop": "center", "flip": False, "seed": 0,
                         "skip_bad": False, "trigger_word": trigger_word}},
        "3": {"class_type": "HeadroomCacheText", "inputs": {"dataset": ["2", 0], "clip": ["1", 1]}},
        "4": {"class_type": "PreviewAny", "inputs": {"source": ["3", 1]}},
    }


def test_dataset_folder_is_a_refreshable_list_and_old_typed_values_still_run(comfy_server, browser_page):
    page, log = browser_page
    input_dir = comfy_server.base_dir / "input"
    tag = uuid.uuid4().hex[:6]
    write_dataset(input_dir / f"my_photos_{tag}")
    write_dataset(input_dir / f"old_{tag}" / "typed" / "deep" / "set")  # deeper than the list goes
    page.evaluate("async () => { await window.app.refreshComboInNodes(); }")
    node = add_node(page, "HeadroomDatasetFromFolder")
    options = page.evaluate("(id) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'folder')"
                            ".options.values", node)
    assert f"my_photos_{tag}" in options and f"old_{tag}/typed" in options, options

    # A folder added while the editor is open appears after the refresh (R) without a restart.
    write_dataset(input_dir / f"new_{tag}")
    page.evaluate("async () => { await window.app.refreshComboInNodes(); }")
    options = page.evaluate("(id) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'folder')"
                            ".options.values", node)
    assert f"new_{tag}" in options, options
    show_node(page, node)
    shot(page, "dataset_folder_list")

    # A workflow saved when the folder was typed (a value the list does not hold) loads and runs.
    page.evaluate("async (p) => { await window.app.loadApiJson(p, 'old.json'); }",
                  folder_prompt(f"old_{tag}/typed/deep/set", trigger_word="sks"))
    dataset_node = page.evaluate("() => String(window.app.graph.nodes.find((n) => n.comfyClass === "
                                 "'HeadroomDatasetFromFolder').id)")
    value = page.evaluate("(id) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'folder').value",
                          dataset_node)
    assert value == f"old_{tag}/typed/deep/set"
    queue_in_editor(page)
    assert wait_outcome(page) == "success"

    # A typo: the node itself says what is wrong and which folders come closest (not only behind View details).
    set_widget(page, dataset_node, "folder", f"my_photo_{tag}")
    queue_in_editor(page)
    assert wait_outcome(page).startswith("error:")
    message = notes(page, dataset_node)
    assert message.startswith(f"Failed: Dataset From Folder (Headroom): folder 'my_photo_{tag}' is not a folder"), message
    assert f"closest existing: 'my_photos_{tag}'" in message, message
    show_node(page, dataset_node)
    shot(page, "dataset_folder_typo")

    # Fixed and run again: the message goes.
    set_widget(page, dataset_node, "folder", f"my_photos_{tag}")
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    assert notes(page, dataset_node) == ""

    # A caption whose image is missing: the run goes on, and the node says so on itself (not only in the server log).
    (input_dir / f"my_photos_{tag}" / "img7.txt").write_text("its image was never copied")
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(500)
    message = notes(page, dataset_node)
    assert message.startswith("2 images.\nWarning: 1 caption(s) with no image of the same name"), message
    assert (f"input/my_photos_{tag}/img7.txt: a caption with no image of the same name; add the image or remove the "
            "caption") in message, message
    show_node(page, dataset_node)
    shot(page, "dataset_folder_orphan_caption")
    (input_dir / f"my_photos_{tag}" / "img7.txt").unlink()
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(500)
    assert notes(page, dataset_node) == ""  # the empty text of a clean folder clears the note
    assert log.headroom_errors() == []


def tiny_workflow(run_name: str) -> tuple[dict, dict]:
    """The shipped tiny demo (UI form) and its node ids by type."""
    workflow = json.loads((WORKFLOWS / "tiny_lora.json").read_text())
    ids = {node["type"]: str(node["id"]) for node in workflow["nodes"]}
    return workflow, ids


def test_results_show_on_the_nodes_batch_is_explained_and_the_chart_follows_run_name(browser_page):
    page, log = browser_page
    run_name = f"path_{uuid.uuid4().hex[:8]}"
    workflow, ids = tiny_workflow(run_name)
    load_workflow(page, workflow)
    init, train, validate, save = (ids[t] for t in ("HeadroomTrainLoraInit", "HeadroomTrainSteps",
                                                    "HeadroomValidate", "HeadroomSaveLora"))
    set_widget(page, init, "run_name", run_name)
    set_widget(page, ids["HeadroomSyntheticDataset"], "count", 2)  # two images ...
    set_widget(page, init, "batch_size", 8)  # ... and a batch of 8
    set_widget(page, train, "steps", 12)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(1000)

    init_notes = notes(page, init)
    assert "batch_size=8" in init_notes and "training with batch 2" in init_notes, init_notes
    save_notes = notes(page, save)
    assert f"models/loras/headroom/{run_name}_step" in save_notes, save_notes
    shown = page.evaluate("(id) => (window.app.nodeOutputs?.[id] ?? window.app.graph.getNodeById(id)"
                          ".__output)?.images ?? null", validate)
    images = page.evaluate("(id) => (window.app.graph.getNodeById(id).imgs ?? []).map((i) => i.src)", validate)
    assert any("before_after" in src for src in images) or (shown and "before_after" in json.dumps(shown)), (
        images, shown)
    # The image under the prompts box leaves it room for its prompts (js/headroom_prompts.js): the stock editor
    # squeezed it to two lines when the grid arrived.
    show_node(page, validate)
    page.wait_for_function("(id) => window.app.graph.getNodeById(id).widgets"
                           ".find((w) => w.name === '$$canvas-image-preview')?.computedHeight >= 220", arg=validate)
    box = prompts_box(page, validate)
    shot(page, "validate_prompts_and_grid")
    assert box["lines"] == 8 and box["shown"] >= box["needed"] - 2, box
    state = chart_state(page, train)
    assert state["run"]["run"] == run_name and state["drawn"] == 12
    low, high = map(float, page.evaluate(
        "(id) => window.app.graph.getNodeById(id).headroomLive.canvas.dataset.lossAxis", train).split())
    assert 0 <= low < high, (low, high)
    for node, name in ((init, "init_notes"), (save, "save_notes"), (validate, "validate_before_after"),
                       (train, "chart")):
        show_node(page, node)
        shot(page, name)

    # Another run name: the chart of the old run goes at once (it is not the run this node trains now).
    set_widget(page, init, "run_name", f"{run_name}_b")
    assert chart_state(page, train)["run"] is None
    assert notes(page, init) == "", "the Init node still speaks of the old run"
    show_node(page, train)
    shot(page, "chart_after_run_name_change")
    assert log.headroom_errors() == []


def test_cancel_says_where_the_run_stopped_and_run_continues_it(browser_page):
    page, log = browser_page
    run_name = f"cancel_{uuid.uuid4().hex[:8]}"
    workflow, ids = tiny_workflow(run_name)
    load_workflow(page, workflow)
    init, train = ids["HeadroomTrainLoraInit"], ids["HeadroomTrainSteps"]
    set_widget(page, init, "run_name", run_name)
    set_widget(page, train, "steps", 2000)
    queue_in_editor(page)
    page.wait_for_function("(id) => window.__headroomLive.points(id) >= 3", arg=train, timeout=300_000)
    page.evaluate("async () => { await window.comfyAPI.api.api.interrupt(null); }")
    assert wait_outcome(page, 60_000) == "interrupted"
    page.wait_for_function("(id) => window.__headroomLive.run(id)?.note?.startsWith('Stopped')", arg=train,
                           timeout=60_000)
    run = chart_state(page, train)["run"]
    assert run["note"] == f"Stopped at step {run['step']}, checkpoint saved; Run again to continue.", run
    assert notes(page, train) == run["note"]
    assert 3 <= run["step"] < 2000 and run["eta_s"] is None, run
    show_node(page, train)
    shot(page, "cancelled")

    # Run again: it continues from the saved step (the first new point is the next step).
    stopped = run["step"]
    set_widget(page, train, "steps", stopped + 3)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    run = chart_state(page, train)["run"]
    assert run["step"] == stopped + 3 and run["note"] is None and notes(page, train) == "", run
    show_node(page, train)
    shot(page, "resumed")
    assert log.headroom_errors() == []


def folder_choices(page, node_id: str) -> list[str]:
    """The folder list of a dataset node's combo, as the editor holds it."""
    return page.evaluate("(id) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'folder')"
                         ".options.values", node_id)


def test_your_folder_template_lists_a_new_folder_after_pressing_r_and_trains_on_it(comfy_server, browser_page):
    """The newcomer's path of the your_folder_lora template: a folder created while the editor is open is not in the
    node's list until R is pressed on the canvas (the editor's Refresh Node Definitions), then it is; picked, the
    template trains on it. A reload of the page lists a folder created after that too."""
    page, log = browser_page
    input_dir = comfy_server.base_dir / "input"
    tag = uuid.uuid4().hex[:6]
    workflow = json.loads((WORKFLOWS / "your_folder_lora.json").read_text())
    ids = {node["type"]: str(node["id"]) for node in workflow["nodes"]}
    load_workflow(page, workflow)
    dataset = ids["HeadroomDatasetFromFolder"]

    # What the newcomer sees on the dataset node: the folder the Note names, 64 px, a fixed seed, a trigger word.
    values = page.evaluate("(id) => Object.fromEntries(window.app.graph.getNodeById(id).widgets"
                           ".map((w) => [w.name, w.value]))", dataset)
    assert values["folder"] == "my_dataset" and values["resolution"] == 64, values
    assert values["seed"] == 0 and values["control_after_generate"] == "fixed", values
    assert values["trigger_word"] == "sks_thing", values
    assert "trigger_word" in widgets(page, dataset)["shown"]

    # A folder created while the editor is open: not listed until R.
    folder = f"my_photos_{tag}"
    write_dataset(input_dir / folder, count=3)
    page.wait_for_timeout(1000)
    assert folder not in folder_choices(page, dataset), "the list changed without a refresh: the tooltip is wrong"
    page.locator("#graph-canvas").click(position={"x": 700, "y": 960})  # an empty spot of the canvas, as a user would
    page.keyboard.press("r")
    page.wait_for_function("([id, folder]) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === "
                           "'folder').options.values.includes(folder)", arg=[dataset, folder], timeout=30_000)
    show_node(page, dataset)
    shot(page, "your_folder_after_r")

    # Picked and run (short: 3 steps, 2 sampling steps); the LoRA is saved under the run's name.
    run_name = f"your_folder_{tag}"
    set_widget(page, dataset, "folder", folder)
    set_widget(page, ids["HeadroomTrainLoraInit"], "run_name", run_name)
    set_widget(page, ids["HeadroomTrainSteps"], "steps", 3)
    set_widget(page, ids["HeadroomValidate"], "sample_steps", 2)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(1000)
    assert f"models/loras/headroom/{run_name}_step000003" in notes(page, ids["HeadroomSaveLora"])
    # What it trained on: Preview Dataset shows the folder's 3 crops and says what each is, on the node.
    preview = ids["HeadroomPreviewDataset"]
    page.wait_for_function("(id) => (window.app.graph.getNodeById(id).imgs ?? []).length === 3", arg=preview,
                           timeout=30_000)
    assert notes(page, preview).startswith("items 0-2 of 3, at resolution 64:\n0: "), notes(page, preview)
    show_node(page, preview)
    shot(page, "your_folder_preview")

    # A reload reads the node definitions again: a folder created since is listed on the restored graph.
    later = f"later_{tag}"
    write_dataset(input_dir / later, count=1)
    page.reload()
    open_editor(page, comfy_server.url)
    page.wait_for_function("(id) => window.app.graph.getNodeById(id)?.comfyClass === 'HeadroomDatasetFromFolder'",
                           arg=dataset, timeout=30_000)
    assert later in folder_choices(page, dataset)
    assert log.headroom_errors() == []


def test_inspect_lora_says_on_the_node_what_load_lora_would_skip(comfy_server, browser_page):
    """A LoRA made for Flux on the tiny SD1.5 model: the stock Load LoRA would patch nothing and only log it; Inspect
    LoRA, connected as Load LoRA is, says so on the node in its first line, with the file's trigger word."""
    import torch
    from safetensors.torch import save_file

    page, log = browser_page
    folder = comfy_server.base_dir / "models" / "loras" / "browser"
    folder.mkdir(parents=True, exist_ok=True)
    name = f"flux_named_{uuid.uuid4().hex[:8]}.safetensors"
    layer = "lora_unet_double_blocks_0_img_attn_qkv"
    save_file({f"{layer}.lora_down.weight": torch.zeros(4, 64), f"{layer}.lora_up.weight": torch.zeros(192, 4)},
              str(folder / name), metadata={"ss_tag_frequency": json.dumps({"1_ohwx": {"ohwx": 3, "dog": 1}})})
    model = add_node(page, "HeadroomTinyModel", (50, 100))
    inspect = add_node(page, "HeadroomInspectLora", (450, 100), alone=False)
    page.evaluate("""([a, b]) => {
        const source = window.app.graph.getNodeById(a), target = window.app.graph.getNodeById(b);
        source.connect(0, target, target.findInputSlot('model'));
        source.connect(1, target, target.findInputSlot('clip'));
    }""", [model, inspect])
    set_widget(page, inspect, "lora_name", f"browser/{name}")
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_function("([id, name]) => window.app.graph.getNodeById(id).widgets?.find((w) => w.name === name)"
                           "?.element.textContent", arg=[inspect, NOTES])
    text = notes(page, inspect)
    assert text.startswith("NOTHING APPLIES: Load LoRA patches 0 weights of the diffusion model (sd15)"), text
    assert "2 of its 2 tensors match no weight of this MODEL or CLIP" in text and "trigger words: ohwx, dog" in text
    show_node(page, inspect)
    shot(page, "inspect_lora")
    assert log.headroom_errors() == []
