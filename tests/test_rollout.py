"""Self-unfolded rollouts: structure, replay scoring, and token-in/token-out training rows."""

import json

import pytest

from envace_core.config import load_config
from envace_core.engines.hf import HFEngine
from envace_core.envs.tau2.tasks import load_tasks, task_context
from envace_core.models import load_model, load_tokenizer
from envace_core.training.loop import rollout_metrics, score
from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
from envace_core.training.rows import TrainingRow
from envace_core.training.trainer import PolicyTrainer
from envace_core.types import Role
from tests.scripted import ScriptedEngine


def _gold_text(call):
    return "<tool_call>" + json.dumps({"name": call.name, "arguments": call.arguments}) + "</tool_call>"


def test_self_unfolded_rollout_alternates_roles_and_is_replay_scored(tiny_model_dir):
    task = next(t for t in load_tasks("airline", "test") if len(t.gold_actions) == 1)
    gold = task.gold_actions[0]
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir), [_gold_text(gold), "All done."],
                            rehearse_text='{"status": "ok"}')
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    trajs = rehearsal_rollouts(engine, task_context(task, 300), 2, p, seed=0)
    t = trajs[0]
    assert [g.role for g in t.generations] == [Role.ACT, Role.REHEARSE, Role.ACT]
    assert t.termination == "agent_message" and t.steps[0].action.name == gold.name
    assert t.steps[0].observation.content == '{"status":"ok"}'  # the canonical rendering
    score(task, t)
    assert t.steps[0].real_observation is not None  # replayed for real, privately
    assert t.steps[0].fidelity is not None and 0.0 <= t.steps[0].fidelity <= 1.0
    assert t.sub_rewards.get("DB") == 1.0  # the gold write, replayed, reproduces the gold DB


def test_turn_limit_and_parse_error_end_with_the_tau2_rule(tiny_model_dir):
    task = load_tasks("airline", "test", limit=1)[0]
    tok = load_tokenizer(tiny_model_dir)
    p = RolloutParams(max_turns=1, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    call = _gold_text(task.gold_actions[0]) if task.gold_actions else '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "x"}}</tool_call>'
    t = rehearsal_rollouts(ScriptedEngine(tok, [call]), task_context(task, 300), 1, p)[0]
    assert t.termination == "max_turns"
    assert score(task, t).reward == 0.0  # cut off by the turn limit: not a clean stop
    bad = rehearsal_rollouts(ScriptedEngine(tok, ['<tool_call>{"name": </tool_call>']),
                             task_context(task, 300), 1, p)[0]
    assert bad.termination == "parse_error" and bad.generations[0].parse_error.startswith("MalformedToolCall")
    assert score(task, bad, format_penalty=-0.5).reward == -0.5


def test_trained_token_ids_are_exactly_the_generated_ones(tiny_model_dir):
    """Rows carry the engine's ids unchanged, and the trainer's log-probs of them match rollout's."""
    tok = load_tokenizer(tiny_model_dir)
    cfg = load_config("test", {"train": {"micro_batch_rows": 3}})
    trainer = PolicyTrainer(load_model(tiny_model_dir), tok, cfg.train, compute_dtype="float32")
    engine = HFEngine(trainer.model, tok, compute_dtype="float32")
    task = load_tasks("airline", "train", limit=1)[0]
    p = RolloutParams(max_turns=2, max_new_tokens_act=6, max_new_tokens_rehearse=6, temperature=1.0)
    trajs = rehearsal_rollouts(engine, task_context(task, 300), 3, p, seed=1)
    gens = [g for t in trajs for g in t.generations]
    rows = [TrainingRow.from_generation(g, 1.0) for g in gens]
    for g, r in zip(gens, rows):
        assert r.prompt_ids == g.prompt_ids and r.completion_ids == g.completion_ids
        assert r.old_logprobs == g.logprobs
    for g, lp in zip(gens, trainer.completion_logprobs(rows)):
        assert lp == pytest.approx(g.logprobs, abs=1e-4)


# ------------------------------------------------------------------------------------ USER-REHEARSE
class UserScriptedEngine(ScriptedEngine):
    """ScriptedEngine that also answers USER-REHEARSE prompts (recognised by tau2's <scenario> tag):
    user reply i = user_texts[i], i = the user's own earlier turns (after the first message)."""

    def __init__(self, tokenizer, act_texts, user_texts, rehearse_text='{"status": "ok"}'):
        super().__init__(tokenizer, act_texts, rehearse_text)
        self.user_texts, self.user_prompts = list(user_texts), []

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            if "<scenario>" not in text:
                out += super().generate([p], params)
                continue
            self.calls.append("user")
            self.user_prompts.append(text)
            i = text.count("<|im_start|>assistant") - 2  # own turns, minus the opening and the generation prompt
            reply = self.user_texts[min(i, len(self.user_texts) - 1)]
            out.append([self._completion(reply) for _ in range(params.n)])
        return out


ASK = "Could you tell me your user id?"


@pytest.fixture(scope="module")
def one_call_task():
    return next(t for t in load_tasks("airline", "test") if len(t.gold_actions) == 1)


def test_user_rehearse_imagines_user_turns_until_stop(tiny_model_dir, one_call_task):
    from envace_core.roles.user import user_instructions

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    engine = UserScriptedEngine(tok, [ASK, _gold_text(task.gold_actions[0]), "All done."],
                                ["My user id is in my first message.", "Thanks! ###STOP###"])
    p = RolloutParams(max_turns=4, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    instr = user_instructions(task.user_scenario)
    t = rehearsal_rollouts(engine, task_context(task, 300), 2, p, seed=0, user=instr)[0]
    assert [g.role for g in t.generations] == [Role.ACT, Role.USER, Role.ACT, Role.REHEARSE, Role.ACT, Role.USER]
    assert t.termination == "user_stop"
    assert [s.message for s in t.steps if s.action is None] == [ASK, "All done."]
    # the user's reply is ACT's next context; the user sees no tool I/O; the scenario reaches only USER
    act2 = tok.decode(t.generations[2].prompt_ids)
    assert "My user id is in my first message." in act2 and "<scenario>" not in act2
    assert '{"status": "ok"}' not in engine.user_prompts[-1] and ASK in engine.user_prompts[-1]
    assert "Task instructions:" in engine.user_prompts[0]
    assert score(task, t).reward == score(task, t.model_copy(update={"termination": "agent_message"})).reward
    assert t.reward_info["reward_fn"] == "replay" and t.sub_rewards.get("DB") == 1.0  # user stop is clean


def test_user_rehearse_turn_budget_and_parse_error(tiny_model_dir, one_call_task):
    from envace_core.roles.user import user_instructions

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    instr = user_instructions(task.user_scenario)
    p1 = RolloutParams(max_turns=1, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    eng = UserScriptedEngine(tok, [ASK], ["never asked"])
    t = rehearsal_rollouts(eng, task_context(task, 300), 1, p1, user=instr)[0]
    assert t.termination == "agent_message" and "user" not in eng.calls  # budget spent: no user turn
    p3 = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    bad = rehearsal_rollouts(UserScriptedEngine(tok, [ASK], ["###STOP### p.s."]), task_context(task, 300), 1, p3,
                             user=instr)[0]
    assert bad.termination == "parse_error" and bad.generations[-1].role == Role.USER
    assert bad.generations[-1].parse_error.startswith("InvalidUserTurn")
    assert score(task, bad, format_penalty=-1.0).reward == -1.0
    chatty = rehearsal_rollouts(UserScriptedEngine(tok, [ASK], ["Why?"]), task_context(task, 300), 1, p3,
                                user=instr)[0]
    assert [g.role for g in chatty.generations] == [Role.ACT, Role.USER] * 2 + [Role.ACT]
    assert chatty.termination == "agent_message"  # the last allowed ACT turn spoke: budget, not a stop


def test_user_rows_get_the_trajectory_reward_and_their_own_baseline():
    from envace_core.training.grpo import estimate_advantages
    from envace_core.training.rows import rows_from_group
    from envace_core.types import Generation, Trajectory

    def traj(r, roles_):
        return Trajectory(task_id="t", reward=r, generations=[
            Generation(role=x, prompt_ids=[1], completion_ids=[2], logprobs=[0.0]) for x in roles_])

    trajs = [traj(1.0, [Role.ACT, Role.USER, Role.ACT]), traj(0.0, [Role.ACT, Role.USER, Role.ACT, Role.USER])]
    rows = rows_from_group("g", trajs)
    assert [r.reward for r in rows] == [1.0] * 3 + [0.0] * 4 and [r.trajectory_index for r in rows] == [0] * 3 + [1] * 4
    stats = estimate_advantages(rows)
    user = [r.advantage for r in rows if r.role == "user"]
    assert user == pytest.approx([1 - 1 / 3, -1 / 3, -1 / 3])  # baseline = mean over the 3 USER rows
    assert stats["reward_mean/user"] == pytest.approx(1 / 3) and stats["reward_mean/act"] == pytest.approx(0.5)


# ------------------------------------------------------------------------------ training groups
def test_training_group_default_is_rehearsal_rollouts_plus_replay_score(tiny_model_dir, one_call_task):
    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    cfg = load_config("test", {"rollout": {"group_size": 2, "max_turns": 3}})
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    texts = [_gold_text(task.gold_actions[0]), "All done."]
    from envace_core.training.rollout import training_group

    got = training_group(ScriptedEngine(tok, texts), task, cfg, p, seed=5)
    ref = [score(task, t) for t in rehearsal_rollouts(ScriptedEngine(tok, texts), task_context(task, 300), 2, p, seed=5)]
    steps = [t.reward_info.pop("env_steps") for t in got]
    assert [t.model_dump() for t in got] == [t.model_dump() for t in ref]
    # World Rehearsal's rollouts touch no environment; scoring replays the one call (and tau2 scores on a copy)
    assert all(s["rollout"] == 0 and s["reward"] >= 1 for s in steps)
    assert rollout_metrics(got)["env_steps/rollout"] == 0


def test_env_steps_are_counted_per_thread_once_per_call():
    import threading

    from envace_core.envs.base import env_steps_in_thread
    from envace_core.envs.tau2.environment import Tau2Environment

    class Wrapped(Tau2Environment):  # a step that calls its parent's step counts once
        def step(self, call):
            return super().step(call)

    env = Wrapped("airline")
    env.reset(load_tasks("airline", "test")[0])
    before = env_steps_in_thread()
    from envace_core.types import ToolCall

    env.step(ToolCall(id="c", name="list_all_airports", arguments={}))
    env.step(ToolCall(id="c", name="no_such_tool", arguments={}))  # an error result is a real call too
    assert env_steps_in_thread() - before == 2 == env.calls_made
    other = []
    th = threading.Thread(target=lambda: other.append(env_steps_in_thread()))
    th.start()
    th.join()
    assert other == [0]  # another thread's count starts at 0


def test_real_source_is_act_only_against_private_environments(tiny_model_dir, one_call_task):
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.training.rollout import training_group

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    made = []

    def factory(domain):
        made.append(Tau2Environment(domain))
        return made[-1]

    cfg = load_config("test", {"rollout": {"source": "real", "group_size": 3, "max_turns": 3}})
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    engine = ScriptedEngine(tok, [_gold_text(task.gold_actions[0]), "All done."])
    trajs = training_group(engine, task, cfg, p, seed=0, env_factory=factory)
    assert "rehearse" not in engine.calls and len(made) == 3  # one fresh private copy per trajectory
    assert all(env.calls_made == 1 for env in made)
    assert [t.reward_info["env_steps"]["rollout"] for t in trajs] == [1, 1, 1]
    assert rollout_metrics(trajs)["env_steps/rollout"] == 3 and rollout_metrics(trajs)["env_steps/reward"] >= 3
    for t in trajs:
        assert not t.imagined and [g.role for g in t.generations] == [Role.ACT, Role.ACT]
        s = t.steps[0]
        assert s.observation is not None and s.observation == s.real_observation and s.fidelity is None
        assert tok.decode(t.generations[1].prompt_ids).count(s.observation.content[:40]) == 1  # real obs as context
        assert t.reward is not None and t.reward_info["reward_fn"] == "replay"
    imagined = training_group(ScriptedEngine(tok, [_gold_text(task.gold_actions[0]), "All done."]), task,
                              load_config("test", {"rollout": {"group_size": 3, "max_turns": 3}}), p, seed=0)
    assert [t.sub_rewards.get("DB") for t in trajs] == [t.sub_rewards.get("DB") for t in imagined]  # same reward


# ----------------------------------------------------------------------------------- role freezing
def test_frozen_roles_get_no_rows_and_no_gradient(tiny_model_dir, one_call_task):
    """With train.trained_roles=[act], REHEARSE and USER rows are skipped: the step equals an ACT-only step."""
    import torch

    from envace_core.roles.user import user_instructions

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    engine = UserScriptedEngine(tok, [ASK, _gold_text(task.gold_actions[0]), "All done."], ["u1", "###STOP###"])
    p = RolloutParams(max_turns=4, max_new_tokens_act=16, max_new_tokens_rehearse=16, temperature=1.0)
    t = rehearsal_rollouts(engine, task_context(task, 300), 1, p, user=user_instructions(task.user_scenario))[0]
    rows = [TrainingRow.from_generation(g, 1.0 if i % 2 else -1.0) for i, g in enumerate(t.generations)]
    scorer = PolicyTrainer(load_model(tiny_model_dir), tok, load_config("test").train, compute_dtype="float32")
    for r, lp in zip(rows, scorer.completion_logprobs(rows)):
        r.old_logprobs = lp  # on-policy behaviour log-probs (the scripted engine's are placeholders)
    assert {r.role for r in rows} == {"act", "rehearse", "user"}
    cfg = load_config("test", {"train": {"trained_roles": ["act"], "learning_rate": 1e-2}})
    assert set(load_config("test", {"rollout": {"user_rehearse": True},
                                    "train": {"trained_roles": ["act", "rehearse", "user"]}}).train.trained_roles) \
        == {"act", "rehearse", "user"}

    def after_step(batch):
        tr = PolicyTrainer(load_model(tiny_model_dir), tok, cfg.train, compute_dtype="float32")
        m = tr.step(batch)
        return m, {n: q.detach().clone() for n, q in tr.model.named_parameters() if q.requires_grad}

    m_all, w_all = after_step(rows)
    m_act, w_act = after_step([r for r in rows if r.role == "act"])
    assert m_all["rows"] == m_act["rows"] == 3 and m_all["rows_skipped"] == 3
    assert all(torch.equal(w_all[n], w_act[n]) for n in w_act)
    assert any(not torch.equal(w_act[n], torch.zeros_like(w_act[n])) for n in w_act if "lora_B" in n)  # it moved
    frozen = [r for r in rows if r.role != "act"]
    with pytest.raises(ValueError, match="no trainable row"):
        PolicyTrainer(load_model(tiny_model_dir), tok, cfg.train, compute_dtype="float32").step(frozen)


# ------------------------------------------------------------------------- long tool results, long prompts
class ContextEngine(ScriptedEngine):
    """ScriptedEngine with a context window: like `HFEngine`, it rejects a prompt that leaves no room for
    max_new_tokens (ValueError), so a prompt the rollout does not bound crashes here as it does for real."""

    context_tokens = 4096

    def generate(self, prompts, params):
        for i, p in enumerate(prompts):
            if len(p) > self.context_tokens - params.max_new_tokens:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={params.max_new_tokens} it "
                                 f"must be at most {self.context_tokens - params.max_new_tokens}")
        return super().generate(prompts, params)


def _huge_result() -> str:  # ~200 KB of JSON, as a search tool over a big table returns
    return json.dumps({"flights": [{"flight_number": f"HAT{i:04d}", "origin": "JFK", "destination": "SFO",
                                    "status": "available", "prices": {"economy": 100 + i, "business": 900 + i},
                                    "seats": {"economy": i % 17, "business": i % 5}} for i in range(1300)]})


def test_a_200kb_real_tool_result_is_cut_with_a_marker_and_the_real_rollout_completes(tiny_model_dir, one_call_task):
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.training.rollout import training_group
    from envace_core.types import Observation

    class HugeResults(Tau2Environment):
        def step(self, call):
            super().step(call)
            return Observation(content=_huge_result())

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    assert len(_huge_result()) > 190_000 and len(tok.encode(_huge_result())) > 60_000
    cfg = load_config("test", {"rollout": {"source": "real", "group_size": 2, "max_turns": 3,
                                           "max_observation_tokens": 512}})
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    engine = ContextEngine(tok, [_gold_text(task.gold_actions[0]), "All done."])
    trajs = training_group(engine, task, cfg, p, seed=0, env_factory=HugeResults)  # raised ValueError before
    for t in trajs:
        assert t.termination == "agent_message" and t.reward is not None
        assert t.steps[0].observation.content == _huge_result()  # the trajectory keeps the whole result
        second = t.generations[1].prompt_ids
        text = tok.decode(second)
        assert "…[tool result truncated: " in text and f"tokens shown]" in text
        first_len = len(t.generations[0].prompt_ids)
        assert len(second) <= first_len + 512 + 64  # + the call, the tool turn's template tokens


def test_a_prompt_that_cannot_fit_is_a_masked_prompt_too_long_trajectory(tiny_model_dir, one_call_task):
    """An uncut 200 KB result (max_observation_tokens=None) against the real HFEngine's context: the
    trajectory ends as prompt_too_long, reward None (masked), counted in the rollout metrics; no exception."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.training.loop import rollout_metrics
    from envace_core.training.rollout import training_group
    from envace_core.training.rows import rows_from_group
    from envace_core.types import Observation

    class HugeResults(Tau2Environment):
        def step(self, call):
            super().step(call)
            return Observation(content=_huge_result())

    task, tok = one_call_task, load_tokenizer(tiny_model_dir)
    cfg = load_config("test", {"rollout": {"source": "real", "group_size": 2, "max_turns": 3,
                                           "max_observation_tokens": None}, "train": {"format_penalty": -1.0}})
    p = RolloutParams(max_turns=3, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0)
    engine = ContextEngine(tok, [_gold_text(task.gold_actions[0]), "All done."])
    trajs = training_group(engine, task, cfg, p, seed=0, env_factory=HugeResults)
    for t in trajs:
        assert t.termination == "prompt_too_long" and t.reward is None and t.reward_info["masked"] == "prompt_too_long"
        info = t.reward_info["prompt_too_long"]
        assert info["role"] == "act" and info["tokens"] > info["limit"] == 4096 - 64
        assert len(t.generations) == 1  # the second ACT turn was never generated
    rows = rows_from_group("g", trajs)
    assert rows and not any(r.valid for r in rows)  # masked, not scored 0 or penalised
    m = rollout_metrics(trajs)
    assert m["termination/prompt_too_long"] == 2 and m["masked_trajectories"] == 2
    # the real engine: a policy too long for its context is the same typed trajectory, not a ValueError
    model = load_model(tiny_model_dir)
    ctx = task_context(task, None).model_copy(update={"policy": "Rule. " * 5000})
    t = rehearsal_rollouts(HFEngine(model, tok, compute_dtype="float32"), ctx, 2, p, seed=0)
    assert [x.termination for x in t] == ["prompt_too_long"] * 2 and all(not x.generations for x in t)
    assert t[0].reward_info["prompt_too_long"]["limit"] == model.config.max_position_embeddings - 64


def test_rehearse_budget_per_tool_and_grounding_reach_the_engine(tiny_model_dir):
    from envace_core.roles.grounding import GroundingIndex
    from envace_core.training.transitions import Transition
    from envace_core.types import Message, Observation, ToolCall

    task = next(t for t in load_tasks("airline", "test") if len(t.gold_actions) == 1)
    gold = task.gold_actions[0]
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir), [_gold_text(gold), "All done."],
                            rehearse_text='{"status": "ok"}')
    other = Transition("airline/other", "airline", gold.name, [Message(role="user", content="hi")],
                       ToolCall(name=gold.name, arguments=gold.arguments), Observation(content='{"seen":"EX4MPLE"}'),
                       "success")
    own = Transition(task.id, "airline", gold.name, [Message(role="user", content="hi")],
                     ToolCall(name=gold.name, arguments=gold.arguments), Observation(content='{"own":"LEAKED"}'),
                     "success")
    p = RolloutParams(max_turns=2, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0,
                      max_new_tokens_rehearse_per_tool={gold.name: 17}, grounding=GroundingIndex([own, other]),
                      grounding_k=2, grounding_max_tokens=300)
    seen = []
    real_generate = engine.generate
    engine.generate = lambda prompts, sp: seen.append((sp.role, sp.max_new_tokens, prompts)) or real_generate(prompts, sp)
    rehearsal_rollouts(engine, task_context(task, 300), 1, p, seed=0)
    rehearse = [(n, pr) for role, n, pr in seen if role == "rehearse"]
    assert rehearse and rehearse[0][0] == 17
    text = engine.tokenizer.decode(rehearse[0][1][0])
    assert "EX4MPLE" in text and "LEAKED" not in text  # another task's example, never the task's own
