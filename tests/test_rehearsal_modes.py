"""Private Rehearsal modes (METHOD.md §4): sequential with SELF-EVAL, the verifier filter, re-entry,
and isolation in each (the real environment gets no call and keeps its DB hash during rehearsal)."""

import json

import pytest

from envace_core import EnvaceError
from envace_core.engines.hf import HFEngine
from envace_core.envs.tau2.rules import airline_reservation_read_before_write
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.rehearsal.agent import IsolationError, RehearsalAgent
from envace_core.rehearsal.verifier import default_checks, verify
from envace_core.roles.self_eval import parse_self_eval, self_eval_prompt_ids
from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
from envace_core.types import Role, ToolCall
from tests.scripted import ScriptedEngine
from tests.test_rehearsal_isolation import CountingEnv, _write_task

P = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)
P3 = RolloutParams(max_turns=3, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)
EVAL = '{"reached_goal": false, "blocker": "reservation is basic economy", "advice": "offer a certificate"}'


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class EvalEngine(ScriptedEngine):
    """ScriptedEngine that also answers SELF-EVAL prompts, records every decoded prompt, and (with
    `leak_into`) touches the real environment from inside a REHEARSE call once `leak_after` real
    calls happened: a deliberately broken policy that isolation checks must catch."""

    def __init__(self, tok, act_texts, eval_text=EVAL, leak_into=None, leak_after=0, **kw):
        super().__init__(tok, act_texts, **kw)
        self.eval_text, self.prompts, self.leak_into, self.leak_after = eval_text, [], leak_into, leak_after
        self.leaks = 0

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            if "You review a rehearsal" in text:
                self.prompts.append(("self_eval", text))
                self.calls.append("self_eval")
                out.append([self._completion(self.eval_text) for _ in range(params.n)])
                continue
            kind = "rehearse" if "You simulate the" in text else "act"
            self.prompts.append((kind, text))
            if kind == "rehearse" and self.leak_into is not None and self.leak_into.calls_made >= self.leak_after:
                self.leak_into.step(ToolCall(name="get_user_details", arguments={"user_id": "x"}))
                self.leaks += 1
            out.extend(super().generate([p], params))
        return out


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def write_task():
    return _write_task()


# ------------------------------------------------------------------------------------------ SELF-EVAL
@pytest.mark.parametrize("text, goal, blocker, advice", [
    (EVAL, False, "reservation is basic economy", "offer a certificate"),
    ('Here:\n```json\n{"reached_goal": "yes", "blocker": "", "advice": "none"}\n```', True, "", "none"),
    ('{"reached_goal": true, "blocker": "the user id was never aske', True, "the user id was never aske", ""),
    ("The agent cancelled without checking the reservation.", None, "", ""),
    ("", None, "", ""),
    ('{"reached_goal": 3, "advice": {"do": "x"}}', None, "", '{"do": "x"}'),
    # the prompt's placeholders copied back say nothing (seen in held-out runs: "blocker: <the rule or …>")
    ('{"reached_goal": true, "blocker": "<the rule or error that stopped it, or empty>", "advice": "ask"}',
     True, "", "ask"),
    ('reached goal: no, "advice": "<what to do instead next time, one sentence>', False, "", ""),
    ('{"reached_goal": false, "blocker": "<The rule or error that stop', False, "", ""),  # cut short, any case
    ('{"reached_goal": false, "blocker": "<none>", "advice": "<"}', False, "<none>", "<"),  # not the hints
])
def test_self_eval_parsing_is_lenient_and_never_crashes(text, goal, blocker, advice):
    ev = parse_self_eval(text)
    assert (ev.reached_goal, ev.blocker, ev.advice, ev.raw) == (goal, blocker, advice, text)
    if text.startswith("The agent"):
        assert ev.as_text() == "- self-eval (unparsed): " + text


def test_self_eval_prompt_shows_policy_request_and_rehearsal(tok):
    ctx = task_context(load_tasks("airline", "test", limit=1)[0], 300)
    text = tok.decode(self_eval_prompt_ids(tok, ctx, "Rehearsal 1:\n- called x({}) -> {}"))
    assert ctx.policy.strip()[:100] in text and ctx.first_user_message.strip()[:100] in text
    assert "Rehearsal 1:" in text and '"reached_goal"' in text and text.rstrip().endswith("assistant")


# ----------------------------------------------------------------------------------------- sequential
def test_sequential_rehearsal_sees_earlier_rehearsals_and_their_self_evals(tok, write_task):
    task, write_text = write_task
    engine = EvalEngine(tok, [write_text, "Done, anything else?"])
    agent = RehearsalAgent(engine, "sequential", 2, 512, act=P, rehearse=P, seed=0)
    rnd = agent.rehearse_round(task_context(task, 300))
    acts = [t for k, t in engine.prompts if k == "act"]
    first_eval = [k for k, _ in engine.prompts].index("self_eval")
    before = [t for k, t in engine.prompts[:first_eval] if k == "act"]
    after = [t for k, t in engine.prompts[first_eval:] if k == "act"]
    assert len(before) == 2 and len(after) == 2 and len(acts) == 4
    assert all("Notes from rehearsal" not in t for t in before)
    write_name = json.loads(write_text[len("<tool_call>"):-len("</tool_call>")])["name"]
    for t in after:  # rehearsal 2's ACT prompts hold rehearsal 1's summary and its self-eval
        assert "Notes from rehearsal" in t and "Rehearsal 1:" in t and f"- called {write_name}(" in t
        assert "- self-eval: goal reached: no; blocker: reservation is basic economy; instead: offer a certificate" in t
    assert [e.reached_goal for e in rnd.self_evals] == [False, False]
    for t in rnd.rehearsals:  # one SELF_EVAL generation recorded per rehearsal, never trained by default
        gens = [g for g in t.generations if g.role == Role.SELF_EVAL]
        assert len(gens) == 1 and gens[0].text == EVAL and gens[0].parse_error is None
    assert "Rehearsal 1:" in rnd.memory and "Rehearsal 2:" in rnd.memory and "self-eval" in rnd.memory


def test_sequential_memory_respects_the_token_budget(tok, write_task):
    task, write_text = write_task
    agent = RehearsalAgent(EvalEngine(tok, [write_text, "Done"]), "sequential", 3, 40, act=P, rehearse=P)
    _, memory = agent.rehearse(task_context(task, 300))
    assert memory and len(tok.encode(memory, add_special_tokens=False)) <= 40


def test_unparsed_self_eval_is_kept_as_raw_text(tok, write_task):
    task, write_text = write_task
    engine = EvalEngine(tok, [write_text, "Done"], eval_text="It went badly because of the rules")
    rnd = RehearsalAgent(engine, "sequential", 2, 512, act=P, rehearse=P).rehearse_round(task_context(task, 300))
    assert rnd.self_evals[0].reached_goal is None
    assert "self-eval (unparsed): It went badly" in rnd.memory
    assert rnd.rehearsals[0].generations[-1].parse_error.startswith("InvalidSelfEval")


# ------------------------------------------------------------------------------------------- verifier
def test_rejected_rehearsals_are_absent_from_memory(tok, write_task):
    task, write_text = write_task
    ctx = task_context(task, 300)
    reject_first = lambda t, c: ["first one is rejected"] if t.group_index == 0 else []
    engine = EvalEngine(tok, [write_text, "Done"])
    agent = RehearsalAgent(engine, "sequential", 2, 512, act=P, rehearse=P, verifier=[reject_first])
    rnd = agent.rehearse_round(ctx)
    assert [t.group_index for t, _ in rnd.rejected] == [0] and rnd.rejected[0][1] == ["first one is rejected"]
    assert rnd.self_evals[0] is None and not any(g.role == Role.SELF_EVAL for g in rnd.rehearsals[0].generations)
    assert all("Notes from rehearsal" not in t for k, t in engine.prompts if k == "act")  # 2 never saw 1
    assert "Rehearsal 1:" not in rnd.memory and "Rehearsal 2:" in rnd.memory and "[rehearsal 2]" in rnd.memory


def test_parallel_verifier_rejects_unknown_tools(tok, write_task):
    task, _ = write_task
    engine = EvalEngine(tok, [call("teleport", to="Mars")])
    agent = RehearsalAgent(engine, "parallel", 3, 512, act=P, rehearse=P, verifier=default_checks("airline"))
    rnd = agent.rehearse_round(task_context(task, 300))
    assert len(rnd.rehearsals) == 3 and len(rnd.rejected) == 3 and rnd.memory == ""
    assert all(any("unknown tool" in r for r in reasons) for _, reasons in rnd.rejected)
    assert "self_eval" not in engine.calls  # parallel: no SELF-EVAL unless asked


def _lookup(task):
    gold = next(a for a in task.gold_actions if a.name.startswith("get_"))
    return call(gold.name, **gold.arguments)


def _agents(tok, mode, act_texts, checks, **kw):
    """The same rehearsal set-up twice, without and with `prune_rejected` (each on its own engine)."""
    return [(e := EvalEngine(tok, act_texts),
             RehearsalAgent(e, mode, 3, 512, act=P3, rehearse=P3, seed=0, verifier=checks, prune_rejected=prune, **kw))
            for prune in (False, True)]


@pytest.mark.parametrize("memory_content", ["calls", "consensus"])
def test_pruning_stops_a_rejected_rehearsal_and_leaves_the_memory_as_it_was(tok, write_task, memory_content):
    task, write_text = write_task
    ctx = task_context(task, 300)
    reject_first = lambda t, c: ["first one is rejected"] if t.group_index == 0 and t.steps else []
    (e_full, full), (e_pruned, pruned) = _agents(tok, "parallel", [_lookup(task), write_text, write_text],
                                                 [reject_first], memory_content=memory_content)
    a, b = full.rehearse_round(ctx), pruned.rehearse_round(ctx)
    assert b.memory == a.memory and b.memory  # the kept rehearsals (and every first call) are the same
    assert [len(t.steps) for t in a.rehearsals] == [3, 3, 3]
    assert [len(t.steps) for t in b.rehearsals] == [1, 3, 3]  # rejected in its first turn, stopped there
    assert b.rehearsals[0].termination == "stopped" and a.rehearsals[0].termination == "max_turns"
    assert [(t.group_index, r) for t, r in b.rejected] == [(0, ["first one is rejected"])]
    assert e_pruned.calls.count("rehearse") == e_full.calls.count("rehearse") - 2  # its turns 2 and 3 not decoded
    assert e_pruned.calls.count("act") == e_full.calls.count("act") - 2


def test_pruning_in_sequential_mode_keeps_each_memory(tok, write_task):
    task, write_text = write_task
    ctx = task_context(task, 300)
    cancel_unread = call("cancel_reservation", reservation_id="ZZ9XQ1")
    (e_full, full), (e_pruned, pruned) = _agents(tok, "sequential", [_lookup(task), cancel_unread, write_text],
                                                 default_checks("airline"))
    a, b = full.rehearse_round(ctx), pruned.rehearse_round(ctx)
    assert len(a.rejected) == len(b.rejected) == 3 and a.memory == b.memory == ""
    assert all(len(t.steps) == 3 for t in a.rehearsals)
    assert all(len(t.steps) == 2 and t.termination == "stopped" for t in b.rehearsals)  # cancelled unread, turn 2
    assert all(any("check the reservation before changing it) at step 1" in r for r in reasons)
               for _, reasons in b.rejected)
    acts = lambda e: [t for k, t in e.prompts if k == "act"]
    assert acts(e_pruned) == [t for t in acts(e_full) if t.count("<|im_start|>assistant") <= 2]


def test_pruning_needs_a_verifier(tok, write_task):
    task, write_text = write_task
    agent = RehearsalAgent(EvalEngine(tok, [write_text]), "parallel", 2, 128, act=P, rehearse=P, prune_rejected=True)
    assert agent.prune_rejected is False
    assert all(t.termination != "stopped" for t in agent.rehearse_round(task_context(task, 300)).rehearsals)


def test_parallel_mode_equals_rehearsal_rollouts(tiny_model_dir):
    engine = HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), compute_dtype="float32")
    ctx = task_context(load_tasks("airline", "test", limit=1)[0], 300)
    ours, _ = RehearsalAgent(engine, "parallel", 2, 64, act=P, rehearse=P, seed=3).rehearse(ctx)
    ref = rehearsal_rollouts(engine, ctx, 2, P, seed=3)
    assert [[g.completion_ids for g in t.generations] for t in ours] == \
        [[g.completion_ids for g in t.generations] for t in ref]


# ------------------------------------------------------------------------------------------ isolation
@pytest.mark.parametrize("mode, kw", [("sequential", {}), ("parallel", {"verifier": "airline"}),
                                      ("sequential", {"verifier": "airline"}), ("sequential", {"reenter": True}),
                                      ("parallel", {"reenter": True, "verifier": "airline"})])
def test_isolation_holds_in_every_mode(tok, write_task, mode, kw):
    task, write_text = write_task
    kw = {**kw, **({"verifier": default_checks(kw["verifier"])} if "verifier" in kw else {})}
    engine = EvalEngine(tok, [write_text, "Done, anything else?"])
    env = CountingEnv("airline")
    env.reset(task)
    before = env.snapshot()
    agent = RehearsalAgent(engine, mode, 2, 128, act=P, rehearse=P, seed=0, **kw)
    agent.rehearse(task_context(task, 300))
    assert env.entries == 0 and env.calls_made == 0 and env.snapshot() == before
    res = agent.run(task_context(task, 300), env)
    assert res.isolation == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    assert "rehearse" in engine.calls and env.entries == 1 and env.snapshot() != before  # committed wrote once
    assert len(res.rounds) == (2 if kw.get("reenter") else 1)


@pytest.mark.parametrize("kw", [{}, {"reenter": True}])
def test_a_leaking_rehearsal_is_caught(tok, write_task, kw):
    task, write_text = write_task
    env = CountingEnv("airline")
    env.reset(task)
    engine = EvalEngine(tok, [write_text, write_text, "Done"], leak_into=env, leak_after=1 if kw else 0)
    agent = RehearsalAgent(engine, "sequential", 2, 128, act=P3, rehearse=P3, **kw)
    with pytest.raises(IsolationError, match="rehearsal changed the real environment"):
        agent.run(task_context(task, 300), env)
    assert engine.leaks >= 1  # re-entry: caught in round 2, after exactly one committed step
    assert env.entries == engine.leaks + (1 if kw else 0)


# -------------------------------------------------------------------------------------------- re-entry
def test_reentry_rehearses_from_the_real_history_before_each_step(tok):
    task = next(t for t in load_tasks("airline", "test") if t.id == "airline/19")
    rid = task.gold_actions[0].arguments["reservation_id"]
    ctx = task_context(task, 300)
    engine = EvalEngine(tok, [call("get_reservation_details", reservation_id=rid),
                              call("cancel_reservation", reservation_id=rid), "Done."],
                        rehearse_text='{"reservation_id": "IMAGINED"}')
    env = CountingEnv("airline")
    env.reset(task)
    agent = RehearsalAgent(engine, "parallel", 2, 256, act=P3, rehearse=P3, seed=0,
                           verifier=default_checks("airline"), reenter=True)
    res = agent.run(ctx, env)
    assert [s.action.name for s in res.committed.steps if s.action] == ["get_reservation_details", "cancel_reservation"]
    assert env.entries == 2 and [r.turn for r in res.rounds] == [0, 1, 2]
    real_read = res.committed.steps[0].real_observation.content
    assert "IMAGINED" not in real_read and rid in real_read
    r1 = res.rounds[1]
    # round 2 starts after the real read: its imagined trajectories begin with the cancel
    assert all(t.tool_calls()[0].name == "cancel_reservation" for t in r1.rehearsals)
    assert any(real_read[:200] in t for k, t in engine.prompts if k == "act" and "Rehearsal 1:" in t)
    # the real prefix satisfies the read-before-write rule; without it the same rehearsal is rejected
    assert r1.rejected == [] and len(r1.rehearsals) == 2
    assert verify(r1.rehearsals[:1], ctx, [airline_reservation_read_before_write])[1]
    assert res.memory == res.rounds[-1].memory and len(res.rehearsals) == 6


def test_real_model_sequential_verifier_reentry_smoke(tiny_model_dir):
    engine = HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), compute_dtype="float32")
    task = load_tasks("airline", "test", limit=1)[0]
    env = CountingEnv("airline")
    env.reset(task)
    agent = RehearsalAgent(engine, "sequential", 2, 64, act=P, rehearse=P, seed=0,
                           verifier=default_checks("airline"), reenter=True, self_eval_max_tokens=8)
    res = agent.run(task_context(task, 300), env)
    assert res.isolation == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    assert env.entries == len(res.committed.tool_calls()) and res.rounds
    kept = [t for t in res.rehearsals if all(t is not r for r, _ in res.rejected)]
    assert all(sum(g.role == Role.SELF_EVAL for g in t.generations) == 1 for t in kept)


def test_calls_memory_keeps_what_was_tried_not_how_the_rehearsal_ended(tok, write_task):
    """memory_content="calls": the calls and their imagined results, no message to the user and no ending;
    SELF-EVAL still reads the whole episode."""
    task, write_text = write_task
    ctx = task_context(task, 300)
    write_name = json.loads(write_text[len("<tool_call>"):-len("</tool_call>")])["name"]
    rounds = {}
    for content in ("episode", "calls"):
        engine = EvalEngine(tok, [write_text, "Done, your booking is cancelled."])
        agent = RehearsalAgent(engine, "sequential", 2, 512, act=P, rehearse=P, seed=0, memory_content=content)
        rounds[content] = (agent.rehearse_round(ctx), engine)
    episode, calls = rounds["episode"][0].memory, rounds["calls"][0].memory
    assert f"- called {write_name}(" in episode and "- told the user: Done" in episode and "- ended:" in episode
    assert f"- called {write_name}(" in calls and "told the user" not in calls and "- ended:" not in calls
    assert "- self-eval:" in calls  # the kept rehearsal's SELF-EVAL line stays with its calls
    evals = [t for k, t in rounds["calls"][1].prompts if k == "self_eval"]
    assert evals and all("- told the user: Done" in t for t in evals)
    only_talk = RehearsalAgent(EvalEngine(tok, ["Done"]), "parallel", 2, 512, act=P, rehearse=P,
                               memory_content="calls").rehearse_round(ctx)
    assert only_talk.memory == ""  # no call tried: nothing to remember


def test_pitfalls_memory_keeps_only_the_calls_that_met_an_imagined_error(tok, write_task):
    """memory_content="pitfalls": only the calls the imagined environment answered with an error, and
    those errors; no successful call, no message to the user, no ending. A rehearsal that met no error
    leaves the memory empty, so the committed run is the one without rehearsal."""
    task, write_text = write_task
    ctx = task_context(task, 300)
    write_name = json.loads(write_text[len("<tool_call>"):-len("</tool_call>")])["name"]
    memories = {}
    for reply in ('{"status": "ok"}', '{"error": "Reservation not found"}'):
        for content in ("episode", "pitfalls"):
            engine = EvalEngine(tok, [write_text, "Done, your booking is cancelled."], rehearse_text=reply)
            memories[reply[2:7], content] = RehearsalAgent(engine, "parallel", 2, 512, act=P, rehearse=P, seed=0,
                                                           memory_content=content).rehearse_round(ctx).memory
    assert memories["statu", "episode"] and "ERROR" not in memories["statu", "episode"]
    assert memories["statu", "pitfalls"] == ""
    episode, pitfalls = memories["error", "episode"], memories["error", "pitfalls"]
    assert "- told the user: Done" in episode and "- ended:" in episode
    assert f"- called {write_name}(" in pitfalls and '-> ERROR {"error":"Reservation not found"}' in pitfalls
    assert "told the user" not in pitfalls and "- ended:" not in pitfalls
    assert all(line.startswith(("[rehearsal", "Rehearsal", "- called")) and ("-> ERROR" in line or "called" not in line)
               for line in pitfalls.splitlines())


def test_pitfalls_memory_keeps_a_self_eval_that_names_a_blocker(tok, write_task):
    """Sequential, "pitfalls": a rehearsal that met no imagined error adds no calls, but its SELF-EVAL's
    blocker and advice (a constraint it found) reach the next rehearsal and the memory."""
    task, write_text = write_task
    engine = EvalEngine(tok, [write_text, "Done, your booking is cancelled."])  # REHEARSE answers without error
    rnd = RehearsalAgent(engine, "sequential", 2, 512, act=P, rehearse=P, seed=0,
                         memory_content="pitfalls").rehearse_round(task_context(task, 300))
    assert "- called" not in rnd.memory and "blocker: reservation is basic economy" in rnd.memory
    assert rnd.memory.count("Rehearsal ") == 2
    second = [t for k, t in engine.prompts if k == "act"]
    assert any("reservation is basic economy" in t for t in second)


# ------------------------------------------------------------------------------------------ arguments
def test_bad_arguments_are_rejected(tok):
    e = ScriptedEngine(tok, ["hi"])
    with pytest.raises(EnvaceError, match="unknown rehearsal mode"):
        RehearsalAgent(e, "telepathy", 2, 64, act=P, rehearse=P)
    with pytest.raises(EnvaceError, match="needs n >= 1"):
        RehearsalAgent(e, "sequential", 0, 64, act=P, rehearse=P)
    with pytest.raises(EnvaceError, match="verifier"):
        RehearsalAgent(e, "parallel", 2, 64, act=P, rehearse=P, verifier=["schema"])
    with pytest.raises(EnvaceError, match="unknown rehearsal memory content 'plans'"):
        RehearsalAgent(e, "parallel", 2, 64, act=P, rehearse=P, memory_content="plans")
    with pytest.raises(EnvaceError, match="unknown rehearsal memory content 'Pitfalls'"):
        RehearsalAgent(e, "parallel", 2, 64, act=P, rehearse=P, memory_content="Pitfalls")
    assert RehearsalAgent(e, "none", 0, 64, act=P, rehearse=P).rehearse(None) == ([], "")
