"""`training.heap.release_free_heap`: free arena pages go back to the OS; without glibc it is only gc."""

import sys

import pytest

from envace_core.training import heap


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None,
                    reason="glibc's malloc_trim (Linux) is what this checks")
def test_fragmented_free_arena_pages_are_returned_to_the_os():
    # 64 KiB blocks sit below glibc's mmap threshold, so they come from the heap; keeping every 16th
    # alive pins the heap's top, so free() alone cannot shrink it (only trim can give the holes back)
    blocks = [bytearray(64 * 1024) for _ in range(3200)]  # ≈ 200 MiB, written (bytearray zero-fills)
    pinned = blocks[::16]
    del blocks
    before = _rss_bytes()
    assert heap.release_free_heap() is True
    after = _rss_bytes()
    assert before - after > 100 * 2**20, f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB"
    assert all(len(b) == 64 * 1024 for b in pinned)  # what is still referenced is untouched


def test_without_malloc_trim_it_only_collects_garbage(monkeypatch):
    collected = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    monkeypatch.setattr(heap.gc, "collect", lambda: collected.append(1) or 0)
    assert heap.release_free_heap() is False
    assert collected == [1]
