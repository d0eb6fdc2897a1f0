"""Finding and importing a real ComfyUI for the integration tests.

Discovery order (the README says the same): $COMFYUI_PATH, then the ComfyUI whose custom_nodes/
holds this package, then comfy-cli's default workspace ~/comfy/ComfyUI. Nothing found: every
ComfyUI test skips with one line saying so. Found: they run for real, never mocked.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import pathlib
import shutil
import sys
import tempfile
import time

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _looks_like_comfyui(path: pathlib.Path) -> bool:
    return (path / "main.py").is_file() and (path / "comfy" / "model_management.py").is_file()


def find_comfyui() -> tuple[pathlib.Path | None, str]:
    """Return (path, how it was found) or (None, why none was found)."""
    env = os.environ.get("COMFYUI_PATH")
    if env:
        path = pathlib.Path(env).expanduser().resolve()
        if _looks_like_comfyui(path):
            return path, "COMFYUI_PATH"
        return None, f"COMFYUI_PATH={env} is not a ComfyUI checkout (no main.py / comfy/model_management.py)"
    parent = REPO_ROOT.parent
    if parent.name == "custom_nodes" and _looks_like_comfyui(parent.parent):
        return parent.parent, "the ComfyUI holding this package in custom_nodes/"
    default = pathlib.Path("~/comfy/ComfyUI").expanduser()
    if _looks_like_comfyui(default):
        return default.resolve(), "comfy-cli default workspace ~/comfy/ComfyUI"
    return None, "no ComfyUI found (set COMFYUI_PATH, or install one at ~/comfy/ComfyUI); ComfyUI tests skipped"


COMFYUI_PATH, COMFYUI_FOUND_BY = find_comfyui()


def register_module(name: str, path: pathlib.Path, package: bool = False):
    """The file `path` imported as module `name` (a package when `package`), once: how scripts run outside pytest
    (tests/realsize_worker.py, bench/gpu/suite.py) load this repo as `headroom`, as tests/conftest.py does."""
    if name in sys.modules:
        return sys.modules[name]
    locations = [str(path.parent)] if package else None
    spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
_BASE_DIR = None
BASE_PREFIX = "headroom-comfy-base-"
STALE_BASE_SECONDS = 12 * 3600  # far longer than any test process lives


def prune_stale_bases(root: str | os.PathLike | None = None, max_age_s: float = STALE_BASE_SECONDS) -> list[str]:
    """Remove the base directories of test processes that were killed before their atexit ran (a timeout, a kill, a
    process ending with os._exit): such leftovers, each with the real-size tier's GiB-sized checkpoints, filled a
    machine's disk until a later run's save failed with 'No space left on device'. Only ones untouched for
    `max_age_s`, so a base another test process is using is never touched. Returns the names removed."""
    removed = []
    for path in pathlib.Path(root or tempfile.gettempdir()).glob(BASE_PREFIX + "*"):
        try:
            if path.is_dir() and not path.is_symlink() and time.time() - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        except OSError:
            continue
    return removed


def import_comfyui_in_process() -> pathlib.Path:
    """Import ComfyUI's modules into this process, on the CPU, with a throw-away base directory.

    `args.cpu` must be set before comfy.model_management is first imported; the base directory
    keeps models/ output/ input/ of the test run out of the ComfyUI checkout.
    """
    global _BASE_DIR
    if COMFYUI_PATH is None:
        pytest.skip(COMFYUI_FOUND_BY)
    if _BASE_DIR is None:
        root = str(COMFYUI_PATH)
        if root not in sys.path:
            sys.path.insert(0, root)
        # ComfyUI's own `utils` / `app` packages must win over any same-named module.
        import comfy.options

        comfy.options.enable_args_parsing(False)
        from comfy.cli_args import args

        prune_stale_bases()
        _BASE_DIR = pathlib.Path(tempfile.mkdtemp(prefix=BASE_PREFIX))
        # Removed when the process ends: the real-size tier writes GiB-sized checkpoints here, and a base left
        # behind by every test process filled a CI machine's disk within a day.
        atexit.register(shutil.rmtree, _BASE_DIR, ignore_errors=True)
        args.cpu = True
        args.base_directory = str(_BASE_DIR)
        import comfy.model_management  # noqa: F401  (reads args.cpu at import)
        import folder_paths  # noqa: F401  (reads args.base_directory at import)
    return _BASE_DIR


@pytest.fixture(scope="session")
def comfyui() -> pathlib.Path:
    """A real ComfyUI imported in-process on the CPU; returns its throw-away base directory."""
    return import_comfyui_in_process()


@pytest.fixture
def cache_dir(comfyui, tmp_path) -> pathlib.Path:
    """A fresh headroom_cache folder for one test, put first the way extra_model_paths.yaml would."""
    import folder_paths

    path = str(tmp_path / "headroom_cache")
    folder_paths.add_model_folder_path("headroom_cache", path, is_default=True)
    yield pathlib.Path(path)
    folder_paths.folder_names_and_paths["headroom_cache"][0].remove(path)


@pytest.fixture(scope="session")
def headroom_nodes(comfyui):
    """Headroom's node modules, imported the way ComfyUI imports them (through the package)."""
    import headroom.nodes

    return headroom.nodes


# ComfyUI's own validation and PromptExecutor, in process: what the server does with a queued prompt, without the
# server. Tests that look at what a graph does as ComfyUI runs it (caching between queues, the UI text the editor
# receives, a cancel and queue again) go through these.
class NoClientServer:
    """What PromptExecutor needs from a PromptServer when no client is connected."""
    client_id = None
    last_node_id = None

    def send_sync(self, event, data, sid=None):
        pass


def register_nodes(monkeypatch, *node_lists) -> None:
    """Put these node classes (each a module's NODES list) into ComfyUI's NODE_CLASS_MAPPINGS for one test."""
    import nodes

    for node_list in node_lists:
        for node in node_list:
            monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, node.GET_SCHEMA().node_id, node)


def validate_prompt(prompt: dict, prompt_id: str = "test"):
    """ComfyUI's validate_prompt on a copy of `prompt`: (valid, error, outputs, node_errors)."""
    import asyncio
    import copy

    import execution

    return asyncio.run(execution.validate_prompt(prompt_id, copy.deepcopy(prompt), None))


def new_executor():
    """A fresh PromptExecutor (nothing cached from an earlier queue, as after a restart of ComfyUI)."""
    import execution

    return execution.PromptExecutor(NoClientServer(), cache_type=execution.CacheType.CLASSIC,
                                    cache_args={"lru": 0, "ram": 0.0, "ram_inactive": 0.0})


def queue_prompt(prompt: dict, prompt_id: str = "test", executor=None):
    """One queue of `prompt`: validated (it must be valid), then executed on `executor` (kept between queues, as the
    server keeps one) or a fresh one. Returns the executor: `success`, `status_messages`, `history_result`."""
    import copy

    valid, error, outputs, node_errors = validate_prompt(prompt, prompt_id)
    assert valid, (error, node_errors)
    executor = executor or new_executor()
    executor.execute(copy.deepcopy(prompt), prompt_id, {}, outputs)  # the server parses a fresh prompt each time
    return executor
