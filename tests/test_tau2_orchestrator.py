"""The tau2 harness: our agent and user simulator under tau2's OWN Orchestrator and evaluator (METHOD.md §4, §6),
and the opening-request protocol scored by the same evaluator."""

from __future__ import annotations

import json
import math

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.engines.base import Completion
from envace_core import EnvaceError
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.evaluation.protocols import OPENING_REQUEST, TAU2_ORCHESTRATOR
from envace_core.evaluation.tau2 import build_orchestrator, run_tau2, summarize
from envace_core.evaluation.tau2_agents import AGENT_NAME, EnvaceTau2Agent, EnvaceUserSimulator, SimulatedUser
from envace_core.rehearsal.agent import RehearsalAgent
from envace_core.training.rollout import RolloutParams
from tests.scripted import ScriptedEngine

GOLD = '<tool_call>{"name": "cancel_reservation", "arguments": {"reservation_id": "Z7GOZK"}}</tool_call>'
FINAL = "Your reservation Z7GOZK is cancelled."
USER = ["I want to cancel my reservation Z7GOZK, user id olivia_gonzalez_2305.", "###STOP###"]


class UserEngine:
    """Scripted user: reply i = replies[i] (i = the user's own earlier turns, flipped to 'assistant')."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies, self.prompts = tokenizer, list(replies), []

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            self.prompts.append(text)
            i = text.count("<|im_start|>assistant") - 1
            reply = self.replies[min(i, len(self.replies) - 1)]
            ids = self.tokenizer.encode(reply, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append([Completion(ids, [0.0] * len(ids), "stop") for _ in range(params.n)])
        return out


class Exploding:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def generate(self, prompts, params):
        raise AssertionError("cached results must not be recomputed")


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


RP = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=32, temperature=0.0)


def _task19():
    return next(t for t in load_tasks("airline", "test") if t.id == "airline/19")


def plain(engine, rp=RP):
    """`run_tau2`'s agent_for: the engine as a plain ACT agent (no rehearsal)."""
    return lambda domain, seed: RehearsalAgent(engine, "none", 0, 200, rp, rp, seed=seed)


def orchestrated(engine, user_engine, **kw):
    return run_tau2([_task19()], plain(engine), TAU2_ORCHESTRATOR, user=SimulatedUser(engine=user_engine),
                    raise_errors=True, **kw)


def test_registered_in_tau2_registry():
    from tau2.agent.base import LocalAgent
    from tau2.registry import registry

    assert registry.get_agent_constructor(AGENT_NAME) is EnvaceTau2Agent
    assert issubclass(EnvaceTau2Agent, LocalAgent)
    assert EnvaceUserSimulator in [registry.get_user_constructor(u) for u in registry.get_users()]


def test_gold_script_gets_db_reward_1_through_tau2_orchestrator(tok):
    agent, user = ScriptedEngine(tok, [GOLD, FINAL]), UserEngine(tok, USER)
    rep = orchestrated(agent, user)
    [r] = rep["results"]
    assert r["protocol"] == TAU2_ORCHESTRATOR and r["task_id"] == "airline/19" and r["success"] == 1.0
    assert r["reward"] == 1.0 and r["reward_breakdown"]["DB"] == 1.0 and r["db_match"] is True
    assert r["termination_reason"] == "user_stop"
    assert r["agent_stats"]["tool_calls"] == 1 and r["agent_stats"]["parse_errors"] == 0
    d = rep["domains"]["airline"]
    assert d["pass_hat_k"] == {1: 1.0} and d["termination_reasons"] == {"user_stop": 1}
    # the user was prompted with tau2's own guidelines and the task's scenario
    assert "<scenario>" in user.prompts[0] and "olivia_gonzalez_2305" in user.prompts[0]
    # tau2's default greeting is dropped: the ACT prompt starts at the user's first message
    assert agent.calls == ["act", "act"]


def test_wrong_write_gets_db_0(tok):
    from tau2.registry import registry

    db = registry.get_env_constructor("airline")().tools.db
    other = next(rid for rid, r in db.reservations.items() if rid != "Z7GOZK" and r.status != "cancelled")
    wrong = GOLD.replace("Z7GOZK", other)
    rep = orchestrated(ScriptedEngine(tok, [wrong, FINAL]), UserEngine(tok, USER))
    [r] = rep["results"]
    assert r["reward_breakdown"]["DB"] == 0.0 and r["reward"] == 0.0 and r["db_match"] is False
    assert rep["domains"]["airline"]["pass_hat_k"] == {1: 0.0}


def test_parse_failure_becomes_a_text_message_and_is_counted(tok):
    bad = '<tool_call>{"name": "cancel_reservation", "arguments": {"reservation_id": 7}}</tool_call>'
    orch, agent, _ = build_orchestrator(_task19(), plain(ScriptedEngine(tok, [bad]))("airline", 0),
                                        SimulatedUser(engine=UserEngine(tok, USER)))
    sim = orch.run()
    assert agent.stats["parse_errors"] == 1 and agent.stats["tool_calls"] == 0
    texts = [m.content for m in sim.messages if m.role == "assistant"]
    assert bad in texts


@pytest.mark.parametrize("reenter", [False, True])
def test_rehearsal_makes_no_real_env_calls_and_keeps_db_hash(tok, reenter):
    from tau2.registry import registry

    engine = ScriptedEngine(tok, [GOLD, FINAL])
    reh = RehearsalAgent(engine, "parallel", 2, 200, act=RP, rehearse=RP, reenter=reenter)
    env = registry.get_env_constructor("airline")()
    calls = []
    real_get_response = env.get_response
    env.get_response = lambda tc: (calls.append(tc.name), real_get_response(tc))[1]
    orch, agent, _ = build_orchestrator(_task19(), reh, SimulatedUser(engine=UserEngine(tok, USER)), environment=env)
    seen = []
    real_rehearse = agent._rehearse

    def watched(ctx, history, turn):
        before = (len(calls), env.get_db_hash())
        memory = real_rehearse(ctx, history, turn)
        seen.append((turn, before, (len(calls), env.get_db_hash())))
        return memory

    agent._rehearse = watched
    orch.initialize()
    start_hash = env.get_db_hash()
    while not orch.done:
        orch.step()
    assert "rehearse" in engine.calls and agent.stats["rehearsals"] >= 2
    turn0 = seen[0]
    assert turn0[0] == 0 and turn0[1] == turn0[2] == (0, start_hash)  # nothing real before the first action
    assert all(b == a for _, b, a in seen)  # no round touched the real environment
    assert len(seen) == (2 if reenter else 1)
    assert calls == ["cancel_reservation"]  # the one real call is the committed action
    assert agent.rounds[0].memory and "Rehearsal 1" in agent.rounds[0].memory


def test_pass_hat_k_on_hand_numbers():
    def rec(task, trial, reward, term="user_stop"):
        return {"domain": "airline", "task_id": task, "trial": trial, "reward": reward,
                "reward_breakdown": {"DB": reward}, "termination_reason": term}

    rs = [rec("a", 0, 1.0), rec("a", 1, 1.0), rec("a", 2, 0.0, "max_steps"),
          rec("b", 0, 1.0), rec("b", 1, 1.0), rec("b", 2, 1.0)]
    d = summarize(rs, trials=3)["airline"]
    # task a: c=2,n=3 -> 2/3, C(2,2)/C(3,2)=1/3, 0; task b: 1,1,1
    assert d["pass_hat_k"][1] == pytest.approx((2 / 3 + 1) / 2)
    assert d["pass_hat_k"][2] == pytest.approx((1 / 3 + 1) / 2)
    assert d["pass_hat_k"][3] == pytest.approx(0.5)
    assert math.isclose(d["reward_breakdown"]["DB"], 5 / 6)
    assert d["termination_reasons"] == {"user_stop": 5, "max_steps": 1}


def test_resume_skips_finished_results(tok, tmp_path):
    cache = tmp_path / "tau2.jsonl"
    first = orchestrated(ScriptedEngine(tok, [GOLD, FINAL]), UserEngine(tok, USER), cache_path=cache)
    assert first["skipped"] == 0 and len(cache.read_text().splitlines()) == 1
    again = orchestrated(Exploding(tok), Exploding(tok), cache_path=cache)
    assert again["skipped"] == 1 and again["results"][0]["reward"] == 1.0
    assert again["domains"]["airline"]["pass_hat_k"] == {1: 1.0}
    # a second trial is new work: only it runs, and is appended
    more = orchestrated(ScriptedEngine(tok, [GOLD, FINAL]), UserEngine(tok, USER), cache_path=cache, trials=2)
    assert more["skipped"] == 1 and [json.loads(x)["trial"] for x in cache.read_text().splitlines()] == [0, 1]
    assert more["domains"]["airline"]["pass_hat_k"] == {1: 1.0, 2: 1.0}


def test_smoke_real_tiny_hf_model(tiny_model_dir):
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    engine = HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32", max_batch_size=2)
    # the real model as both agent and user (its random replies may end the dialogue at once) ...
    rp = RolloutParams(max_turns=3, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=0.0)
    rep = run_tau2([_task19()], plain(engine, rp), TAU2_ORCHESTRATOR, max_steps=6, raise_errors=True,
                   user=SimulatedUser(max_new_tokens=8))
    [r] = rep["results"]
    assert r["error"] is None and r["reward"] in (0.0, 1.0) and r["user_stats"]["calls"] >= 1
    # ... and as the agent against a scripted user, so it surely acts
    rep = run_tau2([_task19()], plain(engine, rp), TAU2_ORCHESTRATOR, max_steps=8, raise_errors=True,
                   user=SimulatedUser(engine=UserEngine(tok, [USER[0], "Anything else?", "###STOP###"])))
    [r] = rep["results"]
    assert r["error"] is None and r["reward"] in (0.0, 1.0) and r["agent_stats"]["act_calls"] >= 1
    assert r["termination_reason"] in ("user_stop", "max_steps", "too_many_errors")


def test_user_through_an_openai_compatible_loopback_endpoint(tok):
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from envace_core.evaluation.tau2_agents import OpenAIChatClient

    bodies = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            bodies.append((self.path, body))
            i = sum(m["role"] == "assistant" for m in body["messages"])  # the user's own earlier turns
            reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": USER[min(i, 1)]}}]})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(reply.encode())

        def log_message(self, *a):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = OpenAIChatClient(f"http://127.0.0.1:{server.server_port}/v1", "local-user")
        rep = run_tau2([_task19()], plain(ScriptedEngine(tok, [GOLD, FINAL])), TAU2_ORCHESTRATOR,
                       user=SimulatedUser(client=client), raise_errors=True)
    finally:
        server.shutdown()
    assert rep["results"][0]["reward"] == 1.0
    path, body = bodies[0]
    assert path == "/v1/chat/completions" and body["model"] == "local-user"
    assert body["messages"][0]["role"] == "system" and "<scenario>" in body["messages"][0]["content"]


# ------------------------------------------------------------------------------ opening_request
def test_opening_request_scores_the_gold_script_1_and_a_wrong_write_0_with_tau2s_evaluator(tok):
    from tau2.registry import registry

    rep = run_tau2([_task19()], plain(ScriptedEngine(tok, [GOLD, FINAL])), OPENING_REQUEST, raise_errors=True)
    [r] = rep["results"]
    assert r["protocol"] == OPENING_REQUEST and r["task_id"] == "airline/19" and r["error"] is None
    assert r["reward"] == 1.0 and r["success"] == 1.0 and r["reward_breakdown"]["DB"] == 1.0 and r["db_match"]
    assert r["termination_reason"] == "agent_message" and r["user_stats"] == {}
    assert r["agent_stats"] == {"act_calls": 2, "tool_calls": 1, "messages": 1, "parse_errors": 0,
                                "rehearsal_rounds": 0, "rehearsals": 0, "rejected": 0}
    steps = r["trace"]["committed"]["steps"]  # what was committed, readable from the record itself
    assert r["trace"]["rounds"] == [] and r["trace"]["committed"]["termination"] == "agent_message"
    assert steps[0]["call"] == {"name": "cancel_reservation", "arguments": {"reservation_id": "Z7GOZK"}}
    assert not steps[0]["error"] and "Z7GOZK" in steps[0]["observation"] and steps[1] == {"message": FINAL}
    db = registry.get_env_constructor("airline")().tools.db
    other = next(rid for rid, x in db.reservations.items() if rid != "Z7GOZK" and x.status != "cancelled")
    wrong = run_tau2([_task19()], plain(ScriptedEngine(tok, [GOLD.replace("Z7GOZK", other), FINAL])),
                     OPENING_REQUEST, raise_errors=True)["results"][0]
    assert wrong["reward"] == 0.0 and wrong["success"] == 0.0 and wrong["db_match"] is False


def test_opening_request_with_rehearsal_records_isolation_and_a_turn_limit_scores_0(tok):
    engine = ScriptedEngine(tok, [GOLD])  # calls the tool on every turn: never ends by itself
    reh = lambda domain, seed: RehearsalAgent(engine, "parallel", 2, 200, act=RP, rehearse=RP, seed=seed)
    [r] = run_tau2([_task19()], reh, OPENING_REQUEST, raise_errors=True)["results"]
    assert r["termination_reason"] == "max_turns" and r["reward"] == 0.0 and r["agent_stats"]["act_calls"] == 3
    assert r["agent_stats"]["rehearsals"] == 2 and r["agent_stats"]["rehearsal_rounds"] == 1
    assert r["isolation"] == {"real_calls_during_rehearsal": 0, "db_hash_unchanged": True}
    [rnd] = r["trace"]["rounds"]  # the two rehearsals, each a run of imagined cancellations, and the memory
    assert [x["index"] for x in rnd["rehearsals"]] == [1, 2] and isinstance(rnd["memory"], str)
    assert all(s["call"]["name"] == "cancel_reservation" for x in rnd["rehearsals"] for s in x["steps"])
    assert [s["call"]["name"] for s in r["trace"]["committed"]["steps"]] == ["cancel_reservation"] * 3
    assert r["trace"]["committed"]["termination"] == "max_turns"


def test_run_tau2_refuses_bad_protocol_trials_and_hooks_for_the_orchestrator(tok):
    agent = plain(ScriptedEngine(tok, [FINAL]))
    with pytest.raises(EnvaceError, match="tau2_orchestrator, opening_request"):
        run_tau2([_task19()], agent, "full")
    with pytest.raises(EnvaceError, match="trials"):
        run_tau2([_task19()], agent, OPENING_REQUEST, trials=0)
    with pytest.raises(EnvaceError, match="opening_request only"):
        run_tau2([_task19()], agent, TAU2_ORCHESTRATOR, score=lambda task, traj: traj)


def test_a_trace_that_fails_leaves_the_scored_episode_as_it_is(tok, monkeypatch):
    from envace_core.rehearsal import trace

    def broken(rounds, traj):
        raise ValueError("cannot serialise")

    monkeypatch.setattr(trace, "episode", broken)
    [r] = run_tau2([_task19()], plain(ScriptedEngine(tok, [GOLD, FINAL])), OPENING_REQUEST)["results"]
    assert r["error"] is None and r["reward"] == 1.0 and r["trace"] == {"error": "ValueError: cannot serialise"}


def test_a_consensus_memory_reaches_only_the_act_turn_after_its_round(tok):
    """rehearsal.memory_content="consensus": the first ACT turn reads the consensus call, the next one (no
    re-entry) does not; the consensus is the grounded call both rehearsals began with."""

    class Recording(ScriptedEngine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.act_prompts: list[str] = []

        def generate(self, prompts, params):
            texts = [self.tokenizer.decode(p) for p in prompts]
            self.act_prompts += [t for t in texts if "You simulate the" not in t]
            return super().generate(prompts, params)

    engine = Recording(tok, [GOLD, FINAL])
    reh = RehearsalAgent(engine, "parallel", 2, 200, act=RP, rehearse=RP, memory_content="consensus")
    orch, agent, _ = build_orchestrator(_task19(), reh, SimulatedUser(engine=UserEngine(tok, USER)))
    orch.initialize()
    while not orch.done:
        orch.step()
    assert agent.rounds[0].memory.startswith("Rehearsal consensus: 2 of 2 rehearsals began with\n- called "
                                             'cancel_reservation({"reservation_id": "Z7GOZK"})')
    committed = engine.act_prompts[-2:]  # the committed turns: the cancellation, then the answer
    assert "Rehearsal consensus" in committed[0] and "Notes from rehearsal" not in committed[1]
