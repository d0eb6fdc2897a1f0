"""Builds locales/en/ (the editor's English strings for Headroom) from the node schemas.

    python workflows/build_locales.py            # rewrites locales/en/nodeDefs.json and main.json
    python workflows/build_locales.py --check    # exit 1 if they differ from what it would write

ComfyUI (app/custom_node_manager.py) serves every custom node's `locales/<lang>/main.json`, with its `nodeDefs.json`
under the key "nodeDefs", at /i18n; the graph editor merges them into its own messages. The schemas stay the source
of truth: this writes their display names, descriptions, input names and tooltips, output names and tooltips, in
the shape of the frontend's own locales/en/nodeDefs.json, so a translator has one file to copy per language.
tests/comfy/test_locales_match_schemas.py fails when the committed files differ from what this builds.

main.json holds the one template string the editor (frontend 1.49.6) looks up for a custom node's templates: the
pack's label in the Templates dialog (Extensions > ...), keyed by the pack's folder name. A custom node's template
cards get no title or description from i18n: the card's title is the file name.

The CLI imports ComfyUI in-process, found as the tests find it (tests/comfy_harness.py: $COMFYUI_PATH, the ComfyUI
holding this pack, ~/comfy/ComfyUI).
"""
from __future__ import annotations

import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCALE_DIR = REPO / "locales" / "en"
NODE_DEFS_FILE = LOCALE_DIR / "nodeDefs.json"
MAIN_FILE = LOCALE_DIR / "main.json"
BUILD_COMMAND = "python workflows/build_locales.py"

# The folder ComfyUI Manager and comfy-cli install the pack into (pyproject's project name): the Templates dialog
# keys a pack's label by it.
PACK_FOLDER = "comfyui-headroom"
PACK_LABEL = "Headroom"

# The editor reads display names, descriptions and slot names through vue-i18n's message compiler (`st()` in the
# frontend's i18n.ts), where these characters are syntax ({name} interpolation, @:linked, a | b plural) and would
# be shown mangled; tooltips are read raw (`stRaw()`), so any text is safe there.
MESSAGE_SYNTAX = set("{}@|")


def i18n_key(name: str) -> str:
    """The frontend's normalizeI18nKey: a dot would split the message path."""
    return name.replace(".", "_")


def _compiled(text: str, where: str) -> str:
    bad = sorted(MESSAGE_SYNTAX & set(text))
    if bad:
        raise ValueError(f"{where}: {' '.join(bad)} is vue-i18n message syntax; the editor would show this text "
                         f"mangled, rephrase it: {text!r}")
    return text


def node_def_entry(info: dict) -> dict:
    """One node's nodeDefs entry from its /object_info entry (a V3 node's GET_NODE_INFO_V1())."""
    node = info["name"]
    entry = {"display_name": _compiled(info.get("display_name") or node, f"{node} display_name")}
    if info.get("description"):
        entry["description"] = _compiled(info["description"], f"{node} description")
    inputs = {}
    order = info.get("input_order") or {section: list(specs) for section, specs in info["input"].items()}
    for section in ("required", "optional"):  # hidden inputs are never shown
        for name in order.get(section, []):
            spec = info["input"][section][name]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            # The editor labels a widget with this name, before the input's own display_name: keep that label.
            item = {"name": _compiled(options.get("display_name") or name, f"{node} input {name}")}
            if options.get("tooltip"):
                item["tooltip"] = options["tooltip"]
            inputs[i18n_key(name)] = item
    if inputs:
        entry["inputs"] = inputs
    outputs = {}
    tooltips = info.get("output_tooltips") or [None] * len(info["output"])
    for index, (kind, name, tooltip) in enumerate(zip(info["output"], info["output_name"], tooltips)):
        item = {}
        if name != kind:  # an output named as its type is labelled by the type's own translation (dataTypes.*)
            item["name"] = _compiled(name, f"{node} output {index}")
        if tooltip:
            item["tooltip"] = tooltip
        if item:
            outputs[str(index)] = item
    if outputs:
        entry["outputs"] = outputs
    return entry


def node_defs(infos: list[dict]) -> dict:
    """nodeDefs.json: every node's entry under its node id, in the order given (the extension's)."""
    out = {}
    for info in infos:
        key = i18n_key(info["name"])
        if key in out:
            raise ValueError(f"two nodes share the locale key {key!r}")
        out[key] = node_def_entry(info)
    return out


def main_messages() -> dict:
    return {"templateWorkflows": {"category": {PACK_FOLDER: PACK_LABEL}}}


def dumps(messages: dict) -> str:
    return json.dumps(messages, indent=2, ensure_ascii=False) + "\n"


def files(infos: list[dict]) -> dict[pathlib.Path, str]:
    """Each locale file and the text it must hold."""
    return {NODE_DEFS_FILE: dumps(node_defs(infos)), MAIN_FILE: dumps(main_messages())}


def _flat(messages: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in messages.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return out


def differences(old: dict, new: dict) -> list[str]:
    """Each message that differs, as one line: its key path, the old text -> the new one."""
    before, after = _flat(old), _flat(new)
    return [f"{path}: {before.get(path, '<none>')!r} -> {after.get(path, '<none>')!r}"
            for path in [*before, *(p for p in after if p not in before)] if before.get(path) != after.get(path)]


def node_infos(node_classes) -> list[dict]:
    """The nodes' /object_info entries as ComfyUI serves them (JSON round trip: tuples become lists)."""
    return [json.loads(json.dumps(node.GET_NODE_INFO_V1())) for node in node_classes]


def pack_nodes(nodes_package) -> list:
    """Headroom's nodes (nodes/__init__.py's _NODE_MODULES, in the extension's order). Not get_node_list(): on a
    ComfyUI that cannot build some schema it adds a node whose description is that problem, which a fixed locale
    string would hide."""
    return [node for module in nodes_package._NODE_MODULES for node in module.NODES]


def current_node_infos() -> list[dict]:
    """Every Headroom node, from an in-process ComfyUI (imported the way the tests do)."""
    sys.path.insert(0, str(REPO / "tests"))
    import conftest  # noqa: F401  (registers the repo root as the package `headroom`)
    from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH, import_comfyui_in_process

    if COMFYUI_PATH is None:
        raise SystemExit(f"build_locales: {COMFYUI_FOUND_BY}")
    import_comfyui_in_process()
    import headroom.nodes

    return node_infos(pack_nodes(headroom.nodes))


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__)
        return 2
    wanted = files(current_node_infos())
    stale = [path for path, text in wanted.items() if not path.is_file() or path.read_text(encoding="utf-8") != text]
    if argv == ["--check"]:
        for path in stale:
            old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            changes = differences(old, json.loads(wanted[path])) or ["(layout only)"]
            print(f"{path.relative_to(REPO)} differs from the node schemas (run `{BUILD_COMMAND}`):\n  "
                  + "\n  ".join(changes))
        return 1 if stale else 0
    LOCALE_DIR.mkdir(parents=True, exist_ok=True)
    for path in stale:
        path.write_text(wanted[path], encoding="utf-8", newline="\n")
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
