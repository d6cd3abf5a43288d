"""Regenerate this folder's tools.json and examples.jsonl from tau2 retail (deterministic output).

    .venv/bin/python examples/tools/export.py [--check]

tools.json: tau2 retail's `find_user_id_by_name_zip` exactly as the domain shows it to the agent
(`tool.openai_schema`, OpenAI function format), plus "documentation": the tool function's whole
docstring (the schema's description is only its first paragraph).

examples.jsonl: N real (call, result) pairs, the tool executed through `Tau2Environment.step` (tau2's
own `Environment.get_response`) on the packaged retail database, for users that no tau2 retail task
names (`synth.test_users` over the `base` split, i.e. every train and test task, so none is a test
user) and whose first name + last name + zip is unique in the database. Users are taken in order of
sha256(user id), so the choice does not depend on dict order.

--check: regenerate in memory and exit 1 if the committed files differ (nothing is written).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import envace_core  # noqa: F401  (offline environment before tau2 is imported)

HERE = Path(__file__).resolve().parent
DOMAIN, TOOL = "retail", "find_user_id_by_name_zip"


def tool_entry() -> dict:
    """The tool's OpenAI schema as tau2 retail exposes it, plus its full docstring."""
    from tau2.registry import registry

    env = registry.get_env_constructor(DOMAIN)()
    tool = next(t for t in env.get_tools() if t.name == TOOL)
    doc = inspect.getdoc(getattr(env.tools, TOOL)) or ""
    return {**tool.openai_schema, "documentation": doc}


def example_users(n: int) -> list[str]:
    """`n` retail user ids named by no tau2 retail task, with a unique name + zip."""
    from envace_core.envs.tau2.synth import domain_env, test_users
    from envace_core.envs.tau2.tasks import load_tasks

    db = domain_env(DOMAIN).tools.db
    named = test_users(DOMAIN, load_tasks(DOMAIN, "base"), db)
    keys: dict[tuple, list[str]] = {}
    for uid, u in db.users.items():
        keys.setdefault((u.name.first_name.lower(), u.name.last_name.lower(), u.address.zip), []).append(uid)
    unique = {v[0] for v in keys.values() if len(v) == 1}
    pool = sorted(unique - named, key=lambda u: hashlib.sha256(u.encode()).hexdigest())
    return pool[:n]


def examples(n: int) -> list[dict]:
    """(call, result) pairs from real executions of the tool on the packaged retail DB."""
    from envace_core.envs.tau2.environment import Tau2Environment
    from envace_core.envs.tau2.observations import result_value
    from envace_core.envs.tau2.synth import domain_env
    from envace_core.types import ToolCall

    db, env, out = domain_env(DOMAIN).tools.db, Tau2Environment(DOMAIN), []
    for uid in example_users(n):
        u = db.users[uid]
        args = {"first_name": u.name.first_name, "last_name": u.name.last_name, "zip": u.address.zip}
        obs = env.step(ToolCall(name=TOOL, arguments=args))
        # `step` gives the canonical rendering (a plain-text result is a JSON string); the example
        # holds the tool's own text
        result = result_value(obs.content, obs.error)
        if obs.error or result != uid:
            raise SystemExit(f"{TOOL}({args}) returned {obs.content!r}, expected {uid!r}")
        out.append({"tool": TOOL, "arguments": args, "result": result})
    return out


def render(n: int) -> dict[str, str]:
    tools = json.dumps([tool_entry()], indent=2) + "\n"
    lines = "".join(json.dumps(e, sort_keys=True) + "\n" for e in examples(n))
    return {"tools.json": tools, "examples.jsonl": lines}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=3, help="number of (call, result) examples")
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = ap.parse_args()
    files = render(args.n)
    if args.check:
        stale = [f for f, text in files.items() if not (HERE / f).is_file() or (HERE / f).read_text() != text]
        print("up to date" if not stale else f"stale: {', '.join(stale)} (run examples/tools/export.py)")
        return 1 if stale else 0
    for f, text in files.items():
        tmp = HERE / f".{f}.tmp"
        tmp.write_text(text)
        os.replace(tmp, HERE / f)  # atomic: a reader never sees half a file
        print(f"wrote {HERE / f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
