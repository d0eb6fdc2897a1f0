"""js/headroom_templates.js puts the pack's templates in reading order: its list names every shipped UI workflow
exactly once (a new workflow added without a place would come last, by name). The browser test checks the order
the editor shows (tests/browser/test_browser.py)."""
from __future__ import annotations

import json
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def template_order() -> list[str]:
    text = (REPO / "js" / "headroom_templates.js").read_text()
    body = re.search(r"export const TEMPLATE_ORDER = (\[.*?\]);", text, re.S)
    assert body, "TEMPLATE_ORDER not found in js/headroom_templates.js"
    return json.loads(re.sub(r",\s*\]", "]", body.group(1)))


def test_the_order_names_every_shipped_workflow_once():
    order = template_order()
    shipped = sorted(path.stem for path in (REPO / "workflows").glob("*.json"))
    assert len(order) == len(set(order)), order
    assert sorted(order) == shipped
    assert order[0] == "tiny_lora"  # the demo first: it runs anywhere in minutes
    assert order[1] == "your_folder_lora"  # then the same on the user's own folder: the next step after the demo
