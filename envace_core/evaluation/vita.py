"""VitaBench adapter: its task files, a small read-only toolset over each task's database, the rubric-window
and reward arithmetic of its official judge, and its metrics avg@k / pass@k / pass^k.

Data: VitaBench (meituan-longcat/vitabench, MIT). Two domains' English task files ship in
`../shared/data/vitabench` (`delivery/tasks_en.json`, `instore/tasks_en.json`, 100 tasks each); the rest
(cross-domain, OTA) come from a user path in the same format. A task record has `id`, `domain`,
`message_history`, `environment` (the per-task database: `time`, `user_id`, `orders`, `stores` / `shops` /
..., `weather`, `location`, `user_historical_behaviors`), `user_scenario.user_profile`, `instructions` (the
user simulator's goal) and `evaluation_criteria` (`expected_states` with required/optional orders and
`state_rubrics`, and `overall_rubrics`).

Gold hygiene: `evaluation_criteria` is kept only in `Task.source` (scoring only). `first_user_message`,
`user_scenario`, `vita_policy`, `vita_tools` and `vita_context` are built from `instructions`,
`user_scenario`, and `environment` only.

Tools (NOT the official ones). VitaBench's 66 tools live in its code, which is not available offline, so
results with these tools are not comparable to published VitaBench numbers. `vita_tools(task)` generates a
small read-only toolset from the top-level keys of the task's `environment`:
  * a *collection* (a mapping whose values are all objects, keyed by id; an empty mapping counts too, e.g.
    `orders: {}`) `<c>` gives `get_<c>(id)` (the record under that key) and `search_<c>(query, limit=10)`
    (records whose JSON text contains every whitespace-separated query term, case-insensitive, in
    database order, at most `limit`; an empty query lists them);
  * any other key `<k>` (`time`, `user_id`, `weather`, `location`, `user_historical_behaviors`, ...) gives
    `get_<k>()` returning its value.
Tool names are the keys lower-cased with runs of other characters than [a-z0-9] replaced by "_". There
are no write tools (the official ones create/modify orders and reservations), so tasks whose rubrics need
an order placed cannot be completed with this toolset.

Scoring (official, not reproducible offline): an LLM judge reads the trajectory in sliding windows of 10
messages overlapping by 2 (`rubric_windows`); it starts with every rubric unmet and, window by window,
returns an updated verdict per rubric; the last verdict of each rubric stands; the task reward is 1 only
when every rubric is met; runs that end early (too many errors, max steps, invalid agent message) score 0
(`aggregate_rubric_verdicts`; VitaBench `src/vita/evaluator/evaluator_traj.py` TrajectoryEvaluator and
`src/vita/evaluator/evaluator.py`). `judge_reward` runs that loop with any judge callable that returns
per-rubric booleans. `VitaEnvironment.score` raises: there is no judge model offline.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envace_core import EnvaceError
from envace_core.envs.vita import WINDOW_OVERLAP, WINDOW_SIZE, vita_source
from envace_core.types import Task


# ------------------------------------------------------------------------------------------ judge
class LLMJudge:
    """VitaBench's rubric judge on a local `Engine` or an `OpenAIChatClient` (one call per window).

    It sees the window's messages, the rubrics and their current states, and must answer with a JSON list
    of booleans (one per rubric); an answer that does not parse keeps the current states and is counted in
    `stats["unparsed"]` (VitaBench's judge prompt is not available offline: this prompt is ours).
    """

    def __init__(self, engine=None, client=None, max_new_tokens: int = 128):
        self.engine, self.client, self.max_new_tokens = engine, client, max_new_tokens
        self.stats: Counter = Counter(calls=0, unparsed=0)

    def _ask(self, chat: list[dict]) -> str:
        from envace_core.engines.base import SamplingParams

        if self.client is not None:
            return self.client.chat(chat, self.max_new_tokens, 0.0, 0)
        tok = self.engine.tokenizer
        ids = [int(i) for i in tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)]
        c = self.engine.generate([ids], SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0))[0][0]
        return tok.decode(c.token_ids, skip_special_tokens=True)

    def __call__(self, window: list, rubrics: list[str], states: list[bool]):
        self.stats["calls"] += 1
        convo = "\n".join(f"[{m['role']}] {m['content']}" for m in window)
        items = "\n".join(f"{i}. [{'met' if s else 'unmet'}] {r}" for i, (r, s) in enumerate(zip(rubrics, states)))
        chat = [{"role": "system", "content": "You grade a customer-service agent's conversation against rubrics. "
                 "Answer with only a JSON list of true/false, one per rubric, in order."},
                {"role": "user", "content": f"Conversation excerpt:\n{convo}\n\nRubrics (current state):\n{items}"}]
        text = self._ask(chat)
        m = re.search(r"\[[^\[\]]*\]", text)
        try:
            vals = json.loads(m.group(0)) if m else None
        except json.JSONDecodeError:
            vals = None
        if not isinstance(vals, list) or len(vals) != len(rubrics) or not all(isinstance(v, bool) for v in vals):
            self.stats["unparsed"] += 1
            return {}
        return vals


# ---------------------------------------------------------------------------------- rubric scoring
def vita_rubrics(task: Task) -> list[str]:
    """The rubrics the official judge checks, in its order: every `state_rubrics` entry of
    `expected_states`, then `overall_rubrics`, each string once (first occurrence kept; VitaBench
    `TrajectoryEvaluator._initialize_rubric_states`). Scoring only: never put these in a prompt."""
    ec = vita_source(task).get("evaluation_criteria") or {}
    out: list[str] = []
    for st in ec.get("expected_states") or []:
        for r in (st or {}).get("state_rubrics") or []:
            if r not in out:
                out.append(r)
    for r in ec.get("overall_rubrics") or []:
        if r not in out:
            out.append(r)
    return out


def rubric_windows(messages: Sequence[Any], size: int = WINDOW_SIZE, overlap: int = WINDOW_OVERLAP) -> list[list[Any]]:
    """The judge's sliding windows over `messages` (VitaBench `TrajectoryEvaluator._create_sliding_windows`).

    With n = len(messages): if n <= size, one window holding all of them (also when n = 0). Otherwise
    windows start at 0, s, 2s, ... with stride s = size − overlap, each `messages[start:start + size]`,
    ending with the first window that reaches the last message. E.g. size 10, overlap 2, n = 19: [0:10],
    [8:18], [16:19]. Raises `EnvaceError` unless 0 <= overlap < size.
    """
    if not (isinstance(size, int) and isinstance(overlap, int) and 0 <= overlap < size):
        raise EnvaceError(f"rubric windows need integers 0 <= overlap < size, got size={size}, overlap={overlap}")
    msgs = list(messages)
    if len(msgs) <= size:
        return [msgs]
    out, i, step = [], 0, size - overlap
    while i < len(msgs):
        out.append(msgs[i:i + size])
        if i + size >= len(msgs):
            break
        i += step
    return out


def rubric_states(verdicts: Sequence[Mapping[int, bool] | Sequence[bool]], n_rubrics: int | None = None) -> list[bool]:
    """Final met/unmet state per rubric after the judge's window verdicts (VitaBench TrajectoryEvaluator).

    Every rubric starts unmet. `verdicts` has one entry per window, in order: a sequence of n booleans, or
    a mapping rubric index -> bool for the rubrics the judge returned (the others keep their state). Each
    verdict overwrites the state: the last verdict given for a rubric stands. `n_rubrics` is required when
    no entry is a full sequence. Raises `EnvaceError` on inconsistent lengths, indices out of range or
    non-boolean verdicts.
    """
    lengths = {len(v) for v in verdicts if not isinstance(v, Mapping)}
    if n_rubrics is None:
        if len(lengths) != 1:
            raise EnvaceError("give n_rubrics (the window verdicts do not fix the number of rubrics)")
        n_rubrics = lengths.pop()
    elif lengths - {n_rubrics}:
        raise EnvaceError(f"window verdict lengths {sorted(lengths)} differ from n_rubrics={n_rubrics}")
    states = [False] * n_rubrics
    for w, v in enumerate(verdicts):
        items = v.items() if isinstance(v, Mapping) else enumerate(v)
        for i, ok in items:
            if not isinstance(i, int) or not 0 <= i < n_rubrics:
                raise EnvaceError(f"window {w}: rubric index {i!r} out of range 0..{n_rubrics - 1}")
            if not isinstance(ok, bool):
                raise EnvaceError(f"window {w}: verdict for rubric {i} must be a bool, got {ok!r}")
            states[i] = ok
    return states


def aggregate_rubric_verdicts(verdicts: Sequence[Mapping[int, bool] | Sequence[bool]], n_rubrics: int | None = None,
                              terminated_early: bool = False) -> float:
    """VitaBench task reward from the judge's window verdicts: 1.0 when every rubric's final state
    (`rubric_states`) is met, else 0.0; 0.0 when the run ended early (too many errors, max steps, invalid
    agent message); 1.0 when the task has no rubric (VitaBench `evaluator.py` / `evaluator_traj.py`)."""
    if terminated_early:
        return 0.0
    if n_rubrics == 0:
        return 1.0
    states = rubric_states(verdicts, n_rubrics)
    return 1.0 if states and all(states) else 0.0


Judge = Callable[[list[Any], list[str], list[bool]], "Mapping[int, bool] | Sequence[bool]"]


def judge_reward(task: Task, messages: Sequence[Any], judge: Judge, terminated_early: bool = False,
                 size: int = WINDOW_SIZE, overlap: int = WINDOW_OVERLAP) -> dict[str, Any]:
    """Run the official sliding-window loop with a plug-in judge.

    `judge(window, rubrics, current_states)` sees one window of `messages`, the rubric texts
    (`vita_rubrics(task)`) and the current states, and returns per-rubric booleans (a list, or a mapping
    index -> bool for the rubrics it updates). Returns `{"reward", "rubric_score" (fraction met),
    "rubric_states", "num_windows"}`; with `terminated_early` the judge is not called and the reward is 0.
    """
    rubrics = vita_rubrics(task)
    if terminated_early:
        return {"reward": 0.0, "rubric_score": 0.0, "rubric_states": [False] * len(rubrics), "num_windows": 0}
    if not rubrics:
        return {"reward": 1.0, "rubric_score": 1.0, "rubric_states": [], "num_windows": 0}
    windows = rubric_windows(messages, size, overlap)
    verdicts: list[Any] = []
    states = [False] * len(rubrics)
    for w in windows:
        verdicts.append(judge(list(w), list(rubrics), list(states)))
        states = rubric_states(verdicts, len(rubrics))
    return {"reward": aggregate_rubric_verdicts(verdicts, len(rubrics)), "rubric_score": sum(states) / len(states),
            "rubric_states": states, "num_windows": len(windows)}


# ------------------------------------------------------------------------------------------ metrics
def _check_nck(n: int, c: int, k: int) -> None:
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise EnvaceError("n, c and k must be integers")
    if k < 1 or n < k or not 0 <= c <= n:
        raise EnvaceError(f"need 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n trials with c successes: 1 − C(n−c, k) / C(n, k) (1 when n − c < k).

    Source: Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (arXiv:2107.03374), as used
    by VitaBench `metrics/agent_metrics.py`. Raises `EnvaceError` unless 1 <= k <= n and 0 <= c <= n.
    """
    _check_nck(n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k: the chance that k trials drawn without replacement from n (c successes) all succeed,
    C(c, k) / C(n, k). Source: Yao et al. 2024, "τ-bench" (arXiv:2406.12045), as used by VitaBench.
    Raises `EnvaceError` unless 1 <= k <= n and 0 <= c <= n."""
    _check_nck(n, c, k)
    return math.comb(c, k) / math.comb(n, k)


def avg_at_k(rewards: Sequence[float], k: int) -> float:
    """avg@k of one task as VitaBench computes it (`average_at_k`): the mean reward of its trials, which
    must number at least k. Raises `EnvaceError` for k < 1 or fewer than k trials."""
    if not isinstance(k, int) or k < 1 or len(rewards) < k:
        raise EnvaceError(f"avg@k needs 1 <= k <= number of trials, got k={k}, trials={len(rewards)}")
    return float(sum(rewards)) / len(rewards)


def vita_metrics(rewards_by_task: Mapping[str, Sequence[float]], ks: Sequence[int] | None = None) -> dict[str, Any]:
    """Benchmark-level metrics: per task, n = its trials, c = trials with reward exactly 1.0 (VitaBench
    `is_successful`); avg@k, pass@k, pass^k averaged over tasks. `ks` defaults to 1..min trials.

    Returns `{"avg_reward" (mean over all trials), "avg@k": {k: ..}, "pass@k": {k: ..}, "pass^k": {k: ..},
    "n_tasks"}`. Raises `EnvaceError` for no tasks, a task with no trials, or k above a task's trials.
    """
    if not rewards_by_task:
        raise EnvaceError("vita_metrics needs at least one task")
    if any(len(r) == 0 for r in rewards_by_task.values()):
        raise EnvaceError("every task needs at least one trial")
    min_n = min(len(r) for r in rewards_by_task.values())
    ks = list(ks) if ks is not None else list(range(1, min_n + 1))
    out: dict[str, Any] = {"n_tasks": len(rewards_by_task), "avg@k": {}, "pass@k": {}, "pass^k": {}}
    all_r = [float(x) for r in rewards_by_task.values() for x in r]
    out["avg_reward"] = sum(all_r) / len(all_r)
    T = len(rewards_by_task)
    for k in ks:
        out["avg@k"][k] = sum(avg_at_k(r, k) for r in rewards_by_task.values()) / T
        out["pass@k"][k] = sum(pass_at_k(len(r), sum(1 for x in r if x == 1.0), k) for r in rewards_by_task.values()) / T
        out["pass^k"][k] = sum(pass_hat_k(len(r), sum(1 for x in r if x == 1.0), k)
                               for r in rewards_by_task.values()) / T
    return out
