"""Supervised warm start of both roles before GRPO (METHOD.md §2b): ACT on gold calls, REHEARSE on real transitions.

Why: a small base model (SmolLM2-135M) almost never emits a parseable `<tool_call>` at first, so every
GRPO group has equal rewards and every advantage is 0 (METHOD.md §3: no learning signal). A few LoRA
steps of supervised fine-tuning on gold ACT turns (behaviour cloning; the "SFT then RL" recipe of
DeepSeekMath §4 / DeepSeek-R1's cold start) puts mass on the format, so the RL stage has something
to compare.

Examples (`act_examples`): for a train task with gold actions a_1..a_n, one ACT example per gold call
and one for the final answer. Example k's prompt is exactly the ACT prompt the rollout would build at
that turn (`roles.act_prompt_ids`, the engine tokenizer's chat template, the task's `TaskContext`),
with the history h_k = user message ⊕ (a_1, o_1) ⊕ .. ⊕ (a_{k-1}, o_{k-1}), where o_j is the REAL
observation of a_j executed in a private environment copy. The target is `roles.format_tool_call(a_k)`
(the text `roles.parse_act` parses back to a_k), then `synth.gold_answer(task)` after the last call;
each target's ids end with the tokenizer's eos (SmolLM2: `<|im_end|>`), where the engine stops.
A test-split task is refused (`transitions.TestSplitError`), as `real_transitions` refuses it: the
warm-start data never holds a test task.

Recovery examples (`act_recovery_examples`, train.sft_act_recovery): the same ACT turn k after a wrong variant
of a_k and the error it gets (as a rollout would show it), with a_k as the target: ACT learns to fix a refused
call rather than repeat it.

REHEARSE examples (`rehearse_examples`): one per real (history, call) → result transition of a train
task (`training.transitions.real_transitions`: gold calls and deterministic wrong calls replayed in
the real environment, so tool errors are learned too; MirrorAPI / StableToolBench: SFT on real
request/response pairs). The prompt is REHEARSE's rollout prompt, optionally with grounding examples
of other tasks (`roles.grounding`); the target is the real result's canonical text
(`envs.tau2.observations`), cut with the marker to the tool's generation budget.

Loss (`sft_warmup`): token-mean cross-entropy over completion tokens only,
    L = -(1 / #completion tokens) Σ_i Σ_t log p_θ(y_{i,t} | prompt_i, y_{i,<t}),
one AdamW step (gradient norm clipped) per batch of `batch_rows` examples of one prompt cluster.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from envace_core import EnvaceError
from envace_core.roles.act import act_prompt_ids
from envace_core.roles.bounds import MAX_OBSERVATION_TOKENS
from envace_core.roles.tools import format_tool_call
from envace_core.types import Message, Task, TaskContext, ToolCall

if TYPE_CHECKING:
    from envace_core.envs.base import ToolEnvironment
    from envace_core.roles.grounding import GroundingIndex
    from envace_core.training.transitions import Transition
    from envace_core.training.trainer import PolicyTrainer



class SFTError(EnvaceError):
    """The warm-up cannot run: no train task with gold actions, no trainable LoRA weight, a
    tokenizer without one eos id, or a non-finite loss."""


@dataclass
class SFTExample:
    """One supervised turn of `role` ("act" / "rehearse"): prompt ids (length P) as the rollout renders
    them, target ids (length C, ending with eos), the target text and the call it is about (ACT: the
    gold call it encodes, None for a message; REHEARSE: the call whose result it is)."""

    task_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    gold: ToolCall | None
    role: str = "act"


def completion_ids(tokenizer, text: str) -> list[int]:
    """Ids of `text` as the assistant's reply: `encode(text)` (no special tokens) + eos, i.e. what
    the engine would sample after the ACT generation prompt and stop on."""
    eos = tokenizer.eos_token_id
    if not isinstance(eos, int):
        raise SFTError(f"the tokenizer has no single eos token id (got {eos!r}): cannot end a target")
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)] + [eos]


def act_examples(tasks: Sequence[Task], tokenizer, policy_max_chars: int | None = None,
                 env_factory: Callable[[str], ToolEnvironment] | None = None,
                 include_answer: bool = True, max_turns: int | None = None,
                 max_tokens: int | None = None,
                 forbid_splits: Collection[str] = ("test",),
                 max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS,
                 memory: Callable[[Task, TaskContext], str | None] | None = None) -> list[SFTExample]:
    """The supervised ACT turns of every task in `tasks` that has gold actions (others are skipped).

    `env_factory(domain)` makes the private environment the gold calls run in (default
    `Tau2Environment`); `include_answer` adds the final-answer turn (`synth.gold_answer`).
    `max_turns`: only the first `max_turns` ACT turns of a task (rollouts never get further:
    ``rollout.max_turns``); `max_tokens`: examples longer than this (prompt + target ids) are
    skipped, since a long tau2 history (tool results of several KB) makes one step need many GB.
    `forbid_splits`: splits whose tasks are refused (`transitions.check_splits`, as
    `transitions.real_transitions` does: warm-start data never holds a test task); pass ``()`` to
    build examples of held-out tasks on purpose, e.g. for measurement. `max_observation_tokens`: each
    tool result in a prompt is cut to this many tokens, as ``rollout.max_observation_tokens`` cuts it
    in a rollout (`roles.act.act_prompt_ids`; None = uncut). `memory(task, ctx)`: the rehearsal memory
    every prompt of that task shows (Committed Execution without re-entry keeps one; None = none).

    Raises:
        TestSplitError: a task's `split` is in `forbid_splits` (the first such task is named),
            before any environment is built.
        UnknownDomainError: a task of an unknown domain (from `task_context`).
    """
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.synth import gold_answer
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.training.transitions import check_splits

    check_splits(tasks, forbid_splits)
    out: list[SFTExample] = []
    for task in tasks:
        if not task.gold_actions:
            continue
        ctx = task_context(task, policy_max_chars)
        env = (env_factory or Tau2Environment)(task.domain)
        m = memory(task, ctx) if memory is not None else None
        env.reset(task)
        history = [Message(role="user", content=ctx.first_user_message)]
        turns = task.gold_actions[:max_turns] if max_turns is not None else task.gold_actions
        for k, gold in enumerate(turns):
            call = ToolCall(name=gold.name, arguments=gold.arguments, id=f"call_{k}")
            text = format_tool_call(call)
            out.append(SFTExample(task.id, act_prompt_ids(tokenizer, ctx, history, m, max_observation_tokens),
                                  completion_ids(tokenizer, text), text, call))
            obs = env.step(call)  # a tool error stays in the history, as the gold replay sees it
            history += [Message(role="assistant", tool_call=call),
                        Message(role="tool", content=obs.content, error=obs.error)]
        if include_answer and len(turns) == len(task.gold_actions) \
                and (max_turns is None or len(turns) < max_turns):
            text = gold_answer(task)
            out.append(SFTExample(task.id, act_prompt_ids(tokenizer, ctx, history, m, max_observation_tokens),
                                  completion_ids(tokenizer, text), text, None))
    if max_tokens is not None:
        out = [e for e in out if len(e.prompt_ids) + len(e.completion_ids) <= max_tokens]
    return out


def extra_argument_call(call: ToolCall, tool_schema: dict, task: Task, rng) -> ToolCall | None:
    """`call` with one argument it does not take: an argument (name and value) of another gold call of
    `task` that `tool_schema` (the tool's JSON schema) has no property for, drawn with `rng`; None when
    there is none. The mistake the warm-started model makes (e.g. `get_reservation_details` given the
    user id the user stated as well)."""
    props = tool_schema.get("properties", {})
    extra = sorted({(k, json.dumps(v)) for g in task.gold_actions for k, v in g.arguments.items()
                    if k not in props and k not in call.arguments})
    if not extra:
        return None
    name, value = extra[rng.randrange(len(extra))]
    return call.model_copy(update={"arguments": {**call.arguments, name: json.loads(value)}})


def act_recovery_examples(tasks: Sequence[Task], tokenizer, policy_max_chars: int | None = None,
                          max_turns: int | None = None, max_tokens: int | None = None,
                          forbid_splits: Collection[str] = ("test",), seed: int = 0,
                          env_factory: Callable[[str], ToolEnvironment] | None = None,
                          max_observation_tokens: int | None = MAX_OBSERVATION_TOKENS) -> list[SFTExample]:
    """ACT turns that recover from a tool error: for gold call a_k of each task (k ≤ `max_turns`), one
    wrong variant w_k drawn with `seed` among `transitions.wrong_calls` (wrong id, missing argument,
    value outside the enum) and `extra_argument_call`; the prompt's history is h_k ⊕ (w_k, e_k), with
    e_k what a rollout or the evaluation shows after w_k (a call the tool's schema refuses:
    `rollout.schema_error_observation` of `roles.parse_act`'s error, as with rollout.schema_errors;
    otherwise the real environment's result), and the target is `format_tool_call(a_k)`: the call that
    fixes the error instead of repeating it. A w_k the environment accepts is dropped (the environment
    is reset to the gold prefix), and a gold call of a tool the prompt does not list gets none. Part of
    the ACT warm start (METHOD.md §2b). Arguments and raises as `act_examples`."""
    import random

    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.roles.act import parse_act
    from envace_core.training.rollout import schema_error_observation
    from envace_core.training.transitions import check_splits, wrong_calls

    check_splits(tasks, forbid_splits)
    out: list[SFTExample] = []
    for task in tasks:
        if not task.gold_actions:
            continue
        ctx = task_context(task, policy_max_chars)
        schemas = {t.name: t.parameters for t in ctx.tools}
        rng = random.Random(f"recovery:{seed}:{task.id}")
        env = (env_factory or Tau2Environment)(task.domain)
        env.reset(task)
        history = [Message(role="user", content=ctx.first_user_message)]
        done: list[ToolCall] = []
        turns = task.gold_actions[:max_turns] if max_turns is not None else task.gold_actions
        for k, gold in enumerate(turns):
            call = ToolCall(name=gold.name, arguments=gold.arguments, id=f"call_{k}")
            variants: list[ToolCall] = []
            if call.name in schemas:  # a tool the prompt does not list: no refusal to learn from
                variants = [w for _, w in wrong_calls(call, schemas[call.name], rng)]
                extra = extra_argument_call(call, schemas[call.name], task, rng)
                variants += [extra] if extra is not None else []
            if variants:
                wrong = variants[rng.randrange(len(variants))].model_copy(update={"id": f"call_{k}"})
                parsed = parse_act(format_tool_call(wrong), ctx.tools, schema_errors=True)
                obs = schema_error_observation(wrong, parsed.schema_error) if parsed.schema_error is not None \
                    else env.step(wrong)
                if obs.error:
                    prompt = history + [Message(role="assistant", tool_call=wrong),
                                        Message(role="tool", content=obs.content, error=True)]
                    text = format_tool_call(call)
                    out.append(SFTExample(task.id, act_prompt_ids(tokenizer, ctx, prompt, None, max_observation_tokens),
                                          completion_ids(tokenizer, text), text, call))
                else:  # accepted: it may have changed the state, so back to the gold prefix
                    env.reset(task)
                    for c in done:
                        env.step(c)
            obs = env.step(call)
            done.append(call)
            history += [Message(role="assistant", tool_call=call),
                        Message(role="tool", content=obs.content, error=obs.error)]
    if max_tokens is not None:
        out = [e for e in out if len(e.prompt_ids) + len(e.completion_ids) <= max_tokens]
    return out


def rehearse_examples(transitions: Sequence[Transition], tokenizer, tasks: Sequence[Task],
                      policy_max_chars: int | None = None, budgets: Mapping[str, int] | None = None,
                      default_budget: int | None = None, max_observation_tokens: int | None = None,
                      grounding: GroundingIndex | None = None, grounding_k: int = 0,
                      grounding_max_tokens: int = 512, max_tokens: int | None = None,
                      max_examples: int | None = None, error_share: float | None = None,
                      seed: int = 0) -> list[SFTExample]:
    """Supervised REHEARSE turns, one per real transition (`training.transitions.real_transitions`).

    Prompt: exactly the REHEARSE prompt a rollout builds (`roles.rehearse.rehearse_prompt_ids`) for
    the transition's task context (`tasks`, by id), history and call, with up to `grounding_k`
    examples of other tasks from `grounding` (never the transition's own task) and tool results cut
    to `max_observation_tokens`. Target: the real result's canonical text (`Transition.observation`)
    cut with the marker (`envs.tau2.observations.cut_observation`) to its tool's generation budget
    minus the eos (`budgets[tool]`, else `default_budget`; None = uncut; a budget below the marker's
    ~16 tokens gives the marker alone, `roles.bounds.bound_text`), + eos: what REHEARSE
    generates and `parse_rehearse` reads back into the same text. `gold` is the call rehearsed.

    `max_tokens`: examples longer (prompt + target) are dropped; `error_share` (in [0, 1)): the error
    transitions kept are a seeded sample of at most ``floor(error_share / (1 - error_share) * S)``
    of them, S the success examples left, so errors are at most that share of the examples (order
    kept; None = all). Why: with one wrong call per gold call half the targets open with the same
    ``{"error"`` token while the successes' openings split over each tool's keys, so greedy decoding
    of a briefly warmed rehearser answers every call with an error (measured in
    benchmarks/RESULTS.md, REHEARSE fidelity). `max_examples`: then a seeded sample of that many
    (order kept).

    Raises:
        SFTError: a transition whose task is not in `tasks`; `error_share` outside [0, 1).
    """
    from envace_core.envs.tau2.observations import cut_observation
    from envace_core.envs.tau2.tasks import task_context
    from envace_core.roles.rehearse import rehearse_prompt_ids

    if error_share is not None and not 0 <= error_share < 1:
        raise SFTError(f"error_share must be in [0, 1), got {error_share!r}")
    by_id = {t.id: t for t in tasks}
    contexts: dict[str, object] = {}
    out: list[SFTExample] = []
    is_error: list[bool] = []
    for tr in transitions:
        if tr.task_id not in by_id:
            raise SFTError(f"transition of task {tr.task_id!r}, which is not among the given tasks")
        ctx = contexts.get(tr.task_id) or contexts.setdefault(tr.task_id, task_context(by_id[tr.task_id], policy_max_chars))
        examples = grounding.examples(tr.task_id, tr.call, grounding_k, grounding_max_tokens, tokenizer) \
            if grounding is not None and grounding_k > 0 else []
        budget = (budgets or {}).get(tr.tool, default_budget)
        text = cut_observation(tr.observation.content, tokenizer, None if budget is None else max(budget - 1, 1))
        out.append(SFTExample(tr.task_id, rehearse_prompt_ids(tokenizer, ctx, tr.history, tr.call, examples,
                                                              max_observation_tokens),
                              completion_ids(tokenizer, text), text, tr.call, role="rehearse"))
        is_error.append(bool(tr.observation.error))
    if max_tokens is not None:
        fit = [len(e.prompt_ids) + len(e.completion_ids) <= max_tokens for e in out]
        out = [e for e, f in zip(out, fit) if f]
        is_error = [k for k, f in zip(is_error, fit) if f]
    if error_share is not None:
        errors = [i for i, k in enumerate(is_error) if k]
        cap = math.floor(error_share / (1 - error_share) * (len(out) - len(errors)) + 1e-9)
        if len(errors) > cap:
            perm = torch.randperm(len(errors), generator=torch.Generator().manual_seed(seed + 1)).tolist()
            drop = {errors[j] for j in perm[cap:]}
            out = [e for i, e in enumerate(out) if i not in drop]
    if max_examples is not None and len(out) > max_examples:
        keep = sorted(torch.randperm(len(out), generator=torch.Generator().manual_seed(seed))[:max_examples].tolist())
        out = [out[i] for i in keep]
    return out


# Two prompts whose common prefix is at least this long (tokens) are in one cluster: the chat
# template's header alone is ~10 tokens, a role's system message for one domain ~400-1,700.
CLUSTER_MIN_PREFIX = 64


def prompt_clusters(examples: Sequence[SFTExample], min_prefix: int = CLUSTER_MIN_PREFIX) -> list[list[int]]:
    """Indices of `examples` grouped by role and shared prompt prefix (≥ `min_prefix` tokens with the
    cluster's first example): one cluster per role × domain system message. Order: first appearance."""
    clusters: list[list[int]] = []
    for i, e in enumerate(examples):
        for c in clusters:
            head = examples[c[0]].prompt_ids
            k = min(min_prefix, len(head), len(e.prompt_ids))
            if k == min_prefix and examples[c[0]].role == e.role and head[:k] == e.prompt_ids[:k]:
                c.append(i)
                break
        else:
            clusters.append([i])
    return clusters


def batch_order(clusters: list[list[int]], batch_rows: int, gen: torch.Generator,
                repeats: Sequence[int] | None = None) -> list[list[int]]:
    """One pass over the examples as batches of ≤ `batch_rows` indices, each from one cluster: every
    cluster shuffled and cut into batches (its last one shorter), `repeats[i]` times for cluster i
    (default 1; each repeat reshuffled: oversampling, as a data mixture's per-source epochs), then the
    batches of all clusters shuffled. Raises ValueError unless `repeats` is None or a list of one int
    ≥ 1 per cluster."""
    reps = [1] * len(clusters) if repeats is None else repeats
    if not isinstance(reps, (list, tuple)) or len(reps) != len(clusters) or any(
            type(r) is not int or r < 1 for r in reps):
        raise ValueError(f"repeats {repeats!r}: need a list of one int ≥ 1 per cluster ({len(clusters)} clusters)")
    batches = []
    for c, r in zip(clusters, reps):
        for _ in range(r):
            perm = [c[j] for j in torch.randperm(len(c), generator=gen).tolist()]
            batches += [perm[k:k + batch_rows] for k in range(0, len(perm), batch_rows)]
    return [batches[j] for j in torch.randperm(len(batches), generator=gen).tolist()]


def sft_warmup(trainer: PolicyTrainer, examples: Sequence[SFTExample], steps: int, learning_rate: float,
               batch_rows: int, seed: int = 0, log: Callable[[str], None] | None = None,
               role_repeats: Mapping[str, int] | None = None) -> list[float]:
    """`steps` AdamW steps of completion-only CE on `examples`, on the LoRA weights of
    `trainer.model` that are trainable now (the shared adapter; for a per-role policy the active
    one: the caller activates each role's adapter, `warm_start_roles`).

    Uses its own AdamW (lr `learning_rate`, no weight decay, grad norm clipped to
    `trainer.cfg.max_grad_norm`), so the GRPO optimizer and LR schedule start fresh afterwards.
    Batches (`batch_order`): each pass shuffles the examples within their prompt cluster (role ×
    domain system message, `prompt_clusters`), cuts each cluster into batches of `batch_rows` (its
    last one shorter) and shuffles the batches; a step takes one batch, so its rows share the
    system message, which runs once (`PolicyTrainer.completion_ce_backward`). `role_repeats` ({role: k},
    default 1) puts each example of that role k times in every pass (`batch_order`'s repeats), e.g.
    {"act": 2}: two ACT epochs per REHEARSE epoch. Returns the loss of each step (nats per completion
    token, before that step's update).

    Raises:
        SFTError: `examples` is empty, no trainable LoRA parameter is found, or `role_repeats` names a
            role no example has. ValueError: a repeat count that is not an int ≥ 1 (`batch_order`).
    """
    if not examples:
        raise SFTError("no supervised ACT example: the train split has no task with gold actions "
                       "(set data.synthetic_tasks_per_domain > 0 or train.sft_warmup_steps: 0)")
    unknown = sorted(set(role_repeats or {}) - {e.role for e in examples})
    if unknown:
        raise SFTError(f"role_repeats names roles {unknown} that no example has (roles: "
                       f"{sorted({e.role for e in examples})})")
    model = trainer.model
    params = [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]
    if not params:
        raise SFTError("the policy has no trainable LoRA parameter to warm up")
    opt = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    clusters = prompt_clusters(examples)
    repeats = [(role_repeats or {}).get(examples[c[0]].role, 1) for c in clusters]
    order: list[list[int]] = []
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        if not order:  # a new pass when the current one runs out
            order = batch_order(clusters, batch_rows, gen, repeats)
        batch = [examples[i] for i in order.pop(0)]
        # token-mean CE over the batch; its rows share their cluster's system message, which runs
        # once (`PolicyTrainer.completion_ce_backward`)
        n_tok = sum(len(r.completion_ids) for r in batch)
        opt.zero_grad(set_to_none=True)
        loss = trainer.completion_ce_backward([(r.prompt_ids, r.completion_ids) for r in batch], 1.0 / n_tok)
        if not math.isfinite(loss):
            raise SFTError(f"SFT loss is {loss} at step {step + 1}: lower train.sft_learning_rate")
        torch.nn.utils.clip_grad_norm_(params, trainer.cfg.max_grad_norm)
        opt.step()
        losses.append(loss)
        if log:
            log(f"[sft] step {step + 1}/{steps}: loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
    opt.zero_grad(set_to_none=True)
    return losses
