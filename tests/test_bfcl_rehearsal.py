"""Private Rehearsal on BFCL multi-turn (METHOD.md §4): a round per user turn (per step with re-entry) in
imagination only (the real `BfclMultiTurnEnv`'s call counter and state hash never move while one runs),
its memory in the committed prompt, no change without rehearsal, and `envace eval` with resume."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment)
import envace_core.evaluation.bfcl_run as bfcl_run_mod
from envace_core.cli import main
from envace_core.envs.bfcl import BfclMultiTurnEnv
from envace_core.evaluation.bfcl import (
    bfcl_prompt_ids,
    bfcl_system_prompt,
    bfcl_task,
    decode_calls,
    load_bfcl,
)
from envace_core.evaluation.bfcl_run import evaluate_bfcl
from envace_core.rehearsal.agent import IsolationError, RehearsalAgent
from envace_core.roles.act import act_messages
from envace_core.training.rollout import RolloutParams
from envace_core.types import TaskContext, ToolSpec
from tests.scripted import ScriptedEngine

P = RolloutParams(max_turns=2, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0)
NOTES = "# Notes from rehearsal"


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from envace_core.models import load_tokenizer

    return load_tokenizer(bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def entry():
    return load_bfcl("multi_turn_base", 1)[0]


def _gt_calls(entry, turn: int) -> list[tuple[str, dict]]:
    env = BfclMultiTurnEnv()
    env.reset(bfcl_task(entry))
    calls = [(n, a) for s in entry.ground_truth[turn] for c in decode_calls(s, env.tools()) for n, a in c.items()]
    env.close()
    return calls


def _tag(name, args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class TurnEngine(ScriptedEngine):
    """Committed (bfcl) prompts: the turn's ground-truth calls in one step, then "Done." after results.
    Rehearsal ACT prompts: the turn's first ground-truth call (one call per reply), then "Done.".
    REHEARSE prompts: `{"status": "ok"}`; SELF-EVAL: goal reached. Records every prompt's text by kind."""

    def __init__(self, tokenizer, entry):
        super().__init__(tokenizer, ["Done."])
        self.entry, self.seen = entry, {"commit": [], "rehearse_act": [], "rehearse": [], "self_eval": []}

    def _reply(self, text: str) -> str:
        if "You simulate the" in text:
            self.seen["rehearse"].append(text)
            return '{"status": "ok"}'
        if "You review a rehearsal" in text:  # SELF-EVAL (sequential mode)
            self.seen["self_eval"].append(text)
            return '{"reached_goal": true, "blocker": "", "advice": "do the same"}'
        kind = "rehearse_act" if "customer service agent in the bfcl domain" in text else "commit"
        self.seen[kind].append(text)
        if text.rfind("<|im_start|>tool") > text.rfind("<|im_start|>user"):
            return "Done."
        calls = _gt_calls(self.entry, text.count("<|im_start|>user") - 1)
        if not calls:
            return "Nothing to do."
        return _tag(*calls[0]) if kind == "rehearse_act" else "\n".join(_tag(n, a) for n, a in calls)

    def generate(self, prompts, params):
        return [[self._completion(self._reply(self.tokenizer.decode(p))) for _ in range(params.n)]
                for p in prompts]


@pytest.fixture
def watched(monkeypatch):
    """Every BfclMultiTurnEnv the evaluator builds, with its real calls counted; every rehearsal round
    checked from outside: no real call and the same state hash on every live env while it runs."""
    envs, log = [], {"calls": 0, "calls_in_rehearsal": 0, "rounds": 0}
    state = {"rehearsing": False}

    class CountingEnv(BfclMultiTurnEnv):
        def __init__(self):
            super().__init__()
            envs.append(self)

        def step_calls(self, calls):
            log["calls"] += 1
            log["calls_in_rehearsal"] += state["rehearsing"]
            return super().step_calls(calls)

    real_round = RehearsalAgent.rehearse_round

    def watched_round(self, *a, **k):
        live = [e for e in envs if e._instances]
        before = [(e.calls_made, e.snapshot()) for e in live]
        state["rehearsing"] = True
        try:
            return real_round(self, *a, **k)
        finally:
            state["rehearsing"] = False
            log["rounds"] += 1
            assert [(e.calls_made, e.snapshot()) for e in live] == before

    monkeypatch.setattr(bfcl_run_mod, "BfclMultiTurnEnv", CountingEnv)
    monkeypatch.setattr(RehearsalAgent, "rehearse_round", watched_round)
    return envs, log


def test_memory_section_is_the_one_the_act_prompt_uses():
    tools = [ToolSpec(name="ls", description="list")]
    ctx = TaskContext(task_id="t", domain="bfcl", policy="p", tools=tools, first_user_message="hi")
    act = act_messages(ctx, [], memory="Rehearsal 1:\n- ended: x")[0]["content"]
    with_memory = bfcl_system_prompt(tools, True, memory="Rehearsal 1:\n- ended: x")
    assert act.endswith(f"{NOTES}\nRehearsal 1:\n- ended: x") and with_memory.endswith(act[act.index(NOTES):])
    assert NOTES not in bfcl_system_prompt(tools, True) and bfcl_system_prompt(tools, True, memory=" ") == \
        bfcl_system_prompt(tools, True)


def test_rehearsal_per_turn_touches_nothing_and_its_memory_reaches_the_committed_prompt(tok, entry, watched):
    envs, log = watched
    engine = TurnEngine(tok, entry)
    agent = RehearsalAgent(engine, "parallel", 2, 128, act=P, rehearse=P, seed=0)
    report = evaluate_bfcl(engine, ["multi_turn_base"], 1, rehearsal=agent)
    [r] = report.categories["multi_turn_base"].entries
    turns = len(entry.question)
    assert r.valid  # the committed execution played the ground truth and bfcl's checker accepts it
    assert r.rehearsal["rounds"] == turns == log["rounds"]  # one round per user turn, none with re-entry off
    assert r.rehearsal["rehearsals"] == 2 * turns and r.rehearsal["real_calls_during_rehearsal"] == 0
    assert engine.seen["rehearse"]  # REHEARSE imagined the tool outputs
    assert log["calls"] >= turns and log["calls_in_rehearsal"] == 0  # real calls only from the committed steps
    assert envs[0].calls_made == sum(len(s) for t in r.calls for s in t)
    assert all(NOTES in p and "Rehearsal 1:" in p for p in engine.seen["commit"])
    # every rehearsal round starts from the real history: the later turns' rounds see earlier real results
    assert any(entry.question[1][0]["content"] in p and "<|im_start|>tool" in p for p in engine.seen["rehearse_act"])


def test_reentry_rehearses_before_every_committed_step(tok, entry, watched):
    _, log = watched
    engine = TurnEngine(tok, entry)
    agent = RehearsalAgent(engine, "sequential", 1, 128, act=P, rehearse=P, seed=0, reenter=True)
    [r] = evaluate_bfcl(engine, ["multi_turn_base"], 1, rehearsal=agent).categories["multi_turn_base"].entries
    assert r.rehearsal["rounds"] == len(engine.seen["commit"]) == log["rounds"] > len(entry.question)
    assert log["calls_in_rehearsal"] == 0 and r.rehearsal["reenter"] is True


def test_a_rehearsal_that_touches_the_real_env_is_an_isolation_error(tok, entry, monkeypatch):
    envs = []

    class Kept(BfclMultiTurnEnv):
        def __init__(self):
            super().__init__()
            envs.append(self)

    def leaky(self, ctx, history=None, prefix=(), turn=0):
        name, args = _gt_calls(entry, 0)[0]
        from envace_core.types import ToolCall

        envs[-1].step(ToolCall(name=name, arguments=args))  # what rehearsal must never be able to do
        return real(self, ctx, history, prefix, turn)

    real = RehearsalAgent.rehearse_round
    monkeypatch.setattr(bfcl_run_mod, "BfclMultiTurnEnv", Kept)
    monkeypatch.setattr(RehearsalAgent, "rehearse_round", leaky)
    engine = TurnEngine(tok, entry)
    with pytest.raises(IsolationError, match="changed the real environment"):
        evaluate_bfcl(engine, ["multi_turn_base"], 1, rehearsal=RehearsalAgent(engine, "parallel", 1, 64, P, P))


def test_no_rehearsal_is_unchanged(tok, entry):
    runs = {}
    for name, agent_mode in (("none", None), ("mode none", "none")):
        engine = TurnEngine(tok, entry)
        agent = None if agent_mode is None else RehearsalAgent(engine, agent_mode, 0, 64, P, P)
        rep = evaluate_bfcl(engine, ["multi_turn_base"], 1, rehearsal=agent)
        runs[name] = (rep.categories["multi_turn_base"].model_dump(), engine.seen)
    assert runs["none"] == runs["mode none"]
    cat, seen = runs["none"]
    assert cat["entries"][0]["rehearsal"] is None and cat["entries"][0]["valid"]
    assert not seen["rehearse"] and not seen["rehearse_act"] and not any(NOTES in p for p in seen["commit"])
    env = BfclMultiTurnEnv()
    env.reset(bfcl_task(entry))
    hist = [{"role": "user", "content": "hi"}]
    assert bfcl_prompt_ids(tok, env.tools(), hist, True) == bfcl_prompt_ids(tok, env.tools(), hist, True, memory="")
    env.close()


def test_tiny_model_rehearses_a_multi_turn_entry(tiny_model_dir, entry, watched):
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer

    _, log = watched
    engine = HFEngine(load_model(tiny_model_dir), load_tokenizer(tiny_model_dir), compute_dtype="float32")
    p = RolloutParams(max_turns=1, max_new_tokens_act=4, max_new_tokens_rehearse=4, temperature=1.0)
    agent = RehearsalAgent(engine, "parallel", 2, 32, act=p, rehearse=p, seed=0)
    rep = evaluate_bfcl(engine, ["multi_turn_base"], 1, max_new_tokens=4, rehearsal=agent)
    [r] = rep.categories["multi_turn_base"].entries
    assert r.rehearsal["rounds"] == log["rounds"] >= 1 and r.rehearsal["rehearsals"] == 2 * log["rounds"]
    assert log["calls_in_rehearsal"] == 0 and r.rehearsal["real_calls_during_rehearsal"] == 0


def test_eval_cli_rehearses_bfcl_multi_turn_and_resumes_per_entry(tiny_model_dir, tmp_path, monkeypatch):
    over = json.dumps({"model": {"compute_dtype": "float32"}, "rollout": {"max_new_tokens_act": 4},
                       "store": {"root": str(tmp_path / "store"), "registry": str(tmp_path / "registry")}})
    out = tmp_path / "ev"
    argv = ["--profile", "test", "--overrides", over, "eval", "--model", str(tiny_model_dir), "--bench",
            "bfcl:multi_turn_base", "--rehearsal", "parallel:2", "--limit", "1", "--out", str(out)]
    assert main(argv) == 0
    first = json.loads((out / "results.json").read_text())
    [e] = first["benches"][0]["report"]["categories"]["multi_turn_base"]["entries"]
    assert e["rehearsal"]["mode"] == "parallel" and e["rehearsal"]["n"] == 2 and e["rehearsal"]["rounds"] >= 1
    assert first["work"] == {"bfcl:multi_turn_base": {"ran": 1, "cached": 0}}
    assert "single-turn BFCL and FinMCP never rehearse" in (out / "report.md").read_text()
    assert (out / "cache" / first["fingerprint"] / "bfcl_multi_turn_base.jsonl").is_file()
    assert main(argv) == 0  # again: the entry comes from the per-entry cache
    again = json.loads((out / "results.json").read_text())
    assert again["work"] == {"bfcl:multi_turn_base": {"ran": 0, "cached": 1}}
    assert again["benches"][0]["report"] == first["benches"][0]["report"]
    argv[argv.index("parallel:2")] = "none"  # other rehearsal settings: another fingerprint, nothing reused
    assert main(argv) == 0
    plain = json.loads((out / "results.json").read_text())
    assert plain["fingerprint"] != first["fingerprint"] and plain["work"]["bfcl:multi_turn_base"]["ran"] == 1
    assert plain["benches"][0]["report"]["categories"]["multi_turn_base"]["entries"][0]["rehearsal"] is None


def test_a_consensus_memory_reaches_only_the_step_after_its_round(tok, entry, watched):
    """rehearsal.memory_content="consensus" names the call to make next: the committed step right after a round
    reads it, the later steps of the same user turn do not (any other memory stays until the next round)."""
    engine = TurnEngine(tok, entry)
    agent = RehearsalAgent(engine, "parallel", 2, 128, act=P, rehearse=P, seed=0, memory_content="consensus")
    evaluate_bfcl(engine, ["multi_turn_base"], 1, rehearsal=agent)
    commits = engine.seen["commit"]
    noted = [k for k, p in enumerate(commits) if NOTES in p]
    assert noted and len(commits) > len(entry.question)  # some round had a consensus; more steps than rounds
    assert all("Rehearsal consensus:" in commits[k] for k in noted)
    assert all(k == 0 or NOTES not in commits[k - 1] for k in noted)  # never two steps in a row
