"""Give the C heap's free pages back to the operating system between the phases of an iteration.

A CPU training iteration alternates two allocation patterns: rollouts (KV caches that grow by a few
tokens per decode step, prefix-pool entries of every size) and the update (activations and gradients of
whole micro-batches). PyTorch's CPU allocator is the C library's ``malloc``; glibc serves blocks below its
mmap threshold from heap arenas, and raises that threshold up to 32 MiB once a large mmapped block is freed
(glibc manual, "Memory Allocation Tunables", M_MMAP_THRESHOLD), so after the first update most tensors of
this model come from the arenas. Freed arena memory stays in the process: the resident set keeps the
update's high-water mark, and rollouts whose blocks do not fit the fragmented free lists grow it further.

`release_free_heap` calls glibc's ``malloc_trim(0)``, which returns every whole free page of every arena
to the kernel (``madvise(MADV_DONTNEED)``; glibc ≥ 2.8, malloc_trim(3)). It changes no tensor and no result;
it only lowers the resident set between phases, so a phase does not start on the previous phase's leftovers.
It cannot lower a phase's own peak: measured with `benchmarks/heap_trim.py` (cpu-smoke, 2 iterations), the
rollouts started at 1.27 GiB instead of 4.68, while the process peak stayed the update's (benchmarks/RESULTS.md,
"Free heap pages back to the OS between rollouts and update"). `training.loop` also calls it after each task's
group of rollouts, whose KV blocks differ in size from group to group: on the main job's three iterations this
lowered the third iteration's rollout peak from 7.64 to 6.65 GiB for +3 % time (RESULTS.md, "Micro-batches
bounded by tokens"). A local main job runs every stage in one process, so each stage's freed heap is released when
it ends (`tasks.resources.timed`, `envace train`) and the evaluation releases each compared model's: after
validate, 3.1 GiB were resident with no live tensor, 1.0 GiB after the trim. Not after every SFT step: there it
lowered the warm start's peak by 0.36 GiB (6.97 → 6.61) for 22 % more time, its pages faulted in again each step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` as a ctypes function, or None (musl, macOS, Windows: no such call)."""
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def release_free_heap() -> bool:
    """Collect Python garbage (so tensors held only by reference cycles are freed), then return the C
    heap's free pages to the OS with glibc's ``malloc_trim(0)``.

    Returns:
        True when glibc released memory, False when there was nothing to release or the C library has no
        ``malloc_trim`` (then this is only ``gc.collect()``). Never raises.
    """
    gc.collect()
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
