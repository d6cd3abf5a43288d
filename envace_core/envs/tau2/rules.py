"""Code-checkable policy rules of the tau2 airline and retail domains, as verifier checks (METHOD.md §4)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from envace_core.envs.base import Check, call_text
from envace_core.types import Step, TaskContext, Trajectory


# ------------------------------------------------------------------------------ domain policy rules
def _ok(step: Step) -> bool:
    """The call succeeded (its observation is present and not an error)."""
    return step.observation is not None and not step.observation.error


def _arg(step: Step, key: str) -> Any:
    return step.action.arguments.get(key) if step.action is not None else None


def _read_before_write(traj: Trajectory, read: str, writes: Iterable[str], key: str, rule: str) -> list[str]:
    """Each call of a tool in `writes` on `key`=X follows a successful `read`(`key`=X)."""
    writes, seen, out = set(writes), set(), []
    for k, s in enumerate(traj.steps):
        if s.action is None:
            continue
        if s.action.name == read and _ok(s):
            seen.add(json.dumps(_arg(s, key)))
        elif s.action.name in writes and json.dumps(_arg(s, key)) not in seen:
            out.append(f"policy ({rule}) at step {k}: {call_text(s)} without an earlier successful "
                       f"{read}({key}={_arg(s, key)!r})")
    return out


_AIRLINE_RESERVATION_WRITES = ("cancel_reservation", "update_reservation_baggages",
                               "update_reservation_flights", "update_reservation_passengers")
_AIRLINE_PAYMENT_LIMITS = {"certificate_": 1, "credit_card_": 1, "gift_card_": 3}


def airline_reservation_read_before_write(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """airline: cancelling or updating reservation R needs an earlier successful
    `get_reservation_details(R)`. Policy: "The API does not check these for the agent, so the agent
    must make sure the rules apply before calling the API!" (modify and cancel); the rules are about
    the reservation's cabin, flights, dates and insurance, which only its details show. This checks
    the weaker, code-checkable part: that the details were read at all."""
    return _read_before_write(traj, "get_reservation_details", _AIRLINE_RESERVATION_WRITES,
                              "reservation_id", "check the reservation before changing it")


def airline_booking_reads_user(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """airline: `book_reservation(user_id=U)` needs an earlier successful `get_user_details(U)`.
    Policy: "All payment methods must already be in user profile", which only the profile shows."""
    return _read_before_write(traj, "get_user_details", ("book_reservation",), "user_id",
                              "payment methods must be in the user profile")


def airline_booking_limits(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """airline: `book_reservation` arguments within the policy's limits: "at most five passengers";
    "at most one travel certificate, at most one credit card, and at most three gift cards" (by the
    payment id's prefix, as in the domain's data: certificate_, credit_card_, gift_card_)."""
    out = []
    for k, s in enumerate(traj.steps):
        if s.action is None or s.action.name != "book_reservation":
            continue
        passengers = _arg(s, "passengers")
        if isinstance(passengers, list) and len(passengers) > 5:
            out.append(f"policy (at most five passengers) at step {k}: {len(passengers)} passengers")
        payments = _arg(s, "payment_methods")
        ids = [p.get("payment_id", "") for p in payments if isinstance(p, dict)] if isinstance(payments, list) else []
        for prefix, limit in _AIRLINE_PAYMENT_LIMITS.items():
            n = sum(1 for i in ids if isinstance(i, str) and i.startswith(prefix))
            if n > limit:
                out.append(f"policy (at most {limit} {prefix.rstrip('_')} payment(s)) at step {k}: {n} used")
    return out


_RETAIL_AUTH = ("find_user_id_by_email", "find_user_id_by_name_zip")
_RETAIL_NO_AUTH_NEEDED = _RETAIL_AUTH + ("calculate", "transfer_to_human_agents")
_RETAIL_ORDER_WRITES = ("cancel_pending_order", "modify_pending_order_address", "modify_pending_order_items",
                        "modify_pending_order_payment", "return_delivered_order_items",
                        "exchange_delivered_order_items")


def retail_authenticate_first(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """retail: no tool call (other than `calculate` and `transfer_to_human_agents`) before a successful
    `find_user_id_by_email` / `find_user_id_by_name_zip`. Policy: "At the beginning of the
    conversation, you have to authenticate the user identity by locating their user id via email, or
    via name + zip code. This has to be done even when the user already provides the user id." """
    for k, s in enumerate(traj.steps):
        if s.action is None:
            continue
        if s.action.name in _RETAIL_AUTH and _ok(s):
            return []
        if s.action.name not in _RETAIL_NO_AUTH_NEEDED:
            return [f"policy (authenticate the user first) at step {k}: {call_text(s)} before locating "
                    + "the user id by email or name + zip"]
    return []


def retail_order_read_before_write(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """retail: cancelling, modifying, returning or exchanging order O needs an earlier successful
    `get_order_details(O)`. Policy (each of the four): "... and you should check its status before
    taking the action." """
    return _read_before_write(traj, "get_order_details", _RETAIL_ORDER_WRITES, "order_id",
                              "check the order status first")


def retail_modify_items_once(traj: Trajectory, ctx: TaskContext) -> list[str]:
    """retail: after a successful `modify_pending_order_items(O)`, no further write on O. Policy: "This
    action can only be called once ... The agent will not be able to modify or cancel the order
    anymore." """
    done, out = set(), []
    for k, s in enumerate(traj.steps):
        if s.action is None or s.action.name not in _RETAIL_ORDER_WRITES:
            continue
        order = json.dumps(_arg(s, "order_id"))
        if order in done:
            out.append(f"policy (order items can be modified only once) at step {k}: {call_text(s)} after "
                       "modify_pending_order_items on the same order")
        elif s.action.name == "modify_pending_order_items" and _ok(s):
            done.add(order)
    return out


_POLICY_RULES: dict[str, tuple[Check, ...]] = {
    "airline": (airline_reservation_read_before_write, airline_booking_reads_user, airline_booking_limits),
    "retail": (retail_authenticate_first, retail_order_read_before_write, retail_modify_items_once),
}


def policy_rule_checks(domain: str) -> list[Check]:
    """Code-checkable policy rules of a tau2 domain (each check's docstring quotes its rule).

    Implemented for `airline` and `retail`. `telecom`, `mock` and any other domain: none are
    implemented yet (an empty list; no rule is pretended). Rules about user confirmation are not
    checked: a rehearsal has no user turns after the first request, so they cannot be judged on it.
    """
    return list(_POLICY_RULES.get(domain, ()))
