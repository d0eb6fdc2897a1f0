"""workflows/build_locales.py writes the shape the ComfyUI frontend reads (its own src/locales/en/nodeDefs.json,
looked up as nodeDefs.<node>.display_name / .description / .inputs.<input>.name|tooltip / .outputs.<index>.name|tooltip),
and locales/ holds only what ComfyUI's /i18n reads. That the strings are the schemas': tests/comfy/
test_locales_match_schemas.py."""
from __future__ import annotations

import json
import pathlib
import re

import pytest

from headroom.workflows import build_locales

REPO = pathlib.Path(__file__).resolve().parents[2]
# What ComfyUI's build_translations (app/custom_node_manager.py) reads from each locales/<lang>/ folder.
COMFY_LOCALE_FILES = {"main.json", "nodeDefs.json", "commands.json", "settings.json"}

# An /object_info entry as ComfyUI serves a V3 node's GET_NODE_INFO_V1().
INFO = {
    "name": "Pack.Node", "display_name": "Pack Node", "description": "Does a thing.",
    "input": {"required": {"count": ["INT", {"tooltip": "How many.", "default": 1}], "model.a": ["MODEL", {}]},
              "optional": {"mode": ["COMBO", {"display_name": "Mode", "tooltip": "Which one.", "options": ["x"]}]},
              "hidden": {"unique_id": "UNIQUE_ID"}},
    "input_order": {"required": ["model.a", "count"], "optional": ["mode"], "hidden": ["unique_id"]},
    "output": ["MODEL", "FLOAT"], "output_name": ["MODEL", "loss"], "output_tooltips": ["The model.", None],
}


def test_a_node_entry_has_the_frontends_shape():
    assert build_locales.node_defs([INFO]) == {"Pack_Node": {
        "display_name": "Pack Node",
        "description": "Does a thing.",
        # declared order; hidden inputs are never shown; a dot in a key would split the frontend's message path
        "inputs": {"model_a": {"name": "model.a"}, "count": {"name": "count", "tooltip": "How many."},
                   "mode": {"name": "Mode", "tooltip": "Which one."}},
        # an output named as its type is labelled by the type (dataTypes.MODEL): no name of ours
        "outputs": {"0": {"tooltip": "The model."}, "1": {"name": "loss"}},
    }}
    assert list(build_locales.node_defs([INFO])["Pack_Node"]["inputs"]) == ["model_a", "count", "mode"]


def test_a_bare_node_keeps_only_what_it_has():
    bare = {"name": "Bare", "display_name": "", "description": "", "input": {}, "output": [], "output_name": []}
    assert build_locales.node_defs([bare]) == {"Bare": {"display_name": "Bare"}}


@pytest.mark.parametrize("field, text", [("display_name", "A {x} node"), ("description", "mail me@home"),
                                         ("description", "one | two")])
def test_message_syntax_is_refused_where_the_editor_compiles_the_text(field, text):
    with pytest.raises(ValueError, match="message syntax"):
        build_locales.node_defs([{**INFO, field: text}])


def test_tooltips_may_hold_any_text():
    """The editor reads tooltips raw (stRaw): no syntax to avoid."""
    info = json.loads(json.dumps(INFO))
    info["input"]["required"]["count"][1]["tooltip"] = "a {b} @c | d"
    assert build_locales.node_defs([info])["Pack_Node"]["inputs"]["count"]["tooltip"] == "a {b} @c | d"


def test_two_nodes_with_one_key_are_refused():
    with pytest.raises(ValueError, match="share the locale key"):
        build_locales.node_defs([INFO, {**INFO, "name": "Pack_Node"}])


def test_differences_name_the_message():
    old = build_locales.node_defs([INFO])
    new = json.loads(json.dumps(old))
    new["Pack_Node"]["inputs"]["count"]["tooltip"] = "How many images."
    del new["Pack_Node"]["description"]
    assert build_locales.differences(old, new) == [
        "Pack_Node.description: 'Does a thing.' -> '<none>'",
        "Pack_Node.inputs.count.tooltip: 'How many.' -> 'How many images.'"]


def test_the_committed_node_strings_have_the_frontends_shape():
    node_defs = json.loads(build_locales.NODE_DEFS_FILE.read_text(encoding="utf-8"))
    assert node_defs and all(name.startswith("Headroom") for name in node_defs)
    for name, entry in node_defs.items():
        assert set(entry) <= {"display_name", "description", "inputs", "outputs"} and entry["display_name"], name
        for item in [*entry.get("inputs", {}).values(), *entry.get("outputs", {}).values()]:
            assert item and set(item) <= {"name", "tooltip"} and all(isinstance(v, str) and v for v in item.values()), name
        assert all(re.fullmatch(r"\d+", index) for index in entry.get("outputs", {})), name


def test_main_json_is_the_generators():
    assert build_locales.MAIN_FILE.read_text(encoding="utf-8") == build_locales.dumps(build_locales.main_messages()), \
        f"locales/en/main.json differs from what `{build_locales.BUILD_COMMAND}` writes"


def test_the_templates_label_is_keyed_by_the_packs_folder():
    """The Templates dialog keys a pack's label by the folder it is installed in: the registry name."""
    from server_harness import PACKAGE_DIR_NAME

    name = re.search(r'^name = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert build_locales.PACK_FOLDER == name == PACKAGE_DIR_NAME


def test_locales_holds_only_language_folders_comfyui_reads():
    """ComfyUI serves every folder in locales/ as a language (a stray __pycache__/ would be one) and reads only these
    files from it."""
    entries = sorted((REPO / "locales").iterdir())
    assert "en" in [entry.name for entry in entries]
    for folder in entries:
        assert folder.is_dir() and re.fullmatch(r"[a-z]{2,3}(-[A-Za-z0-9]+)?", folder.name), folder
        assert {path.name for path in folder.iterdir()} <= COMFY_LOCALE_FILES, folder
