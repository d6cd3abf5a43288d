"""engines.merging.MergingEngine: concurrent workers' generate calls run as merged engine calls, results
routed back in order, sampling settings that differ kept apart, per-call seeds kept (same completions as
the calls made one by one, on the tiny model), errors raised to the caller without a deadlock; and
`SamplingParams.prompt_seeds` on HFEngine."""

from __future__ import annotations

import threading

import pytest
import torch

from envace_core.engines.base import Completion, SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.engines.merging import MergingEngine, merge_key
from envace_core.models import load_model, load_tokenizer
from envace_core.roles.json_prefix import NotJsonStop


class RecordingEngine:
    """Returns, for each prompt, n completions whose ids are [first prompt id, sample index, seed pair]."""

    tokenizer = object()

    def __init__(self):
        self.calls: list[tuple[list[list[int]], SamplingParams]] = []
        self.stats = {"calls": 0}
        self.lock = threading.Lock()

    def generate(self, prompts, params):
        assert self.lock.acquire(blocking=False), "two threads inside the engine at once"
        try:
            self.calls.append((prompts, params))
            seeds = params.prompt_seeds or tuple((params.seed, i) for i in range(len(prompts)))
            return [[Completion([p[0], j, *s], [0.0], "stop") for j in range(params.n)]
                    for p, s in zip(prompts, seeds)]
        finally:
            self.lock.release()


def test_workers_calls_are_merged_and_routed_back():
    inner = RecordingEngine()
    eng = MergingEngine(inner)

    def work(e, k):
        out = []
        for turn in range(2):
            res = e.generate([[100 * k + turn], [100 * k + turn + 50]], SamplingParams(n=2, seed=7 + k))
            out.append([[c.token_ids for c in r] for r in res])
        return out

    results = eng.map(work, [0, 1, 2])
    assert len(inner.calls) == 2 and eng.merged_calls == 2 and eng.calls_in == 6
    assert [len(p) for p, _ in inner.calls] == [6, 6]
    for k, out in enumerate(results):
        for turn, res in enumerate(out):
            # each worker gets its own prompts back, sampled with its own seed at its own prompt index
            assert res == [[[100 * k + turn, j, 7 + k, 0] for j in range(2)],
                           [[100 * k + turn + 50, j, 7 + k, 1] for j in range(2)]]


def test_different_settings_stay_apart_and_an_early_finisher_blocks_nobody():
    inner = RecordingEngine()
    eng = MergingEngine(inner)

    def work(e, k):
        if k == 2:
            return "no call"
        temperature = 1.0 if k == 0 else 0.5
        return e.generate([[k]], SamplingParams(temperature=temperature, seed=k, role="rehearse"))[0][0].token_ids

    assert eng.map(work, [0, 1, 2]) == [[0, 0, 0, 0], [1, 0, 1, 0], "no call"]
    assert sorted(p.temperature for _, p in inner.calls) == [0.5, 1.0]


def test_merge_key_ignores_seeds_and_compares_stop_predicates_by_type(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    a = SamplingParams(seed=1, stop_when=NotJsonStop(tok))
    b = SamplingParams(seed=2, stop_when=NotJsonStop(tok), prompt_seeds=((3, 0),))
    assert merge_key(a) == merge_key(b)
    assert merge_key(a) != merge_key(SamplingParams(seed=1))
    # token budgets do not keep calls apart: the merged call carries each prompt's own
    assert merge_key(a) == merge_key(SamplingParams(seed=4, stop_when=NotJsonStop(tok), max_new_tokens=9,
                                                    prompt_max_new_tokens=(3,)))
    assert merge_key(a) != merge_key(SamplingParams(seed=1, n=2, stop_when=NotJsonStop(tok)))


def test_an_error_reaches_the_caller_after_every_worker_ends():
    inner = RecordingEngine()
    eng = MergingEngine(inner)

    def work(e, k):
        e.generate([[k]], SamplingParams(seed=k))
        if k == 1:
            raise KeyError("worker 1 failed")
        return e.generate([[k]], SamplingParams(seed=k))[0][0].token_ids

    with pytest.raises(KeyError, match="worker 1 failed"):
        eng.map(work, [0, 1, 2])
    assert [len(p) for p, _ in inner.calls] == [3, 2]  # workers 0 and 2 went on without worker 1
    assert eng.map(lambda e, k: k, [5]) == [5]  # usable again


def test_an_engine_error_is_raised_in_every_merged_caller():
    class Failing(RecordingEngine):
        def generate(self, prompts, params):
            raise RuntimeError("engine down")

    eng = MergingEngine(Failing())
    seen = []

    def work(e, k):
        try:
            e.generate([[k]], SamplingParams(seed=k))
        except RuntimeError as err:
            seen.append(str(err))
        return k

    assert eng.map(work, [0, 1]) == [0, 1] and seen == ["engine down", "engine down"]


def test_outside_map_it_is_the_wrapped_engine():
    inner = RecordingEngine()
    eng = MergingEngine(inner)
    assert eng.generate([[4]], SamplingParams(seed=9))[0][0].token_ids == [4, 0, 9, 0]
    assert eng.stats is inner.stats and eng.tokenizer is inner.tokenizer


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_model_dir)
    yield HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32", max_batch_size=16)
    torch.set_num_threads(before)


def _prompts(tok, texts):
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False)
            for t in texts]


def test_prompt_seeds_reproduce_each_calls_own_samples(hf_engine):
    tok = hf_engine.tokenizer
    a, b = _prompts(tok, ["book a flight", "cancel my order please"]), _prompts(tok, ["what is my balance"])
    sp = dict(max_new_tokens=12, temperature=1.0)
    alone_a = hf_engine.generate(a, SamplingParams(seed=11, n=2, **sp))
    alone_b = hf_engine.generate(b, SamplingParams(seed=5, n=2, **sp))
    merged = hf_engine.generate(a + b, SamplingParams(n=2, prompt_seeds=((11, 0), (11, 1), (5, 0)), **sp))
    ids = lambda res: [[c.token_ids for c in r] for r in res]
    assert ids(merged) == ids(alone_a) + ids(alone_b)
    for got, want in zip(merged, alone_a + alone_b):
        for c, d in zip(got, want):
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(d.logprobs), atol=1e-4)
    with pytest.raises(ValueError, match="prompt_seeds holds 1 pairs for 2 prompts"):
        hf_engine.generate(a, SamplingParams(prompt_seeds=((1, 0),), **sp))


def test_merged_workers_get_what_their_calls_get_alone(hf_engine):
    tok = hf_engine.tokenizer
    work_prompts = [_prompts(tok, [f"request number {k}: find reservation ABC{k}"]) for k in range(3)]

    def work(e, k):
        first = e.generate(work_prompts[k], SamplingParams(max_new_tokens=10, n=3, seed=100 + k))[0]
        follow = [work_prompts[k][0] + c.token_ids for c in first]
        second = e.generate(follow, SamplingParams(max_new_tokens=4 + k, seed=200 + k))  # budgets differ
        return [c.token_ids for c in first] + [r[0].token_ids for r in second]

    alone = [work(hf_engine, k) for k in range(3)]
    merging = MergingEngine(hf_engine)
    assert merging.map(work, [0, 1, 2]) == alone
    assert merging.merged_calls == 2 and merging.calls_in == 6


def test_an_iterations_merged_groups_are_its_groups_rolled_out_one_by_one(hf_engine):
    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.training import loop
    from envace_core.training.distributed import World
    from envace_core.training.policy import rollout_params

    tasks = load_tasks("airline", "train", limit=3)
    got = {}
    for merge in (False, True):
        cfg = load_config("test", {"rollout": {"tasks_per_iteration": 3, "group_size": 2, "max_turns": 2,
                                               "temperature": 1.0, "merge_groups": merge}})
        run = loop.TrainingRun(cfg, tasks, None, hf_engine, rollout_params(cfg), World(), None, "run0")
        calls = hf_engine.stats["calls"]
        groups = loop.roll_out(run, tasks, 0)
        got[merge] = ([[(g.role, g.completion_ids) for t in grp for g in t.generations] for grp in groups],
                      [[t.reward for t in grp] for grp in groups], hf_engine.stats["calls"] - calls)
    assert got[True][:2] == got[False][:2]
    assert all(len(grp) >= 2 and all(ids for _, ids in grp) for grp in got[True][0])  # every trajectory generated
    assert got[True][2] < got[False][2]  # fewer, larger engine calls


def test_bad_calls_fail_their_caller_only_and_leave_the_engine_usable():
    inner = RecordingEngine()
    eng = MergingEngine(inner)

    def work(e, k):
        if k == 0:  # one prompt_seeds pair for two prompts
            with pytest.raises(ValueError, match="1 pairs for 2 prompts"):
                e.generate([[1], [2]], SamplingParams(prompt_seeds=((1, 0),)))
        # a list of stop ids (SamplingParams takes one) merges like a tuple
        return e.generate([[k]], SamplingParams(seed=k, stop_token_ids=[2]))[0][0].token_ids

    assert eng.map(work, iter([0, 1])) == [[0, 0, 0, 0], [1, 0, 1, 0]]  # any iterable
    assert len(inner.calls) == 1
    assert eng.map(lambda e, k: k, [3, 4]) == [3, 4]


def test_map_inside_a_worker_and_other_threads_calls_are_refused():
    inner = RecordingEngine()
    eng = MergingEngine(inner)
    side = {}

    def nested(e, k):
        with pytest.raises(RuntimeError, match="called from one of its own workers"):
            eng.map(lambda e2, j: j, [1])
        if k == 0:  # a thread that is not a worker, while map runs
            t = threading.Thread(target=lambda: side.setdefault("err", _catch(lambda: eng.generate([[9]], SamplingParams()))))
            t.start()
            t.join()
        return e.generate([[k]], SamplingParams(seed=k))[0][0].token_ids[0]

    assert eng.map(nested, [0, 1]) == [0, 1]
    assert "not one of map's workers" in side["err"]


def _catch(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


# ------------------------------------------------------------------------------ a bounded worker pool
def _calls_made(items, workers, jitter=None):
    """(results, prompts of every wrapped-engine call, on_result indices) of a pool run: item k makes
    k % 3 + 1 calls of one prompt [10 k + turn]; `jitter(k, turn)` sleeps outside generate."""
    import time

    inner = RecordingEngine()
    eng = MergingEngine(inner)
    seen: list[int] = []

    def work(e, k):
        out = []
        for turn in range(k % 3 + 1):
            if jitter is not None:
                time.sleep(jitter(k, turn))
            out.append(e.generate([[10 * k + turn]], SamplingParams(seed=k))[0][0].token_ids[0])
        return out

    results = eng.map(work, items, workers=workers, on_result=lambda i, r: seen.append(i))
    return results, [[p for p in prompts] for prompts, _ in inner.calls], seen


def test_workers_bound_the_items_running_at_once_and_results_keep_item_order():
    results, calls, seen = _calls_made(list(range(7)), workers=3)
    assert results == [[10 * k + t for t in range(k % 3 + 1)] for k in range(7)]
    assert max(len(c) for c in calls) == 3  # never more than 3 items' calls in one merged call
    assert sum(len(c) for c in calls) == sum(k % 3 + 1 for k in range(7))
    assert sorted(seen) == list(range(7))
    # items start in order: the first merged call holds items 0, 1, 2's first turns
    assert calls[0] == [[0], [10], [20]]


def test_which_items_run_together_does_not_depend_on_thread_timing():
    import random

    rng = random.Random(0)
    delays = {(k, t): rng.choice([0.0, 0.002, 0.02]) for k in range(9) for t in range(3)}
    _, calls_plain, _ = _calls_made(list(range(9)), workers=4)
    _, calls_jitter, _ = _calls_made(list(range(9)), workers=4, jitter=lambda k, t: delays[(k, t)])
    # the same merged calls with the same prompts in them (row order may follow the worker holding an item)
    assert [sorted(map(tuple, c)) for c in calls_plain] == [sorted(map(tuple, c)) for c in calls_jitter]


def test_a_failed_item_starts_no_further_item_and_its_error_is_raised():
    inner = RecordingEngine()
    eng = MergingEngine(inner)
    started: list[int] = []

    def work(e, k):
        started.append(k)
        if k == 1:
            raise KeyError("item 1 failed")
        return e.generate([[k]], SamplingParams(seed=k))[0][0].token_ids[0]

    with pytest.raises(KeyError, match="item 1 failed"):
        eng.map(work, list(range(6)), workers=2)
    assert sorted(started) == [0, 1]  # item 0 finished; 2..5 never started
    assert eng.map(lambda e, k: k, [1, 2], workers=2) == [1, 2]  # usable again


def test_one_worker_runs_the_items_in_the_calling_thread_on_the_wrapped_engine():
    inner = RecordingEngine()
    eng = MergingEngine(inner)
    threads = set()

    def work(e, k):
        threads.add(threading.get_ident())
        assert e is inner
        return k

    assert eng.map(work, [3, 4, 5], workers=1) == [3, 4, 5] and threads == {threading.get_ident()}
    with pytest.raises(ValueError, match="workers must be >= 1"):
        eng.map(work, [3, 4], workers=0)


def test_a_failure_in_maps_own_thread_ends_every_worker_without_a_deadlock(monkeypatch):
    inner = RecordingEngine()
    eng = MergingEngine(inner)
    rounds = []

    def run(calls):
        rounds.append(len(calls))
        if len(rounds) == 2:
            raise KeyboardInterrupt
        MergingEngine._run(eng, calls)

    monkeypatch.setattr(eng, "_run", run)

    def work(e, k):
        for turn in range(5):
            e.generate([[k, turn]], SamplingParams(seed=k))
        return k

    outcome = {}

    def call_map():
        try:
            eng.map(work, list(range(6)), workers=3)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    t = threading.Thread(target=call_map)
    t.start()
    t.join(30)
    assert not t.is_alive(), "map did not return after its own thread failed"
    assert isinstance(outcome.get("error"), KeyboardInterrupt)
    assert rounds == [3, 3]  # nothing ran after the failure
    monkeypatch.undo()
    assert eng.map(lambda e, k: k, [7, 8]) == [7, 8]  # usable again


def test_the_batch_limit_and_the_prefix_pool_hold_room_for_every_worker_while_map_runs():
    class Pooled(RecordingEngine):
        def __init__(self):
            super().__init__()
            self.prefix_pool = type("Pool", (), {"max_tokens": 100})()
            self.max_batch_size = 4
            self.seen = []

        def generate(self, prompts, params):
            self.seen.append((self.prefix_pool.max_tokens, self.max_batch_size))
            return super().generate(prompts, params)

    inner = Pooled()
    eng = MergingEngine(inner)
    eng.map(lambda e, k: e.generate([[k]], SamplingParams(seed=k)), list(range(5)), workers=3)
    assert inner.seen and set(inner.seen) == {(300, 12)}
    assert (inner.prefix_pool.max_tokens, inner.max_batch_size) == (100, 4)  # restored
