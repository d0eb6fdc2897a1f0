"""A run's curves as a TensorBoard log: `<run folder>/tensorboard/`, so `tensorboard --logdir output/headroom_runs`
shows every run side by side, as kohya's sd-scripts (`--log_with tensorboard`), musubi-tuner and OneTrainer users
are used to. Loss, validation loss, learning rate, seconds per step and memory, one point per step.

Written by hand, without the `tensorboard` package: it pulls protobuf and grpcio into ComfyUI's Python, where other
node packs pin their own versions (installing must change none of a user's packages). What a scalar log needs of
its format is small: TFRecord framing (length and data, each with a masked CRC-32C) around `Event` messages in
protobuf's wire format (tensorflow/core/util/event.proto, summary.proto). tests/unit/test_scalar_log.py and
tests/comfy/test_run_tensorboard.py read the files back with TensorBoard's own reader, CRCs checked.

Cost: ~170 bytes and ~30 us a step (six scalars; measured on a 2-core VM), 1.7 MB for 10,000 steps.

Only written, never read: an upload into output/ can change nothing here. A log that cannot be written (disk full, a
file in the way) says so once in the log and is given up for the rest of the process: it never stops a run. Each
write opens, appends and closes, so between steps no file of the run is held open (Windows can then delete it).
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import pathlib
import re
import socket
import struct
import time

from ..data.files import display_path, is_within

log = logging.getLogger(__name__)

FOLDER = "tensorboard"
_OPENED = itertools.count()  # runs opened by this process: each its own file, even within one second


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)  # Castagnoli's polynomial, reflected
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (zlib's crc32 is another polynomial). A record is a few dozen bytes: a table in Python is enough."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tf_record(data: bytes) -> bytes:
    """One TFRecord: length (uint64), its masked CRC, the data, the data's masked CRC (all little-endian)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:  # wire type 2: length-delimited
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(step: int, wall_time: float, *, scalars: dict[str, float] | None = None, file_version: str | None = None,
          session_start: bool = False) -> bytes:
    """An Event message: wall_time (1, double), step (2, int64), file_version (3), summary (5: Summary.value (1):
    Value.tag (1), Value.simple_value (2, float)), session_log (7: SessionLog.status (1) START = 1)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
            for tag, value in scalars.items())
        out += _field_bytes(5, values)
    if session_start:
        out += _field_bytes(7, _varint(1 << 3) + _varint(1))
    return out


class ScalarLog:
    """The TensorBoard log of the run in `run_path`, opened at step `opened_at` (the step it resumed from, 0 for a
    new run): one events file per process (TensorBoard reads them in name order, which is time order)."""

    def __init__(self, run_path: str | os.PathLike, opened_at: int = 0):
        self.run_path = pathlib.Path(run_path)
        self.opened_at = opened_at
        self.folder = self.run_path / FOLDER
        # TensorBoard takes files whose name holds "tfevents"; time first, so a later process's file sorts after
        host = re.sub(r"[^A-Za-z0-9-]", "", socket.gethostname())[:20] or "host"  # a name on every OS
        name = f"events.out.tfevents.{int(time.time()):010d}.{host}.{os.getpid()}.{next(_OPENED):04d}"
        self.path = self.folder / name
        self.broken = False
        self._started = False

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """The finite ones of `values` at `step` (None: not measured here, e.g. VRAM on a CPU)."""
        kept = {tag: float(v) for tag, v in values.items() if v is not None and math.isfinite(float(v))}
        if kept and not self.broken:
            self._write(event(step, time.time(), scalars=kept))

    def _write(self, record: bytes) -> None:
        try:
            records = [record]
            if not self._started:
                self.folder.mkdir(exist_ok=True)
                if not is_within(self.folder, self.run_path) or os.path.lexists(self.path):
                    raise OSError(f"{display_path(self.folder)} leads outside the run folder, or its file exists")
                # This process trains on from the step after `opened_at`; an earlier process may have logged steps
                # past that checkpoint (a crash): TensorBoard drops its points from this session's start on.
                now = time.time()
                records = [event(0, now, file_version="brain.Event:2"),
                           event(self.opened_at + 1, now, session_start=True), record]
            with open(self.path, "ab") as file:  # binary: no newline translation on Windows
                file.write(b"".join(map(tf_record, records)))
            self._started = True
        except OSError as error:
            self.broken = True
            log.warning("Headroom: the run's TensorBoard log %s cannot be written (%s); training goes on without it",
                        display_path(self.path), error)
