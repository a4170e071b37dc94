"""check_offload against real folders, real psutil figures and a patched disk-usage reading."""
from __future__ import annotations

import os
import shutil
import tempfile
from collections import namedtuple
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

import oom_magic.render.units  # noqa: F401  (imported before any privilege drop below)
from oom_magic.common.errors import OomMagicError
from oom_magic.fit.offload import OffloadCheck, check_offload

MiB = 1 << 20
GiB = 1 << 30

_DiskUsage = namedtuple("_DiskUsage", "total used free")


@pytest.fixture
def disk_free_reading(monkeypatch):
    """A patched disk-usage reading (shutil.disk_usage), recording which path it was asked about."""
    asked: list[str] = []

    def install(free: int) -> list[str]:
        def fake_disk_usage(path):
            asked.append(os.fspath(path))
            return _DiskUsage(total=free * 2, used=free, free=free)

        monkeypatch.setattr(shutil, "disk_usage", fake_disk_usage)
        return asked

    return install


def test_existing_folder_with_room(tmp_path, disk_free_reading):
    asked = disk_free_reading(50 * GiB)
    check = check_offload(1 * MiB, 10 * GiB, tmp_path)
    assert isinstance(check, OffloadCheck)
    assert check.folder == tmp_path
    assert check.folder_exists and check.folder_creatable
    assert check.disk_free == 50 * GiB
    assert asked == [str(tmp_path)]
    assert check.ram_available is not None and check.ram_available > 0
    assert check.shortfalls == () and check.ok
    assert repr(check) == f"OffloadCheck({str(tmp_path)!r}, ok)"


def test_real_readings_without_patches(tmp_path):
    check = check_offload(0, 1, tmp_path)
    assert check.ok
    assert abs(check.disk_free - shutil.disk_usage(tmp_path).free) < 256 * MiB
    assert abs(check.ram_available - psutil.virtual_memory().available) < 512 * MiB


def test_missing_folder_counts_as_creatable_and_is_not_created(tmp_path, disk_free_reading):
    asked = disk_free_reading(50 * GiB)
    folder = tmp_path / "offload" / "llama" / "shards"
    check = check_offload(0, 1 * GiB, str(folder))
    assert check.folder == folder
    assert not check.folder_exists
    assert check.folder_creatable
    assert check.ok
    assert not (tmp_path / "offload").exists()
    assert asked == [str(tmp_path)]  # free space where the folder would be created


def test_disk_shortfall_says_by_how_much(tmp_path, disk_free_reading):
    disk_free_reading(10 * GiB)
    check = check_offload(0, 12 * GiB, tmp_path / "off")
    assert check.shortfalls == (
        f"disk at {tmp_path}: the plan offloads 12.00 GiB but only 10.00 GiB is free; short by 2.00 GiB",
    )
    assert not check.ok


def test_ram_shortfall_from_a_patched_psutil_reading(tmp_path, monkeypatch, disk_free_reading):
    """psutil's figure patched (a fake reading: available = 8 GiB) to pin the message exactly."""
    disk_free_reading(100 * GiB)
    reading = namedtuple("svmem", "total available")(64 * GiB, 8 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading)
    check = check_offload(9 * GiB + 512 * MiB, 5 * GiB, tmp_path)
    assert check.ram_available == 8 * GiB
    assert check.shortfalls == (
        "CPU RAM: the plan keeps 9.50 GiB in RAM but only 8.00 GiB is available; short by 1.50 GiB",
    )


def test_ram_shortfall_with_the_real_reading(tmp_path):
    check = check_offload(1 << 60, 0, tmp_path)
    assert len(check.shortfalls) == 1
    line = check.shortfalls[0]
    assert line.startswith("CPU RAM: the plan keeps 1048576.00 TiB in RAM but only ")
    assert " is available; short by " in line


def test_both_fall_short(tmp_path, monkeypatch, disk_free_reading):
    disk_free_reading(1 * GiB)
    reading = namedtuple("svmem", "total available")(4 * GiB, 2 * GiB)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading)
    check = check_offload(3 * GiB, 2 * GiB, tmp_path)
    assert [line.split(":")[0] for line in check.shortfalls] == [f"disk at {tmp_path}", "CPU RAM"]


def test_parent_is_a_file(tmp_path, disk_free_reading):
    disk_free_reading(100 * GiB)
    blocker = tmp_path / "weights.bin"
    blocker.write_bytes(b"x")
    check = check_offload(0, 1 * GiB, blocker / "offload")
    assert not check.folder_exists and not check.folder_creatable
    assert check.shortfalls == (
        f"offload folder {blocker / 'offload'} cannot be created: {blocker} is a file, not a folder",
    )


def test_folder_is_a_file(tmp_path, disk_free_reading):
    disk_free_reading(100 * GiB)
    blocker = tmp_path / "offload"
    blocker.write_bytes(b"x")
    check = check_offload(0, 1 * GiB, blocker)
    assert not check.folder_exists and not check.folder_creatable
    assert check.shortfalls == (f"offload folder {blocker} is a file, not a folder: choose another offload_folder",)


def test_folder_problems_matter_only_when_something_goes_to_disk(tmp_path, disk_free_reading):
    disk_free_reading(0)
    blocker = tmp_path / "weights.bin"
    blocker.write_bytes(b"x")
    check = check_offload(1 * MiB, 0, blocker / "offload")
    assert not check.folder_creatable
    assert check.ok


def test_unreadable_disk_usage_is_unknown_not_short(tmp_path, monkeypatch):
    def broken(path):
        raise PermissionError(13, "Permission denied", os.fspath(path))

    monkeypatch.setattr(shutil, "disk_usage", broken)
    check = check_offload(0, 1 << 50, tmp_path)
    assert check.disk_free is None
    assert check.ok


def test_home_is_expanded(tmp_path, monkeypatch, disk_free_reading):
    disk_free_reading(100 * GiB)
    monkeypatch.setenv("HOME", str(tmp_path))
    check = check_offload(0, 1, "~/offload")
    assert check.folder == tmp_path / "offload"
    assert check.folder_creatable


@contextmanager
def _as_nobody():
    """Run a block as uid/gid 65534 when the tests run as root (root may write anywhere)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_unwritable_parent_is_not_creatable(disk_free_reading):
    """A real read-only directory (mode 555); as root the check runs with uid 65534's rights."""
    disk_free_reading(100 * GiB)
    base = Path(tempfile.mkdtemp(prefix="oom-magic-offload-", dir="/tmp"))
    try:
        base.chmod(0o755)
        locked = base / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        with _as_nobody():
            missing = check_offload(0, 1 * GiB, locked / "offload")
            existing = check_offload(0, 1 * GiB, locked)
        assert not missing.folder_exists and not missing.folder_creatable
        assert missing.shortfalls == (
            f"offload folder {locked / 'offload'}: {locked} is not writable, so the folder cannot be "
            "created by this process",
        )
        assert existing.folder_exists and not existing.folder_creatable
        assert existing.shortfalls == (f"offload folder {locked}: {locked} is not writable by this process",)
    finally:
        (base / "locked").chmod(0o755)
        shutil.rmtree(base)


@pytest.mark.parametrize("args", [(-1, 0), (0, -1), (1.5, 0), (0, "1GiB"), (True, 0)])
def test_bad_plan_figures(tmp_path, args):
    with pytest.raises(OomMagicError):
        check_offload(*args, tmp_path)
