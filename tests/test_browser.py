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

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKFLOWS = REPO_ROOT / "workflows"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
DEMO = "tiny_lora"
BROWSER_STEPS = 6  # enough points for a curve, few enough for a CPU

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

    def headroom_errors(self) -> list[str]:
        # The stock frontend logs its own errors on a bare server (missing user.css, no internet for the
        # release check...): those are not ours. Anything naming Headroom or its files is.
        return [line for line in self.errors if "headroom" in line.lower()]

    def save(self, name: str) -> None:
        (ARTIFACTS / name).write_text("\n".join(self.lines) + "\n")


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


def skip_first_run_dialogs(server_url: str) -> None:
    """A fresh server greets a new user with a templates dialog over the canvas; mark the tour done."""
    request = urllib.request.Request(f"{server_url}/settings/Comfy.TutorialCompleted", data=b"true",
                                     headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=30).close()


def open_editor(page, url: str) -> None:
    page.goto(url)
    # The editor is up when the app has a graph and every extension (ours included) has been loaded.
    page.wait_for_function("() => window.app?.graph && window.__headroomLive",
                           timeout=120_000)


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


def set_widget(page, node_id: str, name: str, value) -> None:
    page.evaluate("""([id, name, value]) => {
        const widget = window.app.graph.getNodeById(id).widgets.find((w) => w.name === name);
        if (!widget) throw new Error(`node ${id} has no widget ${name}`);
        widget.value = value;
    }""", [node_id, name, value])


def test_live_chart_draws_while_training_and_after_reload(comfy_server, browser_page):
    page, log = browser_page
    workflow = json.loads((WORKFLOWS / f"{DEMO}.json").read_text())
    train_node = node_id_of(workflow, "HeadroomTrainSteps")
    init_node = node_id_of(workflow, "HeadroomTrainLoraInit")
    load_workflow(page, workflow)

    widget_nodes = headroom_widget_nodes(page)
    assert widget_nodes == ["HeadroomTrainSteps"], f"the live view belongs on training nodes only, got {widget_nodes}"

    # A run name of its own: a run that already reached its steps would resume and train nothing. (The chart
    # may already show an earlier run of this node from the server's history: the name tells them apart.)
    run_name = f"browser_{uuid.uuid4().hex[:8]}"
    set_widget(page, init_node, "run_name", run_name)
    set_widget(page, train_node, "steps", BROWSER_STEPS)
    page.evaluate("""() => {
        window.__testOutcome = null;
        const api = window.comfyAPI.api.api;
        api.addEventListener('execution_success', () => { window.__testOutcome = 'success'; });
        api.addEventListener('execution_error', (e) => { window.__testOutcome = 'error: ' + JSON.stringify(e.detail); });
    }""")
    page.evaluate("async () => { await window.app.queuePrompt(0, 1); }")

    # Points arrive while the workflow is still running (training, then validation and saving).
    page.wait_for_function(
        "([id, name]) => (window.__headroomLive.run(id)?.run === name && window.__headroomLive.points(id) > 0)"
        " || window.__testOutcome !== null", arg=[train_node, run_name], timeout=300_000)
    assert page.evaluate("() => window.__testOutcome") is None, "no live points before the workflow ended"
    page.wait_for_function("() => window.__testOutcome !== null", timeout=600_000)
    outcome = page.evaluate("() => window.__testOutcome")
    log.save("console_live.log")
    assert outcome == "success", f"the demo workflow failed in the editor: {outcome}\n{comfy_server.log_tail()}"

    show_node(page, train_node)
    run = page.evaluate("(id) => window.__headroomLive.run(id)", train_node)
    drawn = page.evaluate("(id) => window.__headroomLive.drawnPoints(id)", train_node)
    page.screenshot(path=str(ARTIFACTS / "live_chart.png"))
    assert run["run"] == run_name and run["steps"] == list(range(1, BROWSER_STEPS + 1)), run
    assert drawn == BROWSER_STEPS, f"the chart drew {drawn} of {BROWSER_STEPS} loss points"
    assert chart_pixels(page, train_node) > 1000, "the chart canvas is blank"

    # After a reload the editor restores the workflow; the chart comes back from the run's history.
    page.reload()
    open_editor(page, comfy_server.url)
    page.wait_for_function("(id) => window.__headroomLive.drawnPoints(id) > 0", arg=train_node, timeout=60_000)
    show_node(page, train_node)
    restored = page.evaluate("(id) => window.__headroomLive.run(id)", train_node)
    page.screenshot(path=str(ARTIFACTS / "live_chart_after_reload.png"))
    log.save("console_live_and_reload.log")
    assert restored["steps"] == run["steps"] and restored["run"] == run["run"], restored
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())


@pytest.mark.parametrize("name", sorted(p.stem for p in WORKFLOWS.glob("*.json") if not p.stem.endswith("_api")))
def test_editor_turns_ui_workflow_into_the_shipped_api_workflow(browser_page, name):
    """The editor itself converts each shipped UI workflow; the result must be the shipped API workflow.
    The live view sits on the training nodes of it and on no other node."""
    page, log = browser_page
    api_path = WORKFLOWS / f"{name}_api.json"
    assert api_path.exists(), f"{name}.json has no API-format twin {api_path.name}"
    workflow = json.loads((WORKFLOWS / f"{name}.json").read_text())
    load_workflow(page, workflow)
    training_types = page.evaluate("() => window.__headroomLive.nodeTypes")
    training_nodes = sorted(n["type"] for n in workflow["nodes"] if n["type"] in training_types)
    assert sorted(headroom_widget_nodes(page)) == training_nodes, "the live view belongs on training nodes only"
    converted = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    shipped = json.loads(api_path.read_text())

    def comparable(prompt: dict) -> dict:
        return {node_id: {"class_type": node["class_type"], "inputs": node["inputs"]} for node_id, node in prompt.items()}

    assert comparable(converted) == comparable(shipped)
    log.save(f"console_{name}.log")
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())
