"""The live training view (js/) in a real browser: headless Chromium, the real ComfyUI frontend package,
a real ComfyUI server with Headroom.

Needs Debian's `chromium` and Python's `playwright` (driver only: the browser is the system one, never
downloaded). Set up by `.ci/setup-browser`. Without them these tests skip with one line saying so.
Screenshots and the browser console log go to test-artifacts/browser/.
"""
import json
import pathlib
import shutil
import urllib.request
import uuid

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS = REPO_ROOT / "workflows"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DEMO = "tiny_lora"

if CHROMIUM is None:
    pytest.skip("browser tests skipped: no `chromium` on PATH (run .ci/setup-browser)", allow_module_level=True)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="browser tests skipped: Python package `playwright` missing (run .ci/setup-browser)"
)


class BrowserLog:
    """Console messages and uncaught page errors, kept for the artifact and the assertions."""

    def __init__(self, page):
        self.lines: list[str] = []
        self.errors: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", self._page_error)

    def _console(self, message) -> None:
        where = message.location.get("url", "") if message.location else ""
        line = f"console.{message.type}: {message.text} ({where})"
        self.lines.append(line)
        if message.type == "error":
            self.errors.append(line)

    def _page_error(self, error) -> None:
        line = f"pageerror: {error.message}\n{error.stack or ''}"
        self.lines.append(line)
        self.errors.append(line)

    def headroom_errors(self, since: int = 0) -> list[str]:
        # The stock frontend logs its own errors on a bare server (missing user.css, no internet for the
        # release check...): those are not ours. Anything naming Headroom or its files is.
        return [line for line in self.errors[since:] if "headroom" in line.lower()]

    def save(self, name: str, since: int = 0) -> None:
        (ARTIFACTS / name).write_text("\n".join(self.lines[since:]) + "\n")


@pytest.fixture(scope="module")
def browser(comfy_server):
    """One headless Chromium for this module's tests (playwright gives it a fresh temporary profile)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    skip_first_run_dialogs(comfy_server.url)
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def browser_page(comfy_server, browser):
    """The server's graph editor in a new browser context (empty storage: no workflow restored from an
    earlier test), with its console log."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    log = BrowserLog(page)
    try:
        open_editor(page, comfy_server.url)
        yield page, log
    finally:
        context.close()


@pytest.fixture(scope="module")
def shared_editor(comfy_server, browser):
    """One editor for the conversion of every shipped workflow, as a user opens one after another: each loadGraphData
    replaces the whole graph. (A fresh context per workflow spent ~5 s each starting the frontend: 2 min a run.) The
    log is the editor's whole session; each test reads the lines that came after its own start."""
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = context.new_page()
    log = BrowserLog(page)
    try:
        open_editor(page, comfy_server.url)
        assert log.headroom_errors() == [], "the editor's start-up:\n" + "\n".join(log.headroom_errors())
        yield page, log
    finally:
        context.close()


def skip_first_run_dialogs(server_url: str) -> None:
    """A fresh server greets a new user with a templates dialog over the canvas; mark the tour done."""
    request = urllib.request.Request(f"{server_url}/settings/Comfy.TutorialCompleted", data=b"true",
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=30).close()


def open_editor(page, url: str) -> None:
    page.goto(url)
    # The editor is up when the app has a graph, every extension (ours included) has been loaded, and its start-up
    # is over: the frontend removes its splash loader only after it opened the first workflow (default, restored or
    # blank). A graph loaded before that is replaced by that workflow (seen on a busy CI box: a shipped workflow's
    # training nodes were gone right after loadGraphData).
    page.wait_for_function("() => window.app?.graph && window.__headroomLive"
                           " && !document.getElementById('splash-loader')", timeout=120_000)


def load_workflow(page, workflow: dict) -> None:
    page.evaluate("async (workflow) => { await window.app.loadGraphData(workflow); }", workflow)


def headroom_widget_nodes(page) -> list[str]:
    """Types of the nodes that carry the live view widget."""
    return page.evaluate("() => window.app.graph.nodes.filter((n) => n.headroomLive).map((n) => n.comfyClass)")


def show_node(page, node_id: str) -> None:
    """Zoom to 100 % and centre the node, so the screenshot shows its chart readably."""
    page.evaluate("""(id) => {
        const canvas = window.app.canvas;
        const node = window.app.graph.getNodeById(id);
        canvas.ds.scale = 1;
        canvas.centerOnNode(node);
        canvas.setDirty(true, true);
    }""", node_id)
    page.wait_for_timeout(500)


def chart_pixels(page, node_id: str) -> int:
    """How many pixels of the node's chart canvas are painted (a blank canvas has none)."""
    return page.evaluate("""(id) => {
        const canvas = window.app.graph.getNodeById(id).headroomLive.canvas;
        if (!canvas.width || !canvas.height) return 0;
        const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let painted = 0;
        for (let i = 3; i < pixels.length; i += 4) if (pixels[i] > 0) painted++;
        return painted;
    }""", node_id)


def node_id_of(workflow: dict, node_type: str) -> str:
    return str(next(node["id"] for node in workflow["nodes"] if node["type"] == node_type))


def chart_state(page, node_id: str) -> dict:
    """What the node's live view holds and drew, and whether its thumbnails loaded."""
    return page.evaluate("""(id) => {
        const view = window.app.graph.getNodeById(id).headroomLive;
        const images = [...view.thumbnails.querySelectorAll('img')];
        return {run: window.__headroomLive.run(id), drawn: window.__headroomLive.drawnPoints(id),
                thumbnails: images.length, thumbnails_loaded: images.filter((i) => i.complete && i.naturalWidth > 0).length};
    }""", node_id)


def falls(values: list[float]) -> bool:
    """The loss falls over the run: the mean of its last quarter is below that of its first quarter (per-step
    loss is noisy, its trend is what the chart shows)."""
    quarter = max(len(values) // 4, 1)
    return sum(values[-quarter:]) / quarter < sum(values[:quarter]) / quarter


def queue_in_editor(page) -> None:
    """Queue the editor's graph; `window.__testOutcome` becomes 'success' or the error when it ends."""
    page.evaluate("""() => {
        window.__testOutcome = null;
        const api = window.comfyAPI.api.api;
        api.addEventListener('execution_success', () => { window.__testOutcome = 'success'; });
        api.addEventListener('execution_error', (e) => { window.__testOutcome = 'error: ' + JSON.stringify(e.detail); });
    }""")
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")


def demo_workflow(run_name: str) -> tuple[dict, str]:
    """The shipped UI workflow with its Init node's run_name set: (workflow, training node id)."""
    workflow = json.loads((WORKFLOWS / f"{DEMO}.json").read_text())
    init = next(node for node in workflow["nodes"] if node["type"] == "HeadroomTrainLoraInit")
    assert isinstance(init["widgets_values"][0], str), init  # run_name: the Init node's first widget
    init["widgets_values"][0] = run_name
    return workflow, node_id_of(workflow, "HeadroomTrainSteps")


class LossDoesNotFall(AssertionError):
    """The demo's chart shows no learning (checked last, after everything else the test asserts)."""


def test_live_chart_draws_a_falling_loss_and_everything_comes_back_after_reload(comfy_server, browser_page):
    """The shipped workflow as it is (its own steps, model and data), under a run name of its own: a run that
    already reached its steps would resume and train nothing."""
    page, log = browser_page
    run_name = f"browser_{uuid.uuid4().hex[:8]}"
    workflow, train_node = demo_workflow(run_name)
    steps = next(node["widgets_values"][0] for node in workflow["nodes"] if node["type"] == "HeadroomTrainSteps")
    load_workflow(page, workflow)
    widget_nodes = headroom_widget_nodes(page)
    assert widget_nodes == ["HeadroomTrainSteps"], f"the live view belongs on training nodes only, got {widget_nodes}"
    assert page.evaluate("(id) => window.__headroomLive.runName(id)", train_node) == run_name
    assert chart_state(page, train_node)["run"] is None, "a never-run run name must show an empty chart"

    queue_in_editor(page)
    page.wait_for_function(
        "([id, name]) => (window.__headroomLive.run(id)?.run === name && window.__headroomLive.points(id) > 0)"
        " || window.__testOutcome !== null", arg=[train_node, run_name], timeout=300_000)
    assert page.evaluate("() => window.__testOutcome") is None, "no live points before the workflow ended"
    page.wait_for_function("() => window.__testOutcome !== null", timeout=600_000)
    outcome = page.evaluate("() => window.__testOutcome")
    log.save("console_live.log")
    assert outcome == "success", f"the demo workflow failed in the editor: {outcome}\n{comfy_server.log_tail()}"

    show_node(page, train_node)
    page.wait_for_function("(id) => [...window.app.graph.getNodeById(id).headroomLive.thumbnails"
                           ".querySelectorAll('img')].every((i) => i.complete)", arg=train_node, timeout=30_000)
    live = chart_state(page, train_node)
    page.screenshot(path=str(ARTIFACTS / "live_chart.png"))
    run = live["run"]
    assert run["run"] == run_name and run["steps"] == list(range(1, steps + 1)), run
    assert live["drawn"] == steps, f"the chart drew {live['drawn']} of {steps} loss points"
    assert chart_pixels(page, train_node) > 1000, "the chart canvas is blank"
    assert all(lr is not None for lr in run["lrs"]) and all(rss is not None for rss in run["rss"]), run
    assert live["thumbnails"] > 0 and live["thumbnails_loaded"] == live["thumbnails"], live

    # After a reload the editor restores the workflow, and the chart all it showed: loss, lr, memory, thumbnails.
    page.reload()
    open_editor(page, comfy_server.url)
    page.wait_for_function("(id) => window.__headroomLive.drawnPoints(id) > 0 && [...window.app.graph.getNodeById(id)"
                           ".headroomLive.thumbnails.querySelectorAll('img')].every((i) => i.complete)",
                           arg=train_node, timeout=60_000)
    show_node(page, train_node)
    restored = chart_state(page, train_node)
    page.screenshot(path=str(ARTIFACTS / "live_chart_after_reload.png"))
    log.save("console_live_and_reload.log")
    back = restored["run"]
    assert (back["run"], back["steps"], back["loss"]) == (run["run"], run["steps"], run["loss"])
    assert back["lrs"] == pytest.approx(run["lrs"], rel=1e-3) and back["lr"] == pytest.approx(run["lr"], rel=1e-3)
    assert back["rss"] == pytest.approx(run["rss"], abs=2**20)  # carried in whole MiB
    assert (back["val_steps"], back["images"]) == (run["val_steps"], run["images"]) and back["s_per_step"] > 0
    assert restored["drawn"] == steps and restored["thumbnails_loaded"] == live["thumbnails"], restored
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())
    if not falls(run["loss"]):
        raise LossDoesNotFall(f"the loss does not fall over the demo's {steps} steps: {run['loss']}")


def test_a_graph_never_shows_another_runs_data(comfy_server, browser_page):
    """The same node ids under other run names: another client's run (headless, same workflow) never lands on
    the chart, live or from /history, and a freshly loaded graph starts empty; its own run does come back."""
    page, log = browser_page
    mine, other = f"mine_{uuid.uuid4().hex[:8]}", f"other_{uuid.uuid4().hex[:8]}"
    workflow, train_node = demo_workflow(mine)
    load_workflow(page, workflow)

    prompt = json.loads((WORKFLOWS / "api" / f"{DEMO}_api.json").read_text())
    init = next(n for n in prompt.values() if n["class_type"] == "HeadroomTrainLoraInit")
    train = next(n for n in prompt.values() if n["class_type"] == "HeadroomTrainSteps")
    init["inputs"]["run_name"], train["inputs"]["steps"] = other, 3
    seen = []
    comfy_server.run_workflow(prompt, timeout=600, on_event=lambda m: seen.append(m["type"]))
    assert "headroom.train.step" in seen  # the events went out (to every client) while the page was open
    show_node(page, train_node)
    page.screenshot(path=str(ARTIFACTS / "other_run_not_shown_live.png"))
    assert chart_state(page, train_node)["run"] is None, "another client's run was drawn on this graph"

    fresh, _ = demo_workflow(f"fresh_{uuid.uuid4().hex[:8]}")
    load_workflow(page, fresh)
    page.wait_for_timeout(1000)  # the restore from /history has run (or would have)
    show_node(page, train_node)
    page.screenshot(path=str(ARTIFACTS / "fresh_graph_empty.png"))
    assert chart_state(page, train_node)["run"] is None, "a fresh graph shows another run's chart"

    # Positive control: the graph that names the headless run shows that run, from /history.
    own, _ = demo_workflow(other)
    load_workflow(page, own)
    page.wait_for_function("(id) => window.__headroomLive.drawnPoints(id) > 0", arg=train_node, timeout=30_000)
    state = chart_state(page, train_node)
    show_node(page, train_node)
    page.screenshot(path=str(ARTIFACTS / "own_run_restored.png"))
    assert state["run"]["run"] == other and state["run"]["steps"] == [1, 2, 3], state
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())


# The Offload Policy's text at its longest (nodes/memory.py: a card to fit, the auto budget, the host RAM, the card's
# line), with a large machine's figures.
POLICY_TEXT = ("budget fit to this GPU (auto), base storage as_loaded to start from, a lower one only if nothing "
               "fits, parked during validation, encoders kept loaded, fused backward, trained weights in host RAM"
               "\nauto budget now: 139.80 GiB available - 1 GiB reserve = "
               "138.80 GiB\nhost RAM: 10.80 GiB in use now, the run may grow it to 121.33 GiB (what the OS reports "
               "available, less 2 GiB)\ncard this GPU (auto): when a training run opens, the planner picks the "
               "fastest placement, storage, checkpointing and optimizer state that fit it, and the training node "
               "shows them")

# A VRAM monitor's report on a GPU (nodes/bridge/memory_report.py), as the templates' Preview Any nodes show it.
REPORT_TEXT = ("Headroom VRAM monitor: NVIDIA GeForce RTX 4090\ndriver: total 23.99 GiB, free 3.20 GiB (ComfyUI counts "
               "5.10 GiB free, torch cache included)\ntorch: allocated 18.20 GiB, reserved 19.90 GiB\ntorch peak since "
               "last reset: allocated 21.30 GiB, reserved 22.10 GiB\nprocess RSS: 9.80 GiB, peak 12.40 GiB\nloaded "
               "models: 1\n- Flux: 22.17 GiB, 16.00 GiB on cuda:0 (partially loaded)")


def room_below(page, node_id: str, text: str) -> dict:
    """The node shows `text` as its result (its onExecuted, as when it ran): its bottom once it has grown to fit it
    (where the layout kept too little room), whether the text is cut, and the tops (their title bars) of the nodes
    below it that share some of its columns."""
    return page.evaluate("""([id, text]) => new Promise((resolve) => {
        const node = window.app.graph.getNodeById(id);
        node.onExecuted({text: [text]});
        requestAnimationFrame(() => requestAnimationFrame(() => {
            const [x, y] = node.pos, [w, h] = node.size;
            const below = window.app.graph.nodes.filter((n) => n !== node && n.pos[0] < x + w
                && n.pos[0] + n.size[0] > x && n.pos[1] > y);
            const element = node.widgets.find((w) => w.name === 'headroom_notes')?.element;
            resolve({bottom: y + h, shown: element?.textContent ?? null,
                     cut: Boolean(element) && element.scrollHeight > element.clientHeight + 1,
                     below: below.map((n) => ({title: n.title, top: n.pos[1] - window.LiteGraph.NODE_TITLE_HEIGHT}))});
        }));
    })""", [node_id, text])


@pytest.mark.parametrize("name", sorted(p.stem for p in WORKFLOWS.glob("*.json")))
def test_editor_turns_ui_workflow_into_the_shipped_api_workflow(shared_editor, name):
    """The editor itself converts each shipped UI workflow; the result must be the shipped API workflow.
    The live view sits on the training nodes of it and on no other node. An Offload Policy showing its text (the
    budget and host RAM it leaves, at its longest) and a Preview Any showing a memory report grow into the room the
    layout kept, over no node below them."""
    page, log = shared_editor
    lines_before, errors_before = len(log.lines), len(log.errors)
    api_path = WORKFLOWS / "api" / f"{name}_api.json"
    assert api_path.exists(), f"{name}.json has no API-format twin {api_path.name}"
    workflow = json.loads((WORKFLOWS / f"{name}.json").read_text())
    load_workflow(page, workflow)
    training_types = page.evaluate("() => window.__headroomLive.nodeTypes")
    training_nodes = sorted(n["type"] for n in workflow["nodes"] if n["type"] in training_types)
    try:  # the editor adds the live view as it sets up each node: on a busy machine after loadGraphData returned
        page.wait_for_function("(types) => JSON.stringify(window.app.graph.nodes.filter((n) => n.headroomLive)"
                               ".map((n) => n.comfyClass).sort()) === JSON.stringify(types)",
                               arg=training_nodes, timeout=30_000)
    except sync_api.TimeoutError:
        pass  # the assertion below says what the nodes carry
    assert sorted(headroom_widget_nodes(page)) == training_nodes, "the live view belongs on training nodes only"
    converted = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    shipped = json.loads(api_path.read_text())

    def comparable(prompt: dict) -> dict:
        return {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in prompt.items()}

    assert comparable(converted) == comparable(shipped)
    for policy in (str(n["id"]) for n in workflow["nodes"] if n["type"] == "HeadroomOffloadPolicy"):
        room = room_below(page, policy, POLICY_TEXT)
        assert room["shown"] == POLICY_TEXT and not room["cut"], room
        assert all(room["bottom"] <= node["top"] for node in room["below"]), f"{name}: the policy's text covers {room}"
    for preview in (str(n["id"]) for n in workflow["nodes"] if n["type"] == "PreviewAny"):  # the stock node's text
        room = room_below(page, preview, REPORT_TEXT)
        assert all(room["bottom"] <= node["top"] for node in room["below"]), f"{name}: the text shown covers {room}"
    log.save(f"console_{name}.log", since=lines_before)
    errors = log.headroom_errors(since=errors_before)
    assert errors == [], "\n".join(errors)


def test_templates_list_only_the_ui_workflows_each_with_its_thumbnail(comfy_server, browser_page):
    """The editor's Templates dialog, Extensions > Headroom (the pack's label: locales/en/main.json): exactly the shipped
    UI workflows (the API ones live in workflows/api/, which ComfyUI does not list), in reading order
    (js/headroom_templates.js: the demo first, then by family; the server's own order is its directory listing), each
    card's picture its `<name>.jpg` (workflows/thumbnails.py, which also writes the workflow's one-line title into the
    picture), loaded as a real image. ComfyUI 0.33.0 gives a custom node's templates no index, and frontend 1.49.6 no
    title or description from i18n: the card's title is the file name."""
    from server_harness import PACKAGE_DIR_NAME
    from test_templates_order import template_order

    page, log = browser_page
    page.evaluate("() => window.app.extensionManager.command.execute('Comfy.BrowseTemplates')")
    label = json.loads((REPO_ROOT / "locales" / "en" / "main.json").read_text())["templateWorkflows"]["category"]
    page.locator("[role=dialog]").get_by_text(label[PACKAGE_DIR_NAME], exact=True).click()
    cards = "[role=dialog] h3.line-clamp-1"  # a card's title (frontend 1.49.6); the side bar's headings are h3 too
    page.wait_for_function("(cards) => document.querySelectorAll(cards).length > 0", arg=cards, timeout=30_000)
    page.wait_for_timeout(1500)  # the first row's pictures
    page.screenshot(path=str(ARTIFACTS / "templates.png"))
    titles = "(cards) => Array.from(document.querySelectorAll(cards)).map((h) => h.textContent.trim())"
    shown = page.evaluate(titles, cards)
    while True:  # the dialog renders its cards a page (24) at a time, the next as the last comes into view
        page.locator(cards).last.scroll_into_view_if_needed()
        page.wait_for_timeout(1000)
        more = page.evaluate(titles, cards)
        if len(more) == len(shown):
            break
        shown = more
    assert sorted(shown) == sorted(p.stem for p in WORKFLOWS.glob("*.json")), shown
    assert shown == template_order(), shown
    pictures = page.evaluate("() => Array.from(document.querySelectorAll('[role=dialog] img'))"
                             ".filter((i) => i.complete).map((i) => i.naturalWidth)")
    assert pictures and all(width == 512 for width in pictures), pictures  # no placeholder: our 512 x 384 JPEGs
    for name in shown:
        response = page.request.get(f"{comfy_server.url}/api/workflow_templates/{PACKAGE_DIR_NAME}/{name}.jpg")
        assert response.ok and response.headers["content-type"] == "image/jpeg", name
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())
