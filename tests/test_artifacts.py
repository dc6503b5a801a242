"""aerie.tools.artifacts.atomic_publish: the one way every output is published (mode, durability, no partial files)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from aerie.tools.artifacts import (
    atomic_publish,
    atomic_write_bytes,
    load_packed,
    publish_mode,
    save_packed,
    write_jsonl,
)


@pytest.fixture
def umask():
    """Set the process umask for one test and restore it afterwards."""
    old = os.umask(0o022)
    os.umask(old)

    def set_mask(mask: int) -> None:
        os.umask(mask)

    yield set_mask
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_published_files_follow_the_umask(tmp_path, umask, mask, expected) -> None:
    umask(mask)
    assert publish_mode() == expected
    atomic_write_bytes(tmp_path / "a.bin", b"x")
    save_packed(tmp_path / "b.safetensors", {"t": torch.arange(3)}, {"format": "test/1"})
    write_jsonl(tmp_path / "c.jsonl", [{"a": 1}])
    for name in ("a.bin", "b.safetensors", "c.jsonl"):
        assert _mode(tmp_path / name) == expected, name
    tensors, meta = load_packed(tmp_path / "b.safetensors", "test/1")
    assert tensors["t"].tolist() == [0, 1, 2] and meta["format"] == "test/1"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    target = tmp_path / "out.txt"
    target.write_text("old")

    def half_then_fail(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_publish(target, half_then_fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.txt"]


def test_file_and_folder_are_fsynced_before_and_after_the_rename(tmp_path, monkeypatch) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append("fsync dir" if os.path.isdir(target) else "fsync file")
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_write_bytes(tmp_path / "x", b"data")
    assert events == ["fsync file", "replace", "fsync dir"]
