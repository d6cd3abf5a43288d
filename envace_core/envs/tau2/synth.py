"""Synthesized, verifiable training tasks from the tau2 domains' own databases (issue 3 item 6).

Each synthesized task is a real tau2 ``Task`` (``tau2.data_model.tasks.Task``: a structured
``user_scenario``, ``evaluation_criteria`` with gold ``actions``, ``communicate_info`` and
``reward_basis = [DB, COMMUNICATE]``), converted with the adapter's own `to_task`, so tau2's
evaluator scores it exactly like a benchmark task. Difficulty is graded (a curriculum):

* level 1 — one read-only look-up whose result must be told to the user (``communicate_info``: an
  unguessable value such as a flight number, an email address or a user id). An answer without
  the tool call scores 0 (COMMUNICATE fails).
* level 2 — one write whose arguments are all stated in the request, preceded only by the reads
  the domain policy mandates (airline: read the reservation before changing it; retail:
  authenticate the user, read the order before changing it).
* level 3 — a write with an argument only a look-up gives (which reservation/order is meant, the
  user's default address, the other passengers of a reservation).

Gold outcome: the gold actions are executed in a fresh private environment through the harness's
own `rewards.replay_reward`; a task is kept only if every gold call succeeds, the replay scores
reward 1 with DB 1, a write task changes the DB hash (a read-only one does not), the gold
trajectory passes the domain's code-checkable policy rules (`verifier.policy_rule_checks`) and a
plain-text answer without tool calls scores 0 (write tasks: the DB is unchanged, so DB = 0; level 1:
echoing the request back fails tau2's COMMUNICATE check). Requests state the user's consent ("You
confirm when the agent asks you to"), since the policies demand it before any write.

Policy (checked in code, from the domains' policy texts): airline cancellations only when no
segment has been flown and one of "booked within the last 24 hrs" (policy's current time
2024-05-15 15:00 EST), "cancelled by airline", "business", "travel insurance and a covered
(health) reason" holds; retail cancellations and address changes only on ``pending`` orders,
cancellation reasons only 'no longer needed' / 'ordered by mistake'.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.rules import policy_rule_checks
from envace_core.envs.tau2.tasks import load_tasks, task_context, tau2_task, to_task
from envace_core.training.rewards import replay_reward
from envace_core.types import Step, Task, Trajectory

SYNTH_DOMAINS: tuple[str, ...] = ("airline", "retail")
LEVELS: tuple[int, ...] = (1, 2, 3)
SYNTH_MARKER = "envace-synth"
# airline policy: "The current time is 2024-05-15 15:00:00 EST."
AIRLINE_NOW = datetime(2024, 5, 15, 15, 0, 0)
_FLOWN = {"landed", "flying"}
_CONFIRM = "You confirm when the agent asks you to, and you do not want anything else."


class SynthesisError(EnvaceError):
    """Synthesis cannot deliver what was asked (unsupported domain, bad level, too few candidates)."""


@dataclass(frozen=True)
class Candidate:
    """One task before validation: request, gold assistant actions, info to communicate."""

    level: int
    template: str
    reason_for_call: str
    known_info: str
    actions: tuple[tuple[str, dict[str, Any]], ...]
    communicate_info: tuple[str, ...] = ()
    users: frozenset[str] = field(default_factory=frozenset)  # owners of every entity it touches

    def key(self) -> str:
        """Deduplication key: normalised request + canonical gold actions."""
        text = " ".join(f"{self.reason_for_call} {self.known_info}".lower().split())
        return text + "\n" + json.dumps([[n, a] for n, a in self.actions], sort_keys=True)


# ------------------------------------------------------------------------------------ helpers
def _stable(*parts: Any) -> int:
    """A process-independent integer hash (Python's hash() is salted per process)."""
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def domain_env(domain: str):
    from tau2.registry import registry

    return registry.get_env_constructor(domain)()


def _addr(a: Any) -> dict[str, str]:
    return {k: getattr(a, k) for k in ("address1", "address2", "city", "state", "country", "zip")}


def _addr_text(a: dict[str, str]) -> str:
    line = ", ".join(x for x in (a["address1"], a["address2"]) if x)
    return f"{line}, {a['city']}, {a['state']} {a['zip']}, {a['country']}"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _status(db: Any, flight_number: str, date: str) -> str:
    f = db.flights.get(flight_number)
    inst = f.dates.get(date) if f is not None else None
    return getattr(inst, "status", "unknown") if inst is not None else "unknown"


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


# ------------------------------------------------------------------------------------- airline
def airline_cancel_reason(db: Any, res: Any) -> str | None:
    """A cancellation reason the airline policy accepts for reservation `res`, or None if the policy
    forbids cancelling it (already cancelled, a segment flown, or none of the four allowances)."""
    if res.status == "cancelled":
        return None
    statuses = [_status(db, f.flight_number, f.date) for f in res.flights]
    if any(s in _FLOWN or s == "unknown" for s in statuses):
        return None
    if "cancelled" in statuses:
        return "the airline cancelled one of its flights"
    created = datetime.fromisoformat(str(res.created_at))
    if created >= AIRLINE_NOW - timedelta(hours=24) or res.cabin == "business":
        return "a change of plans"
    if res.insurance == "yes":
        return "a health problem: you are sick and cannot travel (you have travel insurance)"
    return None


def _unflown(db: Any, res: Any) -> bool:
    return res.status != "cancelled" and all(
        _status(db, f.flight_number, f.date) not in _FLOWN | {"unknown"} for f in res.flights)


def _new_passenger(db: Any, users: Sequence[str], salt: str) -> dict[str, str]:
    """A fictitious passenger mixed from three other users' names and birth dates."""
    pick = [db.users[users[_stable(salt, i) % len(users)]] for i in range(3)]
    return {"first_name": pick[0].name.first_name, "last_name": pick[1].name.last_name, "dob": pick[2].dob}


def _airline(db: Any, level: int, allowed: Sequence[str]) -> list[Candidate]:
    out: list[Candidate] = []
    for uid in allowed:
        u = db.users[uid]
        you = f"Your user id is {uid}."
        if level == 1:
            out.append(Candidate(1, "user_email", "You want to know which email address is on your profile.",
                                 you, (("get_user_details", {"user_id": uid}),), (u.email,), frozenset([uid])))
            if u.reservations:
                ids = tuple(u.reservations[:5])
                out.append(Candidate(1, "user_reservations", "You want a list of your reservation ids.",
                                     you, (("get_user_details", {"user_id": uid}),), ids, frozenset([uid])))
        trips: dict[tuple, list[str]] = {}
        for rid in u.reservations:
            res = db.reservations.get(rid)
            if res is not None and res.flights:
                trips.setdefault((res.origin, res.destination, res.flights[0].date), []).append(rid)
        for rid in u.reservations:
            res = db.reservations.get(rid)
            if res is None or res.user_id != uid or not res.flights:
                continue
            out += _airline_reservation(db, level, uid, res, trips, allowed)
    return out


def _airline_reservation(db: Any, level: int, uid: str, res: Any, trips: dict, allowed: Sequence[str]
                         ) -> list[Candidate]:
    rid, who, you = res.reservation_id, frozenset([uid]), f"Your user id is {uid}."
    read = ("get_reservation_details", {"reservation_id": rid})
    if level == 1:
        numbers = tuple(dict.fromkeys(f.flight_number for f in res.flights))
        return [Candidate(1, "reservation_flights",
                          f"You want to know the flight numbers of all flights in your reservation {rid}.",
                          you, (read,), numbers, who)]
    out = []
    reason = airline_cancel_reason(db, res)
    if reason and level == 2:
        out.append(Candidate(2, "cancel_reservation",
                             f"You want to cancel your reservation {rid} because of {reason}. {_CONFIRM}",
                             you, (read, ("cancel_reservation", {"reservation_id": rid})), (), who))
    trip = (res.origin, res.destination, res.flights[0].date)
    if reason and level == 3 and len(trips.get(trip, ())) == 1:
        kind = res.flight_type.replace("_", " ")
        out.append(Candidate(3, "cancel_trip",
                             f"You want to cancel your {kind} reservation from {trip[0]} to {trip[1]} whose "
                             f"first flight is on {trip[2]}, because of {reason}. You do not remember the "
                             f"reservation id. {_CONFIRM}", you,
                             (("get_user_details", {"user_id": uid}), read,
                              ("cancel_reservation", {"reservation_id": rid})), (), who))
    if _unflown(db, res) and ((level == 2 and len(res.passengers) == 1) or (level == 3 and len(res.passengers) > 1)):
        i = _stable(rid, "pax") % len(res.passengers)
        old, new = res.passengers[i], _new_passenger(db, allowed, rid)
        if (old.first_name, old.last_name) == (new["first_name"], new["last_name"]):
            return out
        pax = [p.model_dump(mode="json") for p in res.passengers]
        pax[i] = new
        out.append(Candidate(level, "replace_passenger",
                             f"In your reservation {rid}, you want to replace the passenger {old.first_name} "
                             f"{old.last_name} with {new['first_name']} {new['last_name']} (date of birth "
                             f"{new['dob']}); everything else stays the same. {_CONFIRM}", you,
                             (read, ("update_reservation_passengers", {"reservation_id": rid, "passengers": pax})),
                             (), who))
    return out


# -------------------------------------------------------------------------------------- retail
def _retail_auth(db: Any, uid: str, salt: str, name_zip_unique: set[str]) -> tuple[str, tuple[str, dict]]:
    """(what the user states, the authentication call): by email, or by name + zip when unique."""
    u = db.users[uid]
    if uid in name_zip_unique and _stable(salt, "auth") % 2:
        return _name_zip(u)
    return f"Your email is {u.email}.", ("find_user_id_by_email", {"email": u.email})


def _name_zip(u: Any) -> tuple[str, tuple[str, dict]]:
    n = u.name
    return (f"Your name is {n.first_name} {n.last_name} and your zip code is {u.address.zip}.",
            ("find_user_id_by_name_zip", {"first_name": n.first_name, "last_name": n.last_name,
                                          "zip": u.address.zip}))


def _retail(db: Any, level: int, allowed: Sequence[str]) -> list[Candidate]:
    keys: dict[tuple, list[str]] = {}
    for uid, u in db.users.items():
        keys.setdefault((u.name.first_name.lower(), u.name.last_name.lower(), u.address.zip), []).append(uid)
    unique = {v[0] for v in keys.values() if len(v) == 1}
    out: list[Candidate] = []
    for uid in allowed:
        u, who = db.users[uid], frozenset([uid])
        if level == 1:
            forgot = "You want to know your user id; you have forgotten it."
            out.append(Candidate(1, "user_id_by_email", forgot, f"Your email is {u.email}.",
                                 (("find_user_id_by_email", {"email": u.email}),), (uid,), who))
            if uid in unique:
                said, auth = _name_zip(u)
                out.append(Candidate(1, "user_id_by_name_zip", forgot, said, (auth,), (uid,), who))
            continue
        out += _retail_writes(db, level, uid, allowed, unique)
    return out


def _retail_writes(db: Any, level: int, uid: str, allowed: Sequence[str], unique: set[str]) -> list[Candidate]:
    u, who, out = db.users[uid], frozenset([uid]), []
    pending = [db.orders[o] for o in u.orders if o in db.orders and db.orders[o].status == "pending"
               and db.orders[o].user_id == uid]
    other = _addr(db.users[allowed[_stable(uid, "addr") % len(allowed)]].address)
    if level == 2 and other != _addr(u.address):
        said, auth = _retail_auth(db, uid, uid, unique)
        out.append(Candidate(2, "modify_user_address",
                             f"You want to change your default address to {_addr_text(other)}. {_CONFIRM}", said,
                             (auth, ("modify_user_address", {"user_id": uid, **other})), (), who))
    for o in pending:
        oid = o.order_id
        said, auth = _retail_auth(db, uid, oid, unique)
        read = ("get_order_details", {"order_id": oid})
        why = ("no longer needed", "ordered by mistake")[_stable(oid, "why") % 2]
        if level == 2:
            out.append(Candidate(2, "cancel_pending_order",
                                 f"You want to cancel your order {oid}; the reason is: {why}. {_CONFIRM}", said,
                                 (auth, read, ("cancel_pending_order", {"order_id": oid, "reason": why})), (), who))
            new = _addr(db.users[allowed[_stable(oid, "addr") % len(allowed)]].address)
            if new != _addr(o.address):
                out.append(Candidate(2, "modify_order_address",
                                     f"You want the shipping address of your order {oid} changed to "
                                     f"{_addr_text(new)}. {_CONFIRM}", said,
                                     (auth, read, ("modify_pending_order_address", {"order_id": oid, **new})), (), who))
            continue
        names = {i.name for i in o.items}
        lookup = ("get_user_details", {"user_id": uid})
        for name in sorted(names):
            if sum(name in {i.name for i in p.items} for p in pending) == 1:
                out.append(Candidate(3, "cancel_order_with_product",
                                     f"You want to cancel your pending order that contains {_a(name.lower())}; you "
                                     f"do not know the order id; the reason is: {why}. {_CONFIRM}", said,
                                     (auth, lookup, read, ("cancel_pending_order", {"order_id": oid, "reason": why})),
                                     (), who))
                break
        home = _addr(u.address)
        if home != _addr(o.address):
            out.append(Candidate(3, "order_to_default_address",
                                 f"You want your order {oid} shipped to the default address on your profile "
                                 f"instead. {_CONFIRM}", said,
                                 (auth, lookup, read, ("modify_pending_order_address", {"order_id": oid, **home})),
                                 (), who))
    return out


_GENERATORS: dict[str, Callable[[Any, int, Sequence[str]], list[Candidate]]] = {
    "airline": _airline, "retail": _retail}


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
    for c in _GENERATORS[domain](db, level, allowed):
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
            unknown_info=None, task_instructions=_CONFIRM)),
        evaluation_criteria=EvaluationCriteria(
            actions=[Action(action_id=f"{tid}_{i}", requestor="assistant", name=n, arguments=a)
                     for i, (n, a) in enumerate(cand.actions)],
            communicate_info=list(cand.communicate_info),
            reward_basis=[RewardType.DB, RewardType.COMMUNICATE]),
    )
    return to_task(domain, split, t)


def gold_answer(task: Task) -> str:
    """The final message of the gold trajectory: states every ``communicate_info`` item."""
    info = (task.source.get("evaluation_criteria") or {}).get("communicate_info") or []
    return "Done." if not info else "Here is what you asked for: " + "; ".join(info) + "."


def validate(task: Task, base_hash: str | None = None) -> list[str]:
    """Reasons to reject `task` (empty: keep): the five checks of the module docstring ("Gold
    outcome"), run through `rewards.replay_reward` and `verifier.policy_rule_checks`.
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


def synthesize_for_curate(data: Any, full_test: dict[str, list[Task]]) -> list[Task]:
    """The synthetic train tasks a `DataConfig` asks for (``synthetic_tasks_per_domain``,
    ``synthetic_levels``, ``synthetic_seed``), for each configured domain synthesis supports; other
    domains are skipped with a printed notice. `full_test`: {domain: its whole test split}."""
    n = getattr(data, "synthetic_tasks_per_domain", 0)
    if not n:
        return []
    out: list[Task] = []
    for dom in data.domains:
        if dom not in SYNTH_DOMAINS:
            print(f"[curate] synthetic tasks: skipping {dom} (supported: {', '.join(SYNTH_DOMAINS)})")
            continue
        out += synthesize(dom, n, data.synthetic_levels, data.synthetic_seed,
                          test_tasks=full_test[dom], split=data.train_split)
    print(f"[curate] synthetic tasks: {len(out)} added to {data.train_split} "
          f"(levels {list(data.synthetic_levels)}, seed {data.synthetic_seed})")
    return out
