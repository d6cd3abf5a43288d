"""The `judge` reward: checklist from tau2's evaluation criteria, strict verdict parsing, masking."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.config import load_config
from envace_core.envs.tau2.tasks import load_tasks
from envace_core.roles.errors import EmptyOutput
from envace_core.training.judge import (
    InvalidVerdict,
    Judge,
    build_judge,
    checklist,
    parse_verdict,
    transcript,
)
from envace_core.training.rewards import (
    get_reward_fn,
    reward_fn_from_config,
    score_trajectory,
)
from envace_core.types import Generation, Observation, Role, Step, ToolCall, Trajectory
from tests.scripted import ScriptedEngine


@pytest.fixture(scope="module")
def task():
    return load_tasks("airline", "train", limit=3)[2]  # 2 gold actions, communicate "4", 2 NL assertions


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


class VerdictEngine(ScriptedEngine):
    """Answers every prompt with `verdict` and records the decoded prompts."""

    def __init__(self, tokenizer, verdict):
        super().__init__(tokenizer, [verdict])
        self.prompts = []

    def generate(self, prompts, params):
        self.prompts += [self.tokenizer.decode(p) for p in prompts]
        return [[self._completion(self.act_texts[0]) for _ in range(params.n)] for _ in prompts]


def _traj(task):
    call = ToolCall(name="get_reservation_details", arguments={"reservation_id": "JMO1MG"})
    return Trajectory(task_id=task.id, termination="agent_message", steps=[
        Step(action=call, observation=Observation(content='{"cabin": "economy"}')),
        Step(message="Which cabin?"), Step(message="You can bring 4 suitcases.")],
        generations=[Generation(role=Role.USER, prompt_ids=[1], completion_ids=[2], logprobs=[0.0],
                                text="Economy, I think.")])


def test_checklist_comes_from_the_evaluation_criteria(task):
    items = checklist(task)
    assert [i.kind for i in items] == ["ACTION", "ACTION", "COMMUNICATE", "NL_ASSERTION", "NL_ASSERTION"]
    assert items[0].text == 'The agent called get_reservation_details with arguments {"reservation_id": "JMO1MG"}.'
    assert items[2].text == "The agent told the user: 4"
    assert items[3].text == "Agent detects that user is actually a Silver member."


def test_transcript_interleaves_imagined_user_replies(task):
    text = transcript(task, _traj(task))
    assert text.startswith("user: " + task.first_user_message.strip())
    assert text.splitlines()[-5:] == ['agent called: {"name": "get_reservation_details", "arguments": {"reservation_id": "JMO1MG"}}',
                         'tool returned: {"cabin": "economy"}', "agent: Which cabin?", "user: Economy, I think.",
                         "agent: You can bring 4 suitcases."]


@pytest.mark.parametrize("text", ['{"met": [true, false]}', '```json\n{"met": [true, false]}\n```'])
def test_parse_verdict(text):
    assert parse_verdict(text, 2) == [True, False]


@pytest.mark.parametrize("text, match", [
    ('{"met": [true]}', "exactly 2"), ('{"met": [true, "yes"]}', "booleans"), ('{"met": [1, 0]}', "booleans"),
    ('Sure! {"met": [true, true]}', "JSON"), ('{"met": [true, true], "why": ""}', "exactly"),
    ('[true, true]', "exactly"), ('{"met": [true, true]', "JSON")])
def test_parse_verdict_is_strict(text, match):
    with pytest.raises(InvalidVerdict, match=match):
        parse_verdict(text, 2)
    with pytest.raises(EmptyOutput):
        parse_verdict("  ", 2)


def test_judge_reward_mean_all_and_sub_rewards(tok, task):
    engine = VerdictEngine(tok, '{"met": [true, true, false, true, false]}')
    fn = get_reward_fn("judge", judge=Judge(engine))
    t = _traj(task)
    res = fn(task, t)
    assert res.reward == pytest.approx(0.6) and t.reward == pytest.approx(0.6)
    assert res.sub_rewards == {"ACTION": 1.0, "COMMUNICATE": 0.0, "NL_ASSERTION": 0.5}
    assert [c["met"] for c in t.reward_info["checklist"]] == [True, True, False, True, False]
    prompt = engine.prompts[0]
    assert "5. Agent communicate to user" in prompt and "Economy, I think." in prompt and "exactly 5 booleans" in prompt
    assert Judge(engine, aggregate="all").score(task, _traj(task)).reward == 0.0
    assert Judge(VerdictEngine(tok, json.dumps({"met": [True] * 5})), aggregate="all").score(task, t).reward == 1.0


def test_failed_verdict_masks_the_trajectory_never_zero(tok, task):
    fn = get_reward_fn("judge", judge=Judge(VerdictEngine(tok, "The agent did well.")))
    t = _traj(task).model_copy(update={"termination": "max_turns"})
    score_trajectory(task, t, fn)  # even a cut-off trajectory stays masked: None, not 0
    assert t.reward is None and t.reward_info["error"].startswith("InvalidVerdict")
    assert t.reward_info["judge_text"] == "The agent did well."
    assert t.steps[0].real_observation is not None  # fidelity still filled by a private replay
    empty = task.model_copy(update={"source": {**task.source, "evaluation_criteria": None}})
    assert Judge(VerdictEngine(tok, '{"met": []}')).score(empty, _traj(task)) is None


def test_judge_defaults_to_the_policys_base_model_with_the_adapter_off(tiny_model_dir):
    """The default judge generates from the policy's own weights with LoRA disabled (= the base model)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    base = HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32")
    peft = get_peft_model(load_model(tiny_model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter: the policy now differs from its base
    policy = HFEngine(peft, tok, compute_dtype="float32")
    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir)}, "reward": {"name": "judge"}})
    judge = build_judge(cfg, policy)
    prompt = [tok.encode("hello there", add_special_tokens=False)]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    j, b, pol = (e.generate(prompt, sp)[0][0] for e in (judge.engine, base, policy))
    assert j.token_ids == b.token_ids and j.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert pol.logprobs != pytest.approx(b.logprobs, abs=1e-3)
    assert policy.generate(prompt, sp)[0][0].logprobs == pytest.approx(pol.logprobs)  # adapter back on
    # An explicit judge model ref is loaded (once) and served by its own HFEngine.
    cfg2 = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                                "reward": {"name": "judge", "judge_model": str(tiny_model_dir)}})
    fn = reward_fn_from_config(cfg2, policy)
    assert fn.keywords["judge"].engine is build_judge(cfg2, policy).engine
    assert isinstance(fn.keywords["judge"].engine, HFEngine)
