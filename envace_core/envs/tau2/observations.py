"""One canonical text of a tool result, the same for real results and imagined ones (METHOD.md §1).

ACT's history shows real results (`Tau2Environment.step`); REHEARSE is trained to produce, and its
output is parsed back into, the same text (`roles.rehearse.parse_rehearse`), so fidelity compares
like with like and ACT sees one format whichever role answered.

The rendering (`render_observation`):
  - compact JSON (``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``), key order kept;
    a plain-text tau2 result (``"yusuf_rossi_9620"``, ``"Transfer successful"``) is a JSON string, a
    numeric one (``"1200.0"`` from ``calculate``) the number it spells;
  - a tool error is ``{"error":"<message>"}`` (tau2's ``"Error: "`` prefix dropped), the form the
    REHEARSE prompt asks for;
  - a per-tool view (`VIEWS`) drops fields that repeat the key they are filed under (retail
    ``get_product_details``: ``variants.<item_id>.item_id``; ``get_user_details`` and
    ``modify_user_address``: ``payment_methods.<id>.id``), and only when the value equals that key,
    so no information is lost: every value a later gold call, a policy rule or a task's expected
    output can use survives (tests/test_observations.py checks this over the airline + retail
    gold trajectories).

Measured on the 701 gold actions of the airline + retail train + test tasks
(benchmarks/observation_lengths.py, benchmarks/results/observation_lengths.json).
`cut_observation` is the one cut of a too-long result, with a visible marker (`roles.bounds.bound_text`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from envace_core.roles.bounds import TRUNCATION_MARKER, bound_text
from envace_core.types import Observation

ERROR_PREFIX = "Error: "  # tau2 ``Environment.get_response``: ``f"Error: {e}"`` for a failed call


class KeyEcho:
    """A view that drops, in the mapping at `path` (keys of nested dicts), the `field` of each entry
    whose `field` equals the entry's own key (a repeated id); `restore` puts it back. Anything not
    shaped so is left as is."""

    def __init__(self, path: tuple[str, ...], field: str):
        self.path, self.field = path, field

    def _map(self, value: Any, entry: Callable[[str, dict], dict], path: tuple[str, ...]) -> Any:
        if not path or not isinstance(value, dict) or path[0] not in value:
            return value
        out = dict(value)
        if len(path) > 1:
            out[path[0]] = self._map(out[path[0]], entry, path[1:])
        elif isinstance(out[path[0]], dict):
            out[path[0]] = {k: entry(k, e) if isinstance(e, dict) else e for k, e in out[path[0]].items()}
        return out

    def drop(self, value: Any) -> Any:
        f = self.field
        return self._map(value, lambda k, e: {n: v for n, v in e.items() if n != f} if e.get(f) == k else e,
                         self.path)

    def restore(self, value: Any) -> Any:
        f = self.field
        return self._map(value, lambda k, e: e if f in e else {f: k, **e}, self.path)


# tool name -> view of its parsed (non-error) result. Tool names are tau2's (airline, retail); a
# view only changes a value of the shape it names, so a same-named tool elsewhere is unaffected.
VIEWS: dict[str, KeyEcho] = {
    "get_product_details": KeyEcho(("variants",), "item_id"),
    "get_user_details": KeyEcho(("payment_methods",), "id"),
    "modify_user_address": KeyEcho(("payment_methods",), "id"),
}


def compact_json(value: Any) -> str:
    """``json.dumps(value, ensure_ascii=False, separators=(",", ":"))``: no spaces, key order kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def render_observation(tool: str, value: Any) -> str:
    """The canonical text of `tool`'s result `value` (any JSON value: parsed result, or
    ``{"error": ...}``): the tool's view (`VIEWS`, none for an error object) then `compact_json`.
    Idempotent: rendering the parse of a rendering gives the same text.

    Raises ValueError / TypeError (json) for a value JSON cannot hold, RecursionError for one nested
    too deeply to write."""
    is_error = isinstance(value, dict) and value.get("error") not in (None, False, "")
    view = VIEWS.get(tool)
    if view is not None and not is_error:
        value = view.drop(value)
    return compact_json(value)


def result_value(content: str, error: bool) -> Any:
    """The JSON value of a raw tau2 result text: ``{"error": <message>}`` for an error (the
    ``"Error: "`` prefix dropped; an error text that is itself a JSON object with "error" is kept),
    else the parsed JSON, or the text itself as a string when it is not JSON."""
    text = content.strip()
    if error:
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and parsed.get("error") not in (None, False, ""):
            return parsed
        return {"error": text[len(ERROR_PREFIX):] if text.startswith(ERROR_PREFIX) else text}
    try:
        return json.loads(text)
    except ValueError:
        return content


def real_observation(tool: str, content: str, error: bool) -> Observation:
    """The `Observation` ACT's history and fidelity see for a real tau2 result: content =
    ``render_observation(tool, result_value(content, error))``, error kept."""
    return Observation(content=render_observation(tool, result_value(content, error)), error=error)


_CUT = re.compile(re.escape(TRUNCATION_MARKER.format(what="tool result", shown="@", total="@"))
                  .replace("@", r"\d+") + r"\Z")


def is_cut(text: str) -> bool:
    """Whether `text` ends with the marker `cut_observation` appends."""
    return _CUT.search(text.rstrip()) is not None


def cut_observation(text: str, tokenizer, max_tokens: int | None) -> str:
    """`text` cut to `max_tokens` tokens with the visible marker ``…[tool result truncated: k of n
    tokens shown]`` (`roles.bounds.bound_text`), identically for real and imagined observations;
    None = uncut."""
    return bound_text(text, tokenizer, max_tokens, what="tool result")


def tau2_content(tool: str, obs: Observation) -> str:
    """The text tau2's own ``Environment.get_response`` gives for the result `obs` holds in its
    canonical rendering (`real_observation`): the view undone (`KeyEcho.restore`), an error
    ``{"error": m}`` back to ``"Error: m"``, a string result as the bare string, anything else
    ``json.dumps`` (tau2's ``to_json_str``). tau2's evaluator replays a message list and compares
    each ToolMessage with its own result after ``json.loads`` (``Environment.set_state``), so the
    ToolMessages of a scored trajectory must hold this text. Content that is not a canonical
    rendering (e.g. a refusal ``"Error: ..."``) is returned unchanged."""
    try:
        value = json.loads(obs.content)
    except ValueError:
        return obs.content
    if obs.error:
        if isinstance(value, dict) and isinstance(value.get("error"), str) and len(value) == 1:
            return ERROR_PREFIX + value["error"]
        return obs.content
    view = VIEWS.get(tool)
    if view is not None:
        value = view.restore(value)
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
