"""`roles.json_prefix.viable`: exact for what `parse_rehearse` accepts, so stopping on `not viable` changes no verdict."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from envace_core.roles.errors import EmptyOutput, InvalidRehearsal
from envace_core.roles.json_prefix import NotJsonStop, viable
from envace_core.roles.rehearse import parse_rehearse

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8), lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=5), kids, max_size=4), max_leaves=12)


def parses(text: str) -> bool:
    try:
        parse_rehearse(text)
        return True
    except (EmptyOutput, InvalidRehearsal):
        return False


@settings(max_examples=150, deadline=None)
@given(JSON, st.sampled_from(["", "```json\n", "```\n", "  \n"]), st.booleans())
def test_every_prefix_of_an_accepted_output_is_viable(value, fence, compact):
    body = json.dumps(value, separators=(",", ":") if compact else None, ensure_ascii=False)
    text = fence + body + ("\n```" if fence.startswith("```") else "")
    assert parses(text)
    assert all(viable(text[:k]) for k in range(len(text) + 1)), text


MARK = "…[tool result truncated: 12 of 40 tokens shown]"
CONTINUATIONS = ["", "}", "]", '"', '"}', "]}", "0", "e", "1}", "true", "\n```", " ", ":1}", ',"a":1}', "}]", "\"]",
                 MARK, MARK + "\n```", "2 of 40 tokens shown]", " tokens shown]", "]", "2 of 4"]


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]":,0123456789-+.eEtrufalsn \n`xj\\…', max_size=14)
       | st.builds(lambda a, k: a + MARK[:k], st.text(alphabet='{}[]":,01-.ex \n`', max_size=8),
                   st.integers(0, len(MARK))))
def test_a_prefix_judged_not_viable_never_parses_whatever_follows(text):
    if not viable(text):
        assert not any(parses(text + c) for c in CONTINUATIONS), text
    if parses(text):
        assert viable(text), text


def test_prose_and_trailing_text_stop_early_json_in_progress_does_not():
    for bad in ["Sure! Here", "The reservation", '{"a": 1} and', '{"a": tx', "[1, 2,]", '{"a" 1', "01", "NaN",
                '```json\n{"a":1}\n```x', '{"a":1}```', "-x", '"tab\there"']:
        assert not viable(bad), bad
    assert viable('{"a": "b' + MARK) and viable('{"a": "b' + MARK[:9]) and viable("```json\n[1," + MARK + "\n``")
    assert not viable("Sure" + MARK[:5]) and not viable('{"a": 1' + MARK + "x") and not viable('{"a": 1' + MARK[:20] + "x")
    for ok in ["", "  ", "`", "``", "```", "```js", "```json\n", '{"reservation', '{"a": [1, 2', '{"a": tr',
               "-", "1.", "1e+", '"\\u00', '```\n{"a":1}\n``', '[{"b": null}, fals', '{"a":1}  ']:
        assert viable(ok), ok


def test_the_stop_predicate_decodes_the_generated_ids(bundled_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(bundled_tokenizer_dir)
    stop = NotJsonStop(tok)
    assert not stop(tok.encode('{"order_id": "#W1', add_special_tokens=False))
    assert stop(tok.encode("I'm sorry, I cannot", add_special_tokens=False))
