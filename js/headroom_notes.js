// Headroom notes: the text Headroom's training, validate, save, folder dataset, Validation History, Memory Plan and
// Offload Policy nodes return in their UI output (`text`: the run and step a result belongs to, where a LoRA was saved,
// how the precision was chosen, the policy fitted to the card, a batch cut to the data, why nothing trained, a cancel,
// the files skip_bad left out, captions with no image, a history with no validation yet, the plan, the budget and host
// RAM a policy leaves) shown on the node itself, under its widgets, where the user looks, wrapped at word boundaries to
// the node's width. The stock editor shows such text only on its Preview Any node. workflows/build_workflows.py keeps
// room for it on the training, save and policy node types (TEXT_ROOM; a dataset node's text is rare, the others'
// short or on a node of their own: the node grows when it comes). A table's itemised rows (the Memory Plan's) are laid
// out as rows, each value at the right of its line (appendTable). When a Headroom node fails, its error message is
// shown on it the same way (the stock editor shows it only behind "View details").
//
// One text per node: ComfyUI's progress text (what a node says while it runs, e.g. the policy the Init node fitted to
// the card) goes into the same notes, not into the stock text widget above them (which broke words anywhere, cut long
// texts and repeated the plan the node's text then showed again).
//
// Results from an earlier job are marked as such: when this editor's job starts, every result shown on these nodes
// (notes, images, the live chart) is greyed and labelled "(from an earlier job: ...)" until the node gives a result in
// that job (it runs: `executed`, training events; or ComfyUI serves it from its cache: `execution_cached`); a job that
// fails or is cancelled before a node ran leaves its old result marked, saying why. The stock editor keeps a node's
// last images as they were when it does not run again, so an old grid looked current.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const WIDGET_NAME = "headroom_notes";
const PROGRESS_TEXT_WIDGET = "$$node-text-preview"; // the stock frontend's progress-text widget (useNodeProgressText)
const IMAGE_PREVIEW_WIDGET = "$$canvas-image-preview"; // the stock frontend's image preview on a node
const LINE_HEIGHT = 15;
const CHAR_WIDTH = 7.5; // px of a character of the 12 px font, about (for the widget's height)
const MAX_HEIGHT = 480; // px; longer texts (a dataset's list of left-out files) scroll
const NODE_TYPES = ["HeadroomTrainLoraInit", "HeadroomTrainControlNetInit", "HeadroomTrainSteps", "HeadroomTrainLora",
  "HeadroomTrainControlNet", "HeadroomValidate", "HeadroomSaveLora", "HeadroomExtractLora", "HeadroomSaveControlNet",
  "HeadroomDatasetFromFolder", "HeadroomDatasetFromVideos", "HeadroomPreviewDataset", "HeadroomResizeLora",
  "HeadroomMergeLoras", "HeadroomInspectLora", "HeadroomValidationHistory", "HeadroomMemoryPlan",
  "HeadroomOffloadPolicy"];
const STALE_COLOR = "#8a8a8a";

function notesWidget(node) {
  let widget = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (widget) return widget;
  const element = document.createElement("div");
  element.className = "headroom-notes";
  // pre-wrap: the text's own line breaks, and wrapping at spaces; break-word: only a token longer than a whole line
  // (a file path) is broken, after its "/" where it has one (<wbr>, see render).
  element.style.cssText =
    "white-space:pre-wrap;overflow-wrap:break-word;word-break:normal;font:12px sans-serif;color:#d8d8d8;" +
    "background:rgba(0,0,0,0.25);border-radius:4px;padding:4px 6px;overflow:auto;box-sizing:border-box;width:100%;" +
    "height:100%";
  widget = node.addDOMWidget(WIDGET_NAME, WIDGET_NAME, element, {
    serialize: false, // not an input: never sent in the prompt nor saved in widgets_values
    hideOnZoom: false,
    getMinHeight: () => textHeight(element, node),
    // Beside the node's images (a history, a grid, a preview) the text keeps its own height and the images get the
    // room the node has to spare: a one-line note sat in a tall empty box over a small picture.
    getMaxHeight: () => (node.imgs?.length ? textHeight(element, node) : undefined),
  });
  widget.serialize = false;
  return widget;
}

// The laid-out text's height once the browser has it (fitNode), an estimate before.
function textHeight(element, node) {
  return Math.min(Math.max(14 + LINE_HEIGHT * lineCount(element.textContent, node.size[0]), laidOutHeight(element)),
    MAX_HEIGHT);
}

// The height (px, unzoomed) the element's text takes as laid out, with the box's padding; 0 where it is not shown.
// Not its scrollHeight, which is never less than the box: a box once grown would keep its height.
function laidOutHeight(element) {
  const box = element.getBoundingClientRect();
  if (!element.offsetHeight || !box.height) return 0;
  const range = document.createRange();
  range.selectNodeContents(element);
  const style = getComputedStyle(element);
  const padding = parseFloat(style.paddingTop) + parseFloat(style.paddingBottom);
  return range.getBoundingClientRect().height * (element.offsetHeight / box.height) + padding + 2; // (canvas zoom)
}

// Lines a text takes in a node `width` wide (for the widget's height).
function lineCount(text, width) {
  const perLine = Math.max(Math.floor((width - 40) / CHAR_WIDTH), 20);
  return (text || "").split("\n").reduce((n, line) => n + Math.max(Math.ceil(line.length / perLine), 1), 0);
}

// `text` into `element`, with a line-break opportunity after each "/" of a path (no character added).
function appendText(element, text) {
  text.split(/(?<=\/)/).forEach((part, i) => {
    if (i) element.append(document.createElement("wbr"));
    element.append(part);
  });
}

// An itemised line of a table (the Memory Plan's "  frozen block weights (bf16)        1.2 GiB"): indented, then a
// name, two or more spaces, and a value. Its columns are aligned with spaces for a fixed-width font; on the node (a
// proportional font, wrapped to its width) they did not line up.
const TABLE_ROW = /^( +)(\S.*?) {2,}(\S.*)$/;
const TABLE_NODE_TYPES = ["HeadroomMemoryPlan"]; // whose text has such rows (others' may hold two spaces by chance)

// `text` into `element` one block per line, a table row's name to the left and its value to the right of the line
// (the name wraps, the value does not). The spaces between them and each line's break stay in the text, hidden, so
// the element's textContent (what a copy or a test reads) is the node's text as it came.
function appendTable(element, text) {
  const hidden = (part) => {
    const span = document.createElement("span");
    span.style.display = "none";
    span.textContent = part;
    return span;
  };
  text.split("\n").forEach((line, i, lines) => {
    const block = document.createElement("div");
    const row = TABLE_ROW.exec(line);
    if (row) {
      const [, indent, name, value] = row;
      const gap = line.slice(indent.length + name.length, line.length - value.length);
      const left = document.createElement("span");
      left.className = "headroom-row-name";
      left.style.cssText = `flex:1 1 auto;padding-left:${indent.length * 0.28}em`;
      appendText(left, name);
      const right = document.createElement("span");
      right.className = "headroom-row-value";
      right.style.cssText = "flex:none;white-space:nowrap;margin-left:8px;font-variant-numeric:tabular-nums";
      right.textContent = value;
      block.style.display = "flex";
      block.append(hidden(indent), left, hidden(gap), right);
    } else {
      appendText(block, line);
      if (!line) block.append(document.createElement("br")); // an empty line keeps its height
    }
    if (i < lines.length - 1) block.append(hidden("\n"));
    element.append(block);
  });
}

// --- which job a node's result came from --------------------------------------------------------------------------
// The job of this editor running now or last: {id, state: "running" | "done" | "failed" | "cancelled"}.
let job = null;

const STALE_REASONS = {
  running: "this node has not run in the current one yet",
  done: "the last one did not run this node",
  failed: "the last one failed before this node ran",
  cancelled: "the last one was cancelled before this node ran",
};

function resultsOf(node) {
  node.headroomResults ??= { lines: [], job: null };
  return node.headroomResults;
}

// Why the node's result is not from the current (or last) job; null when it is, or when no job of this editor ran.
export function staleReason(node) {
  const results = node.headroomResults;
  if (!job || !results || results.job === job.id) return null;
  return `from an earlier job: ${STALE_REASONS[job.state]}`;
}

function render(node) {
  const results = resultsOf(node);
  const text = results.lines.join("\n");
  const reason = staleReason(node);
  const existing = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (text || existing) {
    const element = notesWidget(node).element;
    element.replaceChildren();
    const shown = text && reason ? `(${reason})\n${text}` : text;
    if (TABLE_NODE_TYPES.includes(node.comfyClass)) appendTable(element, shown);
    else appendText(element, shown);
    element.style.color = reason ? STALE_COLOR : "#d8d8d8";
    element.style.fontStyle = reason ? "italic" : "normal";
    element.style.display = text ? "block" : "none";
    element.dataset.stale = reason ? "true" : "false";
    fitNode(node);
    requestAnimationFrame(() => fitNode(node)); // again once the text is laid out (its real height)
  }
  node.headroomLive?.setStale?.(reason);
  node.setDirtyCanvas?.(true, true);
}

// The node's result came from job `promptId` (an event of it): shown as current when that is this editor's job.
export function markCurrent(node, promptId) {
  if (!job || !node || promptId !== job.id) return;
  resultsOf(node).job = job.id;
  render(node);
}

// Shows `lines` (an array of strings; empty: hides the notes) on `node`, growing it to fit: a result of the job
// running now (or of no job: an edit on the graph).
export function showNotes(node, lines) {
  const results = resultsOf(node);
  results.lines = (lines ?? []).filter((line) => typeof line === "string" && line);
  results.job = job?.id ?? null;
  render(node);
}

// Called as the node is drawn: a node shorter than its widgets need (ComfyUI's image preview came after the notes) is
// grown now, and drawn again: litegraph grows it while laying out the widgets, after it drew the node's body, and
// nothing drew it again (the images hung below the node until the mouse moved).
function growToFit(node) {
  if (node.flags?.collapsed) return;
  const [width, height] = node.computeSize();
  if (height <= node.size[1] + 1 && width <= node.size[0] + 1) return;
  node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
  node.setDirtyCanvas?.(true, true);
}

function fitNode(node) {
  const [width, height] = node.computeSize();
  node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
  node.setDirtyCanvas?.(true, true);
}

export function notesOf(node) {
  return node.widgets?.find((w) => w.name === WIDGET_NAME)?.element.textContent ?? "";
}

// Execution ids are node ids, joined by ":" through subgraphs ("12:5" = node 5 inside subgraph node 12).
export function nodeForExecutionId(executionId) {
  let graph = app.graph;
  let node = null;
  for (const id of String(executionId).split(":")) {
    node = graph?.getNodeById(id) ?? null;
    graph = node?.subgraph;
  }
  return node;
}

function* resultNodes(graph, depth = 0) {
  for (const node of graph?.nodes ?? []) {
    if (NODE_TYPES.includes(node.comfyClass)) yield node;
    if (node.subgraph && depth < 16) yield* resultNodes(node.subgraph, depth + 1);
  }
}

function renderAll() {
  for (const node of resultNodes(app.graph)) if (node.headroomResults || node.headroomLive || node.imgs?.length) {
    resultsOf(node);
    render(node);
  }
}

function onExecutionStart({ detail }) {
  if (!detail?.prompt_id) return;
  job = { id: detail.prompt_id, state: "running" };
  renderAll(); // every result shown is from an earlier job until its node gives one in this job
}

function onJobEnd(state) {
  return ({ detail }) => {
    if (!job || detail?.prompt_id !== job.id) return; // another client's job (interrupts are broadcast)
    job.state = state;
    renderAll();
  };
}

// Nodes ComfyUI serves from its cache in this job: what they show is what the job uses (an output node among them
// gets `executed` too; an Init node, say, gets nothing more).
function onExecutionCached({ detail }) {
  for (const id of detail?.nodes ?? []) markCurrent(nodeForExecutionId(id), detail.prompt_id);
}

function onExecuted({ detail }) {
  markCurrent(nodeForExecutionId(detail.display_node ?? detail.node), detail.prompt_id);
}

function onExecutionError({ detail }) {
  const node = nodeForExecutionId(detail?.node_id);
  if (node?.comfyClass?.startsWith("Headroom") && detail.exception_message) {
    showNotes(node, [`Failed: ${detail.exception_message.trim()}`]);
  }
  onJobEnd("failed")({ detail });
}

// ComfyUI's progress text for this node (send_progress_text while it runs, e.g. the plan fitted to the card) goes
// into its notes. The stock handler of the same event adds its own text widget to the node; it is taken off again
// (as the stock removeTextPreview does) once every listener ran, before the frame is painted.
function onProgressText({ detail }) {
  const node = nodeForExecutionId(detail?.nodeId);
  if (!NODE_TYPES.includes(node?.comfyClass) || typeof detail.text !== "string" || !detail.text) return;
  queueMicrotask(() => {
    const index = node.widgets?.findIndex((w) => w.name === PROGRESS_TEXT_WIDGET) ?? -1;
    if (index >= 0) {
      node.widgets[index].onRemove?.();
      node.widgets.splice(index, 1);
    }
    showNotes(node, [detail.text]);
  });
}

// A node's images (ComfyUI's own preview of its `images` output, a widget drawn after onDrawForeground) from an
// earlier job: dimmed and labelled, over them. The widget draws its images in a microtask after the frame (with the
// frame's transform), so the mark is drawn the same way, queued after them.
function markImagesWhenStale(node) {
  const preview = node.widgets?.find((w) => w.name === IMAGE_PREVIEW_WIDGET);
  if (!preview || preview.headroomMarksStale || typeof preview.drawWidget !== "function") return;
  preview.headroomMarksStale = true;
  const drawWidget = preview.drawWidget;
  preview.drawWidget = function (ctx, options) {
    drawWidget.call(this, ctx, options);
    const stale = Boolean(staleReason(node)) && Boolean(node.imgs?.length);
    node.headroomImagesMarked = stale;
    const width = options?.width ?? node.size[0];
    const top = this.y;
    const height = Math.min(this.computedHeight ?? node.size[1] - top, node.size[1] - top);
    if (!stale || !(height > 0)) return;
    const transform = ctx.getTransform();
    queueMicrotask(() => {
      ctx.save();
      ctx.setTransform(transform);
      ctx.fillStyle = "rgba(20,20,20,0.65)";
      ctx.fillRect(0, top, width, height);
      ctx.fillStyle = "#d8d8d8";
      ctx.font = "italic 12px sans-serif";
      ctx.textAlign = "center";
      ctx.fillText("(from an earlier job)", width / 2, top + height / 2);
      ctx.restore();
    });
  };
}

app.registerExtension({
  name: "headroom.notes",

  setup() {
    api.addEventListener("execution_start", onExecutionStart);
    api.addEventListener("execution_cached", onExecutionCached);
    api.addEventListener("executed", onExecuted);
    api.addEventListener("execution_error", onExecutionError);
    api.addEventListener("progress_text", onProgressText);
    api.addEventListener("execution_interrupted", onJobEnd("cancelled"));
    api.addEventListener("execution_success", onJobEnd("done"));
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      // The node's result replaces what it showed before, also when it has nothing to say now.
      showNotes(this, Array.isArray(output?.text) ? output.text : []);
    };
    const onDrawForeground = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      const result = onDrawForeground?.apply(this, arguments);
      markImagesWhenStale(this); // before the widgets are drawn
      growToFit(this);
      return result;
    };
  },

  afterConfigureGraph() {
    job = null; // a loaded graph's nodes show nothing of a job yet
  },
});

// Read-only hooks for tests and the curious.
window.__headroomNotes = {
  nodeTypes: NODE_TYPES,
  job: () => (job ? { ...job } : null),
  stale: (nodeId) => {
    const node = nodeForExecutionId(nodeId);
    return node ? staleReason(node) : null;
  },
  imagesMarked: (nodeId) => Boolean(nodeForExecutionId(nodeId)?.headroomImagesMarked),
};
