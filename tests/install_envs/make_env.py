"""Regenerate tests/install_envs/<name>.json: what a typical ComfyUI environment has installed, for
tests/unit/test_install.py.

Each file lists the packages of one environment (name, version and their real Requires-Dist, Requires-Python and
Provides-Extra lines, as PyPI serves them), so the test can make pip believe they are installed without
downloading torch (several GB): it writes metadata-only dist-info folders into a fresh venv.

An environment is its pins (what users' ComfyUI has: torch, transformers, huggingface-hub...) plus the rest of
ComfyUI's requirements.txt, resolved together by pip against PyPI as it was at `uploaded_prior_to` (pip's
--uploaded-prior-to), so every other package is a version of that time. ComfyUI's version specifiers are dropped (they
are today's ComfyUI's, e.g. `av>=16`), and so are its requirements with no release before the cutoff. The metadata is
that of the Linux wheels (markers are evaluated for the machine running this, as they are in the test).

    python tests/install_envs/make_env.py                       # every environment
    python tests/install_envs/make_env.py windows_portable_2026 # one
    COMFYUI_PATH=/path/to/ComfyUI python tests/install_envs/make_env.py

Needs PyPI and the environment's Python (python3.12: on PATH or under ~/.pyenv/versions).
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

HERE = pathlib.Path(__file__).resolve().parent

ENVS = {
    "windows_portable_2026": {
        "description": "ComfyUI's Windows portable build of early 2026: embedded Python 3.12, torch 2.8 (cu128), "
                       "transformers 4.57.1, huggingface-hub 0.36.2, numpy 2, pillow 11",
        "python": "3.12",
        "uploaded_prior_to": "2026-02-15T00:00:00Z",
        "pins": ["torch==2.8.0", "torchvision==0.23.0", "torchaudio==2.8.0", "transformers==4.57.1",
                 "huggingface-hub==0.36.2", "safetensors==0.6.2", "tokenizers==0.22.1", "numpy>=2,<3",
                 "pillow>=11,<12"],
    },
    "windows_portable_0_33": {
        "description": "ComfyUI 0.33's default Windows portable build (August 2026, the ComfyUI Headroom requires): "
                       "embedded Python 3.13, torch and everything else the newest of its day, as the build installs "
                       "them (transformers 5, huggingface-hub 1)",
        "python": "3.13",
        "uploaded_prior_to": "2026-08-22T00:00:00Z",
        "pins": ["torch", "torchvision", "torchaudio", "transformers", "huggingface-hub", "safetensors", "tokenizers",
                 "numpy", "pillow"],
    },
    "older": {
        "description": "An environment not updated since spring 2025: Python 3.12, torch 2.5.1 (below Headroom's 2.8: it "
                       "will not run there, but installing must still leave it working), transformers 4.50.3 "
                       "(ComfyUI's lowest), huggingface-hub 0.30, safetensors 0.4.5, numpy 1.26",
        "python": "3.12",
        "uploaded_prior_to": "2025-04-15T00:00:00Z",
        "pins": ["torch==2.5.1", "torchvision==0.20.1", "torchaudio==2.5.1", "transformers==4.50.3",
                 "huggingface-hub==0.30.2", "safetensors==0.4.5", "tokenizers==0.21.1", "numpy==1.26.4",
                 "pillow>=11,<12"],
    },
}


def find_python(version: str) -> str | None:
    """An interpreter of `version` ("3.12"): pyenv's install, else python3.12 on PATH."""
    root = os.environ.get("PYENV_ROOT", str(pathlib.Path.home() / ".pyenv"))
    found = sorted(glob.glob(f"{root}/versions/{version}.*/bin/python{version}"))
    if found:
        return found[-1]
    path = shutil.which(f"python{version}")
    if path and subprocess.run([path, "-c", ""], capture_output=True).returncode == 0:  # a pyenv shim may not run
        return path
    return None


def pip_environ() -> dict[str, str]:
    """os.environ for a pip that resolves against PyPI as a user's would: no config file, no PIP_* settings (this
    machine's cap torch and add local wheel folders); only the CA bundle setting is kept, it changes no result."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    environ["PIP_CONFIG_FILE"] = os.devnull
    environ["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    if "PIP_CERT" in os.environ:
        environ["PIP_CERT"] = os.environ["PIP_CERT"]
    return environ


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(line: str) -> str | None:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
    return match.group(1) if match else None


def comfyui_requirements(comfyui: pathlib.Path) -> list[str]:
    lines = (comfyui / "requirements.txt").read_text().splitlines()
    return [name for name in map(_requirement_name, lines) if name]


def first_upload(name: str) -> str:
    """The upload time of the package's first file on PyPI (the simple API's JSON form)."""
    request = urllib.request.Request(f"https://pypi.org/simple/{canonical(name)}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    return min(f["upload-time"] for f in files if f.get("upload-time"))


def resolve(python: str, requirements: list[str], cutoff: str) -> list[dict]:
    """pip's report of what installing `requirements` into an empty environment would install, as of `cutoff`."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = pathlib.Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpython = str(venv / "bin" / "python")
        environ = pip_environ()
        subprocess.run([vpython, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True, env=environ)
        report = pathlib.Path(tmp) / "report.json"
        subprocess.run([vpython, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "--uploaded-prior-to", cutoff, *requirements],
                       check=True, env=environ)
        return json.loads(report.read_text())["install"]


def make(name: str, comfyui: pathlib.Path) -> dict:
    spec = ENVS[name]
    python = find_python(spec["python"])
    if python is None:
        sys.exit(f"make_env: no python{spec['python']} found (PATH, ~/.pyenv/versions)")
    pinned = {canonical(_requirement_name(pin)) for pin in spec["pins"]}
    cutoff = spec["uploaded_prior_to"]
    extra, dropped = [], []
    for requirement in comfyui_requirements(comfyui):
        if canonical(requirement) in pinned:
            continue
        (extra if first_upload(requirement) < cutoff else dropped).append(requirement)
    installs = resolve(python, ["pip", *spec["pins"], *extra], cutoff)
    packages = []
    pip_version = None
    for item in installs:
        metadata = item["metadata"]
        if canonical(metadata["name"]) == "pip":  # the test installs this pip for real
            pip_version = metadata["version"]
            continue
        packages.append({"name": metadata["name"], "version": metadata["version"],
                         "requires_dist": metadata.get("requires_dist", []),
                         "requires_python": metadata.get("requires_python"),
                         "provides_extra": metadata.get("provides_extra", [])})
    packages.sort(key=lambda p: canonical(p["name"]))
    return {"name": name, "description": spec["description"], "python": spec["python"], "uploaded_prior_to": cutoff,
            "pins": spec["pins"], "comfyui_requirements": extra, "comfyui_requirements_without_release_then": dropped,
            "pip": pip_version, "packages": packages}


def main(argv: list[str]) -> None:
    comfyui = pathlib.Path(os.environ.get("COMFYUI_PATH", pathlib.Path.home() / "comfy" / "ComfyUI"))
    if not (comfyui / "requirements.txt").is_file():
        sys.exit(f"make_env: no ComfyUI requirements.txt at {comfyui} (set COMFYUI_PATH)")
    for name in argv or list(ENVS):
        env = make(name, comfyui)
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(env, indent=1) + "\n")
        print(f"make_env: {path.name}: {len(env['packages'])} packages, pip {env['pip']}; without a release before "
              f"{env['uploaded_prior_to']}: {', '.join(env['comfyui_requirements_without_release_then']) or 'none'}")


if __name__ == "__main__":
    main(sys.argv[1:])
