// Headroom templates: the pack's workflows in the editor's Templates dialog in reading order - the demos first
// (they run on any machine in minutes), the memory plan, then one per family from the oldest model to the newest.
// ComfyUI 0.33 lists a pack's templates in its directory order (a glob), and a pack can give them no index, so the
// list the editor fetches is put in order here, before any dialog asks for it. A workflow missing from TEMPLATE_ORDER
// comes after these, by name (tests/unit/test_templates_order.py keeps the list complete).
import { api } from "../../scripts/api.js";

export const TEMPLATE_ORDER = [
  "tiny_lora", "your_folder_lora", "tiny_controlnet", "memory_plan",
  "sd15_lora", "sd15_full_finetune", "sd15_controlnet", "sdxl_lora", "sdxl_full_finetune", "sdxl_controlnet",
  "sd35_lora", "sd35_full_finetune", "flux_lora", "flux_full_finetune", "flux_controlnet", "flux_kontext_lora",
  "flux2_klein_lora",
  "zimage_lora", "qwen_image_lora", "qwen_image_edit_lora", "krea2_lora", "ideogram4_lora", "hidream_o1_lora",
  "wan21_lora", "hunyuan_video15_lora", "ltx2_lora",
];

// This file is served as /extensions/<the pack's folder>/headroom_templates.js: that folder names the pack's list.
const PACK = decodeURIComponent(new URL(import.meta.url).pathname.split("/")[2] || "");

export function orderTemplates(names) {
  const rank = (name) => {
    const i = TEMPLATE_ORDER.indexOf(name);
    return i === -1 ? TEMPLATE_ORDER.length : i;
  };
  return [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

const fetchTemplates = api.getWorkflowTemplates.bind(api);
api.getWorkflowTemplates = async function () {
  const templates = await fetchTemplates();
  if (templates && Array.isArray(templates[PACK])) templates[PACK] = orderTemplates(templates[PACK]);
  return templates;
};
