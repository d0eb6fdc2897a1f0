"""A run's TensorBoard log (training/core/scalar_log.py), read back with TensorBoard's own reader."""
from __future__ import annotations

import logging
import os
import struct

import pytest

from headroom.training.core.scalar_log import FOLDER, ScalarLog, crc32c


def _read(run_path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (its EventAccumulator: CRCs checked, restarts purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run_path / FOLDER), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _f32(value: float) -> float:  # TensorBoard's simple_value is a float32
    return struct.unpack("<f", struct.pack("<f", value))[0]


def test_crc32c_is_castagnolis():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value
    assert crc32c(b"") == 0


def test_tensorboard_reads_the_curves_as_written(tmp_path):
    log = ScalarLog(tmp_path)
    written = {step: 1.0 / step for step in range(1, 8)}
    for step, loss in written.items():
        log.scalars(step, {"loss/train": loss, "learning_rate": 1e-4 * step, "memory/peak_gib": None,
                           "time/s_per_step": float("nan")})  # not measured / not finite: left out
    log.scalars(7, {"loss/validation": 0.25})
    curves = _read(tmp_path)
    assert set(curves) == {"loss/train", "learning_rate", "loss/validation"}
    assert curves["loss/train"] == [(step, _f32(loss)) for step, loss in written.items()]
    assert curves["learning_rate"] == [(step, _f32(1e-4 * step)) for step in written]
    assert curves["loss/validation"] == [(7, 0.25)]
    assert [p.name for p in (tmp_path / FOLDER).iterdir()] == [log.path.name] and "tfevents" in log.path.name


def test_a_damaged_record_is_refused_by_tensorboards_reader(tmp_path):
    """The reader checks each record's CRC, so the test above proves ours right."""
    from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader

    log = ScalarLog(tmp_path)
    log.scalars(1, {"loss/train": 0.5})
    data = bytearray(log.path.read_bytes())
    assert len(list(RawEventFileLoader(str(log.path)).Load())) == 3  # file version, session start, the scalars
    data[-6] ^= 0xFF  # a byte of the last record's data
    log.path.write_bytes(bytes(data))
    assert len(list(RawEventFileLoader(str(log.path)).Load())) == 2


def test_a_resumed_run_replaces_the_points_after_its_checkpoint(tmp_path):
    """Process 1 logs steps 1-6 and validation at 3, and stops; its last checkpoint was step 3. Process 2 resumes
    from it and validates first: TensorBoard shows steps 1-3 of the first and 4-6 of the second, each step once."""
    first = ScalarLog(tmp_path)
    for step in range(1, 7):
        first.scalars(step, {"loss/train": 1.0, **({"loss/validation": 1.0} if step == 3 else {})})
    second = ScalarLog(tmp_path, opened_at=3)
    assert second.path.name > first.path.name  # read after it
    second.scalars(3, {"loss/validation": 2.0})
    for step in range(4, 7):
        second.scalars(step, {"loss/train": 2.0})
    curves = _read(tmp_path)
    assert curves["loss/train"] == [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]
    assert curves["loss/validation"] == [(3, 1.0), (3, 2.0)]  # both validations of step 3: a later one is drawn


def test_no_file_is_held_open_between_steps(tmp_path):
    """Windows deletes no open file: the run folder can be removed while ComfyUI runs."""
    log = ScalarLog(tmp_path)
    log.scalars(1, {"loss/train": 0.5})
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert str(log.path) not in held


@pytest.mark.parametrize("obstacle", ["file", "symlink out"])
def test_a_log_that_cannot_be_written_never_stops_the_run(tmp_path, caplog, obstacle):
    """A file where the folder goes (an upload into output/), or a folder leading outside the run: one warning, no
    error, nothing written elsewhere; later steps do not try again."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    if obstacle == "file":
        (run / FOLDER).write_text("not a folder")
    else:
        (run / FOLDER).symlink_to(outside, target_is_directory=True)
    log = ScalarLog(run)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 4):
            log.scalars(step, {"loss/train": 0.5})
    assert log.broken and caplog.text.count("TensorBoard log") == 1 and "training goes on" in caplog.text
    assert list(outside.iterdir()) == []


def test_the_file_name_fits_in_the_run_folders_path_budget(tmp_path, monkeypatch):
    """Windows without long paths: a run's longest file path is checked when it opens (run_dir.LONGEST_INSIDE_RUN);
    the events file's name stays within it whatever the host is called, and uses no character Windows refuses."""
    import socket

    from headroom.training.core.run_dir import LONGEST_INSIDE_RUN

    monkeypatch.setattr(socket, "gethostname", lambda: "A-very:long*host?name<with>|odd\\characters.example.com")
    monkeypatch.setattr(os, "getpid", lambda: 4_294_967_295)  # Windows' largest process id
    log = ScalarLog(tmp_path)
    relative = log.path.relative_to(tmp_path).as_posix()
    assert len(relative) <= LONGEST_INSIDE_RUN and not set(log.path.name) & set('\\/:*?"<>|')
