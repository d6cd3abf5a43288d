"""The supervised warm-up (envace_core/training/sft.py): targets, prompts, loss, and the warm-start stage switch."""

from __future__ import annotations

from pathlib import Path

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
import envace_core.training.sft as sft_mod
from envace_core.config import TrainConfig
from envace_core.envs.tau2.synth import gold_answer, synthesize
from envace_core.envs.tau2.tasks import task_context
from envace_core.roles.act import act_messages, act_prompt_ids, parse_act
from envace_core.stages.curate import curate
from envace_core.stages.train import rollout_and_train
from envace_core.training.sft import SFTError, SFTExample, act_examples, sft_warmup


@pytest.fixture(scope="module")
def tasks():
    # one look-up (level 1) and one write (level 2) per domain: multi-call gold trajectories included
    return [t for d in ("airline", "retail") for t in synthesize(d, 2, levels=[1, 2], seed=0)]


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def examples(tasks, tok):
    return act_examples(tasks, tok, policy_max_chars=300)


def test_targets_parse_back_to_the_gold_calls(tasks, examples):
    by_task = {t.id: t for t in tasks}
    assert len(examples) == sum(len(t.gold_actions) + 1 for t in tasks)
    for t in tasks:
        ex = [e for e in examples if e.task_id == t.id]
        calls = [e.gold for e in ex[:-1]]
        assert [(c.name, c.arguments) for c in calls] == [(a.name, a.arguments) for a in t.gold_actions]
        assert ex[-1].gold is None and ex[-1].text == gold_answer(t)
    for e in examples:
        out = parse_act(e.text, task_context(by_task[e.task_id], 300).tools, strict=True)
        if e.gold is None:
            assert out.tool_call is None and out.message == e.text.strip()
        else:
            assert (out.tool_call.name, out.tool_call.arguments) == (e.gold.name, e.gold.arguments)


def test_turn_and_length_limits(tasks, examples, tok):
    """max_turns keeps only the turns a rollout can reach (no answer turn when the gold needs them all);
    max_tokens drops long examples instead of exhausting memory."""
    one = act_examples(tasks, tok, policy_max_chars=300, max_turns=1)
    assert len(one) == sum(1 + (len(t.gold_actions) == 0) for t in tasks if t.gold_actions)
    assert all(e.gold is not None for e in one)  # every task has >= 1 gold call: the answer is turn >= 2
    assert [e.text for e in one] == [next(x for x in examples if x.task_id == e.task_id).text for e in one]
    lengths = sorted(len(e.prompt_ids) + len(e.completion_ids) for e in examples)
    cut = lengths[len(lengths) // 2]
    short = act_examples(tasks, tok, policy_max_chars=300, max_tokens=cut)
    assert short and len(short) < len(examples)
    assert all(len(e.prompt_ids) + len(e.completion_ids) <= cut for e in short)


def test_prompt_and_target_ids_are_the_chat_template_conversation(tasks, examples, tok):
    """prompt ids = the rollout's ACT prompt; prompt + target = the template's rendering of the turn
    (up to the template's newline after <|im_end|>, which the engine never samples)."""
    t = next(t for t in tasks if len(t.gold_actions) > 1)
    ex = [e for e in examples if e.task_id == t.id]
    ctx = task_context(t, 300)
    from envace_core.types import Message

    history = [Message(role="user", content=t.first_user_message)]
    assert ex[0].prompt_ids == act_prompt_ids(tok, ctx, history)
    second = ex[1]
    assert len(second.prompt_ids) > len(ex[0].prompt_ids) + len(ex[0].completion_ids)  # call + real result
    assert second.prompt_ids[:len(ex[0].prompt_ids) + len(ex[0].completion_ids)] == \
        ex[0].prompt_ids + ex[0].completion_ids
    for e in examples:
        assert e.completion_ids[-1] == tok.eos_token_id
        assert tok.decode(e.completion_ids, skip_special_tokens=True) == e.text
        msgs = act_messages(ctx, history) if e is ex[0] else None
        if msgs is not None:
            full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": e.text}], tokenize=True,
                                           return_dict=False)
            assert list(full[:len(e.prompt_ids) + len(e.completion_ids)]) == e.prompt_ids + e.completion_ids


def test_warmup_loss_decreases_on_a_fixed_set(examples, tiny_model_dir):
    import torch

    from envace_core.models import load_model, load_tokenizer
    from envace_core.training.trainer import PolicyTrainer

    # all linear layers: the random 64-wide model needs the capacity to fit its targets in a few steps
    cfg = TrainConfig(lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj"])
    trainer = PolicyTrainer(load_model(str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir)), cfg,
                            compute_dtype="float32")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    fixed = examples[:2]
    losses = sft_warmup(trainer, fixed, steps=12, learning_rate=1e-2, batch_rows=2, seed=0)
    assert len(losses) == 12 and all(torch.isfinite(torch.tensor(losses)))
    # same 2 examples every step: the fit must improve (~0.9 nats here from the uniform ~10.8; a loop
    # that skipped the update or trained on prompt tokens would not move the completion CE like this)
    assert losses[-1] < losses[0] - 0.5 and sum(losses[-4:]) < sum(losses[:4]), losses
    changed = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)  # only the adapter moved
    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    assert all(not p.requires_grad for p in base)


def test_empty_set_is_a_clear_error():
    with pytest.raises(SFTError, match="synthetic_tasks_per_domain"):
        sft_warmup(None, [], steps=1, learning_rate=1e-4, batch_rows=1)


def test_a_role_repeat_for_a_role_no_example_has_is_a_clear_error():
    ex = SFTExample(task_id="t", prompt_ids=[1, 2], completion_ids=[3], text="x", gold=None, role="act")
    with pytest.raises(SFTError, match=r"names roles \['ACT'\]"):
        sft_warmup(None, [ex], steps=1, learning_rate=1e-4, batch_rows=1, role_repeats={"ACT": 2})


def test_config_defaults_and_bounds():
    c = TrainConfig()
    assert (c.sft_warmup_steps, c.sft_learning_rate, c.sft_batch_rows, c.sft_act_repeats) == (0, 1e-4, 4, 1)
    from pydantic import ValidationError

    for bad in ({"sft_warmup_steps": -1}, {"sft_learning_rate": 0}, {"sft_batch_rows": 0}, {"sft_act_repeats": 0}):
        with pytest.raises(ValidationError):
            TrainConfig(**bad)


def _cfg(model_dir, root, steps):
    from envace_core.config import load_config

    return load_config("test", {
        "model": {"ref": str(model_dir), "compute_dtype": "float32"},
        "data": {"synthetic_tasks_per_domain": 1, "synthetic_levels": [1]},  # tau2's first has no gold
        "train": {"sft_warmup_steps": steps, "sft_batch_rows": 1},
        "store": {"root": str(Path(root) / "store"), "registry": str(Path(root) / "registry")}})


def test_warmup_runs_only_when_asked_in_the_warm_start_stage_never_in_training(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    from envace_core import EnvaceError
    from envace_core.stages.warm_start import warm_start
    from envace_core.training.sft import sft_warmup

    calls = []
    real = sft_warmup
    monkeypatch.setattr(sft_mod, 'sft_warmup', lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    plain, sft = _cfg(tiny_model_dir, tmp_path / "a", 0), _cfg(tiny_model_dir, tmp_path / "b", 2)
    ds = curate(plain)
    rollout_and_train(plain, ds, warm_start(plain, ds))
    assert calls == []  # default: no warm-up
    with pytest.raises(EnvaceError, match="train.sft_warmup_steps=2"):  # never skipped silently
        rollout_and_train(sft, ds)
    warm = warm_start(sft, ds)
    assert calls == [2]
    rollout_and_train(sft, ds, warm)
    rollout_and_train(sft, ds, warm)  # resumes: checkpoint has it
    assert calls == [2]


# ------------------------------------------------------------------------- REHEARSE warm-start examples
@pytest.fixture(scope="module")
def transitions(tasks):
    from envace_core.training.transitions import real_transitions

    return real_transitions(tasks, seed=0)


def test_rehearse_examples_target_the_real_results(tasks, tok, transitions):
    from envace_core.envs.tau2.observations import is_cut
    from envace_core.roles.rehearse import parse_rehearse, rehearse_prompt_ids
    from envace_core.training.sft import rehearse_examples

    ex = rehearse_examples(transitions, tok, tasks, policy_max_chars=300)
    assert len(ex) == len(transitions) and {e.role for e in ex} == {"rehearse"}
    assert {t.kind for t in transitions} == {"success", "error"}  # errors included
    by_id = {t.id: t for t in tasks}
    for e, tr in zip(ex, transitions):
        assert e.text == tr.observation.content and e.completion_ids[-1] == tok.eos_token_id
        assert parse_rehearse(tok.decode(e.completion_ids[:-1]), tr.tool) == tr.observation  # real == imagined
        assert e.prompt_ids == rehearse_prompt_ids(tok, task_context(by_id[tr.task_id], 300), tr.history, tr.call)
    long = max(transitions, key=lambda t: len(t.observation.content))
    cut = rehearse_examples([long], tok, tasks, 300, budgets={long.tool: 40})[0]
    assert is_cut(cut.text) and len(cut.completion_ids) <= 40  # the budget holds the cut text and the eos
    assert long.observation.content.startswith(cut.text.split("…[")[0])
    assert len(rehearse_examples(transitions, tok, tasks, 300, max_examples=3, seed=1)) == 3


def test_rehearse_error_share_caps_the_errors_and_keeps_every_success(tasks, tok, transitions):
    """error_share subsamples only the error transitions (seeded, order kept) so they are at most that
    share of the examples; every success stays; a share outside [0, 1) is refused."""
    from envace_core.training.sft import rehearse_examples

    full = rehearse_examples(transitions, tok, tasks, 300)
    n_succ = sum(t.kind == "success" for t in transitions)
    n_err = len(transitions) - n_succ
    assert n_err >= 2 and n_succ >= 2
    for share in (0.0, 0.2, 1 / 3):
        ex = rehearse_examples(transitions, tok, tasks, 300, error_share=share, seed=3)
        errs = [e for e in ex if e.text.startswith('{"error"')]
        assert len(ex) - len(errs) == n_succ  # every success kept
        assert len(errs) == min(n_err, int(share / (1 - share) * n_succ + 1e-9))
        assert len(errs) <= share * len(ex) + 1e-9
        # order kept: the kept examples appear in the full list's order
        idx = [next(i for i, f in enumerate(full) if f.prompt_ids == e.prompt_ids and f.text == e.text) for e in ex]
        assert idx == sorted(idx)
    again = [rehearse_examples(transitions, tok, tasks, 300, error_share=0.2, seed=3) for _ in range(2)]
    assert [e.prompt_ids for e in again[0]] == [e.prompt_ids for e in again[1]]  # deterministic
    assert rehearse_examples(transitions, tok, tasks, 300, error_share=0.99)[0].text == full[0].text
    for bad in (-0.1, 1.0):
        with pytest.raises(SFTError, match="error_share"):
            rehearse_examples(transitions, tok, tasks, 300, error_share=bad)


def test_rehearse_grounding_never_shows_the_task_its_own_results(tasks, tok, transitions):
    import json

    from envace_core.roles.grounding import GroundingIndex
    from envace_core.training.sft import rehearse_examples

    idx = GroundingIndex(transitions)
    owners: dict[tuple[str, str], set[str]] = {}
    for t in transitions:
        owners.setdefault((json.dumps(t.call.arguments, sort_keys=True), t.observation.content), set()).add(t.task_id)
    shown = 0
    for tr in transitions:
        for c, o in idx.examples(tr.task_id, tr.call, 2, 400, tok):
            assert owners[(json.dumps(c.arguments, sort_keys=True), o.content)] - {tr.task_id}  # another task's
            shown += 1
    assert shown > 0
    ex = rehearse_examples(transitions, tok, tasks, 300, grounding=idx, grounding_k=2, grounding_max_tokens=400)
    plain = rehearse_examples(transitions, tok, tasks, 300)
    assert any(len(a.prompt_ids) > len(b.prompt_ids) for a, b in zip(ex, plain))
    assert "Examples from other conversations" in tok.decode(max(ex, key=lambda e: len(e.prompt_ids)).prompt_ids)


def test_warm_start_trains_both_roles_and_each_per_role_adapter(tiny_model_dir, tmp_path):
    import torch

    from envace_core.config import load_config
    from envace_core.envs.tau2.tasks import load_tasks
    from envace_core.stages.warm_start import warm_examples, warm_up
    from envace_core.training.loop import real_train_transitions
    from envace_core.training.policy import rollout_params
    from envace_core.training.trainer import PolicyTrainer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train = [t for t in load_tasks("airline", "train") if t.gold_actions][:1]
    for per_role in (False, True):
        cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                                   "train": {"sft_warmup_steps": 1, "sft_batch_rows": 2, "policy_per_role": per_role,
                                             "sft_max_rehearse_examples": 2}})
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        trainer = PolicyTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, cfg.train,
                                compute_dtype="float32")
        by_role = warm_examples(cfg, train, tok, rollout_params(cfg), real_train_transitions(cfg, train))
        assert {r: {e.role for e in ex} for r, ex in by_role.items()} == {"act": {"act"}, "rehearse": {"rehearse"}}
        assert len(by_role["rehearse"]) == 2
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        losses = warm_up(cfg, trainer, by_role, say=lambda _: None)
        assert set(losses) == ({"act", "rehearse"} if per_role else {"policy"})
        moved = {n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])}
        assert moved
        if per_role:  # each adapter warmed on its own role's examples
            assert any(".act." in n for n in moved) and any(".rehearse." in n for n in moved)
            assert trainer.model.active_adapter == "act"


# ------------------------------------------------------------------------- test-split guard of the ACT data
def test_act_examples_refuse_a_test_split_task_before_replaying_anything(tasks, tok):
    import re

    from envace_core.training.transitions import TestSplitError

    held = tasks[1].model_copy(update={"split": "test"})
    built: list[str] = []

    def factory(domain):
        built.append(domain)
        from envace_core.envs.tau2.environment import Tau2Environment
        return Tau2Environment(domain)

    with pytest.raises(TestSplitError, match=re.escape(repr(held.id))):
        act_examples([tasks[0], held], tok, policy_max_chars=300, env_factory=factory)
    assert built == []  # refused before the train task's environment was even built
    with pytest.raises(TestSplitError, match="'test' split"):  # the guard is on by default, tasks without gold too
        act_examples([held.model_copy(update={"gold_actions": []})], tok, 300)
    # forbid_splits=() builds held-out examples on purpose (measurement): the same turns as the train copy
    on_purpose = act_examples([held], tok, 300, forbid_splits=())
    assert [e.text for e in on_purpose] == [e.text for e in act_examples([tasks[1]], tok, 300)]
    # another forbidden split, same semantics as transitions.real_transitions
    with pytest.raises(TestSplitError, match=re.escape(repr(tasks[0].id))):
        act_examples([tasks[0]], tok, 300, forbid_splits=("train",))


def test_the_warm_start_stage_builder_refuses_a_test_split_task(tasks, tok, tiny_model_dir):
    import re

    from envace_core.config import load_config
    from envace_core.stages.warm_start import warm_examples
    from envace_core.training.policy import rollout_params
    from envace_core.training.transitions import TestSplitError

    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                               "train": {"sft_warmup_steps": 1}})
    held = tasks[0].model_copy(update={"split": cfg.data.test_split})
    with pytest.raises(TestSplitError, match=re.escape(repr(held.id))):
        warm_examples(cfg, [tasks[1], held], tok, rollout_params(cfg), [])



def test_the_warm_start_cuts_tool_results_in_act_prompts_as_rollouts_do(tasks, tok, tiny_model_dir):
    """rollout.max_observation_tokens bounds each tool result of the warm-up's ACT prompts (plain and recovery
    examples), as `rollout.act_turn` bounds it: the SFT prompt of a turn is the prompt a rollout builds there."""
    from envace_core.config import load_config
    from envace_core.roles.bounds import TRUNCATION_MARKER
    from envace_core.stages.warm_start import warm_examples
    from envace_core.training.policy import rollout_params

    marker = TRUNCATION_MARKER.split("{")[0]
    texts = {}
    for bound in (None, 32):
        cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                                   "rollout": {"max_turns": 3, "max_observation_tokens": bound},
                                   "train": {"sft_warmup_steps": 1, "sft_roles": ["act"], "sft_act_recovery": True}})
        ex = warm_examples(cfg, tasks, tok, rollout_params(cfg), [])["act"]
        texts[bound] = [tok.decode(e.prompt_ids) for e in ex]
    later = [i for i, t in enumerate(texts[None]) if "<|im_start|>tool" in t]
    assert later and not any(marker in texts[None][i] for i in later)
    cut = [i for i in later if marker in texts[32][i]]  # look-up results are over 32 tokens; short errors are not
    assert cut and all(len(texts[32][i]) < len(texts[None][i]) for i in cut)
    assert all(texts[32][i] == texts[None][i] for i in range(len(texts[None])) if i not in cut)


def test_the_warm_start_holds_each_final_answer_example_k_times(tasks, tok, tiny_model_dir):
    """train.sft_answer_repeats = k: every final-answer ACT example (gold None: the message after the last gold
    call) is in the ACT warm-up examples k times; every call example stays once."""
    from envace_core.config import load_config
    from envace_core.stages.warm_start import warm_examples
    from envace_core.training.policy import rollout_params

    got = {}
    for k in (1, 3):
        cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                                   "rollout": {"max_turns": 5},
                                   "train": {"sft_warmup_steps": 1, "sft_roles": ["act"], "sft_answer_repeats": k}})
        got[k] = warm_examples(cfg, tasks, tok, rollout_params(cfg), [])["act"]
    answers = [e for e in got[1] if e.gold is None]
    assert answers and len(answers) < len(got[1])
    assert len(got[3]) == len(got[1]) + 2 * len(answers)
    key = lambda e: (e.task_id, tuple(e.prompt_ids), e.text)  # noqa: E731
    for e in got[1]:
        assert sum(key(x) == key(e) for x in got[3]) == (3 if e.gold is None else 1)

# ------------------------------------------------------------------------- REHEARSE prompts never leak the own task
@pytest.fixture(scope="module")
def several():
    """Four synthesized train tasks per domain (two of each tool's look-ups, one more write) and their
    real transitions, wrong calls' errors included: every tool but one is called by >= 2 tasks."""
    from envace_core.training.transitions import real_transitions

    many = [t for d in ("airline", "retail") for t in synthesize(d, 4, levels=[1, 2], seed=0)]
    return many, real_transitions(many, seed=0)


def _grounding_results(prompt: str) -> list[str]:
    """The result texts of the grounding section of a decoded REHEARSE prompt
    (`roles.rehearse.rehearse_messages`: "call: <json>\\nresult: <text>" per example, joined by
    newlines, between the section head and "# Conversation"); [] without that section."""
    head = "# Examples from other conversations\n"
    if head not in prompt:
        return []
    section = prompt.split(head, 1)[1].split("\n\n# Conversation\n", 1)[0]
    return [chunk.split("\nresult: ", 1)[1] for chunk in ("\n" + section).split("\ncall: ")[1:]]


def test_rehearse_prompts_never_show_the_own_tasks_results_as_grounding(several, tok):
    """The REHEARSE warm-start prompt of a transition holds no real result of its own task among its
    grounding examples (least of all its own target): only results of other tasks, or ones already
    in its own history. Uncut (no observation bound, a large grounding budget), so a leaked result
    would appear whole."""
    from envace_core.roles.grounding import GroundingIndex
    from envace_core.training.sft import rehearse_examples

    many, trans = several
    ex = rehearse_examples(trans, tok, many, 300, max_observation_tokens=None, grounding=GroundingIndex(trans),
                           grounding_k=4, grounding_max_tokens=8192)
    assert len(ex) == len(trans) and len({tr.task_id for tr in trans}) == len(many)
    owners: dict[str, set[str]] = {}
    for tr in trans:
        owners.setdefault(tr.observation.content.strip(), set()).add(tr.task_id)
    checked = shown = targets = 0
    for e, tr in zip(ex, trans):
        assert e.task_id == tr.task_id and e.gold == tr.call
        shown_here = _grounding_results(tok.decode(e.prompt_ids))
        shown += len(shown_here)
        # every shown result is a real result of some task: the section was parsed right
        assert all(r in owners for r in shown_here), shown_here
        in_history = {m.content.strip() for m in tr.history if m.role == "tool"}
        own = {o.observation.content.strip() for o in trans if o.task_id == tr.task_id} - in_history
        # a text another task also got (e.g. the same look-up's result) is no leak: only the own task's
        own = {o for o in own if owners[o] == {tr.task_id}}
        leaked = own & set(shown_here)
        assert not leaked, f"{tr.task_id}'s own results in its grounding examples: {leaked}"
        checked += len(own)
        targets += tr.observation.content.strip() in own  # its own target is among the texts checked
    # grounding did show examples; most targets (all but shared texts such as "User not found") checked
    assert shown >= len(ex) // 2 and checked > len(ex) and targets >= len(ex) * 3 // 4, (shown, checked, targets)


# ------------------------------------------------------------------------- per-role ablation of the warm start
def test_per_role_warm_start_trains_each_adapter_on_its_own_roles_examples_only(tasks, tok, transitions,
                                                                                 tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from envace_core.config import load_config
    from envace_core.stages.warm_start import warm_examples, warm_up
    from envace_core.training.policy import rollout_params
    from envace_core.training.trainer import PolicyTrainer

    cfg = load_config("test", {"model": {"ref": str(tiny_model_dir), "compute_dtype": "float32"},
                               "train": {"sft_warmup_steps": 1, "policy_per_role": True}})
    trainer = PolicyTrainer(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tok, cfg.train,
                            compute_dtype="float32")
    by_role = warm_examples(cfg, tasks, tok, rollout_params(cfg), transitions)
    assert by_role["act"] and by_role["rehearse"]
    seen: list[tuple[str, set[str], set[str], int]] = []

    def record(trainer_, examples, steps, *a, **k):
        # the adapter whose LoRA weights are trainable during this call (peft: only the active one)
        trainable = {n.split(".")[i + 1] for n, p in trainer_.model.named_parameters() if p.requires_grad
                     for i, part in enumerate(n.split(".")) if part.startswith("lora_")}
        seen.append((trainer_.model.active_adapter, {e.role for e in examples}, trainable, len(examples)))
        return [0.0] * steps

    monkeypatch.setattr(sft_mod, "sft_warmup", record)  # warm_up imports it from the module at call time
    losses = warm_up(cfg, trainer, by_role, say=lambda _: None)
    assert {a: roles for a, roles, _, _ in seen} == {"act": {"act"}, "rehearse": {"rehearse"}}
    assert len(seen) == 2 and all(trainable == {a} for a, _, trainable, _ in seen)
    assert {a: n for a, _, _, n in seen} == {r: len(ex) for r, ex in by_role.items()}  # all of them, none other
    assert set(losses) == {"act", "rehearse"} and trainer.model.active_adapter == "act"


def test_recovery_examples_show_a_wrong_call_and_its_error_then_target_the_gold_call(tasks, tok):
    """`act_recovery_examples`: the prompt ends with a wrong variant of the gold call and the error a rollout
    would show for it; the target is the gold call itself. Same seed, same examples; a test task is refused."""
    import json
    import re

    from envace_core.training.sft import act_recovery_examples
    from envace_core.training.transitions import TestSplitError

    ex = act_recovery_examples(tasks, tok, policy_max_chars=300, seed=0)
    assert ex and len(ex) <= sum(len(t.gold_actions) for t in tasks)
    by_task = {t.id: t for t in tasks}
    for e in ex:
        tools = task_context(by_task[e.task_id], 300).tools
        call = parse_act(e.text, tools).tool_call
        assert (call.name, call.arguments) == (e.gold.name, e.gold.arguments)
        assert (e.gold.name, e.gold.arguments) in [(g.name, g.arguments) for g in by_task[e.task_id].gold_actions]
        prompt = tok.decode(e.prompt_ids)
        turn = r"assistant\n<tool_call>(.*?)</tool_call><\|im_end\|>\n<\|im_start\|>tool\n(.*?)<\|im_end\|>"
        wrong_text, error_text = re.findall(turn, prompt, re.S)[-1]
        wrong = json.loads(wrong_text)
        assert wrong["name"] == e.gold.name and wrong["arguments"] != e.gold.arguments
        assert "error" in json.loads(error_text)  # the wrong call's error, the last thing before the turn
        assert prompt.rstrip().endswith("<|im_start|>assistant")
    again = act_recovery_examples(tasks, tok, policy_max_chars=300, seed=0)
    assert [(e.prompt_ids, e.completion_ids) for e in again] == [(e.prompt_ids, e.completion_ids) for e in ex]
    with pytest.raises(TestSplitError):
        act_recovery_examples([tasks[0].model_copy(update={"split": "test"})], tok, policy_max_chars=300)


def test_extra_argument_is_another_gold_calls_argument_the_tool_does_not_take():
    import random

    from envace_core.training.sft import extra_argument_call
    from envace_core.types import Task, ToolCall

    task = Task(id="airline/x", domain="airline", split="train", first_user_message="hi", gold_actions=[
        ToolCall(name="get_user_details", arguments={"user_id": "ana_1"}),
        ToolCall(name="get_reservation_details", arguments={"reservation_id": "ABC123"})])
    schema = {"type": "object", "properties": {"reservation_id": {"type": "string"}}, "required": ["reservation_id"]}
    got = extra_argument_call(task.gold_actions[1], schema, task, random.Random(0))
    assert got.arguments == {"reservation_id": "ABC123", "user_id": "ana_1"}
    schema["properties"]["user_id"] = {"type": "string"}
    assert extra_argument_call(task.gold_actions[1], schema, task, random.Random(0)) is None
