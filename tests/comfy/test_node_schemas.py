"""Headroom's public node API against a committed snapshot (tests/node_schemas.json).

Every node's id, display name, category, output-node flag, inputs (required / optional / hidden, in order; type,
default, min / max / step, combo options and the other widget options), and outputs (types, names, lists), read
the way ComfyUI serves them: each node class's `GET_NODE_INFO_V1()`, which ComfyUI's `GET /object_info` returns
for V3 nodes. Tooltips and descriptions are prose and left out.

A workflow saved against one version must load against the next: a change here is a change of the public API.
When it is intended (a new input appended, a new node), update the snapshot and commit it with the change:

    python tests/comfy/test_node_schemas.py --update
"""
from __future__ import annotations

import asyncio
import json
import pathlib
import sys

SNAPSHOT = pathlib.Path(__file__).resolve().parents[1] / "node_schemas.json"
UPDATE_COMMAND = "python tests/comfy/test_node_schemas.py --update"
# Combo options listed from a ComfyUI models folder: they depend on the files there, so the snapshot records the
# fixed options and a placeholder for the listing.
FOLDER_LISTED = {("HeadroomLoraConfig", "init_lora"): "loras", ("HeadroomResizeLora", "lora_name"): "loras",
                 ("HeadroomInspectLora", "lora_name"): "loras",
                 **{("HeadroomMergeLoras", f"lora_{index}"): "loras" for index in range(1, 5)}}
# The dataset nodes' folder choices: the subfolders of ComfyUI's input directory (nodes/bridge/cache_folders.py).
INPUT_FOLDERS_LISTED = {("HeadroomDatasetFromFolder", "folder"), ("HeadroomDatasetFromVideos", "folder")}
LEFT_OUT = {"tooltip"}  # prose; ComfyUI's info also has description / output_tooltips, left out too


def _input_spec(node_id: str, name: str, spec: list) -> dict:
    kind = spec[0]
    options = dict(spec[1]) if len(spec) > 1 and isinstance(spec[1], dict) else {}
    options = {key: value for key, value in options.items() if key not in LEFT_OUT}
    if isinstance(kind, list):  # a V1 combo given as its options
        options["options"], kind = kind, "COMBO"
    folder = FOLDER_LISTED.get((node_id, name))
    if folder is not None:
        import folder_paths

        listed = set(folder_paths.get_filename_list(folder))
        options["options"] = [o for o in options.get("options", []) if o not in listed] + [f"<files of models/{folder}>"]
    if (node_id, name) in INPUT_FOLDERS_LISTED:
        options["options"] = ["<folders of input/>"]
    return {"name": name, "type": kind, **options}


def node_schema(node_cls) -> tuple[str, dict]:
    """(node id, what the snapshot keeps of its /object_info entry)."""
    info = json.loads(json.dumps(node_cls.GET_NODE_INFO_V1()))  # JSON as served (tuples -> lists, big ints kept)
    node_id = info["name"]
    inputs = {}
    for section in ("required", "optional", "hidden"):
        specs = info["input"].get(section) or {}
        order = (info.get("input_order") or {}).get(section) or list(specs)
        if order:
            inputs[section] = [_input_spec(node_id, name, specs[name]) for name in order]
    outputs = [{"type": kind, "name": name, "is_list": bool(is_list)}
               for kind, name, is_list in zip(info["output"], info["output_name"],
                                              info.get("output_is_list") or [False] * len(info["output"]))]
    return node_id, {"display_name": info["display_name"], "category": info["category"],
                     "output_node": bool(info.get("output_node")), "is_input_list": bool(info.get("is_input_list")),
                     "inputs": inputs, "outputs": outputs}


def current_schemas() -> dict:
    """Every node the extension registers, in its order."""
    import headroom.nodes

    nodes = asyncio.run(headroom.nodes.HeadroomExtension().get_node_list())
    schemas = dict(node_schema(node) for node in nodes)
    assert len(schemas) == len(nodes), "two Headroom nodes share a node id"
    return schemas


def dumps(schemas: dict) -> str:
    """One input / output per line, so a diff of the snapshot reads like the change."""
    lines = ["{"]
    for n, (node_id, schema) in enumerate(schemas.items()):
        lines.append(f"  {json.dumps(node_id)}: {{")
        for key in ("display_name", "category", "output_node", "is_input_list"):
            lines.append(f"    {json.dumps(key)}: {json.dumps(schema[key])},")
        lines.append('    "inputs": {')
        sections = list(schema["inputs"].items())
        for s, (section, specs) in enumerate(sections):
            lines.append(f"      {json.dumps(section)}: [")
            lines += [f"        {json.dumps(spec)}" + ("," if i < len(specs) - 1 else "") for i, spec in enumerate(specs)]
            lines.append("      ]" + ("," if s < len(sections) - 1 else ""))
        lines.append("    },")
        lines.append('    "outputs": [')
        outputs = schema["outputs"]
        lines += [f"      {json.dumps(out)}" + ("," if i < len(outputs) - 1 else "") for i, out in enumerate(outputs)]
        lines.append("    ]")
        lines.append("  }" + ("," if n < len(schemas) - 1 else ""))
    lines.append("}")
    return "\n".join(lines) + "\n"


def differences(old: dict, new: dict) -> list[str]:
    """Each change as one line: which node, which input / output, old -> new."""
    out = [f"node {n}: removed" for n in old if n not in new] + [f"node {n}: added" for n in new if n not in old]
    for node_id in [n for n in old if n in new]:
        before, after = old[node_id], new[node_id]
        for key in ("display_name", "category", "output_node", "is_input_list"):
            if before.get(key) != after.get(key):
                out.append(f"node {node_id}: {key} {before.get(key)!r} -> {after.get(key)!r}")
        for section in sorted(set(before["inputs"]) | set(after["inputs"])):
            was = {spec["name"]: spec for spec in before["inputs"].get(section, [])}
            now = {spec["name"]: spec for spec in after["inputs"].get(section, [])}
            where = f"node {node_id}: {section} input"
            out += [f"{where} {name!r} removed" for name in was if name not in now]
            out += [f"{where} {name!r} added: {json.dumps(now[name])}" for name in now if name not in was]
            for name in [name for name in was if name in now]:
                for key in sorted(set(was[name]) | set(now[name])):
                    if was[name].get(key, "<unset>") != now[name].get(key, "<unset>"):
                        out.append(f"{where} {name!r}: {key} {json.dumps(was[name].get(key, '<unset>'))} -> "
                                   f"{json.dumps(now[name].get(key, '<unset>'))}")
            common_was = [name for name in was if name in now]
            common_now = [name for name in now if name in was]
            if common_was != common_now:
                out.append(f"{where}s reordered: {common_was} -> {common_now}")
        if before["outputs"] != after["outputs"]:
            out.append(f"node {node_id}: outputs {json.dumps(before['outputs'])} -> {json.dumps(after['outputs'])}")
    if not out and list(old) != list(new):
        out.append(f"node order {list(old)} -> {list(new)}")
    return out


def test_node_schemas_match_the_snapshot(headroom_nodes):
    assert SNAPSHOT.is_file(), f"no snapshot {SNAPSHOT.name}: run `{UPDATE_COMMAND}` and commit it"
    changes = differences(json.loads(SNAPSHOT.read_text()), current_schemas())
    assert not changes, (
        f"{len(changes)} change(s) of the nodes' public API (node ids / inputs / types / defaults / outputs) against "
        f"tests/{SNAPSHOT.name}:\n  " + "\n  ".join(changes) + "\nSaved workflows depend on these. If the change is "
        f"intended, run `{UPDATE_COMMAND}` and commit tests/{SNAPSHOT.name} with it.")


def test_the_snapshot_file_is_as_the_update_command_writes_it():
    """Hand edits drift: the committed file is exactly what `--update` writes for its own content."""
    text = SNAPSHOT.read_text()
    assert dumps(json.loads(text)) == text, f"tests/{SNAPSHOT.name} was edited by hand: run `{UPDATE_COMMAND}`"


def test_differences_name_the_node_and_input():
    old = {"N": {"display_name": "n", "category": "c", "output_node": False, "is_input_list": False,
                 "inputs": {"required": [{"name": "a", "type": "INT", "default": 1}, {"name": "b", "type": "FLOAT"}]},
                 "outputs": [{"type": "INT", "name": "x", "is_list": False}]}}
    new = json.loads(json.dumps(old))
    new["N"]["inputs"]["required"][0]["default"] = 2
    new["N"]["inputs"]["required"].append({"name": "c", "type": "STRING"})
    assert differences(old, new) == ["node N: required input 'c' added: {\"name\": \"c\", \"type\": \"STRING\"}",
                                     "node N: required input 'a': default 1 -> 2"]
    del new["N"]["inputs"]["required"][1]
    assert "node N: required input 'b' removed" in differences(old, new)


def main(argv: list[str]) -> int:
    if argv not in ([], ["--update"]):
        print(__doc__)
        return 2
    tests_dir = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tests_dir))
    import conftest  # noqa: F401  (registers the repo root as the package `headroom`)
    from comfy_harness import import_comfyui_in_process

    import_comfyui_in_process()
    text = dumps(current_schemas())
    if argv == ["--update"]:
        SNAPSHOT.write_text(text)
        print(f"wrote {SNAPSHOT}")
        return 0
    same = SNAPSHOT.is_file() and SNAPSHOT.read_text() == text
    print("snapshot up to date" if same else f"snapshot differs: run `{UPDATE_COMMAND}`")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
