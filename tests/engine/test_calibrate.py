"""The host's measured limits (engine/calibrate.py): the read bandwidth the rooflines divide by."""

from __future__ import annotations

import os

import pytest

from engine import calibrate, kernels


def test_the_largest_cache_is_read_from_the_sizes_sysfs_reports(tmp_path):
    for index, size in enumerate(["48K", "2048K", "491520K", "1M", "junk", ""]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    (tmp_path / "index9").mkdir()  # a level without a size file
    assert calibrate.largest_cache_bytes(tmp_path) == 491520 << 10
    (tmp_path / "index3" / "size").write_text("1G\n")
    assert calibrate.largest_cache_bytes(tmp_path) == 1 << 30
    assert calibrate.largest_cache_bytes(tmp_path / "absent") == 0


@pytest.mark.parametrize("cache_bytes,want", [(0, 512 << 20), (32 << 20, 512 << 20), (480 << 20, 1920 << 20)])
def test_the_bandwidth_buffer_is_four_times_the_largest_cache_within_an_eighth_of_memory(monkeypatch, cache_bytes,
                                                                                        want):
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(calibrate, "largest_cache_bytes", lambda: cache_bytes)
    assert calibrate.bandwidth_buffer_bytes() == min(want, memory // 8)
    monkeypatch.setattr(calibrate, "largest_cache_bytes", lambda: memory)  # a cache as large as memory: capped
    assert calibrate.bandwidth_buffer_bytes() == memory // 8


def test_the_read_bandwidth_is_the_fastest_of_the_reads_it_times(monkeypatch, tmp_path):
    """memory_bandwidth_gbps times PyTorch's sum and the kernels' stream_read both ways on one buffer and
    keeps the fastest: each read is timed (a read that is not left out), and the figure is its rate. (A
    small buffer, partly cached: its figure is kept in a calibration store of its own.)"""
    monkeypatch.setattr(calibrate, "bandwidth_buffer_bytes", lambda: 64 << 20)
    monkeypatch.setenv("MOETUNE_CACHE", str(tmp_path))
    native = kernels.load()
    assert native is not None, kernels.status()["error"]
    calls: list[str] = []
    real = native.stream_read

    class Ops:  # the kernels' ops, each stream_read recorded with the way it read
        def __getattr__(self, name):
            return getattr(native, name)

        def stream_read(self, buf, ahead=True):
            calls.append("ahead" if ahead else "plain")
            return real(buf, ahead)

    monkeypatch.setattr(kernels, "load", lambda: Ops())
    gbps = calibrate.memory_bandwidth_gbps(fresh=True)
    assert calls.count("plain") == calls.count("ahead") == 6  # a warm-up and five timed reads each
    assert 1.0 < gbps < 10_000.0
    assert calibrate.memory_bandwidth_gbps() == gbps  # kept for this machine and thread count
