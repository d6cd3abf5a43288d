"""The canonical rendering of tool results (envace_core/envs/tau2/observations.py): real == imagined, the
per-tool views keep every value the gold trajectories use, tau2's evaluator still replays, and the cut."""

from __future__ import annotations

import json

import pytest

import envace_core  # noqa: F401  (offline environment before tau2)
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.observations import (
    cut_observation,
    is_cut,
    real_observation,
    render_observation,
    tau2_content,
)
from envace_core.envs.tau2.tasks import load_tasks, tau2_registry, tau2_task
from envace_core.roles.bounds import bound_history, n_tokens
from envace_core.roles.rehearse import parse_rehearse
from envace_core.types import Message, Step, ToolCall


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


@pytest.fixture(scope="module")
def gold_replays():
    """(task, [(call, canonical obs, tau2's own text)]) of the first task with gold actions per domain
    and split: our environment and a bare tau2 one in step."""
    out = []
    for d in ("airline", "retail"):
        for split in ("train", "test"):
            for task in [t for t in load_tasks(d, split) if t.gold_actions][:1]:
                env, bare = Tau2Environment(d), _bare_tau2(task)
                env.reset(task)
                steps = []
                for k, g in enumerate(task.gold_actions):
                    call = ToolCall(name=g.name, arguments=g.arguments, id=f"call_{k}")
                    steps.append((call, env.step(call), bare.get_response(_tau2_call(call)).content))
                out.append((task, steps))
    return out


def _bare_tau2(task):
    t = tau2_task(task)
    env = tau2_registry().get_env_constructor(task.domain)()
    init = t.initial_state
    env.set_state(initialization_data=init.initialization_data if init else None,
                  initialization_actions=init.initialization_actions if init else None,
                  message_history=list(init.message_history or []) if init else [])
    return env


def _tau2_call(call):
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    return Tau2ToolCall(id=call.id, name=call.name, arguments=call.arguments, requestor="assistant")


def _leaves(x, out: set) -> set:
    if isinstance(x, dict):
        for k, v in x.items():
            out.add(str(k))
            _leaves(v, out)
    elif isinstance(x, list):
        for v in x:
            _leaves(v, out)
    else:
        out.add(str(x))
    return out


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def test_render_is_compact_ordered_and_drops_only_key_echoes():
    v = {"name": "Lamp", "variants": {"111": {"item_id": "111", "price": 2.5}, "222": {"item_id": "999"}}}
    assert render_observation("get_product_details", v) == \
        '{"name":"Lamp","variants":{"111":{"price":2.5},"222":{"item_id":"999"}}}'  # 999 != its key: kept
    assert render_observation("other_tool", v) == json.dumps(v, separators=(",", ":"))
    assert render_observation("get_product_details", {"error": "x"}) == '{"error":"x"}'
    assert real_observation("t", "Error: Order #W1 not found", True).content == '{"error":"Order #W1 not found"}'
    assert real_observation("t", "yusuf_rossi_9620", False).content == '"yusuf_rossi_9620"'
    assert real_observation("t", "1200.0", False).content == "1200.0"


def test_real_and_imagined_results_have_one_format(gold_replays):
    for task, steps in gold_replays:
        for call, obs, raw in steps:
            # a model replying the real value in any JSON layout is parsed into the real text
            pretty = json.dumps(json.loads(obs.content), indent=2)
            imagined = parse_rehearse(f"```json\n{pretty}\n```", call.name)
            assert (imagined.content, imagined.error) == (obs.content, obs.error), call.name
            assert render_observation(call.name, json.loads(obs.content)) == obs.content  # idempotent
    err = Tau2Environment("airline")
    err.reset(gold_replays[0][0])
    real = err.step(ToolCall(name="get_reservation_details", arguments={"reservation_id": "NOPE00"}))
    imagined = parse_rehearse('{"error": "Reservation NOPE00 not found"}', "get_reservation_details")
    assert real == imagined and real.error


def test_views_keep_every_value_the_gold_trajectories_use(gold_replays):
    checked = 0
    for task, steps in gold_replays:
        seen_raw: set = set()
        seen_view: set = set()
        for call, obs, raw in steps:
            for v in _leaves(call.arguments, set()):
                if v in seen_raw:  # a value a later gold call takes from an earlier result
                    assert v in seen_view, (task.id, call.name, v)
                    checked += 1
            _leaves(_value(raw), seen_raw)
            _leaves(json.loads(obs.content), seen_view)
            # nothing is lost: the view undone is tau2's own result
            assert _value(tau2_content(call.name, obs)) == _value(raw), call.name
        for info in (task.source.get("evaluation_criteria") or {}).get("communicate_info") or []:
            if str(info) in seen_raw:
                assert str(info) in seen_view
    assert checked >= 4


def test_scoring_replays_the_rendered_results(gold_replays):
    task, steps = next((t, s) for t, s in gold_replays if t.domain == "retail")
    env = Tau2Environment("retail")
    env.reset(task)
    traj = [Step(action=c, observation=o, real_observation=o) for c, o, _ in steps]
    assert env.score(task, traj, "Done.").info["db_match"] is True  # tau2's replay matched every result


def test_cut_marker_is_the_same_for_real_and_imagined(tok):
    text = json.dumps({"items": [{"id": i, "name": f"item {i}"} for i in range(200)]}, separators=(",", ":"))
    cut = cut_observation(text, tok, 40)
    assert n_tokens(tok, cut) <= 40 and is_cut(cut) and text.startswith(cut.split("…[")[0])
    assert not is_cut(text)
    # the cut in a prompt history is this one, whoever produced the result
    hist = bound_history([Message(role="tool", content=text)], tok, 40)
    assert hist[0].content == cut
    # a REHEARSE output cut the same way is read back as that text
    obs = parse_rehearse(cut, "get_order_details")
    assert obs.content == cut and not obs.error


def test_rehearse_budget_table_is_the_measured_one_and_covers_p95_and_errors():
    """`REHEARSE_TOKENS_PER_TOOL` (every profile's per-tool REHEARSE budget, cpu-smoke included) equals
    the budgets benchmarks/observation_lengths.py measured, and each budget holds the tool's p95 gold
    result and its longest wrong-call error plus the eos (so no error is taught as the bare marker)."""
    import json
    from pathlib import Path

    from envace_core.config import REHEARSE_TOKENS_PER_TOOL, load_config

    measured = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                           / "observation_lengths.json").read_text())
    assert REHEARSE_TOKENS_PER_TOOL == measured["budgets"]
    for key, v in measured["per_tool"].items():
        budget = REHEARSE_TOKENS_PER_TOOL[key.split("/", 1)[1]]
        assert budget >= v["after"]["p95"] + 1
        if v.get("errors"):
            assert budget >= v["errors"]["max"] + 1
    assert load_config("cpu-smoke").rollout.max_new_tokens_rehearse_per_tool == REHEARSE_TOKENS_PER_TOOL
