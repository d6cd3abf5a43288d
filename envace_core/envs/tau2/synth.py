"""Synthesized, verifiable training tasks from the tau2 domains' own databases.

Each synthesized task is a real tau2 ``Task`` (``tau2.data_model.tasks.Task``: a structured
``user_scenario``, ``evaluation_criteria`` with gold ``actions``, ``communicate_info`` and
``reward_basis = [DB, COMMUNICATE]``), converted with the adapter's own `to_task`, so tau2's
evaluator scores it exactly like a benchmark task. Difficulty is graded (a curriculum, levels 1-3:
one look-up to report, one write with every argument stated, a write with an argument only a
look-up gives); the candidates of each level and the domain policy they follow come from
`synth_candidates`. An answer without the tool call scores 0.

Gold outcome: the gold actions are executed in a fresh private environment through the harness's
own `rewards.replay_reward`; a task is kept only if every gold call succeeds, the replay scores
reward 1 with DB 1, a write task changes the DB hash (a read-only one does not), the gold
trajectory passes the domain's code-checkable policy rules (`rules.policy_rule_checks`) and a
plain-text answer without tool calls scores 0 (write tasks: the DB is unchanged, so DB = 0; level 1:
echoing the request back fails tau2's COMMUNICATE check).

Never overlapping the test split (`test_users`): the *test users* of a domain are every user named
in a test task (user id, email, first name + last name + zip in gold arguments or scenario text)
or owning a reservation/order named there. A synthesized task may not touch a test user, nor any
reservation/order a test user owns, nor reuse a test task id; so no synthesized write can
coincide in (tool, key arguments) with a test task's gold write.

Ids are ``<domain>/synth-L<level>-<12 hex>``, the hash of the normalised request plus the canonical
gold actions (deduplication key); the tau2 ``description.notes`` carries the marker
``envace-synth level=<L> template=<name>``. Output is deterministic given (domain, n, levels, seed).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterable, Sequence
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.rules import policy_rule_checks
from envace_core.envs.tau2.synth_candidates import CANDIDATE_BUILDERS, CONFIRM, Candidate
from envace_core.envs.tau2.tasks import load_tasks, task_context, tau2_task, to_task
from envace_core.training.rewards import replay_reward
from envace_core.types import Step, Task, Trajectory

SYNTH_DOMAINS: tuple[str, ...] = tuple(CANDIDATE_BUILDERS)  # ("airline", "retail")
LEVELS: tuple[int, ...] = (1, 2, 3)
SYNTH_MARKER = "envace-synth"


class SynthesisError(EnvaceError):
    """Synthesis cannot deliver what was asked (unsupported domain, bad level, too few candidates)."""


def domain_env(domain: str):
    """A fresh tau2 environment of `domain` (its tools and packaged database: `.tools.db`)."""
    from tau2.registry import registry

    return registry.get_env_constructor(domain)()



# --------------------------------------------------------------------------- test-split users
_TOKEN = re.compile(r"[#\w.@+-]+")


def test_users(domain: str, test_tasks: Iterable[Task], db: Any = None) -> set[str]:
    """User ids a synthesized task must never touch: every user named by a test task of `domain`.

    A test task names user U when its gold-action arguments or scenario text contain U's user id or
    email, a reservation/order id U owns, or (gold arguments) U's first name + last name + zip.
    `db` defaults to the domain's packaged database.
    """
    db = db if db is not None else domain_env(domain).tools.db
    by_email = {u.email: uid for uid, u in db.users.items() if getattr(u, "email", None)}
    owned = {k: v.user_id for k, v in (db.reservations if domain == "airline" else db.orders).items()}
    out: set[str] = set()
    for t in test_tasks:
        texts = [t.user_scenario, t.first_user_message, json.dumps([a.arguments for a in t.gold_actions])]
        for tok in (tok.rstrip(".") for s in texts for tok in _TOKEN.findall(s or "")):
            if tok in db.users:
                out.add(tok)
            elif tok in by_email:
                out.add(by_email[tok])
            elif tok in owned:
                out.add(owned[tok])
        for a in t.gold_actions:
            if {"first_name", "last_name", "zip"} <= set(a.arguments):
                out |= {uid for uid, u in db.users.items()
                        if (u.name.first_name.lower(), u.name.last_name.lower(), u.address.zip)
                        == (str(a.arguments["first_name"]).lower(), str(a.arguments["last_name"]).lower(),
                            str(a.arguments["zip"]))}
    return out


# ---------------------------------------------------------------------------------- candidates
def candidates(domain: str, level: int, excluded_users: Iterable[str] = (), db: Any = None) -> list[Candidate]:
    """Every candidate task of `level` in `domain`'s packaged DB that touches no excluded user,
    deduplicated by `Candidate.key`, in DB order (unvalidated). Raises SynthesisError for an
    unsupported domain or level."""
    if domain not in SYNTH_DOMAINS:
        raise SynthesisError(f"cannot synthesize tasks for domain {domain!r}; supported: {', '.join(SYNTH_DOMAINS)}")
    if level not in LEVELS:
        raise SynthesisError(f"unknown synthetic task level {level!r}; valid levels: {LEVELS}")
    db = db if db is not None else domain_env(domain).tools.db
    excluded = set(excluded_users)
    allowed = [u for u in db.users if u not in excluded]
    seen, out = set(), []
    for c in CANDIDATE_BUILDERS[domain](db, level, allowed):
        if c.level == level and not (c.users & excluded) and c.key() not in seen:
            seen.add(c.key())
            out.append(c)
    return out


# ---------------------------------------------------------------------------------- task + check
def build_task(domain: str, cand: Candidate, split: str = "train") -> Task:
    """The candidate as a tau2 Task (validated by tau2's pydantic model), in our `Task` type."""
    from tau2.data_model.tasks import (
        Action,
        Description,
        EvaluationCriteria,
        RewardType,
        StructuredUserInstructions,
        UserScenario,
    )
    from tau2.data_model.tasks import Task as Tau2Task

    tid = f"synth-L{cand.level}-{hashlib.sha256(cand.key().encode()).hexdigest()[:12]}"
    t = Tau2Task(
        id=tid,
        description=Description(purpose=f"Synthesized level-{cand.level} task ({cand.template}).",
                                notes=f"{SYNTH_MARKER} level={cand.level} template={cand.template}"),
        user_scenario=UserScenario(instructions=StructuredUserInstructions(
            domain=domain, reason_for_call=cand.reason_for_call, known_info=cand.known_info,
            unknown_info=None, task_instructions=CONFIRM)),
        evaluation_criteria=EvaluationCriteria(
            actions=[Action(action_id=f"{tid}_{i}", requestor="assistant", name=n, arguments=a)
                     for i, (n, a) in enumerate(cand.actions)],
            communicate_info=list(cand.communicate_info),
            reward_basis=[RewardType.DB, RewardType.COMMUNICATE]),
    )
    return to_task(domain, split, t)


def level_of(task: Task) -> int:
    """The level (1-3) of a synthesized task, from its id ``<domain>/synth-L<level>-<hash>``.
    Raises SynthesisError for a task that is not synthesized."""
    m = re.search(r"synth-L(\d)-", task.id)
    if not m:
        raise SynthesisError(f"task {task.id!r} is not a synthesized task")
    return int(m.group(1))


def gold_answer(task: Task) -> str:
    """The final message of the gold trajectory: states every ``communicate_info`` item."""
    info = (task.source.get("evaluation_criteria") or {}).get("communicate_info") or []
    return "Done." if not info else "Here is what you asked for: " + "; ".join(info) + "."


def validate(task: Task, base_hash: str | None = None) -> list[str]:
    """Reasons to reject `task` (empty: keep): the five checks of the module docstring ("Gold
    outcome"), run through `rewards.replay_reward` and `rules.policy_rule_checks`.
    `base_hash`: the domain's initial DB snapshot (computed when None). Costs about three fresh
    tau2 environments (0.2-0.6 s each on a laptop CPU)."""
    from tau2.environment.toolkit import ToolType

    envs: list[Tau2Environment] = []

    def factory(domain: str) -> Tau2Environment:
        envs.append(Tau2Environment(domain))
        return envs[-1]

    traj = Trajectory(task_id=task.id, imagined=False,
                      steps=[Step(action=a) for a in task.gold_actions] + [Step(message=gold_answer(task))])
    res = replay_reward(task, traj, env_factory=factory)
    if res is None:
        return [f"gold replay failed: {traj.reward_info.get('error')}"]
    reasons = [f"gold call {s.action.name} failed: {s.real_observation.content[:120]}"
               for s in traj.steps if s.action is not None and s.real_observation.error]
    if res.reward != 1.0 or res.sub_rewards.get("DB") != 1.0:
        reasons.append(f"gold replay scored {res.reward} ({res.sub_rewards})")
    tools = envs[0]._env.tools
    writes = any(tools.tool_type(a.name) == ToolType.WRITE for a in task.gold_actions)
    base_hash = base_hash if base_hash is not None else Tau2Environment(task.domain).snapshot()
    if writes == (envs[0].snapshot() == base_hash):
        reasons.append("a write task left the DB unchanged" if writes else "a read-only task changed the DB")
    for s in traj.steps:
        s.observation = s.real_observation
    ctx = task_context(task)
    reasons += [r for check in policy_rule_checks(task.domain) for r in check(traj, ctx)]
    if not writes and _echo_communicates(task):
        reasons.append("a plain-text answer without tool calls scores above 0")
    return reasons


def _echo_communicates(task: Task) -> bool:
    """Whether echoing the request back (everything the agent knows without a tool call) passes
    tau2's COMMUNICATE check. Only asked of read-only tasks: without tool calls their DB reward is
    1, so this is their whole plain-text reward; a write task's plain-text DB reward is 0 already
    (its gold replay changes the DB hash, checked above)."""
    from tau2.data_model.message import AssistantMessage, UserMessage
    from tau2.evaluator.evaluator_communicate import CommunicateEvaluator

    msgs = [UserMessage(role="user", content=task.first_user_message),
            AssistantMessage(role="assistant", content=task.first_user_message)]
    return CommunicateEvaluator.calculate_reward(tau2_task(task), msgs).reward != 0.0


# ------------------------------------------------------------------------------------- synthesize
def level_quotas(n: int, levels: Sequence[int]) -> dict[int, int]:
    """`n` split evenly over `levels` (the remainder goes to the lowest levels)."""
    levels = sorted(set(levels))
    if not levels:
        raise SynthesisError("synthetic_levels is empty; choose from 1, 2, 3")
    return {lv: n // len(levels) + (i < n % len(levels)) for i, lv in enumerate(levels)}


def synthesize(domain: str, n: int, levels: Sequence[int] = LEVELS, seed: int = 0, *,
               test_tasks: Sequence[Task] | None = None, split: str = "train") -> list[Task]:
    """`n` validated synthetic tasks of `domain`, split evenly over `levels`, ordered by level.

    `test_tasks`: the domain's whole test split (default: the package's ``test`` split); their users
    are excluded (`test_users`) and their ids are never reused. Candidates of each level are shuffled
    with ``random.Random(f"{seed}:{domain}:{level}")`` and validated in that order until the level's
    quota is met, so the output is a deterministic function of the arguments.

    Raises SynthesisError for an unsupported domain or level, n < 0, or when a level has fewer valid
    candidates than its quota (the message says how many it found).
    """
    if n < 0:
        raise SynthesisError(f"number of synthetic tasks must be >= 0, got {n}")
    if domain not in SYNTH_DOMAINS:
        raise SynthesisError(f"cannot synthesize tasks for domain {domain!r}; supported: {', '.join(SYNTH_DOMAINS)}")
    quotas = level_quotas(n, levels)
    test = list(test_tasks) if test_tasks is not None else load_tasks(domain, "test")
    db = domain_env(domain).tools.db
    excluded = test_users(domain, test, db)
    test_ids = {t.id for t in test}
    base = Tau2Environment(domain).snapshot()
    out: list[Task] = []
    for level, quota in quotas.items():
        pool = candidates(domain, level, excluded, db)
        random.Random(f"{seed}:{domain}:{level}").shuffle(pool)
        kept = 0
        for cand in pool:
            if kept == quota:
                break
            task = build_task(domain, cand, split)
            if task.id not in test_ids and not validate(task, base):
                out.append(task)
                kept += 1
        if kept < quota:
            raise SynthesisError(f"{domain} level {level}: only {kept} valid synthetic tasks of {quota} asked "
                                 f"({len(pool)} candidates); lower data.synthetic_tasks_per_domain")
    return out


HELDOUT_SPLIT = "heldout"  # split name of synthesized tasks kept out of training, for evaluation


def synthesize_for_curate(data: Any, full_test: dict[str, list[Task]]) -> tuple[list[Task], list[Task]]:
    """(train, held-out) synthetic tasks a `DataConfig` asks for, for each configured domain synthesis
    supports; other domains are skipped with a printed notice. `full_test`: {domain: its whole test split}.

    Train: ``synthetic_tasks_per_domain`` per domain (``synthetic_levels``, ``synthetic_seed``), split
    ``data.train_split``. Held-out: ``synthetic_heldout_per_domain`` more per domain, split
    `HELDOUT_SPLIT`, never trained on (the evaluate stage measures base, warm start and trained
    policy on them). Both come from one `synthesize` call of n + h tasks: each level's candidates are
    validated in one seeded order, so its first quota(n) tasks are exactly what `synthesize` with n
    alone returns (the train tasks do not change when h does) and the rest are held out, disjoint."""
    n = getattr(data, "synthetic_tasks_per_domain", 0)
    h = getattr(data, "synthetic_heldout_per_domain", 0)
    if not n and not h:
        return [], []
    train: list[Task] = []
    held: list[Task] = []
    for dom in data.domains:
        if dom not in SYNTH_DOMAINS:
            print(f"[curate] synthetic tasks: skipping {dom} (supported: {', '.join(SYNTH_DOMAINS)})")
            continue
        tasks = synthesize(dom, n + h, data.synthetic_levels, data.synthetic_seed,
                           test_tasks=full_test[dom], split=data.train_split)
        quota = level_quotas(n, data.synthetic_levels)
        for t in tasks:
            lv = level_of(t)
            if quota.get(lv, 0) > 0:
                quota[lv] -= 1
                train.append(t)
            else:
                held.append(t.model_copy(update={"split": HELDOUT_SPLIT}))
    print(f"[curate] synthetic tasks: {len(train)} added to {data.train_split}, {len(held)} held out "
          f"(levels {list(data.synthetic_levels)}, seed {data.synthetic_seed})")
    return train, held
