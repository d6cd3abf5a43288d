"""Rehearsal fidelity per (real observation, imagined text, call) pair, aggregated per tool and kind.

METHOD.md §2 asks for rehearsal fidelity "per tool and per kind (validity, error-vs-success, key
structure, leaf values)". For one transition (h, a, o) and REHEARSE's text t for it:

- **json_valid** ∈ {0, 1}: t passes the strict REHEARSE parser (`roles.rehearse.parse_rehearse`: one
  JSON value, optionally in one ``` fence, or a result cut with the truncation marker, which then
  matches no key or value). ô is t's value in the canonical rendering (the tool's view applied,
  `envs.tau2.observations`), the form o has.
- **error_match** ∈ {0, 1}: t is an error (an object with a truthy "error" key) iff o is (tau2's
  ``Error: ...`` results). 0 when t does not parse.
- **key_f1** ∈ [0, 1]: F1 of the sets of key paths (`key_paths`: ``a.b[].c``, list positions collapsed
  to ``[]``; a scalar root is ``$``) of ô and o.
- **value_f1** ∈ [0, 1]: F1 of the multisets of (key path, canonical leaf) pairs (`leaf_values`).
- **echo_share** ∈ [0, 1] (o only): the share of o's leaves whose canonical value equals a leaf of
  the call's arguments (an "echo", e.g. the reservation id it was asked about); the other leaves had
  to be imagined (or remembered from the history).
- **echo_f1** / **imagined_f1**: value F1 restricted to the echo part / the rest, on both sides (an
  imagined leaf is "echo" by the same rule). None where neither side has a leaf of that part.

F1 = 2|I ∩ R| / (|I| + |R|) (harmonic mean of precision |I∩R|/|I| and recall |I∩R|/|R|; multiset
intersection for values), 1 when both are empty. An unparseable t scores 0 on every metric that is
defined for the pair.

Canonical leaves (`canonical_leaf`): strings have surrounding whitespace stripped and inner runs of
whitespace collapsed to one space, but keep their case, since tau2's ids and codes are case-sensitive
("PEP4E0", "#W6390527", flight "HAT176") and a rehearser that changes their case imagines another
record; numbers (not booleans) are compared as floats (51 == 51.0; ``true`` != 1); null, booleans, empty
objects and empty lists are leaves of their own. A real error ``Error: <message>`` is the value
``{"error": "<message>"}``, the form REHEARSE is asked to write; a real result that is not JSON is that
string as a scalar (`envs.tau2.observations.result_value`).

Aggregation (`aggregate`): the mean of each metric over transitions with a 95 % percentile bootstrap
interval (Efron & Tibshirani 1993, ch. 13; numpy, seeded), overall, per tool and per kind
("success" / "error" of the real observation).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from envace_core.envs.tau2.observations import is_cut, result_value
from envace_core.roles.errors import ParseError
from envace_core.roles.rehearse import parse_rehearse
from envace_core.types import Observation, ToolCall

CUT = object()  # the value of a cut (marker-ended) imagined result: no key paths, no leaves
METRICS = ("json_valid", "error_match", "key_f1", "value_f1", "echo_share", "echo_f1", "imagined_f1")
_WS = re.compile(r"\s+")


@dataclass(frozen=True)
class PairScore:
    """The fidelity metrics of one transition (module docstring); None = not defined for the pair."""

    tool: str
    kind: str  # "success" | "error": the real observation's
    json_valid: float
    error_match: float
    key_f1: float
    value_f1: float
    echo_share: float | None
    echo_f1: float | None
    imagined_f1: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ canonical form
def canonical_leaf(value: Any) -> str:
    """One leaf as a comparable string (module docstring: strings stripped, whitespace collapsed,
    case kept; numbers as floats; bool/null/{}/[] by their JSON text). Type-tagged, so the string
    "1" != the number 1."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return f"n:{float(value)!r}"
    if isinstance(value, str):
        return "s:" + _WS.sub(" ", value.strip())
    if isinstance(value, (dict, list)) and not value:
        return json.dumps(value)
    raise TypeError(f"not a JSON leaf: {type(value).__name__}")


def _walk(value: Any, path: str):
    """(path, leaf) for every leaf of `value`; dict keys join with '.', list items add '[]'."""
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list) and value:
        for v in value:
            yield from _walk(v, f"{path}[]")
    else:
        yield path or "$", value


def key_paths(value: Any) -> set[str]:
    """Every key path of a JSON value, e.g. ``{"a": {"b": [{"c": 1}]}}`` -> {"a", "a.b", "a.b[]",
    "a.b[].c"}; a scalar (or empty) root is {"$"}. List positions collapse to ``[]``."""
    out: set[str] = set()

    def walk(v: Any, path: str) -> None:
        if path:
            out.add(path)
        if isinstance(v, dict):
            for k, x in v.items():
                walk(x, f"{path}.{k}" if path else str(k))
        elif isinstance(v, list):
            for x in v:
                walk(x, f"{path}[]")

    walk(value, "")
    return out or {"$"}


def leaf_values(value: Any) -> Counter[tuple[str, str]]:
    """The multiset of (key path, `canonical_leaf`) pairs of a JSON value."""
    return Counter((p, canonical_leaf(v)) for p, v in _walk(value, ""))


def f1(pred: Counter | set, gold: Counter | set) -> float:
    """F1 = 2|P ∩ G| / (|P| + |G|) of two sets or multisets (Counter: multiset intersection); 1.0
    when both are empty."""
    if isinstance(pred, set):
        pred, gold = Counter(pred), Counter(gold)
    n_p, n_g = sum(pred.values()), sum(gold.values())
    if n_p + n_g == 0:
        return 1.0
    return 2.0 * sum((pred & gold).values()) / (n_p + n_g)


def real_value(obs: Observation) -> Any:
    """The JSON value of a real observation (`envs.tau2.observations.result_value`): ``{"error":
    message}`` for a tool error (tau2's ``Error: `` prefix dropped), the parsed content when it is
    JSON, else the text as a string."""
    return result_value(obs.content, obs.error)


def imagined_value(text: str | None, tool: str = "") -> tuple[Any, bool] | None:
    """(JSON value, is an error) of a REHEARSE output for `tool`, in the canonical rendering
    (`roles.rehearse.parse_rehearse`: the tool's view applied, as real results have it), or None when
    it fails the strict parser. An output cut with the truncation marker (the taught form of a result
    over the tool's budget) is valid with value `CUT`: it matches no key or value of an uncut result."""
    if text is None:
        return None
    try:
        obs = parse_rehearse(text, tool)
    except ParseError:
        return None
    if is_cut(obs.content):
        return CUT, obs.error
    return json.loads(obs.content), obs.error


def _argument_leaves(arguments: Mapping[str, Any]) -> set[str]:
    return {canonical_leaf(v) for _, v in _walk(dict(arguments), "") if not isinstance(v, (dict, list))}


def _split(leaves: Counter, echo: set[str]) -> tuple[Counter, Counter]:
    e = Counter({k: n for k, n in leaves.items() if k[1] in echo})
    return e, leaves - e


# ------------------------------------------------------------------------------------------- score
def score_pair(real: Observation, imagined_text: str | None, call: ToolCall) -> PairScore:
    """The metrics of one transition (module docstring): `real` the real observation o of `call`,
    `imagined_text` REHEARSE's raw output for it (None: nothing generated)."""
    kind = "error" if real.error else "success"
    gold = real_value(real)
    g_leaves = leaf_values(gold)
    echo = _argument_leaves(call.arguments)
    g_echo, g_rest = _split(g_leaves, echo)
    n = sum(g_leaves.values())
    echo_share = sum(g_echo.values()) / n if n else None
    got = imagined_value(imagined_text, call.name)
    if got is None:
        return PairScore(call.name, kind, 0.0, 0.0, 0.0, 0.0, echo_share,
                         0.0 if g_echo else None, 0.0 if g_rest else None)
    value, is_error = got
    p_leaves = Counter() if value is CUT else leaf_values(value)
    p_echo, p_rest = _split(p_leaves, echo)
    return PairScore(
        call.name, kind, 1.0, float(is_error == real.error),
        f1(set() if value is CUT else key_paths(value), key_paths(gold)),
        f1(p_leaves, g_leaves), echo_share,
        f1(p_echo, g_echo) if (p_echo or g_echo) else None,
        f1(p_rest, g_rest) if (p_rest or g_rest) else None)


# --------------------------------------------------------------------------------------- aggregate
def bootstrap_mean_ci(xs: Sequence[float], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """{"mean", "ci_low", "ci_high", "n"}: the mean of `xs` and its 95 % percentile bootstrap interval
    (resampling items with replacement `n_boot` times, numpy ``default_rng(seed)``). All None and
    n = 0 for an empty `xs` (nothing measured is never reported as 0)."""
    if not len(xs):
        return {"mean": None, "ci_low": None, "ci_high": None, "n": 0}
    a = np.asarray(xs, dtype=float)
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, len(a), size=(n_boot, len(a)))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(a.mean()), "ci_low": float(lo), "ci_high": float(hi), "n": int(len(a))}


def summarize(scores: Iterable[PairScore], n_boot: int = 2000, seed: int = 0) -> dict[str, dict[str, Any]]:
    """{metric: `bootstrap_mean_ci` over the transitions where the metric is defined} for `METRICS`."""
    scores = list(scores)
    return {m: bootstrap_mean_ci([getattr(s, m) for s in scores if getattr(s, m) is not None], n_boot, seed)
            for m in METRICS}


def aggregate(scores: Iterable[PairScore], n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """{"all": summary, "per_tool": {tool: summary}, "per_kind": {"success"/"error": summary}} with
    each summary as in `summarize`; groups are sorted by name."""
    scores = list(scores)

    def by(attr: str) -> dict[str, Any]:
        keys = sorted({getattr(s, attr) for s in scores})
        return {k: summarize([s for s in scores if getattr(s, attr) == k], n_boot, seed) for k in keys}

    return {"all": summarize(scores, n_boot, seed), "per_tool": by("tool"), "per_kind": by("kind")}
