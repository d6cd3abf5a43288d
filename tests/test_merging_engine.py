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
