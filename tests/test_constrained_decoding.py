"""Constrained decoding: ACT's and REHEARSE's formats as token-by-token constraints (roles.constrained),
the transformers engine drawing only allowed tokens (engines.constrained_sampling) with unconstrained
log-probs, per-prompt constraints through merged calls, and rollouts that no longer end in format errors."""

from __future__ import annotations

import json
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, LlamaConfig

from envace_core.engines.base import SamplingParams
from envace_core.engines.hf import HFEngine
from envace_core.engines.merging import MergingEngine
from envace_core.roles.act import parse_act
from envace_core.roles.chat import chat_ids
from envace_core.roles.constrained import ActConstraint, RehearseConstraint
from envace_core.roles.errors import ParseError
from envace_core.roles.rehearse import parse_rehearse
from envace_core.types import ToolSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = [ToolSpec(name=n, description="", parameters={"type": "object", "properties": {}})
         for n in ("get_user", "get_user_details", "cancel_pending_order")]
NAMES = [t.name for t in TOOLS]
ACT = ActConstraint(None, NAMES)
CALL = '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "ana_1", "n": [1, 2.5e3]}}</tool_call>'


@pytest.mark.parametrize("text,viable,complete", [
    ("", True, False),
    ("  <tool_ca", True, True),  # also a message ("<tool_ca" has no tag)
    ("<tool_call>", True, False),
    ('<tool_call>{"name": "get_us', True, False),
    ('<tool_call>{"name": "get_user"', True, False),  # get_user, or the start of get_user_details
    ('<tool_call>{"name":"get_user"}</tool_call>', True, True),  # "arguments" omitted: {}
    ('<tool_call>{"name":"get_user","arguments":{"a":1}}', True, False),  # not closed: may not end
    ('<tool_call>{"name":"get_user","arguments":{"a":1}}</tool_', True, False),
    (CALL + "\n", True, True),
    ("Your order is cancelled.", True, True),
    ('<tool_call>{"error": "not found"}', False, False),  # REHEARSE's form in ACT's turn
    ('<tool_call>{"name": "get_userx', False, False),  # no such tool
    ('<tool_call>{"arguments": {}, "name": "get_user"}', False, False),  # "name" comes first
    ('<tool_call>{"name":"get_user","arguments":{"a":1}}}', False, False),  # a brace too many
    ('<tool_call>{"name":"get_user","arguments":{"a":1,"a":2', False, False),  # a key twice
    ('<tool_call>{"name":"get_user","arguments":{"a":1},"description":', False, False),  # a third key
    ('<tool_call>{"name":"get_user","arguments":[1]}', False, False),  # arguments not an object
    ('<tool_call>{"name":"get_user"}</tool_call><tool_call>', False, False),  # a second call
    ('<tool_call>{"name":"get_user"}</tool_call> thanks', False, False),  # text after the call
    ("Let me check. <tool_call>", False, False),  # text before the call
    ("done </tool_call>", False, False),
    ("Use the <tool_callback> hook.", False, False),  # parse_act: "<tool_call" anywhere is a bad tag
    ("see </tool_calls", True, True),  # not a tag for parse_act
    ("see </tool_call", True, False),  # may still become "</tool_calls"
    ('<tool_call>{"name": "get_user", "arguments": {"q": "</tool_call>"}}</tool_call>', False, False),
    ('<tool_call>{"name": "get_user", "arguments": {"q": "<tool_callx"}}</tool_call>', True, True),
    ('<tool_call>{"name": "get_user", "arguments": {"n": ' + "1" * 4301, False, False),  # json.loads refuses it
])
def test_act_constraint_states(text, viable, complete):
    assert ACT.state(text) == (viable, complete)


def test_every_prefix_of_a_valid_call_is_viable_and_only_the_whole_may_end():
    for i in range(len(CALL)):
        assert ACT.state(CALL[:i])[0], CALL[:i]
        assert not ACT.state(CALL[:i])[1] or not CALL[:i].startswith("<tool_call>")
    assert ACT.state(CALL) == (True, True)


_PIECES = ["<tool_call>", "</tool_call>", "{", "}", '"name"', '"arguments"', ":", ",", " ", '"get_user"',
           '"get_user_details"', '"x"', "1", "[", "]", "hello", "<", "tool_call>", '"', "\n", "null"]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=14))
def test_an_output_the_act_constraint_lets_end_always_parses(pieces):
    text = "".join(pieces)
    viable, complete = ACT.state(text)
    if complete:
        assert viable
        parse_act(text, TOOLS, strict=True, schema_errors=True)  # raises ParseError if the constraint lied


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(['{', '}', '[', ']', '"error"', '"a"', ':', ',', '1', ' ', 'true', '```json\n',
                                 '```', 'x', '"']), max_size=12))
def test_rehearse_constraint_ends_exactly_where_parse_rehearse_accepts(pieces):
    text = "".join(pieces)
    c = RehearseConstraint(types.SimpleNamespace(decode=lambda ids, skip_special_tokens: text))
    try:
        parse_rehearse(text)
        ok = True
    except ParseError:
        ok = False
    assert c.allows([1], ends=True) == ok


def test_non_ascii_tool_names_either_way_json_writes_them():
    c = ActConstraint(None, ["café"])
    for text in ('<tool_call>{"name": "café"}</tool_call>', '<tool_call>{"name": "caf\\u00e9"}</tool_call>'):
        assert c.state(text) == (True, True)
        parse_act(text, [ToolSpec(name="café", description="", parameters={"type": "object"})], strict=True)


def test_special_tokens_and_ids_past_the_vocabulary_are_refused_mid_output(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir)
    ids = tok.encode('<tool_call>{"name": "get_user"', add_special_tokens=False)
    act, reh = ActConstraint(tok, NAMES), RehearseConstraint(tok)
    assert act.allows(ids, ends=False)
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for bad in (im_start, len(tok) + 3):
        assert not act.allows(ids + [bad], ends=False)
        assert not reh.allows(tok.encode('{"a": 1', add_special_tokens=False) + [bad], ends=False)


def test_act_constraint_needs_tools():
    with pytest.raises(ValueError, match="at least one tool"):
        ActConstraint(None, [])


# ------------------------------------------------------------------ the engine
SIZES = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**SIZES), attn_implementation="sdpa").eval()


class Forbid:
    """Refuses the ids in `banned`, and ending before `min_len` generated ids."""

    def __init__(self, banned, min_len=0):
        self.banned, self.min_len, self.asked = set(banned), min_len, 0

    def allows(self, ids, ends):
        self.asked += 1
        return ids[-1] not in self.banned and (not ends or len(ids) - 1 >= self.min_len)


class AllowAll:
    def allows(self, ids, ends):
        return True


PROMPTS = [[5, 17, 33, 2, 41, 9], [7, 3, 8]]


def _engine(model, ids_tokenizer):
    return HFEngine(model, ids_tokenizer, compute_dtype="float32", max_batch_size=8)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_constraint_that_refuses_nothing_changes_nothing(model, ids_tokenizer, temperature):
    eng = _engine(model, ids_tokenizer)
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, n=3, seed=11)
    want = eng.generate(PROMPTS, sp)
    got = eng.generate(PROMPTS, SamplingParams(**{**sp.__dict__, "constraints": (AllowAll(), AllowAll())}))
    assert [[c.token_ids for c in r] for r in got] == [[c.token_ids for c in r] for r in want]
    assert [[c.logprobs for c in r] for r in got] == [[c.logprobs for c in r] for r in want]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_refused_tokens_never_appear_and_logprobs_stay_unconstrained(model, ids_tokenizer, temperature):
    eng = _engine(model, ids_tokenizer)
    free = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=temperature, n=4, seed=3))
    banned = {t for r in free for c in r for t in c.token_ids[:3]} - {0}  # tokens the model likes here
    cons = (Forbid(banned), None)  # the second prompt is not constrained
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=10, temperature=temperature, n=4, seed=3,
                                               constraints=cons))
    assert cons[0].asked > 0
    assert all(not banned & set(c.token_ids) for c in out[0])
    assert [c.token_ids for c in out[1]] == [c.token_ids for c in free[1]]  # unconstrained prompt: as before
    t = temperature or 1.0
    for c in out[0]:  # the recorded log-prob is log softmax(logits / T) over the whole vocabulary
        ids = torch.tensor([PROMPTS[0] + c.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(PROMPTS[0]) - 1:-1].float() / t
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(c.logprobs), want, atol=1e-4)
        if temperature == 0.0:  # greedy: the best allowed token at every step
            masked = logits.clone()
            masked[:, sorted(banned)] = -float("inf")
            assert c.token_ids == masked.argmax(-1).tolist()


def test_same_seed_same_constrained_samples(model, ids_tokenizer):
    eng = _engine(model, ids_tokenizer)
    sp = lambda: SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=5,
                                constraints=(Forbid(range(1, 60)), Forbid(range(30, 90))))
    a, b = eng.generate(PROMPTS, sp()), eng.generate(PROMPTS, sp())
    assert [[c.token_ids for c in r] for r in a] == [[c.token_ids for c in r] for r in b]
    assert all(t == 0 or t >= 60 for c in a[0] for t in c.token_ids)


def test_ending_is_refused_until_allowed(model, ids_tokenizer):
    eng = _engine(model, ids_tokenizer)
    # eos (0) is refused before 6 tokens: every sample is at least that long
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.5, n=6, seed=2,
                                               constraints=(Forbid(set(), min_len=6),) * 2))
    for c in [c for r in out for c in r]:
        assert 0 not in c.token_ids[:6]
        assert (c.finish_reason == "stop") == (c.token_ids[-1:] == [0])


def test_a_row_with_no_allowed_token_ends_without_one(model, ids_tokenizer):
    eng = _engine(model, ids_tokenizer)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=1,
                                               constraints=(Forbid(range(97)), None)))
    assert all(c.token_ids == [] and c.logprobs == [] and c.finish_reason == "stop" for c in out[0])
    assert all(c.token_ids for c in out[1])
    assert eng.stats["constraint_dead_rows"] == 2 and eng.stats["constraint_refusals"] == 2


def test_constraints_are_checked(model, ids_tokenizer):
    eng = _engine(model, ids_tokenizer)
    with pytest.raises(ValueError, match="one .a constraint or None. per prompt"):
        eng.generate(PROMPTS, SamplingParams(constraints=(AllowAll(),)))
    with pytest.raises(ValueError, match="no allows"):
        eng.generate(PROMPTS, SamplingParams(constraints=(object(), None)))
    with pytest.raises(ValueError, match="pass an instance"):
        eng.generate(PROMPTS, SamplingParams(constraints=(AllowAll, None)))
    with pytest.raises(ValueError, match="must be a tuple"):
        eng.generate(PROMPTS, SamplingParams(constraints=AllowAll()))

    class Says:
        def allows(self, ids, ends):
            return "no"

    with pytest.raises(TypeError, match="not a bool"):
        eng.generate(PROMPTS, SamplingParams(max_new_tokens=3, constraints=(Says(), None)))


def test_ignore_eos_keeps_the_constraint(model, ids_tokenizer):
    eng = _engine(model, ids_tokenizer)
    out = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=4, ignore_eos=True,
                                               constraints=(Forbid(range(40, 97)), None)))
    assert all(t < 40 for c in out[0] for t in c.token_ids) and all(len(c.token_ids) == 6 for c in out[0])


def test_merged_calls_keep_each_prompts_constraint(model, ids_tokenizer):
    eng = MergingEngine(_engine(model, ids_tokenizer))
    bans = [set(range(1, 50)), set(range(50, 97))]

    def work(e, k):
        return e.generate([PROMPTS[k]], SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=k,
                                                       constraints=(Forbid(bans[k]),)))

    out = eng.map(work, [0, 1])
    assert eng.merged_calls == 1
    for k in (0, 1):
        assert all(not bans[k] & set(c.token_ids) for c in out[k][0])


# ------------------------------------------------------------------ real formats on a real tokenizer
def test_constrained_rehearsals_and_calls_on_a_random_model_stay_in_format(tiny_model_dir):
    from envace_core.models import load_model, load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    model = load_model(str(tiny_model_dir))
    eng = HFEngine(model, tok, compute_dtype="float32", max_batch_size=8)
    prompt = chat_ids(tok, [{"role": "user", "content": "hi"}])
    rehearse, act = RehearseConstraint(tok), ActConstraint(tok, NAMES)
    out = eng.generate([prompt, prompt], SamplingParams(max_new_tokens=24, temperature=1.0, n=4, seed=0,
                                                        constraints=(rehearse, act)))
    for c in out[0]:
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        assert rehearse.allows(c.token_ids, ends=False), text  # every output a JSON prefix
        if c.token_ids and c.token_ids[-1] == tok.eos_token_id:
            parse_rehearse(text)
    for c in out[1]:
        text = tok.decode(c.token_ids, skip_special_tokens=True)
        assert act.state(text)[0], text
        if c.token_ids and c.token_ids[-1] == tok.eos_token_id:
            parse_act(text, TOOLS, strict=True, schema_errors=True)
    assert json.dumps([c.finish_reason for r in out for c in r])  # they ran to an end


# ------------------------------------------------------------------ rollouts
class RecordingScripted:
    """`tests.scripted.ScriptedEngine` that also records each call's constraints."""

    def __init__(self, inner):
        self.inner, self.tokenizer, self.stats, self.seen = inner, inner.tokenizer, {}, []

    def generate(self, prompts, params):
        out = self.inner.generate(prompts, params)
        self.seen.append((self.inner.calls[-1], params.constraints, len(prompts)))
        return out


@pytest.mark.parametrize("constrained", [False, True])
def test_rollouts_pass_each_roles_constraint_per_prompt(tiny_model_dir, constrained):
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.models import load_tokenizer
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts
    from tests.scripted import ScriptedEngine

    task = next(t for t in load_tasks("airline", "test") if t.gold_actions)
    gold = task.gold_actions[0]
    call = "<tool_call>" + json.dumps({"name": gold.name, "arguments": gold.arguments}) + "</tool_call>"
    eng = RecordingScripted(ScriptedEngine(load_tokenizer(tiny_model_dir), [call, "Done."]))
    p = RolloutParams(max_turns=2, max_new_tokens_act=64, max_new_tokens_rehearse=64, temperature=1.0,
                      constrained=constrained)
    rehearsal_rollouts(eng, task_context(task, 300), 2, p, seed=0)
    roles = [r for r, _, _ in eng.seen]
    assert roles[:2] == ["act", "rehearse"]
    for role, cons, n in eng.seen:
        if not constrained:
            assert cons is None
            continue
        assert cons is not None and len(cons) == n
        want = ActConstraint if role == "act" else RehearseConstraint
        assert all(isinstance(c, want) for c in cons)


def test_constrained_rollouts_of_a_random_model_end_in_no_format_error_but_the_budgets(tiny_model_dir):
    from envace_core.envs.tau2.tasks import load_tasks, task_context
    from envace_core.models import load_model, load_tokenizer
    from envace_core.training.rollout import RolloutParams, rehearsal_rollouts

    tok = load_tokenizer(tiny_model_dir)
    eng = HFEngine(load_model(tiny_model_dir), tok, compute_dtype="float32", max_batch_size=8)
    task = load_tasks("retail", "train", limit=1)[0]
    p = RolloutParams(max_turns=2, max_new_tokens_act=24, max_new_tokens_rehearse=24, temperature=1.0,
                      constrained=True)
    trajs = rehearsal_rollouts(eng, task_context(task, 300), 4, p, seed=0)
    for g in (g for t in trajs for g in t.generations if g.parse_error):
        # an output the constraint let end parses: only budget cuts (or rows left without any allowed
        # token) can fail, and those did not end with the eos
        assert g.finish_reason == "length" or g.completion_ids[-1:] != [tok.eos_token_id], g.parse_error


@pytest.mark.parametrize("rollout, rehearsal, want", [(True, False, False), (True, True, True), (False, True, False)])
def test_rehearsals_are_constrained_only_when_both_settings_say_so(rollout, rehearsal, want):
    from envace_core.config import load_config
    from envace_core.config_checks import UnusedSettingWarning
    from envace_core.training.policy import rehearsal_params, rollout_params

    overrides = {"rollout": {"constrained_decoding": rollout},
                 "rehearsal": {"constrained_decoding": rehearsal, "temperature": 0.7}}
    if rehearsal and not rollout:  # a setting with no effect says so
        with pytest.warns(UnusedSettingWarning, match="rehearsal.constrained_decoding=true has no effect"):
            cfg = load_config("cpu-smoke", overrides)
    else:
        cfg = load_config("cpu-smoke", overrides)
    p = rehearsal_params(cfg, 2)
    assert (p.constrained, p.temperature, p.max_turns) == (want, 0.7, 2)
    assert rollout_params(cfg).constrained is rollout  # rollouts and committed ACT keep their own setting
