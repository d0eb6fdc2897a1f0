"""How .ci/test's parallel run (pytest-xdist, `-n 2 --dist loadfile`) shares workers: tests/conftest.py's scheduler
keeps each file together, the whole realsize tier in one worker (never two ~14 GiB tests at once), and the server and
browser tests in one (one ComfyUI server)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest


def _conftest(request):
    return next(p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "worker_scope"))


def test_realsize_and_server_tests_share_a_scope_and_other_files_keep_theirs(request):
    scope = _conftest(request).worker_scope
    realsize = {scope("tests/realsize/test_realsize.py::test_sd15[fp16]"),
                scope("tests/realsize/test_validation_as_saved.py::test_x"),
                scope("tests/realsize/test_memory_plan_server.py::test_y")}
    server = {scope("tests/server/test_demo.py::test_a"), scope("tests/browser/test_browser.py::test_b[sd35_lora]"),
              scope("tests/server/test_workflows.py::test_c")}
    assert len(realsize) == 1 and len(server) == 1 and realsize != server
    assert scope("tests/comfy/test_monitor.py::test_a") == "tests/comfy/test_monitor.py"
    assert scope("tests/comfy/test_monitor.py::test_b[x::y]") == "tests/comfy/test_monitor.py"
    assert scope("tests/unit/test_policy.py::test_a") != scope("tests/unit/test_trainer.py::test_a")


def _scheduled(tmp_path, *folders: str) -> list[tuple[str, str]]:
    """(worker, test file) per test in the order the run reported them, through pytest-xdist itself (every test
    skipped as it starts: only the scheduling is looked at)."""
    pytest.importorskip("xdist")
    (tmp_path / "skip_every_test.py").write_text(
        "import pytest\n\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_setup(item):\n"
        "    pytest.skip('scheduling check only')\n")
    tests = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile", "-v", "-p", "skip_every_test",
         "-p", "no:cacheprovider", *(str(tests / folder) for folder in folders)],
        capture_output=True, text=True, cwd=tests.parent, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return re.findall(r"\[(gw\d+)\] .*SKIPPED (tests/\w+/\w+\.py)", result.stdout)


def test_the_two_long_scopes_start_first_on_different_workers(tmp_path):
    """The realsize tier and the server tests (the two longest scopes) are dealt first, one to each worker, so
    neither waits behind the other; xdist's own order (most tests first) gave both to one worker."""
    ran = _scheduled(tmp_path, "unit/test_policy.py", "server", "realsize", "unit/test_trainer.py")
    first_of = {worker: path.split("/")[1] for worker, path in reversed(ran)}  # each worker's first test's folder
    assert sorted(first_of.values()) == ["realsize", "server"], ran[:10]


def test_the_loadfile_run_puts_the_realsize_tier_on_one_worker(tmp_path):
    """The three realsize tier's files land on one worker, where plain loadfile spreads them over both."""
    tests = pathlib.Path(__file__).resolve().parent.parent
    ran = _scheduled(tmp_path, "realsize")
    files = {path for _, path in ran}
    tier = len(list((tests / "realsize").glob("test_*.py")))
    assert tier >= 3 and len([f for f in files if f.startswith("tests/realsize/")]) == tier, ran
    assert len({worker for worker, path in ran if path.startswith("tests/realsize/")}) == 1, ran
