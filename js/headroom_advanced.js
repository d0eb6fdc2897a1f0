// Headroom's expert and family-specific inputs carry the V3 schema's `advanced` flag. The editor's Vue nodes fold
// them behind "Show advanced inputs". Its classic canvas has the same toggle (the node menu's "Show Advanced" /
// "Hide Advanced": LGraphNode.showAdvanced, isWidgetVisible), but this frontend version copies the flag only to
// `widget.options.advanced`, and lays out hidden advanced widgets anyway (empty gaps, a node as tall as before).
// For Headroom's nodes the flag is copied to the widget (a seed's "control after generate" folds with its seed) and
// the layout leaves folded widgets out, so the stock toggle works there too.
import { app } from "../../scripts/app.js";

function layoutWidgets() {
  return this.widgets?.filter((widget) => !widget.hidden && !(widget.advanced && !this.showAdvanced)) ?? [];
}

app.registerExtension({
  name: "headroom.advanced",

  nodeCreated(node) {
    if (!node.comfyClass?.startsWith("Headroom") || !node.widgets) return;
    let folded = false;
    for (const widget of node.widgets) {
      if (!widget.options?.advanced) continue;
      widget.advanced = true;
      for (const linked of widget.linkedWidgets ?? []) linked.advanced = true;
      folded = true;
    }
    if (!folded) return;
    node.getLayoutWidgets = layoutWidgets;
    node.setSize([node.size[0], node.computeSize()[1]]);
  },
});
