"""Thumbnails of the shipped UI workflows for the editor's Templates list: `<name>.jpg` beside `<name>.json`.

    python workflows/thumbnails.py            # rewrites every thumbnail (after build_workflows.py)
    python workflows/thumbnails.py --demo-grid <step_..._before_after.png>
                                              # docs/before_after.png from the grid `bash .ci/demo` wrote, then them

ComfyUI (app/custom_node_manager.py) lists a custom node's `workflows/*.json` as templates, and the editor shows
`<name>.jpg` from the same folder as each one's picture. The demo's is the before/after grid its LoRA makes
(docs/before_after.png: the demo's grid enlarged 2x; here its samples alone, pretrained model above, with the demo's
LoRA below); every other one is its own graph, drawn from the UI file (nodes where the editor puts them, their titles,
the links), under the model it trains. Standard library, Pillow and numpy only (the grid's cells are read by
training/core/validation_grid.py, loaded from its file).
"""
from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import numpy as np
from PIL import Image, ImageDraw, ImageFont

HERE = pathlib.Path(__file__).resolve().parent
DEMO_PICTURE = HERE.parent / "docs" / "before_after.png"
DEMO = "tiny_lora"
SIZE = (512, 384)
HEADER = 56
BACKGROUND, NODE, NOTE, LINK, TEXT = (32, 32, 36), (63, 63, 70), (74, 70, 50), (140, 160, 200), (230, 230, 230)
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


def font(size: int):
    try:
        return ImageFont.truetype(FONT, size)
    except OSError:
        return ImageFont.load_default(size)


def headline(workflow: dict) -> str:
    """What the template trains, from its Train node's title ("Train LoRA (Flux.1 dev)") or its first Note's line."""
    for node in workflow["nodes"]:
        title = node.get("title") or ""
        if "(" in title and title.startswith("Train"):
            return title
    notes = [n for n in workflow["nodes"] if n["type"] in ("Note", "MarkdownNote")]
    return notes[0]["widgets_values"][0].split(".")[0][:60] if notes else ""


def draw_graph(workflow: dict, name: str) -> Image.Image:
    image = Image.new("RGB", SIZE, BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.text((12, 8), name, font=font(22), fill=TEXT)
    draw.text((12, 34), headline(workflow), font=font(14), fill=(170, 170, 180))
    nodes = {n["id"]: n for n in workflow["nodes"]}
    left = min(n["pos"][0] for n in nodes.values())
    top = min(n["pos"][1] for n in nodes.values())
    right = max(n["pos"][0] + n["size"][0] for n in nodes.values())
    bottom = max(n["pos"][1] + n["size"][1] for n in nodes.values())
    scale = min((SIZE[0] - 24) / (right - left), (SIZE[1] - HEADER - 16) / (bottom - top))

    def at(x, y):
        return 12 + (x - left) * scale, HEADER + 8 + (y - top) * scale

    for link in workflow["links"]:
        _, source, _, target, _, _ = link
        a, b = nodes[source], nodes[target]
        draw.line([at(a["pos"][0] + a["size"][0], a["pos"][1] + 15), at(b["pos"][0], b["pos"][1] + 15)],
                  fill=LINK, width=2)
    small = font(max(9, int(26 * scale)))
    for node in nodes.values():
        x0, y0 = at(*node["pos"])
        x1, y1 = at(node["pos"][0] + node["size"][0], node["pos"][1] + node["size"][1])
        draw.rounded_rectangle([x0, y0, x1, y1], radius=4, fill=NOTE if node["type"] == "Note" else NODE,
                               outline=(110, 110, 120))
        draw.text((x0 + 4, y0 + 3), (node.get("title") or node["type"])[:int((x1 - x0) / 6) + 1], font=small,
                  fill=TEXT)
    return image


def validation_grid():
    """training/core/validation_grid.py (it imports nothing of the package): where a grid's cells are."""
    spec = importlib.util.spec_from_file_location("headroom_validation_grid",
                                                  HERE.parent / "training" / "core" / "validation_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def demo_picture() -> Image.Image:
    """The demo's before/after samples (its grid without the labels: the thumbnail draws its own), cropped to the
    thumbnail's aspect (its left columns)."""
    cells = validation_grid().grid_cells(DEMO_PICTURE)  # [2, prompts, H, W, 3]
    rows = [np.concatenate(list(row), axis=1) for row in cells]
    grid = Image.fromarray(np.concatenate(rows, axis=0))
    width = min(grid.width, grid.height * SIZE[0] // SIZE[1])
    image = grid.crop((0, 0, width, grid.height)).resize(SIZE, Image.NEAREST)
    draw = ImageDraw.Draw(image)
    for y, label in ((6, "before: pretrained tiny model"), (SIZE[1] // 2 + 6, "after: with the demo's LoRA")):
        draw.rectangle([6, y, 16 + draw.textlength(label, font=font(16)), y + 24], fill=BACKGROUND)
        draw.text((11, y + 3), label, font=font(16), fill=TEXT)
    return image


def thumbnail(path: pathlib.Path) -> Image.Image:
    if path.stem == DEMO:
        return demo_picture()
    return draw_graph(json.loads(path.read_text(encoding="utf-8")), path.stem)


def write_demo_picture(grid_path: pathlib.Path) -> None:
    """docs/before_after.png: the demo's before/after grid, labels and all, enlarged 2x (64 px samples read small)."""
    grids = validation_grid()
    temp = DEMO_PICTURE.with_suffix(".tmp.png")
    temp.write_bytes(grids.grid_png(grids.enlarged(grid_path, 2)))
    temp.replace(DEMO_PICTURE)
    print(f"wrote {DEMO_PICTURE.relative_to(HERE.parent)}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--demo-grid"] and len(argv) == 2:
        write_demo_picture(pathlib.Path(argv[1]))
    elif argv:
        print(__doc__, file=sys.stderr)
        return 2
    for path in sorted(HERE.glob("*.json")):
        target = path.with_suffix(".jpg")
        thumbnail(path).save(target.with_suffix(".tmp.jpg"), "JPEG", quality=85)
        target.with_suffix(".tmp.jpg").replace(target)
        print(f"wrote {target.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
