"""Installing Headroom changes none of the packages a user's ComfyUI already has (issue 40).

ComfyUI-Manager runs `pip install <line>` for each line of requirements.txt; `comfy node install` runs
`pip install -r requirements.txt`. Either must leave torch, transformers, huggingface-hub, safetensors... as they are:
when diffusers' line upgraded huggingface-hub under transformers 4.x, `import transformers` failed and ComfyUI did not
start.

Each environment of tests/install_envs/ (what a user's ComfyUI has installed, with the packages' real metadata; made by
make_env.py) becomes a venv whose site-packages holds metadata-only dist-info folders: pip takes torch & co as
installed without their gigabytes. `pip install --dry-run --report` then says what it would install, resolving
against PyPI as it is today, so a new release of a dependency that would drag an upgrade fails here: that is the point.
uv (ComfyUI Desktop's environment, Manager's `use_uv`, comfy-cli's `--fast-deps`) resolves differently; its
`uv pip install --dry-run` is read the same way.
Markers are evaluated for this machine (Linux, the venv's platform), not for the Windows portable build: the
environments hold the Linux wheels' metadata, and our requirements carry no marker that tells the two apart.

Needs PyPI (marker `pypi`); runs in the normal suite (about a minute).
"""
from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parents[2]
ENV_DIR = REPO / "tests" / "install_envs"
sys.path.append(str(ENV_DIR))
from make_env import canonical, find_python, pip_environ  # noqa: E402

ENV_NAMES = ("windows_portable_0_33", "windows_portable_2026", "older")
# What a typical ComfyUI environment owns: installing Headroom may never change these (nor anything else installed).
OWNED_BY_COMFYUI = ("torch", "torchvision", "torchaudio", "transformers", "huggingface-hub", "safetensors",
                    "tokenizers", "numpy", "pillow")
INSTALLER = "headroom-install-test"  # marks the dist-info folders this test wrote (pip's own are kept)


def requirement_lines(path: pathlib.Path = REPO / "requirements.txt") -> list[str]:
    """The lines ComfyUI-Manager hands to pip one by one: everything but blank lines and comments."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]


class FakeEnv:
    """A venv with the environment's pip installed for real and every other package as metadata only."""

    def __init__(self, root: pathlib.Path, spec: dict, python: str):
        self.spec = spec
        subprocess.run([python, "-m", "venv", str(root)], check=True)
        self.python = str(root / "bin" / "python")
        self._pip("install", "--quiet", f"pip=={spec['pip']}")
        self.site = pathlib.Path(subprocess.check_output(
            [self.python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True).strip())
        self.installed: dict[str, tuple[str, str]] = {}
        self.reset()

    def _pip(self, *args: str) -> subprocess.CompletedProcess:
        result = subprocess.run([self.python, "-m", "pip", *args], capture_output=True, text=True, env=pip_environ(),
                                timeout=600)
        if result.returncode != 0:
            pytest.fail(f"pip {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    def reset(self) -> None:
        """Back to the environment's packages, as make_env.py recorded them."""
        for folder in self.site.glob("*.dist-info"):
            if (folder / "INSTALLER").is_file() and (folder / "INSTALLER").read_text().strip() == INSTALLER:
                shutil.rmtree(folder)
        self.installed = {}
        for package in self.spec["packages"]:
            self.write(package)

    def write(self, metadata: dict) -> None:
        """A metadata-only dist-info for `metadata` (name, version, requires_dist, ...), replacing any of its name."""
        key = canonical(metadata["name"])
        if key in self.installed:
            name, version = self.installed[key]
            shutil.rmtree(self.site / f"{_escaped(name)}-{version}.dist-info")
        lines = ["Metadata-Version: 2.1", f"Name: {metadata['name']}", f"Version: {metadata['version']}"]
        if metadata.get("requires_python"):
            lines.append(f"Requires-Python: {metadata['requires_python']}")
        lines += [f"Provides-Extra: {extra}" for extra in metadata.get("provides_extra") or []]
        lines += [f"Requires-Dist: {requirement}" for requirement in metadata.get("requires_dist") or []]
        folder = self.site / f"{_escaped(metadata['name'])}-{metadata['version']}.dist-info"
        folder.mkdir()
        (folder / "METADATA").write_text("\n".join(lines) + "\n")
        (folder / "INSTALLER").write_text(INSTALLER + "\n")
        (folder / "RECORD").write_text("")
        self.installed[key] = (metadata["name"], metadata["version"])

    def dry_run(self, *args: str, report: pathlib.Path) -> list[dict]:
        """The metadata of each package `pip install <args>` would install here."""
        self._pip("install", "--dry-run", "--quiet", "--report", str(report), *args)
        return [item["metadata"] for item in json.loads(report.read_text())["install"]]

    def uv_changes(self, *args: str) -> list[tuple[str, str, str]]:
        """(name, installed version, version uv would install) for each installed package `uv pip install <args>` would
        replace or remove here: uv's resolver, not pip's (it prefers what is installed, and backtracks differently)."""
        environ = {**pip_environ(), "UV_NO_CONFIG": "1"}  # PyPI as a user's uv sees it: no uv.toml of this machine
        result = subprocess.run([sys.executable, "-m", "uv", "pip", "install", "--dry-run", "--python", self.python,
                                 *args], capture_output=True, text=True, env=environ, timeout=600)
        if result.returncode != 0:
            pytest.fail(f"uv pip install {' '.join(args)} failed ({result.returncode}):\n"
                        f"{result.stdout}\n{result.stderr}")
        out = result.stdout + result.stderr
        removed = dict(re.findall(r"^ - ([A-Za-z0-9._-]+)==(\S+)$", out, re.M))
        added = {canonical(name): version for name, version in re.findall(r"^ \+ ([A-Za-z0-9._-]+)==(\S+)$", out, re.M)}
        assert "Would install" in out or "Would make no changes" in out or "Audited" in out, out  # uv said what it does
        return [(name, old, added.get(canonical(name), "(removed)")) for name, old in removed.items()]

    def changes(self, installs: list[dict]) -> list[tuple[str, str, str]]:
        """(name, installed version, version pip would install) for each installed package pip would replace."""
        return [(self.installed[key][0], self.installed[key][1], item["version"]) for item in installs
                if (key := canonical(item["name"])) in self.installed and self.installed[key][1] != item["version"]]


def _escaped(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name)


@pytest.fixture(scope="session")
def fake_envs(tmp_path_factory):
    """name -> FakeEnv, each built once per session (a venv and a pip install: a few seconds)."""
    built: dict[str, FakeEnv] = {}

    def get(name: str) -> FakeEnv:
        if name not in built:
            spec = json.loads((ENV_DIR / f"{name}.json").read_text())
            python = find_python(spec["python"])
            if python is None:
                pytest.skip(f"{name} needs python{spec['python']} (on PATH or under ~/.pyenv/versions)")
            built[name] = FakeEnv(tmp_path_factory.mktemp(name), spec, python)
        env = built[name]
        env.reset()
        return env

    return get


def _describe(changes: list[tuple[str, str, str, str]], env: FakeEnv) -> str:
    return (f"installing Headroom would change packages of {env.spec['name']} ({env.spec['description']}):\n"
            + "\n".join(f"  {name} {old} -> {new}   (pulled by {line!r})" for name, old, new, line in changes))


pypi = pytest.mark.pypi


@pypi
@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_pip_install_r_requirements_changes_no_installed_package(fake_envs, env_name, tmp_path):
    """`pip install -r requirements.txt`, as `comfy node install` and the Comfy Registry run it."""
    env = fake_envs(env_name)
    installs = env.dry_run("-r", str(REPO / "requirements.txt"), report=tmp_path / "report.json")
    changes = [(*change, "-r requirements.txt") for change in env.changes(installs)]
    assert not changes, _describe(changes, env)
    assert "peft" in {canonical(item["name"]) for item in installs}  # the check saw the requirements at all


@pypi
@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_each_requirements_line_changes_no_installed_package(fake_envs, env_name, tmp_path):
    """ComfyUI-Manager's way: `pip install <line>` for each line, each on what the lines before it installed."""
    env = fake_envs(env_name)
    changes = []
    for i, line in enumerate(requirement_lines()):
        installs = env.dry_run(line, report=tmp_path / f"report{i}.json")
        changes += [(*change, line) for change in env.changes(installs)]
        for item in installs:
            env.write(item)
    assert not changes, _describe(changes, env)


@pypi
@pytest.mark.parametrize("env_name", ENV_NAMES)
def test_uv_installs_change_no_installed_package(fake_envs, env_name):
    """uv's way: ComfyUI Desktop manages its Python with uv, and ComfyUI-Manager's `use_uv` and comfy-cli's
    `--fast-deps` install through it. The whole file, and each line alone on the environment as it was."""
    env = fake_envs(env_name)
    changes = [(*change, "-r requirements.txt") for change in env.uv_changes("-r", str(REPO / "requirements.txt"))]
    for line in requirement_lines():
        changes += [(*change, line) for change in env.uv_changes(line)]
    assert not changes, _describe(changes, env)


@pypi
def test_the_uv_check_sees_an_upgrade(fake_envs):
    """uv's output is read: an unbounded accelerate would replace the torch of a ComfyUI on torch 2.5.1 (accelerate
    1.16 requires torch>=2.6), which is why requirements.txt bounds it."""
    env = fake_envs("older")
    changed = {canonical(name): (old, new) for name, old, new in env.uv_changes("accelerate>=0.21")}
    assert changed["torch"][0] == "2.5.1" and changed["torch"][1] != "2.5.1"


@pypi
def test_the_check_sees_an_upgrade(fake_envs, tmp_path):
    """A line that needs a newer huggingface-hub than the environment's is reported, named and with its versions."""
    env = fake_envs("windows_portable_2026")
    installs = env.dry_run("huggingface-hub>=1.0", report=tmp_path / "report.json")
    changed = {canonical(name): (old, new) for name, old, new in env.changes(installs)}
    old, new = changed["huggingface-hub"]
    assert old == "0.36.2" and int(new.split(".")[0]) >= 1
    assert "huggingface-hub" in _describe([("huggingface-hub", old, new, "huggingface-hub>=1.0")], env)


def test_requirements_leave_comfyuis_packages_alone():
    """Nothing ComfyUI owns is listed (ComfyUI already requires what a run needs of them), and every line is a plain
    requirement: ComfyUI-Manager hands each line to pip as it is."""
    names = {canonical(re.match(r"[A-Za-z0-9._-]+", line).group(0)) for line in requirement_lines()}
    assert names.isdisjoint(OWNED_BY_COMFYUI)
    for line in requirement_lines():
        assert not line.startswith("-") and "#" not in line, line


def test_pyproject_dependencies_are_requirements_txt():
    """The Comfy Registry installs from pyproject.toml's dependencies, Manager and git clones from requirements.txt."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

    def normal(line: str) -> tuple:
        requirement = Requirement(line)
        return canonical(requirement.name), str(requirement.specifier), str(requirement.marker or "")

    assert sorted(map(normal, project["dependencies"])) == sorted(map(normal, requirement_lines()))


def test_environments_are_what_their_names_say():
    """The recorded environments hold the versions the tests are about (make_env.py regenerates them)."""
    for name, expected in (("windows_portable_0_33", {"torch": "2.13.0", "transformers": "5.15.1",
                                                      "huggingface-hub": "1.28.0", "safetensors": "0.8.0"}),
                           ("windows_portable_2026", {"torch": "2.8.0", "transformers": "4.57.1",
                                                      "huggingface-hub": "0.36.2", "safetensors": "0.6.2"}),
                           ("older", {"torch": "2.5.1", "transformers": "4.50.3", "numpy": "1.26.4"})):
        spec = json.loads((ENV_DIR / f"{name}.json").read_text())
        versions = {canonical(p["name"]): p["version"] for p in spec["packages"]}
        assert {key: versions.get(key) for key in expected} == expected
        assert spec["pip"] and all(p["requires_dist"] is not None for p in spec["packages"])
        # torch's own requirements are there too, or pip would add them (cu12's or cu13's, as torch's wheel names)
        assert any(name.startswith("nvidia-cudnn-cu") for name in versions)


def test_ci_installs_the_test_extra():
    """.ci/setup's TEST_PACKAGES are pyproject's `test` extra: the optional packages the tests use are installed."""
    setup = (REPO / ".ci" / "setup").read_text()
    listed = re.search(r"^TEST_PACKAGES=\((.*)\)$", setup, re.M).group(1).split()
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert sorted(map(canonical, listed)) == sorted(canonical(Requirement(line).name) for line in extra)
