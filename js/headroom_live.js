// Headroom live view: a loss chart and a memory bar drawn on Headroom's training nodes in the graph
// editor, fed by the trainer's websocket events and restored after a page reload from the node's UI
// output in /history. Other nodes are left alone. A node shows only its own run: the events and history
// entries it takes carry its node id AND the run name its graph gives it (run_name on the node, or on the
// Init node its `run` input comes from); everything is cleared when a graph is loaded.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { drawTrainingView } from "./headroom_chart.js";
import { markCurrent, nodeForExecutionId, showNotes } from "./headroom_notes.js";

// The node types that train and emit `headroom.train.step` / `headroom.validate`.
const TRAINING_NODE_TYPES = ["HeadroomTrainSteps", "HeadroomTrainLora", "HeadroomTrainControlNet"];
const STEP_EVENT = "headroom.train.step";
const VALIDATE_EVENT = "headroom.validate";
const STOPPED_EVENT = "headroom.train.stopped"; // a cancel stopped training (step, checkpoint saved or not)
const HISTORY_KEY = "headroom_history"; // the training node's UI output key (one entry per run)
const VALIDATION_KEY = "headroom_validation"; // HeadroomValidate's UI output: the run, step, loss and images
const MIB = 1024 * 1024; // history entries carry memory in MiB (`memory_mib`), events in bytes
const HISTORY_ITEMS_SEARCHED = 64; // recent /history entries searched when a graph is (re)loaded
const CHART_HEIGHT = 250;
const THUMBNAIL_HEIGHT = 72;
const MEMORY_KEYS = ["allocated", "reserved", "peak", "rss"];

function emptyRun(name) {
  return {
    run: name, step: 0, total_steps: 0, lr: null, s_per_step: null, eta_s: null, note: null,
    steps: [], loss: [], lrs: [], allocated: [], reserved: [], peak: [], rss: [],
    val_steps: [], val_loss: [], images: [], images_step: null,
  };
}

// A step at or before the last one means the run went back (restarted, or resumed from an earlier
// checkpoint): the points from there on are dropped so the curve stays one line over the steps.
function dropFrom(run, step) {
  const keep = run.steps.findIndex((s) => s >= step);
  if (keep >= 0) {
    for (const key of ["steps", "loss", "lrs", ...MEMORY_KEYS]) run[key].length = keep;
  }
  const keepValidation = run.val_steps.findIndex((s) => s >= step);
  if (keepValidation >= 0) {
    run.val_steps.length = keepValidation;
    run.val_loss.length = keepValidation;
  }
}

function addStep(run, data) {
  if (run.steps.length && data.step <= run.steps.at(-1)) dropFrom(run, data.step);
  run.steps.push(data.step);
  run.loss.push(data.loss);
  run.lrs.push(data.lr ?? null);
  for (const key of MEMORY_KEYS) run[key].push(data[key] ?? null);
  run.step = data.step;
  run.total_steps = data.total_steps ?? run.total_steps;
  run.lr = data.lr ?? run.lr;
  run.s_per_step = data.s_per_step ?? run.s_per_step;
  run.eta_s = data.eta_s ?? null;
  run.note = null;
}

const lastOf = (value) => (Array.isArray(value) ? value.at(-1) : value) ?? null;

const perStep = (values, length, scale = 1) =>
  Array.isArray(values) && values.length === length
    ? values.map((value) => (value == null ? null : value * scale))
    : Array.from({ length }, () => null);

// One entry of the node's `headroom_history` UI output -> the run the chart draws. Entries of older versions
// (no lr / memory / images) still draw; memory comes as `memory_mib` (or, older, in bytes per key).
function runFromHistory(entry) {
  const run = emptyRun(entry.run);
  run.steps = [...(entry.steps ?? [])];
  run.loss = [...(entry.loss ?? [])];
  const length = run.steps.length;
  run.lrs = perStep(entry.lr, length);
  for (const key of MEMORY_KEYS) {
    run[key] = entry.memory_mib?.[key] ? perStep(entry.memory_mib[key], length, MIB) : perStep(entry[key], length);
  }
  run.val_steps = [...(entry.val_steps ?? [])];
  run.val_loss = [...(entry.val_loss ?? [])];
  run.images = [...(entry.images ?? [])];
  run.images_step = entry.images_step ?? (run.images.length ? run.val_steps.at(-1) ?? null : null);
  run.step = run.steps.at(-1) ?? 0;
  run.total_steps = entry.total_steps ?? run.step;
  run.lr = Array.isArray(entry.lr) ? run.lrs.findLast((value) => value != null) ?? null : lastOf(entry.lr);
  run.s_per_step = lastOf(entry.s_per_step);
  run.eta_s = 0;
  run.note = entry.note ?? null;
  return run;
}

// A HeadroomValidate output of the same run (modular graphs validate in a node of their own): its images, and its
// loss where the history does not have it yet (the validation ran after the training node).
function addValidation(run, validation) {
  if (!validation || validation.run !== run.run) return;
  if (typeof validation.val_loss === "number" && !run.val_steps.includes(validation.step)) {
    run.val_steps.push(validation.step);
    run.val_loss.push(validation.val_loss);
  }
  if (validation.images?.length && (run.images_step == null || validation.step >= run.images_step)) {
    run.images = [...validation.images];
    run.images_step = validation.step;
  }
}

// The chart widget of one training node: a canvas and, after a validation, its preview images.
class LiveView {
  constructor(node) {
    this.node = node;
    this.run = null;
    this.drawnPoints = 0;
    this.element = document.createElement("div");
    this.element.className = "headroom-live";
    this.element.style.cssText = "display:flex;flex-direction:column;gap:4px;width:100%;height:100%;overflow:hidden";
    this.canvas = document.createElement("canvas");
    this.canvas.style.cssText = `width:100%;flex:1 1 auto;min-height:${CHART_HEIGHT - 20}px`;
    this.thumbnails = document.createElement("div");
    this.thumbnails.style.cssText = `display:none;gap:4px;height:${THUMBNAIL_HEIGHT}px;overflow:hidden`;
    // Over a chart of an earlier job (js/headroom_notes.js decides): says so; the chart and thumbnails are dimmed.
    this.staleLabel = document.createElement("div");
    this.staleLabel.className = "headroom-live-stale";
    this.staleLabel.style.cssText = "display:none;position:absolute;left:0;right:0;top:40%;text-align:center;" +
      "font:italic 12px sans-serif;color:#d8d8d8;background:rgba(20,20,20,0.75);padding:4px 6px;pointer-events:none";
    this.element.style.position = "relative";
    this.staleReason = null;
    this.element.append(this.canvas, this.thumbnails, this.staleLabel);
    this.resizeObserver = new ResizeObserver(() => this.draw());
    this.resizeObserver.observe(this.canvas);
    this.widget = node.addDOMWidget("headroom_live", "headroom_live", this.element, {
      serialize: false, // not an input: never sent in the prompt
      hideOnZoom: false,
      getMinHeight: () => CHART_HEIGHT + (this.run?.images.length ? THUMBNAIL_HEIGHT + 4 : 0),
    });
    this.widget.serialize = false; // nor saved in the workflow's widgets_values
  }

  setRun(run) {
    this.run = run;
    this.showImages();
    this.draw();
    this.showStale();
  }

  // `reason` (a string) when the node's chart is from an earlier job than this editor's current one; null when not.
  setStale(reason) {
    this.staleReason = reason ?? null;
    this.showStale();
  }

  showStale() {
    const stale = Boolean(this.staleReason && this.run);
    this.staleLabel.textContent = stale ? `(${this.staleReason})` : "";
    this.staleLabel.style.display = stale ? "block" : "none";
    this.canvas.style.opacity = this.thumbnails.style.opacity = stale ? "0.45" : "1";
    this.element.dataset.stale = stale ? "true" : "false";
  }

  showImages() {
    const images = this.run?.images ?? [];
    this.thumbnails.replaceChildren(
      ...images.map((image) => {
        const img = document.createElement("img");
        img.src = api.apiURL(`/view?${new URLSearchParams({
          filename: image.filename, subfolder: image.subfolder ?? "", type: image.type ?? "output",
        })}`);
        img.style.cssText = "height:100%;object-fit:contain;border-radius:3px";
        img.title = `validation at step ${this.run.images_step ?? this.run.val_steps.at(-1) ?? "?"}`;
        return img;
      })
    );
    this.thumbnails.style.display = images.length ? "flex" : "none";
  }

  draw() {
    this.drawnPoints = drawTrainingView(this.canvas, this.run);
    this.canvas.title = this.run?.note ?? "";
    this.canvas.dataset.points = String(this.drawnPoints);
    this.canvas.dataset.steps = String(this.run?.steps.length ?? 0);
  }

  remove() {
    this.resizeObserver.disconnect();
  }
}

function viewForExecutionId(executionId) {
  const node = nodeForExecutionId(executionId);
  return TRAINING_NODE_TYPES.includes(node?.comfyClass) ? node.headroomLive ?? null : null;
}

// The node linked to a node's input `name` (litegraph's own lookup), or null.
function sourceOf(node, name) {
  const index = node.inputs?.findIndex((slot) => slot.name === name) ?? -1;
  return index >= 0 && node.inputs[index].link != null ? node.getInputNode?.(index) ?? null : null;
}

// The value a node's graph gives its input `name`: its widget, or (converted to an input) the widget of the
// node linked to it, e.g. a Primitive. null when the graph does not say (a computed value).
function widgetValue(node, name) {
  const source = sourceOf(node, name);
  const value = source ? source.widgets?.[0]?.value : node.widgets?.find((widget) => widget.name === name)?.value;
  return typeof value === "string" ? value : null;
}

// The run a training node trains: its own run_name (all-in-one nodes), else the run_name of the node its `run`
// input comes from (Train LoRA / ControlNet Init), followed through pass-through nodes such as reroutes.
function runNameOf(node, depth = 0) {
  if (!node || depth > 16) return null;
  if (node.widgets?.some((widget) => widget.name === "run_name") || node.inputs?.some((s) => s.name === "run_name")) {
    return widgetValue(node, "run_name");
  }
  const source = sourceOf(node, "run") ?? (node.inputs?.length === 1 && node.inputs[0].link != null
    ? node.getInputNode?.(0) ?? null : null);
  return runNameOf(source, depth + 1);
}

// Prompts this editor queued (ComfyUI sends execution_start to the queuing client only).
const ownPrompts = new Set();

// A training event belongs on the node with its id whose graph names the same run; where the graph cannot name
// the run (computed run_name), only events of this editor's own prompts do.
function viewForEvent(detail) {
  const view = viewForExecutionId(detail?.node);
  if (!view) return null;
  const expected = runNameOf(view.node);
  if (expected !== null) return expected === detail.run ? view : null;
  return ownPrompts.has(detail.prompt_id) ? view : null;
}

function onTrainStep({ detail }) {
  const view = viewForEvent(detail);
  if (!view || typeof detail.step !== "number") return;
  const run = view.run && view.run.run === detail.run ? view.run : emptyRun(detail.run);
  if (run.stopped) {
    run.stopped = false; // running again: the note about the cancel is history
    showNotes(view.node, []);
  }
  addStep(run, detail);
  view.setRun(run);
  markCurrent(view.node, detail.prompt_id); // the chart is of the job running now
}

// A cancel (ComfyUI's interrupt) is no crash: the chart and the node say where the run stopped and how to go on.
function stoppedNote(detail) {
  return detail.saved
    ? `Stopped at step ${detail.step}, checkpoint saved; Run again to continue.`
    : `Stopped at step ${detail.step}; no checkpoint could be written (see the log).`;
}

function onTrainStopped({ detail }) {
  const view = viewForEvent(detail);
  if (!view || typeof detail.step !== "number") return;
  const run = view.run && view.run.run === detail.run ? view.run : emptyRun(detail.run);
  run.step = detail.step;
  run.eta_s = null;
  run.note = stoppedNote(detail);
  run.stopped = true;
  view.setRun(run);
  showNotes(view.node, [run.note]);
}

// A chart shows only the run its node's graph names now: after run_name changed (or a run under the new name
// failed before its first step) the old run's curve goes.
function clearStaleCharts() {
  for (const node of trainingNodesOf(app.graph)) {
    const view = node.headroomLive;
    if (view.run && view.run.run !== runNameOf(node)) view.setRun(null);
  }
}

// Validation can come from the training node itself (all-in-one) or from a HeadroomValidate node of a
// modular graph: then it belongs on the chart that shows the same run.
function viewForValidation(detail) {
  const own = viewForEvent(detail);
  if (own) return own;
  const views = trainingNodesOf(app.graph).map((node) => node.headroomLive);
  return views.find((view) => view.run?.run === detail?.run && runNameOf(view.node) === detail.run) ?? null;
}

function onValidate({ detail }) {
  const view = viewForValidation(detail);
  if (!view) return;
  const run = view.run && view.run.run === detail.run ? view.run : emptyRun(detail.run);
  if (typeof detail.val_loss === "number") {
    run.val_steps.push(detail.step);
    run.val_loss.push(detail.val_loss);
  }
  if (detail.images?.length) {
    run.images = detail.images;
    run.images_step = detail.step;
  }
  view.setRun(run);
}

// The node's UI output of a finished run carries its whole history: redraw from it. What the history
// lacks but the live events brought (memory per step, lr, speed, validation images) is kept.
function restoreFromOutput(view, output, validations = []) {
  const history = output?.[HISTORY_KEY];
  if (!Array.isArray(history) || history.length === 0) return false;
  const run = runFromHistory(history.at(-1));
  const live = view.run?.run === run.run ? view.run : null;
  if (live) {
    const liveIndex = new Map(live.steps.map((step, i) => [step, i]));
    for (const key of ["lrs", ...MEMORY_KEYS]) {
      run[key] = run[key].map((value, i) =>
        value ?? (liveIndex.has(run.steps[i]) ? live[key][liveIndex.get(run.steps[i])] ?? null : null));
    }
    run.lr ??= live.lr;
    run.s_per_step ??= live.s_per_step;
    addValidation(run, { run: run.run, step: live.images_step, images: live.images });
  }
  for (const validation of validations) addValidation(run, validation);
  view.setRun(run);
  return true;
}

// Every HeadroomValidate output in one /history entry.
function validationsIn(outputs) {
  return Object.values(outputs ?? {}).flatMap((output) => output?.[VALIDATION_KEY] ?? []);
}

function trainingNodesOf(graph) {
  return (graph?.nodes ?? []).filter((node) => TRAINING_NODE_TYPES.includes(node.comfyClass) && node.headroomLive);
}

// After a page reload (or opening a workflow) the charts are empty: find each training node's last
// finished run in the server's history: same node id and type, the run its graph names (same workflow when
// both say which). Validation images of that run from the same prompt come along.
async function restoreFromServerHistory() {
  const views = trainingNodesOf(app.graph).map((node) => node.headroomLive).filter((view) => !view.run);
  if (!views.length) return;
  const response = await api.fetchApi(`/history?max_items=${HISTORY_ITEMS_SEARCHED}`);
  if (!response.ok) return;
  const entries = Object.values(await response.json()).reverse(); // newest first
  const workflowId = app.graph?.id;
  for (const view of views) {
    const nodeId = String(view.node.id);
    const runName = runNameOf(view.node);
    if (runName === null) continue; // the graph does not say which run: showing any would be a guess
    for (const entry of entries) {
      const promptNode = entry.prompt?.[2]?.[nodeId];
      const entryWorkflowId = entry.prompt?.[3]?.extra_pnginfo?.workflow?.id;
      if (promptNode?.class_type !== view.node.comfyClass) continue;
      if (workflowId && entryWorkflowId && workflowId !== entryWorkflowId) continue;
      const output = entry.outputs?.[nodeId];
      if (output?.[HISTORY_KEY]?.at(-1)?.run !== runName) continue;
      if (restoreFromOutput(view, output, validationsIn(entry.outputs))) break;
    }
  }
}

app.registerExtension({
  name: "headroom.live",

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TRAINING_NODE_TYPES.includes(nodeData.name)) return;

    const onNodeCreated = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = onNodeCreated?.apply(this, arguments);
      this.headroomLive = new LiveView(this);
      return result;
    };

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      if (this.headroomLive) restoreFromOutput(this.headroomLive, output);
    };

    const onRemoved = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function () {
      this.headroomLive?.remove();
      return onRemoved?.apply(this, arguments);
    };
  },

  setup() {
    api.addEventListener(STEP_EVENT, onTrainStep);
    api.addEventListener(VALIDATE_EVENT, onValidate);
    api.addEventListener(STOPPED_EVENT, onTrainStopped);
    api.addEventListener("execution_start", ({ detail }) => {
      if (detail?.prompt_id) ownPrompts.add(detail.prompt_id);
      clearStaleCharts();
    });
    api.addEventListener("execution_error", clearStaleCharts);
  },

  nodeCreated(node) {
    // Any node with a run_name widget (all-in-one and Init nodes): editing it clears charts of another run.
    const widget = node.widgets?.find((w) => w.name === "run_name");
    if (!widget) return;
    const callback = widget.callback;
    widget.callback = function () {
      const result = callback?.apply(this, arguments);
      clearStaleCharts();
      showNotes(node, []); // what it said was about the run of the old name
      return result;
    };
  },

  async afterConfigureGraph() {
    // A loaded graph starts empty: nothing of the graph shown before (or of another run) stays on its nodes.
    for (const node of trainingNodesOf(app.graph)) node.headroomLive.setRun(null);
    try {
      await restoreFromServerHistory();
    } catch (error) {
      // A history the server cannot give is no reason to break loading the graph; say why, once.
      console.warn("Headroom live view: could not restore charts from /history:", error);
    }
  },
});

// Read-only hooks for tests and the curious: how many loss points a training node holds and drew.
window.__headroomLive = {
  nodeTypes: TRAINING_NODE_TYPES,
  points: (nodeId) => viewForExecutionId(nodeId)?.run?.steps.length ?? 0,
  drawnPoints: (nodeId) => viewForExecutionId(nodeId)?.drawnPoints ?? 0,
  run: (nodeId) => structuredClone(viewForExecutionId(nodeId)?.run ?? null),
  runName: (nodeId) => {
    const node = nodeForExecutionId(nodeId);
    return node ? runNameOf(node) : null;
  },
};
