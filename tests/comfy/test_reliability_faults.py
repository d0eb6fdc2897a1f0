"""Fault tests: kill -9 at random points of caching, training and checkpoint writing, and a full disk in every
write path (issue 13).

Kills: real processes with the real ComfyUI imported (tests/fault_worker.py forks them from one process that
imported it once), killed with SIGKILL at seeded random times (HEADROOM_FAULT_SEED reproduces a run's schedule).
After every kill: every file parses (strict JSON, safetensors, weights-only torch files); the next process resumes
from what is on disk; what was lost is bounded by the commit / checkpoint interval; and finally the interrupted runs
end bitwise where uninterrupted ones end.

Full disk: every write path meets a real ENOSPC (tests/disk_full_cases.py); where this test may mount (root, or an
unprivileged user namespace), also on a real, small tmpfs.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import select
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open

from comfy_harness import COMFYUI_FOUND_BY, COMFYUI_PATH

pytestmark = pytest.mark.comfyui

TESTS = pathlib.Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("HEADROOM_FAULT_SEED", "1313"))
KILLS: list[dict] = []  # every kill of this session, for the summary


class Zygote:
    """tests/fault_worker.py: forks job processes on request."""

    def __init__(self, base: pathlib.Path):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.base = base
        self.process = subprocess.Popen([sys.executable, str(TESTS / "fault_worker.py"), str(base)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(base / "zygote.err", "w"),
                                        text=True, env=env)
        self._read(timeout=300)

    def _read(self, timeout: float) -> dict:
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.process.kill()
            raise RuntimeError(f"fault worker did not answer: {(self.base / 'zygote.err').read_text()[-3000:]}")
        return json.loads(line)

    def _call(self, timeout: float = 60, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read(timeout)

    def start(self, job: str, log: pathlib.Path, **args) -> int:
        return self._call(op="start", job=job, log=str(log), args=args)["pid"]

    def wait(self, pid: int, timeout: float = 600) -> dict:
        return self._call(op="wait", pid=pid, timeout=timeout)

    def run(self, job: str, log: pathlib.Path, **args) -> list[dict]:
        """A job to its end (no kill): its log events; a job's error fails the test with its traceback."""
        status = self.wait(self.start(job, log, **args))
        events = read_log(log)
        errors = [e["traceback"] for e in events if e["e"] == "error"]
        assert status["code"] == 0 and not errors, f"{job} failed: {status} {errors} {_out(log)}"
        return events

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.process.stdin.flush()
            self.process.wait(timeout=30)
        if self.process.poll() is None:
            self.process.kill()


def read_log(path: pathlib.Path) -> list[dict]:
    """A job's events; a line cut by the kill (no newline yet) is not an event."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _out(log: pathlib.Path) -> str:
    out = pathlib.Path(str(log) + ".out")
    return out.read_text()[-3000:] if out.exists() else ""


def kill_after(zygote: Zygote, pid: int, delay: float, watch=None, then: float = 0.0) -> float:
    """SIGKILL `pid` after `delay` seconds (and, with `watch`, once `watch()` is true and `then` seconds more);
    returns the kill's time."""
    time.sleep(delay)
    if watch is not None:
        deadline = time.monotonic() + 60
        while not watch() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(then)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    status = zygote.wait(pid)
    assert status["signal"] == signal.SIGKILL, f"job {pid} ended before the kill: {status}"
    return killed_at


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    if COMFYUI_PATH is None:
        pytest.skip(COMFYUI_FOUND_BY)
    base = tmp_path_factory.mktemp("faults")
    worker = Zygote(base)
    yield worker
    worker.close()
    if KILLS:
        print(f"\nkill -9 summary (seed {SEED}): {len(KILLS)} kills: " + json.dumps(KILLS))


# --- caching --------------------------------------------------------------------------------------------------
COMMIT_SECONDS, ITEM_SECONDS = 0.3, 0.01


def check_cache(cache_dir: pathlib.Path) -> int:
    """Every file of the cache parses and every listed entry verifies; no temp is left once it is opened.
    Returns the number of entries."""
    from headroom.training.data.cache_store import ShardStore
    from headroom.training.data.files import read_json

    store = ShardStore(cache_dir)  # opening removes what the killed writer left
    if (cache_dir / "manifest.json").exists():
        read_json(cache_dir / "manifest.json", "manifest")  # strict JSON, whole
    good, problems = store.verify(list(store.entries))
    assert not problems and good == set(store.entries), problems
    for shard in (cache_dir / "shards").glob("*"):
        assert not shard.name.startswith("."), f"temp left after open: {shard.name}"
        with safe_open(str(shard), framework="pt") as handle:  # listed or not, every shard is a whole file
            for name in handle.keys():
                handle.get_tensor(name)
    return len(store.entries)


def test_kill_during_caching_loses_at_most_the_commit_interval(zygote, tmp_path):
    rng = random.Random(SEED)
    cache_dir = tmp_path / "cache"
    items = 600
    committed = 0
    for kill in range(8):
        log = tmp_path / f"cache_{kill}.log"
        pid = zygote.start("cache", log, items=items, cache_dir=str(cache_dir), commit_seconds=COMMIT_SECONDS,
                           item_seconds=ITEM_SECONDS)
        killed_at = kill_after(zygote, pid, rng.uniform(0.3, 1.2))
        events = read_log(log)
        encoded = [e["t"] for e in events if e["e"] == "encoded"]
        now = check_cache(cache_dir / "latents")
        new = now - committed
        # An entry waits at most COMMIT_SECONDS (plus the next item's encoding) before its commit; slack for a
        # busy machine (the flush itself, scheduling).
        bound = COMMIT_SECONDS + 2 * ITEM_SECONDS + 0.5
        must_have = sum(1 for t in encoded if t <= killed_at - bound)
        assert must_have <= new <= len(encoded), (kill, must_have, new, len(encoded))
        KILLS.append({"job": "cache", "encoded": len(encoded), "committed": new, "lost": len(encoded) - new,
                      "lost_s": round(killed_at - encoded[new - 1], 2) if new and new <= len(encoded) else None})
        committed = now
    assert 0 < committed < items, "the kills should land mid-way through the caching"
    events = zygote.run("cache", tmp_path / "cache_final.log", items=items, cache_dir=str(cache_dir),
                        commit_seconds=COMMIT_SECONDS, item_seconds=0.0)
    assert sum(e["e"] == "encoded" for e in events) == items - committed  # resumed: only the rest is encoded
    assert check_cache(cache_dir / "latents") == items

    # The same items cached without a kill: the same entries, bit for bit.
    zygote.run("cache", tmp_path / "cache_straight.log", items=items, cache_dir=str(tmp_path / "straight"),
               commit_seconds=COMMIT_SECONDS, item_seconds=0.0)
    _assert_same_cache(cache_dir / "latents", tmp_path / "straight" / "latents")


def _assert_same_cache(one: pathlib.Path, other: pathlib.Path) -> None:
    from headroom.training.data.cache_store import ShardStore

    first, second = ShardStore(one), ShardStore(other)
    assert set(first.entries) == set(second.entries)
    for key, entry in first.entries.items():
        assert entry["tensors"] == second.entries[key]["tensors"]  # sha256 of every tensor's bytes


# --- training and checkpoint writing --------------------------------------------------------------------------------
def check_run(run_dir: pathlib.Path) -> int:
    """Every file of a run folder parses and the checkpoint latest.json names loads; no temp left once the run
    opens (checked after the next job opened it). Returns the saved step (0 without a checkpoint)."""
    from headroom.training.data.files import read_json
    from headroom.training.core.run_dir import RunDir

    for path in [run_dir / "config.json", run_dir / "memory_record.json", run_dir / "latest.json",
                 *run_dir.glob("checkpoints/step_*/trainer.json")]:
        if path.exists():
            read_json(path, path.name)
    for folder in run_dir.glob("checkpoints/step_*"):
        with safe_open(str(folder / "adapter.safetensors"), framework="pt") as handle:
            [handle.get_tensor(name) for name in handle.keys()]
        for name in ("optimizer.pt", "rng.pt"):
            torch.load(folder / name, weights_only=True)
    checkpoint = RunDir(run_dir.parent, run_dir.name).load_checkpoint()
    return 0 if checkpoint is None else checkpoint.step


def temp_entries(run_dir: pathlib.Path) -> list[str]:
    return [p.name for folder in (run_dir, run_dir / "checkpoints") if folder.exists()
            for p in folder.iterdir() if ".hrtmp-" in p.name]


def kill_training(zygote, tmp_path, run_name: str, kills: int, rng: random.Random, lost_steps_bound=None,
                  lost_seconds_bound=None, targeted: bool = False, **cadence) -> int:
    """`kills` jobs training `run_name`, each resuming the last and killed at a random point; returns its step."""
    run_dir = zygote.base / "output" / "headroom_runs" / run_name
    saved = check_run(run_dir) if run_dir.exists() else 0
    landed_in_write = 0
    for kill in range(kills):
        log = tmp_path / f"{run_name}_{kill}.log"
        pid = zygote.start("train", log, run_name=run_name, steps=100_000, **cadence)
        watch = None
        if targeted:  # then wait for a checkpoint being written (its temp folder), and kill somewhere inside it
            seen_before = set(temp_entries(run_dir))
            watch = lambda: bool(set(temp_entries(run_dir)) - seen_before)  # noqa: E731
        killed_at = kill_after(zygote, pid, rng.uniform(1.0, 3.5) if not targeted else rng.uniform(0.3, 2.0), watch,
                               then=rng.uniform(0.0, 0.02))
        mid_write = bool(temp_entries(run_dir))
        landed_in_write += mid_write
        events = read_log(log)
        opened = [e["step"] for e in events if e["e"] == "opened"]
        steps = [e for e in events if e["e"] == "step"]
        if opened:  # the job got as far as opening the run: it resumed exactly where the disk said
            assert opened[0] == saved, (kill, opened, saved)
        now = check_run(run_dir)
        assert now >= saved
        last = steps[-1]["step"] if steps else saved
        if lost_steps_bound is not None:
            assert last - now <= lost_steps_bound, (kill, last, now)
        if lost_seconds_bound is not None:  # every step finished this long before the kill is on disk
            must_have = max([e["step"] for e in steps if e["t"] <= killed_at - lost_seconds_bound], default=saved)
            assert now >= must_have, (kill, must_have, now)
        KILLS.append({"job": f"train {run_name}", "at_step": last, "saved": now, "lost_steps": last - now,
                      "mid_write": mid_write})
        saved = now
    if targeted:
        assert landed_in_write >= 2, f"only {landed_in_write} of {kills} kills landed inside a checkpoint write"
    return saved


def _latest(run_dir: pathlib.Path):
    from headroom.training.core.run_dir import RunDir

    return RunDir(run_dir.parent, run_dir.name).load_checkpoint()


def test_kill_during_training_and_checkpoint_writes_loses_at_most_the_interval(zygote, tmp_path):
    rng = random.Random(SEED + 1)
    every = 4
    by_steps = kill_training(zygote, tmp_path, "killed_steps", 6, rng, lost_steps_bound=every, checkpoint_every=every)
    # By time: 0.01 minutes = 0.6 s; a step here takes ~0.1 s, a checkpoint write less; slack for a busy machine.
    by_time = kill_training(zygote, tmp_path, "killed_minutes", 4, rng, lost_seconds_bound=0.6 + 1.0,
                            checkpoint_minutes=0.01)
    writes = kill_training(zygote, tmp_path, "killed_writes", 8, rng, lost_steps_bound=1, targeted=True,
                           checkpoint_every=1)
    assert min(by_steps, by_time, writes) > 0, "the kills should land after some training"

    # Each interrupted run, continued to the same step, ends bitwise where an uninterrupted run ends.
    target = max(by_steps, by_time, writes) + 2
    zygote.run("train", tmp_path / "straight.log", run_name="straight", steps=target)
    runs = zygote.base / "output" / "headroom_runs"
    straight = _latest(runs / "straight")
    for name in ("killed_steps", "killed_minutes", "killed_writes"):
        events = zygote.run("train", tmp_path / f"{name}_final.log", run_name=name, steps=target, checkpoint_every=1)
        assert temp_entries(runs / name) == [], "opening the run removes the killed writers' temp folders"
        resumed = _latest(runs / name)
        assert resumed.step == straight.step == target, events[-1]
        assert resumed.adapter.keys() == straight.adapter.keys()
        for key, value in straight.adapter.items():
            assert torch.equal(resumed.adapter[key], value), f"{name}: {key} differs from the straight run"
        assert resumed.loss_history == straight.loss_history


# --- full disk ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def disk_full_context(comfyui):
    import disk_full_cases
    from test_train_lora_nodes import _data

    from headroom.training.data.synthetic import generate_shapes

    model, clip, vae, latents, texts = _data("sd15")
    return disk_full_cases.Context(model, clip, vae, latents, texts, generate_shapes(3, 32, 5).images, base=comfyui)


def _case_names():
    import disk_full_cases

    return [case.name for case in disk_full_cases.CASES if case.injected]


@pytest.mark.parametrize("name", _case_names())
def test_injected_enospc_in_every_write_path(disk_full_context, monkeypatch, name):
    import disk_full_cases
    from faults import disk_full_for

    case = next(c for c in disk_full_cases.CASES if c.name == name)

    @contextlib.contextmanager
    def full(case):
        injected = disk_full_for(monkeypatch, case.pattern)
        yield
        monkeypatch.undo()
        assert injected, f"{case.name}: no file named like {case.pattern!r} was written"

    disk_full_cases.run_case(case, disk_full_context, full)


def test_disk_full_on_a_real_tmpfs(zygote, tmp_path):
    """The scenarios whose target is the first write, on a real tmpfs that is full (root, or a user namespace)."""
    import disk_full_cases

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (run as root, e.g. in CI's container); the injected ENOSPC "
                    "test covers every write path without it")
    log = tmp_path / "tmpfs.log"
    zygote.run("disk_full", log, mount=str(zygote.base / "fullfs"), size="6m", base=str(zygote.base))
    events = read_log(log)
    skipped = [e["reason"] for e in events if e["e"] == "skip"]
    if skipped:
        pytest.skip(f"no tmpfs could be mounted here: {skipped[0]}")
    cases = {e["name"]: e for e in events if e["e"] == "case"}
    assert sorted(cases) == sorted(disk_full_cases.TMPFS_CASES)
    failed = {name: e["message"] for name, e in cases.items() if not e["ok"]}
    assert not failed, failed
    for event in cases.values():  # a real full disk: the message says how much is needed and how little is free
        assert "is free there" in event["message"], event["message"]
