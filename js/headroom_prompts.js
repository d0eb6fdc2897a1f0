// Headroom prompts: the validation prompts box (the `prompts` input of Validate and of the all-in-one training nodes)
// keeps room for its lines when the node shows images. The stock editor gives a multiline text box a minimum height of
// 50 px (DOMWidgetImpl.computeLayoutSize, when the widget has no getMinHeight) and its image preview one of 220 px; a
// node too short for both gives each its minimum, so when the samples or the before/after grid arrived the prompts were
// squeezed to two lines. With a minimum of the prompts' own lines (MIN_LINES to MAX_LINES), litegraph grows the node
// instead (LGraphNode._arrangeWidgets grows a node whose widgets need more than it has).
import { app } from "../../scripts/app.js";

const NODE_TYPES = ["HeadroomValidate", "HeadroomTrainLora", "HeadroomTrainControlNet"];
const WIDGET_NAME = "prompts";
const MIN_LINES = 3; // an empty or one-line box: room to see that it takes one prompt per line
const MAX_LINES = 8; // more prompts scroll, rather than push the image far down

let measure = null; // a canvas context to measure text with the box's own font

function measuring(font) {
  measure ??= document.createElement("canvas").getContext("2d");
  measure.font = font;
  return measure;
}

// The box's font, line height and vertical padding + border, read once it is in the page (fallbacks before).
function metrics(element) {
  if (element.headroomMetrics) return element.headroomMetrics;
  if (!element.isConnected) return { font: "12px sans-serif", line: 15, padding: 8 };
  const style = getComputedStyle(element);
  const px = (value) => parseFloat(value) || 0;
  const font = style.font || `${style.fontSize} ${style.fontFamily}`;
  const sample = measuring(font).measureText("Ag");
  element.headroomMetrics = {
    font,
    // line-height "normal" (parses as NaN) is the font's own ascent + descent
    line: px(style.lineHeight) || Math.ceil(sample.fontBoundingBoxAscent + sample.fontBoundingBoxDescent) ||
      Math.ceil(px(style.fontSize) * 1.25) || 15,
    padding: px(style.paddingTop) + px(style.paddingBottom) + px(style.borderTopWidth) + px(style.borderBottomWidth),
  };
  return element.headroomMetrics;
}

// Lines `text` takes in a box `width` px wide: its own lines, each wrapped.
export function wrappedLines(text, font, width) {
  const measure = measuring(font);
  const room = Math.max(width, 40);
  return String(text ?? "").split("\n")
    .reduce((count, line) => count + Math.max(1, Math.ceil(measure.measureText(line).width / room)), 0);
}

// The prompts box's minimum height on `node`: its lines (MIN_LINES to MAX_LINES) at the box's line height, with the
// widget's margin (the editor draws the box that much smaller than the height it gives the widget, each side). Called
// at every layout (each frame drawn): the count is kept until the text or the node's width changes.
function minHeight(node, widget) {
  const element = widget.element;
  const { font, line, padding } = metrics(element);
  const margin = widget.margin ?? 10;
  const width = node.size[0] - 2 * margin - padding;
  const text = element.value ?? "";
  if (widget.headroomLines?.text !== text || widget.headroomLines?.width !== width) {
    widget.headroomLines = { text, width, count: wrappedLines(text, font, width) };
  }
  return Math.min(Math.max(widget.headroomLines.count, MIN_LINES), MAX_LINES) * line + padding + 2 * margin;
}

app.registerExtension({
  name: "headroom.prompts",

  nodeCreated(node) {
    if (!NODE_TYPES.includes(node.comfyClass)) return;
    const widget = node.widgets?.find((w) => w.name === WIDGET_NAME && w.element);
    if (!widget?.options || widget.options.getMinHeight) return; // not the stock text box: leave it as it is
    widget.options.getMinHeight = () => minHeight(node, widget);
  },
});
