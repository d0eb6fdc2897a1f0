"""The pack as the Comfy Registry gets it: `comfy node validate` passes without a warning (comfy-cli only warns about a
field it cannot read, then drops it), the fields the Registry shows are there, and the archive `comfy node pack` makes
honours .comfyignore: tests, CI and dev tools out; the nodes, the engine, the editor extension and the templates in.

comfy-cli (pyproject's test extra) runs with a throw-away HOME, telemetry off and --skip-prompt (no consent question),
in a git copy of the repository: pack lists git's files, and validate's ruff run leaves a cache where it runs.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from PIL import Image

REPO = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
COMFY = shutil.which("comfy", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("comfy")
# What .comfyignore leaves out (the test restates it so either side drifting fails)
LEFT_OUT_FOLDERS = (".ci/", "tests/", "bench/")
LEFT_OUT_FILES = {".gitignore", ".comfyignore", "workflows/build_workflows.py", "workflows/thumbnails.py",
                  "workflows/pretrain_tiny.py", "workflows/build_locales.py"}


def _repository_files() -> list[str]:
    """The files a commit of the working tree would hold: tracked ones and new ones git does not ignore."""
    listed = subprocess.check_output(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                                      "--exclude-standard"], text=True).split("\0")
    return sorted(name for name in set(listed) if name and (REPO / name).is_file())


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("registry") / "comfyui-headroom"
    for name in _repository_files():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, root / name)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    return root


def _comfy(root: pathlib.Path, home: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    assert COMFY is not None, "comfy-cli is not installed: .ci/setup installs it (pyproject's test extra)"
    environ = {key: value for key, value in os.environ.items() if not key.startswith("XDG_")}
    environ.update(HOME=str(home), DO_NOT_TRACK="1", COMFY_NO_TELEMETRY="1", COLUMNS="200")
    return subprocess.run([COMFY, "--skip-prompt", "--no-json", "node", *args], cwd=root, env=environ,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)


def test_comfy_node_validate_is_clean(checkout, tmp_path):
    result = _comfy(checkout, tmp_path, "validate")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "All validation checks passed successfully" in output, output
    assert "warning" not in output.lower() and "error" not in output.lower(), output


def test_the_registry_reads_every_field(checkout, monkeypatch):
    """What comfy-cli hands the Registry, as it parses pyproject.toml (a field it cannot read is left empty)."""
    from comfy_cli.registry.config_parser import extract_node_configuration

    monkeypatch.chdir(checkout)
    config = extract_node_configuration(str(checkout / "pyproject.toml"))
    project, comfy = config.project, config.tool_comfy
    repository = "https://github.com/headroom-nodes/comfyui-headroom"
    assert project.urls.repository == repository
    assert project.urls.documentation.startswith(repository) and project.urls.issues == repository + "/issues"
    assert project.supported_os == ["OS Independent", "Microsoft :: Windows", "POSIX :: Linux"]
    assert project.supported_accelerators == ["GPU :: NVIDIA CUDA"]
    assert project.supported_comfyui_version == ">=0.33.0"
    assert project.dependencies == PYPROJECT["project"]["dependencies"]
    assert (comfy.publisher_id, comfy.display_name) == ("headroom", PYPROJECT["tool"]["comfy"]["DisplayName"])
    # The icon is a URL (the Registry wants one) to a file this repository ships, on its default branch.
    prefix = repository.replace("https://github.com/", "https://raw.githubusercontent.com/") + "/main/"
    assert comfy.icon.startswith(prefix)
    with Image.open(REPO / comfy.icon.removeprefix(prefix)) as icon:
        assert icon.format == "PNG" and icon.size == (400, 400)


def test_the_pack_honours_comfyignore(checkout, tmp_path):
    result = _comfy(checkout, tmp_path, "pack")
    assert result.returncode == 0, result.stdout + result.stderr
    with zipfile.ZipFile(checkout / "node.zip") as archive:
        packed = set(archive.namelist())
    files = _repository_files()
    expected = {name for name in files if not name.startswith(LEFT_OUT_FOLDERS) and name not in LEFT_OUT_FILES}
    assert packed == expected, (f"packed but not expected: {sorted(packed - expected)[:10]}; "
                                f"expected but not packed: {sorted(expected - packed)[:10]}")
    assert not any(name.startswith(LEFT_OUT_FOLDERS) for name in packed)
    for needed in ("__init__.py", "pyproject.toml", "requirements.txt", "README.md", "nodes/__init__.py",
                   "training/__init__.py", "workflows/tiny_lora.json", "workflows/tiny_lora.jpg",
                   "workflows/headroom_run.py", "locales/en/nodeDefs.json", "locales/en/main.json"):
        assert needed in packed, needed
    for folder in ("nodes/", "training/", "js/", "workflows/api/", "nodes/weights/"):
        assert any(name.startswith(folder) for name in packed), folder
