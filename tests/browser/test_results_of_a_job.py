"""What the nodes show after a job, in the real editor (issue 44; the harness of test_browser.py): every result names
the run and step it belongs to; a job that fails or is cancelled before a node ran leaves that node's old result
marked as from an earlier job (greyed, labelled, its images dimmed), never shown as current; the Init node shows the
plan fitted to the card once, wrapped at word boundaries, whole. Screenshots in test-artifacts/browser/results_*.png:
look at them."""
import json
import uuid

from test_browser import ARTIFACTS, WORKFLOWS, browser, browser_page, chart_state, load_workflow, show_node  # noqa: F401

NOTES = "headroom_notes"


def set_widget(page, node_id: str, name: str, value) -> None:
    page.evaluate("""([id, name, value]) => {
        const widget = window.app.graph.getNodeById(id).widgets.find((w) => w.name === name);
        widget.value = value;
        widget.callback?.(value);
    }""", [node_id, name, value])


def notes(page, node_id: str) -> str:
    return page.evaluate("""([id, name]) => window.app.graph.getNodeById(id).widgets
        ?.find((w) => w.name === name)?.element.textContent ?? ''""", [node_id, NOTES])


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


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"results_{name}.png"))


def stale(page, node_id: str):
    return page.evaluate("(id) => window.__headroomNotes.stale(id)", node_id)


def images_marked(page, node_id: str) -> bool:
    """Whether the node's images were drawn dimmed and labelled (the node in view, a frame drawn)."""
    show_node(page, node_id)
    return page.evaluate("(id) => window.__headroomNotes.imagesMarked(id)", node_id)


def add_card_policy(page, init: str) -> str:
    """An Offload Policy fitted to "this GPU (auto)" on the Init node's policy input: the Init node shows the plan."""
    return page.evaluate("""(init) => {
        const policy = window.LiteGraph.createNode('HeadroomOffloadPolicy');
        policy.pos = [100, 900];
        window.app.graph.add(policy);
        policy.widgets.find((w) => w.name === 'card').value = 'this GPU (auto)';
        const target = window.app.graph.getNodeById(init);
        policy.connect(0, target, target.findInputSlot('policy'));
        return String(policy.id);
    }""", init)


def shown_texts(page, node_id: str) -> list[str]:
    """The texts a node shows: its notes and any other visible text widget (the stock progress text)."""
    return page.evaluate("""(id) => {
        const node = window.app.graph.getNodeById(id);
        return node.widgets.filter((w) => !w.hidden && (w.name === 'headroom_notes' || w.name === '$$node-text-preview'))
            .map((w) => w.element?.textContent ?? String(w.value ?? ''));
    }""", node_id)


def layout_of_notes(page, node_id: str) -> dict:
    """How the notes are laid out: lines broken inside a word (a break not after a space, "/" or a newline), and
    whether the text overflows its box (cut)."""
    return page.evaluate("""(id) => {
        const element = window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'headroom_notes').element;
        const chars = [];
        const walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
        for (let text = walker.nextNode(); text; text = walker.nextNode()) {
            for (let i = 0; i < text.data.length; i++) {
                const range = document.createRange();
                range.setStart(text, i);
                range.setEnd(text, i + 1);
                const rect = [...range.getClientRects()].at(-1);
                chars.push({c: text.data[i], top: rect ? rect.top : null});
            }
        }
        const broken = [];
        let last = null;
        for (let i = 0; i < chars.length; i++) {
            const {c, top} = chars[i];
            if (c === '\\n' || top === null || /\\s/.test(c)) continue;
            if (last !== null && top > last.top + 4) {  // a new visual line starts at this character
                const before = chars[i - 1].c;
                if (!/\\s/.test(before) && before !== '/') {
                    const text = chars.map((x) => x.c).join('');
                    broken.push(text.slice(Math.max(0, i - 12), i) + '|' + text.slice(i, i + 12));
                }
            }
            last = {top};
        }
        return {broken, cut: element.scrollHeight > element.clientHeight + 1 || element.scrollWidth > element.clientWidth + 1,
                width: element.clientWidth, lines: element.scrollHeight};
    }""", node_id)


def tiny_graph(page, run_name: str, steps: int) -> dict:
    workflow = json.loads((WORKFLOWS / "tiny_lora.json").read_text())
    ids = {node["type"]: str(node["id"]) for node in workflow["nodes"]}
    load_workflow(page, workflow)
    set_widget(page, ids["HeadroomTrainLoraInit"], "run_name", run_name)
    set_widget(page, ids["HeadroomSyntheticDataset"], "count", 2)
    set_widget(page, ids["HeadroomTrainSteps"], "steps", steps)
    return ids


def test_results_name_their_run_and_step_and_a_failed_or_cancelled_job_marks_old_ones(browser_page):
    page, log = browser_page
    run_name = f"results_{uuid.uuid4().hex[:8]}"
    ids = tiny_graph(page, run_name, 3)
    init, train, validate, save = (ids[t] for t in ("HeadroomTrainLoraInit", "HeadroomTrainSteps", "HeadroomValidate",
                                                    "HeadroomSaveLora"))
    policy = add_card_policy(page, init)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(1000)

    # Each result names its run and step, and is current.
    lora = f"models/loras/headroom/{run_name}_step000003.safetensors"
    assert notes(page, save) == f"run '{run_name}', step 3: LoRA saved to {lora}"
    assert notes(page, validate).startswith(f"run '{run_name}', step 3: validation loss ")
    assert f"grid saved to output/headroom_runs/{run_name}/validation/step_00000003.png" in notes(page, validate)
    init_notes = notes(page, init)
    assert init_notes.startswith(f"run '{run_name}', step 0: started\n"), init_notes
    assert [stale(page, node) for node in (init, train, validate, save)] == [None] * 4
    assert not images_marked(page, validate)

    # The plan fitted to the card: shown once (the node's notes; no stock progress text over them), whole, wrapped at
    # word boundaries to the node's width.
    texts = [text for text in shown_texts(page, init) if "planned peak" in text]
    assert len(texts) == 1 and texts[0].count("planned peak") == 1, shown_texts(page, init)
    assert "Train LoRA: Init (Headroom): this GPU (auto): base " in init_notes, init_notes
    layout = layout_of_notes(page, init)
    assert layout["broken"] == [] and not layout["cut"], layout
    show_node(page, init)
    shot(page, "init_plan_once")
    # The policy says on its node what it leaves: the budget on this machine now and the host RAM the run may use.
    policy_notes = notes(page, policy)
    assert policy_notes.startswith("budget fit to this GPU (auto), "), policy_notes
    assert "\nauto budget now: " in policy_notes and "\nhost RAM: " in policy_notes, policy_notes
    layout = layout_of_notes(page, policy)
    assert layout["broken"] == [] and not layout["cut"] and stale(page, policy) is None, layout
    show_node(page, policy)
    shot(page, "policy_notes")

    # A job that fails at Init (another rank under the same run name: the run refuses it): Train steps, Validate and
    # Save did not run; their old results stay, marked as from an earlier job and why, not as current.
    set_widget(page, ids["HeadroomLoraConfig"], "rank", 4)
    queue_in_editor(page)
    assert wait_outcome(page).startswith("error:")
    page.wait_for_timeout(500)
    failed = "(from an earlier job: the last one failed before this node ran)\n"
    assert notes(page, save) == f"{failed}run '{run_name}', step 3: LoRA saved to {lora}"
    assert notes(page, validate).startswith(f"{failed}run '{run_name}', step 3: validation loss ")
    assert notes(page, init).startswith("Failed: Train LoRA: Init (Headroom): "), notes(page, init)
    assert stale(page, init) is None  # its failure is this job's
    assert stale(page, save) == stale(page, validate) == stale(page, train) == failed[1:-2]
    assert page.evaluate("(id) => window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'headroom_notes')"
                         ".element.dataset.stale", save) == "true"
    assert images_marked(page, validate), "Validate's old grid is drawn as current"
    assert page.evaluate("(id) => window.app.graph.getNodeById(id).headroomLive.element.dataset.stale", train) == "true"
    for node, name in ((save, "failed_save"), (validate, "failed_validate"), (train, "failed_chart")):
        show_node(page, node)
        shot(page, name)

    # Fixed, and a long job cancelled while training: Save and Validate have not run, so marked; the training node
    # says where it stopped (a result of this job).
    set_widget(page, ids["HeadroomLoraConfig"], "rank", 8)
    set_widget(page, train, "steps", 5000)
    queue_in_editor(page)
    page.wait_for_function("(id) => window.__headroomLive.points(id) >= 5", arg=train, timeout=300_000)
    running = "(from an earlier job: this node has not run in the current one yet)\n"
    assert notes(page, save).startswith(running), notes(page, save)
    assert stale(page, train) is None and stale(page, init) is None  # steps of this job; Init ran in it
    page.evaluate("async () => { await window.comfyAPI.api.api.interrupt(null); }")
    assert wait_outcome(page, 120_000) == "interrupted"
    page.wait_for_function("(id) => window.__headroomLive.run(id)?.note?.startsWith('Stopped')", arg=train,
                           timeout=60_000)
    cancelled = "(from an earlier job: the last one was cancelled before this node ran)\n"
    assert notes(page, save) == f"{cancelled}run '{run_name}', step 3: LoRA saved to {lora}"
    assert notes(page, validate).startswith(f"{cancelled}run '{run_name}', step 3: validation loss ")
    assert images_marked(page, validate)
    assert notes(page, train).startswith("Stopped at step ") and stale(page, train) is None
    for node, name in ((save, "cancelled_save"), (validate, "cancelled_validate")):
        show_node(page, node)
        shot(page, name)

    # Run to the end: every node's result is this job's again, unmarked.
    set_widget(page, train, "steps", chart_state(page, train)["run"]["step"] + 1)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(500)
    assert [stale(page, node) for node in (init, train, validate, save)] == [None] * 4
    assert not notes(page, save).startswith("(") and not images_marked(page, validate)
    show_node(page, save)
    shot(page, "current_again")
    assert log.headroom_errors() == [], "\n".join(log.headroom_errors())


def add_memory_plan(page, model: str) -> str:
    """A Memory Plan of the graph's MODEL at the tiny model's size, on its own (nothing reads its outputs)."""
    return page.evaluate("""(model) => {
        const plan = window.LiteGraph.createNode('HeadroomMemoryPlan');
        plan.pos = [100, 1200];
        window.app.graph.add(plan);
        for (const name of ['width', 'height']) plan.widgets.find((w) => w.name === name).value = 64;
        window.app.graph.getNodeById(model).connect(0, plan, 0);
        return String(plan.id);
    }""", model)


def plan_rows(page, node_id: str) -> dict:
    """The itemised rows of a Memory Plan's notes as laid out: each row's name, value and the value's right edge (px),
    the box's content right edge, and the job's plan text as the server sent it (its history)."""
    return page.evaluate("""async (id) => {
        const element = window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'headroom_notes').element;
        const style = getComputedStyle(element);
        const box = element.getBoundingClientRect();
        const rows = [...element.querySelectorAll('.headroom-row-value')].map((value) => ({
            name: value.parentElement.querySelector('.headroom-row-name').textContent,
            value: value.textContent, right: value.getBoundingClientRect().right}));
        const history = await (await fetch('/api/history?max_items=1')).json();
        const sent = Object.values(history)[0].outputs[id].text.join('\\n');
        const right = box.left + element.clientLeft + element.clientWidth - parseFloat(style.paddingRight);
        return {rows, sent, right};
    }""", node_id)


def notes_box(page, node_id: str) -> dict:
    """The node's notes box height and the height its laid-out text takes in it (px, unzoomed, with its padding)."""
    return page.evaluate("""(id) => {
        const element = window.app.graph.getNodeById(id).widgets.find((w) => w.name === 'headroom_notes').element;
        const range = document.createRange();
        range.selectNodeContents(element);
        const scale = element.offsetHeight / element.getBoundingClientRect().height;
        const style = getComputedStyle(element);
        return {box: element.offsetHeight, text: range.getBoundingClientRect().height * scale
            + parseFloat(style.paddingTop) + parseFloat(style.paddingBottom)};
    }""", node_id)


def test_validation_history_and_memory_plan_say_on_the_node_what_they_found(browser_page):
    """Their text (ui `text`) was sent but not shown: a Memory Plan on its own showed nothing, and a Validation History
    before the run's first validation a black image with no word why (the stock editor shows text only on Preview
    Any). The tiny ControlNet template: first without prompts (no validation yet), then validating."""
    page, log = browser_page
    run_name = f"history_{uuid.uuid4().hex[:8]}"
    workflow = json.loads((WORKFLOWS / "tiny_controlnet.json").read_text())
    ids = {node["type"]: str(node["id"]) for node in workflow["nodes"]}
    load_workflow(page, workflow)
    train, history = ids["HeadroomTrainControlNet"], ids["HeadroomValidationHistory"]
    for name, value in (("run_name", run_name), ("steps", 2), ("prompts", "")):
        set_widget(page, train, name, value)
    plan = add_memory_plan(page, ids["HeadroomTinyModel"])
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    assert notes(page, history).startswith(f"run '{run_name}' has no validation grid yet: validate it with prompts")
    assert notes(page, plan).startswith("Headroom memory plan: "), notes(page, plan)
    show_node(page, plan)
    # Its itemised rows: each value at the right of its line, the values' right edges aligned (the plan's columns
    # are spaced for a fixed-width font: on the node they did not line up); the node's text is the plan as sent.
    table = plan_rows(page, plan)
    assert len(table["rows"]) >= 8, table
    assert any(row["name"] == "trainable weights (fp32)" for row in table["rows"]), table["rows"]
    assert all(abs(row["right"] - table["right"]) < 1.5 for row in table["rows"]), table
    assert notes(page, plan) == table["sent"]
    assert layout_of_notes(page, plan)["broken"] == []
    shot(page, "memory_plan_alone")

    for name, value in (("steps", 4), ("validate_every", 2), ("prompts", "a red circle in the center")):
        set_widget(page, train, name, value)
    queue_in_editor(page)
    assert wait_outcome(page) == "success"
    page.wait_for_timeout(500)
    assert notes(page, history).startswith(f"run '{run_name}', step 4: validation history, "), notes(page, history)
    show_node(page, history)
    page.wait_for_function("(id) => window.app.graph.getNodeById(id).imgs?.every((i) => i.complete && i.naturalWidth)",
                           arg=history, timeout=30_000)
    shot(page, "validation_history")
    # The note keeps its text's height; the node's spare room goes to the sheet (a one-line note sat in a tall box)
    box = notes_box(page, history)
    assert box["text"] - 1 <= box["box"] <= box["text"] + 6, box
    assert stale(page, history) is None and log.headroom_errors() == [], "\n".join(log.headroom_errors())
