// Headroom live view: a loss chart and a memory bar drawn on Headroom's training nodes in the graph
// editor, fed by the trainer's websocket events and restored after a page reload from the node's UI
// output in /history. Other nodes are left alone.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { drawTrainingView } from "./headroom_chart.js";

// The node types that train and emit `headroom.train.step` / `headroom.validate`.
const TRAINING_NODE_TYPES = ["HeadroomTrainSteps", "HeadroomTrainLora", "HeadroomTrainControlNet"];
const STEP_EVENT = "headroom.train.step";
const VALIDATE_EVENT = "headroom.validate";
const HISTORY_KEY = "headroom_history"; // the training node's UI output key (one entry per run)
const HISTORY_ITEMS_SEARCHED = 64; // recent /history entries searched when a graph is (re)loaded
const CHART_HEIGHT = 250;
const THUMBNAIL_HEIGHT = 72;
const MEMORY_KEYS = ["allocated", "reserved", "peak", "rss"];

function emptyRun(name) {
  return {
    run: name, step: 0, total_steps: 0, lr: null, s_per_step: null, eta_s: null,
    steps: [], loss: [], allocated: [], reserved: [], peak: [], rss: [],
    val_steps: [], val_loss: [], images: [],
  };
}

// A step at or before the last one means the run went back (restarted, or resumed from an earlier
// checkpoint): the points from there on are dropped so the curve stays one line over the steps.
function dropFrom(run, step) {
  const keep = run.steps.findIndex((s) => s >= step);
  if (keep >= 0) {
    for (const key of ["steps", "loss", ...MEMORY_KEYS]) run[key].length = keep;
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
  for (const key of MEMORY_KEYS) run[key].push(data[key] ?? null);
  run.step = data.step;
  run.total_steps = data.total_steps ?? run.total_steps;
  run.lr = data.lr ?? run.lr;
  run.s_per_step = data.s_per_step ?? run.s_per_step;
  run.eta_s = data.eta_s ?? null;
}

const lastOf = (value) => (Array.isArray(value) ? value.at(-1) : value) ?? null;

// One entry of the node's `headroom_history` UI output -> the run the chart draws.
function runFromHistory(entry) {
  const run = emptyRun(entry.run);
  run.steps = [...(entry.steps ?? [])];
  run.loss = [...(entry.loss ?? [])];
  for (const key of MEMORY_KEYS) {
    const values = entry[key];
    run[key] = Array.isArray(values) && values.length === run.steps.length ? [...values] : run.steps.map(() => null);
  }
  run.val_steps = [...(entry.val_steps ?? [])];
  run.val_loss = [...(entry.val_loss ?? [])];
  run.images = [...(entry.images ?? [])];
  run.step = run.steps.at(-1) ?? 0;
  run.total_steps = entry.total_steps ?? run.step;
  run.lr = lastOf(entry.lr);
  run.s_per_step = lastOf(entry.s_per_step);
  run.eta_s = 0;
  return run;
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
    this.element.append(this.canvas, this.thumbnails);
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
        img.title = `validation at step ${this.run.val_steps.at(-1) ?? "?"}`;
        return img;
      })
    );
    this.thumbnails.style.display = images.length ? "flex" : "none";
  }

  draw() {
    this.drawnPoints = drawTrainingView(this.canvas, this.run);
    this.canvas.dataset.points = String(this.drawnPoints);
    this.canvas.dataset.steps = String(this.run?.steps.length ?? 0);
  }

  remove() {
    this.resizeObserver.disconnect();
  }
}

// Execution ids are node ids, joined by ":" through subgraphs ("12:5" = node 5 inside subgraph node 12).
function nodeForExecutionId(executionId) {
  let graph = app.graph;
  let node = null;
  for (const id of String(executionId).split(":")) {
    node = graph?.getNodeById(id) ?? null;
    graph = node?.subgraph;
  }
  return node;
}

function viewForExecutionId(executionId) {
  const node = nodeForExecutionId(executionId);
  return TRAINING_NODE_TYPES.includes(node?.comfyClass) ? node.headroomLive ?? null : null;
}

function onTrainStep({ detail }) {
  const view = viewForExecutionId(detail?.node);
  if (!view || typeof detail.step !== "number") return;
  const run = view.run && view.run.run === detail.run ? view.run : emptyRun(detail.run);
  addStep(run, detail);
  view.setRun(run);
}

// Validation can come from the training node itself (all-in-one) or from a HeadroomValidate node of a
// modular graph: then it belongs on the chart that shows the same run.
function viewForValidation(detail) {
  const own = viewForExecutionId(detail?.node);
  if (own) return own;
  const views = trainingNodesOf(app.graph).map((node) => node.headroomLive);
  return views.find((view) => view.run?.run === detail?.run) ?? null;
}

function onValidate({ detail }) {
  const view = viewForValidation(detail);
  if (!view) return;
  const run = view.run && view.run.run === detail.run ? view.run : emptyRun(detail.run);
  if (typeof detail.val_loss === "number") {
    run.val_steps.push(detail.step);
    run.val_loss.push(detail.val_loss);
  }
  run.images = detail.images ?? [];
  view.setRun(run);
}

// The node's UI output of a finished run carries its whole history: redraw from it. What the history
// lacks but the live events brought (memory per step, lr, speed, validation images) is kept.
function restoreFromOutput(view, output) {
  const history = output?.[HISTORY_KEY];
  if (!Array.isArray(history) || history.length === 0) return false;
  const run = runFromHistory(history.at(-1));
  const live = view.run?.run === run.run ? view.run : null;
  if (live) {
    const liveIndex = new Map(live.steps.map((step, i) => [step, i]));
    for (const key of MEMORY_KEYS) {
      if (run[key].every((value) => value == null)) {
        run[key] = run.steps.map((step) => (liveIndex.has(step) ? live[key][liveIndex.get(step)] : null));
      }
    }
    run.lr ??= live.lr;
    run.s_per_step ??= live.s_per_step;
    if (!run.images.length) run.images = live.images;
  }
  view.setRun(run);
  return true;
}

function trainingNodesOf(graph) {
  return (graph?.nodes ?? []).filter((node) => TRAINING_NODE_TYPES.includes(node.comfyClass) && node.headroomLive);
}

// After a page reload (or opening a workflow) the charts are empty: find each training node's last
// finished run in the server's history (same node id and type, same workflow when both say which).
async function restoreFromServerHistory() {
  const views = trainingNodesOf(app.graph).map((node) => node.headroomLive).filter((view) => !view.run);
  if (!views.length) return;
  const response = await api.fetchApi(`/history?max_items=${HISTORY_ITEMS_SEARCHED}`);
  if (!response.ok) return;
  const entries = Object.values(await response.json()).reverse(); // newest first
  const workflowId = app.graph?.id;
  for (const view of views) {
    const nodeId = String(view.node.id);
    for (const entry of entries) {
      const promptNode = entry.prompt?.[2]?.[nodeId];
      const entryWorkflowId = entry.prompt?.[3]?.extra_pnginfo?.workflow?.id;
      if (promptNode?.class_type !== view.node.comfyClass) continue;
      if (workflowId && entryWorkflowId && workflowId !== entryWorkflowId) continue;
      if (restoreFromOutput(view, entry.outputs?.[nodeId])) break;
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
  },

  async afterConfigureGraph() {
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
};
