"""Candidate synthetic tasks built from a tau2 domain's packaged database, one builder per domain.

A candidate is a request, the gold assistant actions and the information to communicate, before
`synth.validate` replays it. Difficulty is graded (a curriculum):

* level 1: one read-only look-up whose result must be told to the user (``communicate_info``: an
  unguessable value such as a flight number, an email address or a user id).
* level 2: one write whose arguments are all stated in the request, preceded only by the reads
  the domain policy mandates (airline: read the reservation before changing it; retail:
  authenticate the user, read the order before changing it).
* level 3: a write with an argument only a look-up gives (which reservation/order is meant, the
  user's default address, the other passengers of a reservation).

Policy (checked in code, from the domains' policy texts): airline cancellations only when no
segment has been flown and one of "booked within the last 24 hrs" (policy's current time
2024-05-15 15:00 EST), "cancelled by airline", "business", "travel insurance and a covered
(health) reason" holds; retail cancellations and address changes only on ``pending`` orders,
cancellation reasons only 'no longer needed' / 'ordered by mistake'. Requests state the user's
consent (`CONFIRM`), since the policies demand it before any write.

Builders take the domain DB (``tau2`` ``FlightDB`` / ``RetailDB``), a level and the user ids they
may use, and return candidates in DB order; variation (which passenger, which reason, which
authentication) comes from `stable`, so the output is a deterministic function of the DB.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

# airline policy: "The current time is 2024-05-15 15:00:00 EST."
AIRLINE_NOW = datetime(2024, 5, 15, 15, 0, 0)
_FLOWN = {"landed", "flying"}
CONFIRM = "You confirm when the agent asks you to, and you do not want anything else."


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
def stable(*parts: Any) -> int:
    """A process-independent integer hash (Python's hash() is salted per process)."""
    return int(hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:12], 16)


def _addr(a: Any) -> dict[str, str]:
    return {k: getattr(a, k) for k in ("address1", "address2", "city", "state", "country", "zip")}


def _addr_text(a: dict[str, str]) -> str:
    line = ", ".join(x for x in (a["address1"], a["address2"]) if x)
    return f"{line}, {a['city']}, {a['state']} {a['zip']}, {a['country']}"


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def flight_status(db: Any, flight_number: str, date: str) -> str:
    """The airline DB's status of flight `flight_number` on `date` ("available", "landed", "flying",
    "cancelled", ...), "unknown" when the DB has no such flight or date."""
    f = db.flights.get(flight_number)
    inst = f.dates.get(date) if f is not None else None
    return getattr(inst, "status", "unknown") if inst is not None else "unknown"


# ------------------------------------------------------------------------------------- airline
def airline_cancel_reason(db: Any, res: Any) -> str | None:
    """A cancellation reason the airline policy accepts for reservation `res`, or None if the policy
    forbids cancelling it (already cancelled, a segment flown, or none of the four allowances)."""
    if res.status == "cancelled":
        return None
    statuses = [flight_status(db, f.flight_number, f.date) for f in res.flights]
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


def is_unflown(db: Any, res: Any) -> bool:
    """Whether reservation `res` is active and none of its flights has flown (or has an unknown status)."""
    return res.status != "cancelled" and all(
        flight_status(db, f.flight_number, f.date) not in _FLOWN | {"unknown"} for f in res.flights)


def _new_passenger(db: Any, users: Sequence[str], salt: str) -> dict[str, str]:
    """A fictitious passenger mixed from three other users' names and birth dates."""
    pick = [db.users[users[stable(salt, i) % len(users)]] for i in range(3)]
    return {"first_name": pick[0].name.first_name, "last_name": pick[1].name.last_name, "dob": pick[2].dob}


def airline_candidates(db: Any, level: int, allowed: Sequence[str]) -> list[Candidate]:
    """Airline candidates of `level` over the users `allowed`: level 1 profile and reservation
    look-ups, level 2 cancel / replace the only passenger of a named reservation, level 3 cancel
    the one trip described by route and date, replace one of several passengers."""
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
                             f"You want to cancel your reservation {rid} because of {reason}. {CONFIRM}",
                             you, (read, ("cancel_reservation", {"reservation_id": rid})), (), who))
    trip = (res.origin, res.destination, res.flights[0].date)
    if reason and level == 3 and len(trips.get(trip, ())) == 1:
        kind = res.flight_type.replace("_", " ")
        out.append(Candidate(3, "cancel_trip",
                             f"You want to cancel your {kind} reservation from {trip[0]} to {trip[1]} whose "
                             f"first flight is on {trip[2]}, because of {reason}. You do not remember the "
                             f"reservation id. {CONFIRM}", you,
                             (("get_user_details", {"user_id": uid}), read,
                              ("cancel_reservation", {"reservation_id": rid})), (), who))
    if is_unflown(db, res) and ((level == 2 and len(res.passengers) == 1) or (level == 3 and len(res.passengers) > 1)):
        i = stable(rid, "pax") % len(res.passengers)
        old, new = res.passengers[i], _new_passenger(db, allowed, rid)
        if (old.first_name, old.last_name) == (new["first_name"], new["last_name"]):
            return out
        pax = [p.model_dump(mode="json") for p in res.passengers]
        pax[i] = new
        out.append(Candidate(level, "replace_passenger",
                             f"In your reservation {rid}, you want to replace the passenger {old.first_name} "
                             f"{old.last_name} with {new['first_name']} {new['last_name']} (date of birth "
                             f"{new['dob']}); everything else stays the same. {CONFIRM}", you,
                             (read, ("update_reservation_passengers", {"reservation_id": rid, "passengers": pax})),
                             (), who))
    return out


# -------------------------------------------------------------------------------------- retail
def _retail_auth(db: Any, uid: str, salt: str, name_zip_unique: set[str]) -> tuple[str, tuple[str, dict]]:
    """(what the user states, the authentication call): by email, or by name + zip when unique."""
    u = db.users[uid]
    if uid in name_zip_unique and stable(salt, "auth") % 2:
        return _name_zip(u)
    return f"Your email is {u.email}.", ("find_user_id_by_email", {"email": u.email})


def _name_zip(u: Any) -> tuple[str, tuple[str, dict]]:
    n = u.name
    return (f"Your name is {n.first_name} {n.last_name} and your zip code is {u.address.zip}.",
            ("find_user_id_by_name_zip", {"first_name": n.first_name, "last_name": n.last_name,
                                          "zip": u.address.zip}))


def retail_candidates(db: Any, level: int, allowed: Sequence[str]) -> list[Candidate]:
    """Retail candidates of `level` over the users `allowed`: level 1 user-id look-ups (by email,
    by name + zip where unique), level 2 change the default address / cancel or re-address a named
    pending order, level 3 cancel the pending order holding a product, ship an order to the default
    address."""
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
    other = _addr(db.users[allowed[stable(uid, "addr") % len(allowed)]].address)
    if level == 2 and other != _addr(u.address):
        said, auth = _retail_auth(db, uid, uid, unique)
        out.append(Candidate(2, "modify_user_address",
                             f"You want to change your default address to {_addr_text(other)}. {CONFIRM}", said,
                             (auth, ("modify_user_address", {"user_id": uid, **other})), (), who))
    for o in pending:
        oid = o.order_id
        said, auth = _retail_auth(db, uid, oid, unique)
        read = ("get_order_details", {"order_id": oid})
        why = ("no longer needed", "ordered by mistake")[stable(oid, "why") % 2]
        if level == 2:
            out.append(Candidate(2, "cancel_pending_order",
                                 f"You want to cancel your order {oid}; the reason is: {why}. {CONFIRM}", said,
                                 (auth, read, ("cancel_pending_order", {"order_id": oid, "reason": why})), (), who))
            new = _addr(db.users[allowed[stable(oid, "addr") % len(allowed)]].address)
            if new != _addr(o.address):
                out.append(Candidate(2, "modify_order_address",
                                     f"You want the shipping address of your order {oid} changed to "
                                     f"{_addr_text(new)}. {CONFIRM}", said,
                                     (auth, read, ("modify_pending_order_address", {"order_id": oid, **new})), (), who))
            continue
        names = {i.name for i in o.items}
        lookup = ("get_user_details", {"user_id": uid})
        for name in sorted(names):
            if sum(name in {i.name for i in p.items} for p in pending) == 1:
                out.append(Candidate(3, "cancel_order_with_product",
                                     f"You want to cancel your pending order that contains {_a(name.lower())}; you "
                                     f"do not know the order id; the reason is: {why}. {CONFIRM}", said,
                                     (auth, lookup, read, ("cancel_pending_order", {"order_id": oid, "reason": why})),
                                     (), who))
                break
        home = _addr(u.address)
        if home != _addr(o.address):
            out.append(Candidate(3, "order_to_default_address",
                                 f"You want your order {oid} shipped to the default address on your profile "
                                 f"instead. {CONFIRM}", said,
                                 (auth, lookup, read, ("modify_pending_order_address", {"order_id": oid, **home})),
                                 (), who))
    return out


CANDIDATE_BUILDERS: dict[str, Callable[[Any, int, Sequence[str]], list[Candidate]]] = {
    "airline": airline_candidates, "retail": retail_candidates}
