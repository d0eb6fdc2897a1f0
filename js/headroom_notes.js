// Headroom notes: the text Headroom's training, save and folder dataset nodes return in their UI output (`text`: where
// a LoRA was saved, how the precision was chosen, a batch cut to the data, why nothing trained, a cancel, the files
// skip_bad left out, captions with no image) shown on the node itself, under its widgets, where the user looks. The
// stock editor shows such text only on its Preview Any node. workflows/build_workflows.py keeps room for it on the
// training and save node types (NOTES_NODE_TYPES; a dataset node's text is rare: the node grows when it comes). When
// a Headroom node fails, its error message is shown on it the same way (the stock editor shows it only behind "View
// details").
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const WIDGET_NAME = "headroom_notes";
const LINE_HEIGHT = 15;
const CHAR_WIDTH = 7.5; // px of a character of the 12 px font, about (for the widget's height)
const NODE_TYPES = ["HeadroomTrainLoraInit", "HeadroomTrainControlNetInit", "HeadroomTrainSteps", "HeadroomTrainLora",
  "HeadroomTrainControlNet", "HeadroomSaveLora", "HeadroomSaveControlNet", "HeadroomDatasetFromFolder",
  "HeadroomDatasetFromVideos"];

function notesWidget(node) {
  let widget = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (widget) return widget;
  const element = document.createElement("div");
  element.className = "headroom-notes";
  element.style.cssText =
    "white-space:pre-wrap;overflow-wrap:anywhere;font:12px sans-serif;color:#d8d8d8;background:rgba(0,0,0,0.25);" +
    "border-radius:4px;padding:4px 6px;overflow:auto;box-sizing:border-box;width:100%;height:100%";
  widget = node.addDOMWidget(WIDGET_NAME, WIDGET_NAME, element, {
    serialize: false, // not an input: never sent in the prompt nor saved in widgets_values
    hideOnZoom: false,
    // The laid-out text's height once the browser has it (fitNode), an estimate before.
    getMinHeight: () =>
      Math.min(Math.max(14 + LINE_HEIGHT * lineCount(element.textContent, node.size[0]), element.scrollHeight + 2), 200),
  });
  widget.serialize = false;
  return widget;
}

// Lines a text takes in a node `width` wide (for the widget's height).
function lineCount(text, width) {
  const perLine = Math.max(Math.floor((width - 40) / CHAR_WIDTH), 20);
  return (text || "").split("\n").reduce((n, line) => n + Math.max(Math.ceil(line.length / perLine), 1), 0);
}

// Shows `lines` (an array of strings; empty: hides the notes) on `node`, growing it to fit.
export function showNotes(node, lines) {
  const text = (lines ?? []).filter((line) => typeof line === "string" && line).join("\n");
  const existing = node.widgets?.find((w) => w.name === WIDGET_NAME);
  if (!text && !existing) return;
  const widget = notesWidget(node);
  widget.element.textContent = text;
  widget.element.style.display = text ? "block" : "none";
  fitNode(node);
  requestAnimationFrame(() => fitNode(node)); // again once the text is laid out (its real height)
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

const failed = new Set(); // nodes showing an error message: cleared when the next prompt starts

function onExecutionError({ detail }) {
  const node = nodeForExecutionId(detail?.node_id);
  if (!node?.comfyClass?.startsWith("Headroom") || !detail.exception_message) return;
  showNotes(node, [`Failed: ${detail.exception_message.trim()}`]);
  failed.add(node);
}

function onExecutionStart() {
  for (const node of failed) showNotes(node, []);
  failed.clear();
}

app.registerExtension({
  name: "headroom.notes",

  setup() {
    api.addEventListener("execution_error", onExecutionError);
    api.addEventListener("execution_start", onExecutionStart);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (output) {
      onExecuted?.apply(this, arguments);
      if (Array.isArray(output?.text)) showNotes(this, output.text);
    };
  },
});
