"""The declared, checked range (issue 40 item 3): on an older ComfyUI or torch, one log line saying what Headroom needs
and what is installed, and one node saying it in the editor, instead of IMPORT FAILED; a family whose ComfyUI
classes are missing is left out alone, every other node loads."""
from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import sys
import tomllib

import pytest

from headroom.training import environment

pytestmark = pytest.mark.comfyui
REPO = pathlib.Path(__file__).resolve().parents[2]


def test_versions_compare_by_their_numbers():
    assert environment.older_than("2.5.1+cu121", "2.8") and not environment.older_than("2.8.0+cu128", "2.8")
    assert not environment.older_than("2.14.1", "2.8") and environment.older_than("0.3.60", "0.33.0")
    assert not environment.older_than("0.33.0", "0.33.0") and not environment.older_than("weird", "2.8")
    line = environment.environment_problem({"torch": "2.5.1", "ComfyUI": "0.3.60"})
    assert line.startswith("Headroom needs ComfyUI >= 0.33.0 (this one has 0.3.60) and torch >= 2.8 (this one has "
                           "2.5.1): update ComfyUI") and "\n" not in line
    assert environment.environment_problem({"torch": "2.14.1", "ComfyUI": "0.33.0"}) is None
    assert environment.environment_problem({"torch": None, "ComfyUI": None}) is None  # unknown: no complaint


def test_pyproject_declares_the_checked_minimums():
    data = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert data["tool"]["comfy"]["requires-comfyui"] == f">={environment.MIN_COMFYUI}"
    assert data["tool"]["headroom"]["requires-torch"] == f">={environment.MIN_TORCH}"
    assert not any(dep.split(">")[0].split("=")[0].strip() == "torch" for dep in data["project"]["dependencies"])


def _node_list(extension):
    return asyncio.run(extension.get_node_list())


@pytest.mark.min_torch
def test_this_comfyui_loads_every_node(headroom_nodes):
    import headroom

    nodes = _node_list(asyncio.run(headroom.comfy_entrypoint()))
    assert len(nodes) > 20 and "HeadroomUnavailable" not in {node.GET_SCHEMA().node_id for node in nodes}


def test_loading_the_pack_imports_no_training_library():
    """What ComfyUI's start-up runs (the package and its node list, in a fresh process beside ComfyUI) imports neither
    peft nor bitsandbytes: they are imported where a run first needs them. With them the pack added 2.2 s to every
    ComfyUI start, 0.4 s without (ComfyUI's "Import times for custom nodes", on the 2-core test machine)."""
    import subprocess

    script = ("import asyncio, json, sys; sys.path.insert(0, 'tests'); import comfy_harness; "
              "comfy_harness.import_comfyui_in_process(); import nodes; "
              "loaded = lambda: sorted(m for m in ('peft', 'bitsandbytes') if m in sys.modules); before = loaded(); "
              "pack = comfy_harness.register_module('headroom', comfy_harness.REPO_ROOT / '__init__.py', package=True); "
              "listed = asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list()); "
              "print(json.dumps({'nodes': len(listed), 'before': before, 'after': loaded()}))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["nodes"] > 20 and result["before"] == [] and result["after"] == [], result


def test_an_old_torch_gets_one_line_and_a_node_that_says_so(headroom_nodes, monkeypatch, caplog):
    import headroom

    monkeypatch.setattr(environment, "installed_versions", lambda: {"torch": "2.5.1+cu121", "ComfyUI": "0.33.0"})
    with caplog.at_level(logging.WARNING, logger="headroom"):
        [node] = _node_list(asyncio.run(headroom.comfy_entrypoint()))
    [record] = [r for r in caplog.records if r.name == "headroom"]
    assert record.getMessage() == ("Headroom: Headroom needs torch >= 2.8 (this one has 2.5.1+cu121): update ComfyUI "
                                   "(Windows portable: run update\\update_comfyui_and_python_dependencies.bat; ComfyUI "
                                   "Desktop updates itself; comfy-cli: comfy update all). Its nodes refuse to run until "
                                   "then.")
    schema = node.GET_SCHEMA()
    assert schema.node_id == "HeadroomUnavailable" and "torch >= 2.8" in schema.description
    with pytest.raises(RuntimeError, match=r"needs torch >= 2\.8 \(this one has 2\.5\.1\+cu121\)"):
        node.execute()


def test_nodes_that_cannot_import_say_so_instead_of_import_failed(headroom_nodes, monkeypatch, caplog):
    import headroom

    monkeypatch.setitem(sys.modules, "headroom.nodes", None)  # as a ComfyUI lacking a class the nodes import
    with caplog.at_level(logging.WARNING, logger="headroom"):
        [node] = _node_list(asyncio.run(headroom.comfy_entrypoint()))
    assert node.GET_SCHEMA().node_id == "HeadroomUnavailable"
    assert "Headroom's nodes cannot load on this ComfyUI (ModuleNotFoundError" in node.GET_SCHEMA().description


def test_a_family_whose_comfyui_class_is_missing_is_left_out_alone(headroom_nodes, monkeypatch, caplog):
    import comfy.text_encoders.hunyuan_video

    from headroom.nodes.bridge import families

    # hidream.py subclasses this tokenizer at import; a ComfyUI that renamed it once took every node down.
    monkeypatch.delattr(comfy.text_encoders.hunyuan_video, "LLAMA3Tokenizer")
    monkeypatch.delitem(sys.modules, "headroom.nodes.bridge.families.hidream")
    with caplog.at_level(logging.WARNING, logger="headroom"):
        found = families._discover()
    assert "hidream" not in found and {"sd15", "sdxl", "flux", "qwen_image"} <= set(found)
    assert set(found) == set(families.FAMILIES) - {"hidream"}
    [line] = [r.getMessage() for r in caplog.records if r.name == "headroom"]
    assert line.startswith("Headroom: the hidream family is left out: this ComfyUI lacks what it uses "
                           "(AttributeError: ") and "LLAMA3Tokenizer" in line


def test_the_min_torch_venv_installs_the_declared_minimum():
    """.ci/setup-min-torch builds the second venv where the min_torch tests run: on MIN_TORCH, not on some other."""
    text = (REPO / ".ci" / "setup-min-torch").read_text(encoding="utf-8")
    import re

    pinned = re.search(r"torch==(\d+\.\d+)\.\d+ ", text).group(1)
    assert pinned == environment.MIN_TORCH
    assert f'startswith("{environment.MIN_TORCH}.")' in text
    # ... with the other packages of the Windows portable build that shipped that torch (transformers 4.57.1,
    # safetensors 0.6.2...): the profile tests/unit/test_install.py installs into
    assert "tests/install_envs/windows_portable_2026.json" in text
    profile = json.loads((REPO / "tests" / "install_envs" / "windows_portable_2026.json").read_text(encoding="utf-8"))
    assert re.search(r"torch==(\d+\.\d+)\.\d+ ", text).group(0).strip() in profile["pins"]


def test_a_node_whose_schema_this_comfyui_cannot_build_is_left_out_alone(headroom_nodes, monkeypatch, caplog):
    """On a ComfyUI without the V3 `advanced` option (0.3.67 of October 2025, tried by hand), 11 schemas fail: those
    nodes are left out and one node names them, instead of the whole pack failing to load."""
    import headroom
    from headroom.nodes.train_lora import HeadroomLoraConfig

    def old_comfyui_schema(cls):
        raise TypeError("Combo.Input.__init__() got an unexpected keyword argument 'advanced'")

    monkeypatch.setattr(HeadroomLoraConfig, "define_schema", classmethod(old_comfyui_schema))
    with caplog.at_level(logging.WARNING, logger="headroom"):
        nodes = _node_list(asyncio.run(headroom.comfy_entrypoint()))
    ids = [node.GET_SCHEMA().node_id for node in nodes]
    assert "HeadroomLoraConfig" not in ids and "HeadroomTrainLora" in ids and ids[-1] == "HeadroomUnavailable"
    description = nodes[-1].GET_SCHEMA().description
    assert description.startswith("1 of Headroom's nodes cannot be built on this ComfyUI, so they are left out: "
                                  "HeadroomLoraConfig (TypeError: Combo.Input.__init__() got an unexpected keyword "
                                  "argument 'advanced')")
    assert [r.getMessage() for r in caplog.records if r.name == "headroom"] == [f"Headroom: {description}"]
