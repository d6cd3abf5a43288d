"""Grounding examples for REHEARSE (envace_core/roles/grounding.py): same tool, other tasks only, most
similar first, deterministic, under the token budget; and they reach REHEARSE's rollout prompt."""

from __future__ import annotations

import pytest

from envace_core.roles.grounding import GroundingIndex, example_text
from envace_core.roles.bounds import n_tokens
from envace_core.training.transitions import Transition
from envace_core.types import Message, Observation, ToolCall


@pytest.fixture(scope="module")
def tok(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled_tokenizer_dir)


def _t(task, tool, arg, result):
    call = ToolCall(name=tool, arguments={"order_id": arg})
    return Transition(task, "retail", tool, [Message(role="user", content="hi")], call,
                      Observation(content=result), "success")


INDEX = [
    _t("retail/1", "get_order_details", "#W2378156", '{"order_id":"#W2378156"}'),  # the rehearsed task's own
    _t("retail/2", "get_order_details", "#W2378157", '{"order_id":"#W2378157"}'),
    _t("retail/3", "get_order_details", "#W9911714", '{"order_id":"#W9911714"}'),
    _t("retail/4", "cancel_pending_order", "#W2378156", '{"status":"cancelled"}'),  # another tool
    _t("retail/5", "get_order_details", "#W2378157", '{"order_id":"#W2378157"}'),  # same call again
]


def test_other_tasks_same_tool_most_similar_first(tok):
    idx = GroundingIndex(INDEX)
    call = ToolCall(name="get_order_details", arguments={"order_id": "#W2378156"})
    got = idx.examples("retail/1", call, k=4, max_tokens=1000, tokenizer=tok)
    assert [c.arguments["order_id"] for c, _ in got] == ["#W2378157", "#W9911714"]  # own task, dup, other tool: out
    assert got == idx.examples("retail/1", call, k=4, max_tokens=1000, tokenizer=tok)  # deterministic
    assert idx.examples("retail/1", call, k=1, max_tokens=1000, tokenizer=tok) == got[:1]
    assert idx.examples("retail/1", call, k=0, max_tokens=1000, tokenizer=tok) == []
    assert idx.examples("retail/9", ToolCall(name="nope"), k=2, max_tokens=1000, tokenizer=tok) == []


def test_token_budget(tok):
    idx = GroundingIndex(INDEX)
    call = ToolCall(name="get_order_details", arguments={"order_id": "#W2378156"})
    one = n_tokens(tok, example_text(*idx.examples("retail/1", call, 1, 1000, tok)[0])) + 1
    got = idx.examples("retail/1", call, k=4, max_tokens=one + 1, tokenizer=tok)
    assert len(got) == 1
    assert idx.examples("retail/1", call, k=4, max_tokens=3, tokenizer=tok) == []


def test_rollout_rehearse_prompt_holds_the_examples(tok):
    from envace_core.training.rollout import RolloutParams

    p = RolloutParams(max_turns=1, max_new_tokens_act=8, max_new_tokens_rehearse=8, temperature=1.0,
                      grounding=GroundingIndex(INDEX), grounding_k=1, grounding_max_tokens=200,
                      max_new_tokens_rehearse_per_tool={"get_order_details": 5})
    call = ToolCall(name="get_order_details", arguments={"order_id": "#W2378156"})
    assert [c.arguments for c, _ in p.grounding_examples("retail/1", call, tok)] == [{"order_id": "#W2378157"}]
    assert (p.rehearse_budget("get_order_details"), p.rehearse_budget("other")) == (5, 8)


def test_same_domain_only_and_a_long_result_is_cut_to_the_budget_instead_of_skipped(tok):
    """Examples come from the rehearsed task's domain only; the most similar example, too long to fit
    whole, is shown cut with the truncation marker (not replaced by a shorter, less similar one), and
    the examples' texts stay within the budget."""
    from envace_core.envs.tau2.observations import is_cut

    long_record = '{"order_id":"#W2378157","items":[' + ",".join(f'{{"item_id":"{i:010d}","price":{i}.5}}'
                                                                   for i in range(60)) + "]}"
    airline = Transition("airline/7", "airline", "get_order_details", [Message(role="user", content="hi")],
                         ToolCall(name="get_order_details", arguments={"order_id": "#W2378156"}),
                         Observation(content='{"order_id":"airline"}'), "success")
    idx = GroundingIndex([airline, _t("retail/2", "get_order_details", "#W2378157", long_record),
                          _t("retail/3", "get_order_details", "#X0000000", '{"error":"not found"}')])
    call = ToolCall(name="get_order_details", arguments={"order_id": "#W2378156"})
    assert n_tokens(tok, long_record) > 300
    got = idx.examples("retail/1", call, k=2, max_tokens=200, tokenizer=tok)
    assert [c.arguments["order_id"] for c, _ in got] == ["#W2378157"]  # no airline example; the cut one first
    assert is_cut(got[0][1].content) and got[0][1].content.startswith('{"order_id":"#W2378157"')
    assert sum(n_tokens(tok, example_text(c, o)) + 1 for c, o in got) <= 200
    whole = idx.examples("retail/1", call, k=2, max_tokens=2000, tokenizer=tok)
    assert [o.content for _, o in whole] == [long_record, '{"error":"not found"}']
    assert [c.arguments for c, _ in idx.examples("airline/8", call, k=3, max_tokens=2000, tokenizer=tok)] \
        == [{"order_id": "#W2378156"}]
