"""Several rollouts in lockstep over one engine: their concurrent `generate` calls become one batch.

An iteration rolls out one GRPO group per task (`training.loop.roll_out`), each group a lockstep of G
trajectories. Run one after another, every group's turn is its own engine call of G rows; decoding on a
CPU is bound by reading the weights once per step and by per-step Python work, both paid per call, so
three groups of four pay them three times for the same tokens. `MergingEngine.map` runs the groups in
threads (one per group) and, each time every live worker is waiting in `generate`, runs the waiting calls
in its own thread (the only one that ever enters the wrapped engine) as one call per compatible set of sampling
settings (`merge_key`: all fields but the seeds, the token budgets and the per-prompt constraints; e.g.
REHEARSE calls with different token budgets share one call). Each merged prompt keeps its own call's
randomness through `SamplingParams.prompt_seeds` and its own call's budget through
`SamplingParams.prompt_max_new_tokens`, so a worker's completions are those its call would have got alone
(up to float rounding of a different batch shape), and results do not depend on how workers were grouped:
same seeds, same rollouts.

This is the continuous-batching idea of vLLM's scheduler (many requests, one forward per step) applied
at the granularity of whole calls, for the transformers engine; with `engines.vllm` it only makes calls
larger.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from envace_core.engines.base import (
    Completion,
    Engine,
    SamplingParams,
    check_constraints,
    check_prompt_seeds,
    prompt_budgets,
    with_prompt_budgets,
)

T = TypeVar("T")


def merge_key(params: SamplingParams) -> tuple:
    """What two calls must share to be one call: every `SamplingParams` field except the seeds, the token
    budgets and the per-prompt constraints (the merged call carries each prompt's own), and the
    stop predicate's type (predicates are compared by type: `roles.json_prefix.NotJsonStop` holds no
    per-call state)."""
    base = replace(params, seed=None, prompt_seeds=None, stop_when=None, constraints=None, max_new_tokens=0,
                   prompt_max_new_tokens=None,
                   stop_token_ids=tuple(int(t) for t in params.stop_token_ids))  # a list is allowed too
    return base, type(params.stop_when)


@dataclass
class _Call:
    worker: int
    prompts: list[list[int]]
    params: SamplingParams
    result: list[list[Completion]] | None = None
    error: BaseException | None = None
    done: bool = False
    seeds: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    budgets: tuple[int, ...] = field(default_factory=tuple)


class MergingEngine:
    """An `Engine` over `engine` for `map`'s worker threads (module docstring). Attributes other than
    `generate` and `map` are the wrapped engine's (`tokenizer`, `stats`, `model`, ...).

    Outside `map` (no workers), `generate` is the wrapped engine's. While `map` runs, only its workers
    may call `generate` (another thread's call raises RuntimeError), and workers must not wait for each
    other: a worker blocked on another worker's progress, outside `generate`, stalls every worker for
    good (the merged call waits for it).

    Attributes:
        merged_calls: engine calls made for the workers; ``calls_in``: worker calls they served.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cond = threading.Condition()
        self._alive: set[int] = set()
        self._waiting: dict[int, _Call] = {}
        self._local = threading.local()
        self._owner: int | None = None  # the thread running `map`
        self._claims: set[int] = set()  # workers waiting for their next item
        self._given: dict[int, int | None] = {}  # worker -> index of its next item (None: no more)
        self._next, self._stop = 0, False
        self._closed: BaseException | None = None  # set when map's own thread failed: workers stop waiting
        self.merged_calls = 0
        self.calls_in = 0

    def __getattr__(self, name: str) -> Any:  # only called for attributes not found on self
        return getattr(self.__dict__["engine"], name)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ workers
    def map(self, fn: Callable[[Engine, T], Any], items: Sequence[T], workers: int | None = None,
            on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
        """``[fn(self, item) for item in items]`` in worker threads, their `generate` calls merged.

        workers: how many items run at once (None: all). A worker that finishes an item takes the next one
            not yet started, in `items` order. Items are handed out only while every live worker waits (in
            `generate` or for an item), so which items run together, and so every merged call, does not
            depend on thread timing. 1 (or a single item): ``fn(wrapped engine, item)`` in the calling
            thread, one item after another.
        on_result: ``on_result(index, result)`` in the worker's thread after each item that returned (e.g. to
            append it to a cache file as soon as it is done); an exception from it counts as the item's.

        The wrapped engine runs only in the thread that called `map`: every torch call of a merged batch
        comes from one thread, so one OpenMP team does the work (a team per calling thread would spin
        against the others for the same cores). Meanwhile a wrapped engine's ``max_batch_size`` (rows per decode
        forward) and its prefix KV pool (``prefix_pool``, `engines.prefix_cache.PrefixPool`: ``max_tokens``)
        hold that much per worker, so a merged turn is not cut back into one batch per worker (8 held-out
        episodes at parallel:4, 8 at a time: 16.9 s per episode at 8 rows, 14.0 at 32). Returns the results in
        `items` order. Once any call of `fn` raises, no further item starts, and the first exception (in
        `items` order) is raised after every thread has ended; an exception in the calling thread (e.g.
        KeyboardInterrupt) fails every waiting call and is raised once the workers have ended. Not
        re-entrant: one `map` at a time.
        """
        items = list(items)
        if getattr(self._local, "worker", None) is not None:
            raise RuntimeError("MergingEngine.map called from one of its own workers: a worker's calls are "
                               "already merged; call fn for its items directly")
        n_threads = len(items) if workers is None else min(int(workers), len(items))
        if workers is not None and int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if n_threads <= 1:
            out = []
            for i, item in enumerate(items):
                out.append(fn(self.engine, item))
                if on_result is not None:
                    on_result(i, out[-1])
            return out
        results: list[Any] = [None] * len(items)
        errors: list[BaseException | None] = [None] * len(items)
        with self._cond:
            if self._alive:
                raise RuntimeError("MergingEngine.map is already running")
            self._alive, self._owner = set(range(n_threads)), threading.get_ident()
            self._claims, self._given, self._next, self._stop, self._closed = set(), {}, 0, False, None

        def work(k: int) -> None:
            self._local.worker = k
            try:
                while (i := self._claim(k)) is not None:
                    try:
                        results[i] = fn(self, items[i])
                        if on_result is not None:
                            on_result(i, results[i])
                    except BaseException as e:  # noqa: BLE001 - re-raised by map in the caller's thread
                        errors[i] = e
                        with self._cond:
                            self._stop = True
            finally:
                with self._cond:
                    self._alive.discard(k)
                    self._cond.notify_all()

        threads = [threading.Thread(target=work, args=(k,), name=f"envace-merged-{k}", daemon=True)
                   for k in range(n_threads)]
        pool = getattr(self.engine, "prefix_pool", None)
        pool_tokens = getattr(pool, "max_tokens", None)
        if pool_tokens is not None:
            pool.max_tokens = pool_tokens * n_threads
        batch = getattr(self.engine, "max_batch_size", None)
        if isinstance(batch, int):
            self.engine.max_batch_size = batch * n_threads
        try:
            for t in threads:
                t.start()
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: not self._alive
                                        or len(self._waiting) + len(self._claims) >= len(self._alive))
                    if not self._alive:
                        break
                    if self._claims:  # hand out items in worker order, then wait for their first calls
                        for k in sorted(self._claims):
                            done = self._stop or self._next >= len(items)
                            self._given[k], self._next = (None, self._next) if done else (self._next, self._next + 1)
                        self._claims = set()
                        self._cond.notify_all()
                        continue
                    calls = [self._waiting[w] for w in sorted(self._waiting)]
                    self._waiting = {}
                try:
                    self._run(calls)  # every live worker waits: nothing else runs meanwhile
                except BaseException as e:  # noqa: BLE001 - e.g. an interrupt: every waiting caller gets it
                    for c in calls:
                        c.error = c.error or e
                    raise
                finally:
                    with self._cond:
                        for c in calls:
                            c.done = True
                        self._cond.notify_all()
        except BaseException as e:  # the workers still running end with it instead of waiting for a round
            with self._cond:
                self._closed, self._stop = e, True
                self._cond.notify_all()
            raise
        finally:
            for t in threads:
                t.join()
            if pool_tokens is not None:
                pool.max_tokens = pool_tokens
            if isinstance(batch, int):
                self.engine.max_batch_size = batch
            with self._cond:
                self._alive, self._waiting, self._owner = set(), {}, None
                self._claims, self._given, self._closed = set(), {}, None
        for e in errors:
            if e is not None:
                raise e
        return results

    def _claim(self, worker: int) -> int | None:
        """The index of `worker`'s next item, handed out by `map`'s thread; None when none is left (or an
        item failed, or `map` is ending)."""
        with self._cond:
            self._claims.add(worker)
            self._cond.notify_all()
            self._cond.wait_for(lambda: worker in self._given or self._closed is not None)
            return self._given.pop(worker, None)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """As `Engine.generate`. From a `map` worker: waits until every live worker waits or has ended;
        `map`'s thread then runs the waiting calls merged. Otherwise the wrapped engine's call."""
        worker = getattr(self._local, "worker", None)
        if worker is None:
            if self._alive and threading.get_ident() != self._owner:
                raise RuntimeError("MergingEngine.generate from a thread that is not one of map's workers "
                                   "while map runs: the wrapped engine serves one thread at a time")
            return self.engine.generate(prompts, params)
        check_prompt_seeds(params, len(prompts))
        check_constraints(params, len(prompts))
        call = _Call(worker, list(prompts), params, budgets=tuple(prompt_budgets(params, len(prompts))))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
        call.seeds = params.prompt_seeds or tuple((seed, i) for i in range(len(prompts)))
        with self._cond:
            if self._closed is not None:
                raise RuntimeError(f"MergingEngine.map is ending ({type(self._closed).__name__})")
            self._waiting[worker] = call
            self._cond.notify_all()
            self._cond.wait_for(lambda: call.done or self._closed is not None)
            if not call.done:
                raise RuntimeError(f"MergingEngine.map is ending ({type(self._closed).__name__})")
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    def _run(self, calls: list[_Call]) -> None:
        """The waiting calls, merged by `merge_key` (in worker order), one engine call per set. A merged call
        that raises ValueError (the engine refused an input: a prompt too long for its budget, an empty one)
        is run again call by call, so that only the caller whose input it was gets the error."""
        sets: dict[tuple, list[_Call]] = {}
        for c in calls:
            try:
                sets.setdefault(merge_key(c.params), []).append(c)
            except Exception as e:  # noqa: BLE001 - settings that cannot be compared fail their caller only
                c.error = e
        for group in sets.values():
            try:
                self._call(group)
            except ValueError as e:
                if len(group) == 1:
                    group[0].error = e
                    continue
                for c in group:
                    try:
                        self._call([c])
                    except BaseException as e1:  # noqa: BLE001 - raised in this caller only
                        c.error = e1
            except BaseException as e:  # noqa: BLE001 - raised in every caller of the merged call
                for c in group:
                    c.error = e

    def _call(self, group: list[_Call]) -> None:
        """One engine call for `group`: each prompt with its call's seed pair, budget and constraint; results
        routed back to each call. Raises what the engine raises."""
        prompts = [p for c in group for p in c.prompts]
        seeds = tuple(s for c in group for s in c.seeds)
        cons = [x for c in group for x in (c.params.constraints or (None,) * len(c.prompts))]
        budgets = tuple(b for c in group for b in c.budgets)
        params = with_prompt_budgets(replace(group[0].params, seed=None, prompt_seeds=seeds,
                                             constraints=tuple(cons) if any(x is not None for x in cons) else None),
                                     budgets)
        out = self.engine.generate(prompts, params) if prompts else []
        self.merged_calls += 1
        self.calls_in += len(group)
        at = 0
        for c in group:
            c.result, at = out[at:at + len(c.prompts)], at + len(c.prompts)
