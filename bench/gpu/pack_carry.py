"""Assemble what the GPU kit carries to the borrowed GPU machine: `.gpukit/` in the repo root (ignored by git).

    python bench/gpu/pack_carry.py [--comfyui ~/comfy/ComfyUI] [--wheels-from DIR]

- `.gpukit/ComfyUI.tar.gz`: ComfyUI's source without what the kit never imports (API nodes, tests, blueprints,
  examples, the database migrations, git metadata, caches); extracted there into /tmp.
- `.gpukit/whl/`: wheels of what ComfyUI's in-process import and Headroom's node path need and the GPU image lacks
  (WHEELS, pinned to versions that run with its torch 2.11 and Python 3.12), downloaded for CPython 3.12 manylinux.
  comfy-kitchen travels without its compiled CUDA / HIP extensions (235 MB): ComfyUI imports it for its fp8 / int8
  kernels, which the kit's bf16 models never call, and it loads without them (its own fallback).
- `.gpukit/results/` is left as it is (the kit's results so far: a later command resumes after them).

Refuses (exit 1) when the repo's tracked files plus `.gpukit/` exceed what one device call may carry (64 MiB).
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CARRY = REPO_ROOT / ".gpukit"
LIMIT = 64 * 1024 * 1024
# What the GPU image lacks, as imported on the kit's path (docs/GPU_KIT.md says why each one):
WHEELS = [
    "comfy-aimdo==0.4.13",  # comfy.model_management, model_patcher, ops
    "comfy-kitchen==0.2.31",  # comfy.ldm.modules.attention, comfy.quant_ops (extensions stripped, see above)
    "torchsde==0.2.6", "trampoline==0.1.2",  # comfy.k_diffusion.sampling (torchsde needs trampoline)
    "av==18.1.0",  # comfy_api.latest (_ui, video types): every V3 node, Headroom's too
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",  # comfy_api
    "prodigyopt==1.1.2",  # the CUDA tests' Prodigy resume case (an optional optimizer; the tests install it here)
]
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64"]
# ComfyUI's top-level entries the kit never imports.
DROP = {"comfy_api_nodes", "tests", "tests-unit", "blueprints", "script_examples", "alembic_db", "input", "output",
        "user", "temp", ".git", ".github", ".ci", "openapi.yaml", "notebooks"}
STRIPPED = ("comfy_kitchen/backends/cuda/_C.", "comfy_kitchen/backends/hip/_C.")


def find_comfyui(given: str | None) -> Path:
    if given:
        return Path(given).expanduser().resolve()
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH

    if COMFYUI_PATH is None:
        sys.exit(f"pack_carry: {COMFYUI_FOUND_BY}")
    return COMFYUI_PATH


def _skip(path: Path) -> bool:
    return "__pycache__" in path.parts or path.suffix == ".pyc"


def pack_comfyui(root: Path, out: Path) -> int:
    """ComfyUI's source as a gzip tar (top folder ComfyUI/), without DROP; returns its size."""
    temp = out.with_name(out.name + ".tmp")
    with tarfile.open(temp, "w:gz", compresslevel=9) as tar:
        for entry in sorted(root.iterdir()):
            if entry.name in DROP or entry.name.startswith("."):
                continue
            tar.add(entry, arcname=f"ComfyUI/{entry.name}", filter=lambda info: None if _skip(Path(info.name)) else info)
    os.replace(temp, out)
    return out.stat().st_size


def download_wheels(folder: Path, wheels_from: Path | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    if wheels_from is not None:
        command += ["--no-index", "--find-links", str(wheels_from)]
    subprocess.run([*command, *WHEELS], check=True)


def strip_kitchen(folder: Path) -> None:
    """comfy-kitchen's wheel without its compiled extensions (RECORD rewritten to match)."""
    for wheel in folder.glob("comfy_kitchen-*.whl"):
        with zipfile.ZipFile(wheel) as source:
            names = [n for n in source.namelist() if not n.startswith(STRIPPED)]
            if len(names) == len(source.namelist()):
                continue
            buffer = io.BytesIO()
            with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as target:
                for name in names:
                    data = source.read(name)
                    if name.endswith(".dist-info/RECORD"):
                        lines = data.decode().splitlines()
                        data = ("\n".join(l for l in lines if not l.startswith(STRIPPED)) + "\n").encode()
                    target.writestr(name, data)
        temp = wheel.with_name(wheel.name + ".tmp")
        temp.write_bytes(buffer.getvalue())
        os.replace(temp, wheel)


def tracked_bytes() -> int:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO_ROOT / os.fsdecode(n)).stat().st_size for n in names if n and (REPO_ROOT / os.fsdecode(n)).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--comfyui", help="the ComfyUI checkout to pack (default: found as the tests find it)")
    parser.add_argument("--wheels-from", type=Path, help="a folder of wheels to take them from (no download)")
    args = parser.parse_args()
    root = find_comfyui(args.comfyui)
    CARRY.mkdir(exist_ok=True)
    wheels = CARRY / "whl"
    shutil.rmtree(wheels, ignore_errors=True)
    download_wheels(wheels, args.wheels_from)
    strip_kitchen(wheels)
    comfy_bytes = pack_comfyui(root, CARRY / "ComfyUI.tar.gz")
    repo, carry = tracked_bytes(), folder_bytes(CARRY)
    mib = 1024 * 1024
    print(f"pack_carry: ComfyUI {comfy_bytes / mib:.1f} MiB (from {root}), wheels {folder_bytes(wheels) / mib:.1f} MiB; "
          f"repo tracked files {repo / mib:.1f} MiB + .gpukit {carry / mib:.1f} MiB = {(repo + carry) / mib:.1f} MiB "
          f"of {LIMIT / mib:.0f} MiB")
    for wheel in sorted(wheels.iterdir()):
        print(f"  {wheel.name}  {wheel.stat().st_size / mib:.2f} MiB")
    if repo + carry > LIMIT:
        print("pack_carry: too large to carry in one device call: drop wheels or results from .gpukit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
