"""The tau2 evaluation protocols: what each one runs, how it scores, and what it skips.

`evaluation.tau2.run_tau2` runs a protocol; the main job's evaluate stage (``eval.protocol``), `envace
eval` (``--protocol``) and tool learning's measurement (``eval.protocol``) name one, and every result,
report and registered manifest carries the name and this description (`describe`).

Both protocols play the same agent (`rehearsal.agent.RehearsalAgent`: the policy's engine, ACT at
``eval.temperature``, Private Rehearsal as configured) on a private copy of the task's tau2 domain
environment with the task's ``initial_state`` applied, and score with tau2's own evaluator
(``tau2.evaluator.evaluator.evaluate_simulation`` with ``EvaluationType.ALL``: reward = product of the
task's reward-basis checks DB, ENV_ASSERTION, ACTION, COMMUNICATE; success = tau2's ``is_successful``,
reward 1). In both, NL_ASSERTION is dropped from the reward basis (it needs an LLM judge, unavailable
offline), and a task judged only by NL assertions is unscored (reward None, left out of pass^k).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from envace_core import EnvaceError

TAU2_ORCHESTRATOR = "tau2_orchestrator"
OPENING_REQUEST = "opening_request"
MAX_STEPS = 30  # tau2_orchestrator: orchestrator steps (agent + user + tool messages) per dialogue
USER_MAX_NEW_TOKENS = 128  # tau2_orchestrator: tokens per simulated user reply
NL_ASSERTIONS = "skipped: no judge offline (NL_ASSERTION dropped from the reward basis)"


@dataclass(frozen=True)
class Protocol:
    """One protocol in words: who plays the user, how the agent's turns end, how it is scored, what it
    leaves out compared with tau2-bench's own run (``tau2 run``, ``tau2.run.run_task``)."""

    name: str
    user: str
    turns: str
    scoring: str
    skips: str


PROTOCOLS: dict[str, Protocol] = {
    TAU2_ORCHESTRATOR: Protocol(
        name=TAU2_ORCHESTRATOR,
        user="a simulated user: tau2's UserSimulator prompt (tau2's simulation guidelines + the task's "
             "<scenario>) answered by a local model (default: the evaluated policy) or an OpenAI-compatible "
             "endpoint; it ends the dialogue with ###STOP### / ###TRANSFER### / ###OUT-OF-SCOPE###",
        turns="tau2's Orchestrator (as tau2.run.run_task builds it) alternates agent, user and environment "
              "until the user stops, max_steps messages, or max_errors tool errors",
        scoring="evaluate_simulation(EvaluationType.ALL) on the simulation tau2 recorded; a run that ended "
                "other than by user/agent stop scores 0 (tau2's rule)",
        skips=f"NL assertions ({NL_ASSERTIONS}); otherwise tau2-bench's protocol, with our user model in "
              "place of tau2's LLM user"),
    OPENING_REQUEST: Protocol(
        name=OPENING_REQUEST,
        user="none simulated: the task's opening request (user_scenario reason_for_call + known_info) is the "
             "only user message",
        turns="the agent acts against the real environment until it sends a message (the end), an "
              "unparseable output, or eval.max_turns ACT turns",
        scoring="the tool calls replayed in a fresh private environment and the message list scored by "
                "evaluate_simulation(EvaluationType.ALL) as an agent stop (Tau2Environment.score); stopped by "
                "the turn limit: 0, by a parse error: 0 (tau2's premature-termination rule)",
        skips=f"every later user turn (information the user would give when asked, confirmations, user-side "
              f"tool calls in telecom), tau2's Orchestrator and its step/error limits, and NL assertions "
              f"({NL_ASSERTIONS}); fast on CPU, not comparable to published tau2-bench numbers"),
}


def check_protocol(name: str) -> str:
    """`name` if it is a protocol, else `EnvaceError` naming the choices."""
    if name not in PROTOCOLS:
        raise EnvaceError(f"unknown tau2 evaluation protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return name


def describe(name: str, **settings) -> dict:
    """{"name", "user", "turns", "scoring", "skips", **settings}: what a result records about how it was
    measured (settings: trials, max_steps / max_turns, seed, user model, ...)."""
    return {**asdict(PROTOCOLS[check_protocol(name)]), **settings}
