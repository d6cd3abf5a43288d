"""`SamplingParams.prompt_max_new_tokens`: one call decodes rows of different token budgets, each ending at
its own (HFEngine, the vLLM engine's requests, MergingEngine's merged calls), and the REHEARSE turn of a
rollout and validate's REHEARSE rows use it instead of one call per tool budget."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from envace_core.engines.base import Completion, SamplingParams, prompt_budgets
from envace_core.engines.hf import HFEngine
from envace_core.engines.merging import MergingEngine
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
from tests.scripted import ScriptedEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def eng(tiny_model_dir, tok):
    return HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32")


@pytest.fixture(scope="module")
def prompts(tok):
    texts = ["hi", "Please book a flight from Paris to Rome for next Tuesday, economy class.",
             "Call get_weather for Berlin and summarise the answer in one sentence."]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                    return_dict=False) for t in texts]


def test_prompt_budgets_reads_and_checks_the_field():
    assert prompt_budgets(SamplingParams(max_new_tokens=5), 3) == [5, 5, 5]
    assert prompt_budgets(SamplingParams(prompt_max_new_tokens=(1, 0, np.int64(7))), 3) == [1, 0, 7]
    for bad, match in (((1, 2), r"holds 2 budget\(s\) for 3"), ((1, -1, 2), r"\[1\]: -1 is not a token budget"),
                       ((1, True, 2), r"\[1\]: True is not a token budget"), ((1, 2.5, 2), "2.5 is not"),
                       ((1, "8", 2), "'8' is not"), (8, "must be a tuple")):
        with pytest.raises(ValueError, match=match):
            prompt_budgets(SamplingParams(prompt_max_new_tokens=bad), 3)
    for bad in (-1, 2.5, True):  # checked even where per-prompt budgets replace it: a caller's bug either way
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
            prompt_budgets(SamplingParams(max_new_tokens=bad, prompt_max_new_tokens=(1,)), 1)
    # a list is the tuple it stands for: hashable, equal
    assert SamplingParams(prompt_max_new_tokens=[1, 2]) == SamplingParams(prompt_max_new_tokens=(1, 2))
    assert hash(SamplingParams(prompt_max_new_tokens=[1, 2])) == hash(SamplingParams(prompt_max_new_tokens=(1, 2)))


def test_each_row_ends_at_its_own_budget_as_it_would_alone(eng, prompts):
    sp = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=99, prompt_max_new_tokens=(3, 0, 7))
    out = eng.generate(prompts, sp)
    assert [[len(c.token_ids) for c in r] for r in out] == [[3], [0], [7]]
    assert all(c.finish_reason == "length" for r in out for c in r)
    for p, budget, r in zip(prompts, (3, 0, 7), out):
        [[alone]] = eng.generate([p], SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=budget))
        assert r[0].token_ids == alone.token_ids
        assert r[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_sampled_groups_keep_their_seeds_and_budgets(eng, prompts):
    """n samples per prompt (the shared-prefix path), seeded per prompt: each prompt's samples are those of
    its own call, cut at its budget."""
    seeds = ((11, 0), (12, 0))
    out = eng.generate(prompts[1:], SamplingParams(n=3, temperature=1.0, ignore_eos=True, prompt_seeds=seeds,
                                                   prompt_max_new_tokens=(2, 6)))
    assert [[len(c.token_ids) for c in r] for r in out] == [[2] * 3, [6] * 3]
    for p, (seed, _), budget, r in zip(prompts[1:], seeds, (2, 6), out):
        alone = eng.generate([p], SamplingParams(n=3, temperature=1.0, ignore_eos=True, seed=seed,
                                                 max_new_tokens=budget))[0]
        assert [c.token_ids for c in r] == [c.token_ids for c in alone]


def test_the_context_check_and_errors_use_each_prompts_budget(eng, prompts):
    long = [1] * 4090  # the tiny model's context is 4096 tokens
    with pytest.raises(ValueError, match="prompt 1 has 4090 tokens; with a budget of 10 new tokens it must be at most 4086"):
        eng.generate([prompts[0], long], SamplingParams(prompt_max_new_tokens=(100, 10)))
    with pytest.raises(ValueError, match="budget of 5000 new tokens leaves no room for a prompt"):
        eng.generate([prompts[0]], SamplingParams(prompt_max_new_tokens=(5000,)))
    [[c]] = eng.generate([long], SamplingParams(max_new_tokens=100, prompt_max_new_tokens=(0,)))
    assert c.token_ids == [] and c.finish_reason == "length"  # budget 0: nothing to decode, no forward
    with pytest.raises(ValueError, match=r"holds 1 budget\(s\) for 2 prompt\(s\)"):
        eng.generate(prompts[:2], SamplingParams(prompt_max_new_tokens=(4,)))


class _Recorder:
    """An engine that honours per-prompt budgets with a fixed token and records each call."""

    tokenizer = object()

    def __init__(self):
        self.calls, self.stats = [], {}

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([p[0]] * b, [0.0] * b, "length") for _ in range(params.n)]
                for p, b in zip(prompts, prompt_budgets(params, len(prompts)))]


def test_merging_engine_merges_calls_of_different_budgets():
    inner = _Recorder()
    eng = MergingEngine(inner)

    def work(e, k):
        if k == 2:  # another temperature: a call of its own
            return e.generate([[k]], SamplingParams(max_new_tokens=5, seed=k, temperature=0.5))[0][0].token_ids
        return e.generate([[k], [k + 10]], SamplingParams(max_new_tokens=3 + 2 * k, seed=k, role="rehearse"))

    out = eng.map(work, [0, 1, 2])
    assert [[len(r[0].token_ids) for r in x] for x in out[:2]] == [[3, 3], [5, 5]]
    assert out[1][1][0].token_ids == [11] * 5  # each worker gets its own prompts' completions back
    assert out[2] == [2] * 5
    assert len(inner.calls) == 2 and eng.merged_calls == 2 and eng.calls_in == 3
    merged = next(c for c in inner.calls if c.role == "rehearse")
    assert merged.prompt_max_new_tokens == (3, 3, 5, 5) and merged.max_new_tokens == 5
    alone = next(c for c in inner.calls if c.role is None)
    assert alone.prompt_max_new_tokens is None and alone.max_new_tokens == 5


def test_one_workers_bad_prompt_fails_that_worker_only(eng, prompts):
    """Merged with a call its budget would have kept apart before, a prompt too long for its own budget fails
    its caller alone; the other worker gets what its call alone gives."""
    merging = MergingEngine(eng)
    asked = {0: ([[5] * 4090], 7), 1: ([prompts[0]], 6)}

    def work(e, k):
        ps, budget = asked[k]
        try:
            return [c.token_ids for r in e.generate(ps, SamplingParams(temperature=0, max_new_tokens=budget,
                                                                        ignore_eos=True)) for c in r]
        except ValueError as err:
            return str(err)

    got = merging.map(work, [0, 1])
    assert "4090 tokens; with a budget of 7 new tokens" in got[0]
    assert got[1] == [eng.generate([prompts[0]], SamplingParams(temperature=0, max_new_tokens=6,
                                                                ignore_eos=True))[0][0].token_ids]


def test_vllm_engine_sends_each_request_its_own_max_tokens(monkeypatch):
    from envace_core.engines.vllm import VLLMEngine

    sent = []

    class FakeSP:
        def __init__(self, **kw):
            self.kw = kw

    class FakeLLM:
        def generate(self, prompts, sp, **kw):
            sent.append((prompts, sp))
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                token_ids=[5] * s.kw["max_tokens"], logprobs=[{5: -0.1}] * s.kw["max_tokens"],
                finish_reason="length")]) for s in sp]

    eng = object.__new__(VLLMEngine)
    eng._vllm = types.SimpleNamespace(SamplingParams=FakeSP)
    eng.llm, eng.tokenizer, eng._loras, eng._warned_constraints = FakeLLM(), None, {}, False
    eng.stats = {"generated_tokens": 0, "seconds": 0.0, "calls": 0}
    import sys

    monkeypatch.setitem(sys.modules, "vllm.inputs",
                        types.SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids))
    out = eng.generate([[1, 2], [3], [4]], SamplingParams(seed=9, prompt_max_new_tokens=(2, 0, 4)))
    assert [len(r[0].token_ids) for r in out] == [2, 0, 4]
    [(reqs, sps)] = sent
    assert reqs == [[1, 2], [4]]  # the budget-0 prompt sends no request
    assert [(s.kw["max_tokens"], s.kw["seed"]) for s in sps] == [(2, 9), (4, 9)]
    # the settings are checked even when no prompt decodes
    with pytest.raises(ValueError, match="invalid SamplingParams"):
        eng.generate([[1]], SamplingParams(n=0, prompt_max_new_tokens=(0,)))
    assert len(sent) == 1


class _BudgetScripted(ScriptedEngine):
    """ACT sample j of the first turn calls tool j of `calls`; REHEARSE answers honour each row's budget
    (cut to it) and every call is recorded with its budgets."""

    def __init__(self, tok, calls):
        super().__init__(tok, ["Done."])
        self.act_calls, self.rehearse_params = calls, []

    def generate(self, prompts, params):
        if "You simulate the" not in self.tokenizer.decode(prompts[0]):
            if self.tokenizer.decode(prompts[0]).count("<|im_start|>assistant") > 1:
                return super().generate(prompts, params)
            return [[self._completion("<tool_call>" + json.dumps(self.act_calls[j % len(self.act_calls)])
                                      + "</tool_call>") for j in range(params.n)] for _ in prompts]
        self.rehearse_params.append(params)
        out = super().generate(prompts, params)
        return [[Completion(c.token_ids[:b], c.logprobs[:b], c.finish_reason) for c in r]
                for r, b in zip(out, prompt_budgets(params, len(prompts)))]


def test_a_rehearse_turn_is_one_call_whatever_the_tools_budgets(tok):
    task = next(t for t in load_tasks("airline", "test") if t.gold_actions)
    calls = [{"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}},
             {"name": "get_reservation_details", "arguments": {"reservation_id": "4WQ150"}}]
    eng = _BudgetScripted(tok, calls)
    p = RolloutParams(max_turns=2, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0,
                      max_new_tokens_rehearse_per_tool={"get_reservation_details": 96})
    trajs = rehearsal_rollouts(eng, task_context(task, 300), 4, p, seed=0)
    assert len(eng.rehearse_params) == 1  # one call for the turn, not one per budget
    [sp] = eng.rehearse_params
    assert sorted(sp.prompt_max_new_tokens) == [64, 64, 96, 96] and sp.max_new_tokens == 96
    assert all(t.steps[0].observation is not None for t in trajs)
    assert {t.steps[0].action.name for t in trajs} == {c["name"] for c in calls}
