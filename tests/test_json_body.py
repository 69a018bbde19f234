"""The body parser that gives up the GIL between values: json.loads's result and errors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipellm.entrypoints.json_body import free_in_pieces, loads_in_pieces

SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text()
DOCUMENTS = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(document=DOCUMENTS, indent=st.sampled_from([None, 0, 2]))
def test_any_document_parses_as_json_loads_parses_it(document, indent):
    data = json.dumps(document, indent=indent).encode()
    assert loads_in_pieces(data) == json.loads(data)


@pytest.mark.parametrize(
    "text",
    [
        '{"messages": [{"role": "user"}], "n": 1}',
        ' \n{"a": {"b": [1, 2, {"c": [3]}]}, "a": 2} ',  # the last duplicate key wins
        '{"x": NaN, "y": -Infinity, "s": "\\ud800\\u00e9"}',
        "[]",
        "{}",
        '"just a string"',
    ],
)
def test_documents_with_the_edges_of_the_format(text):
    for data in (text.encode(), text.encode("utf-16"), b"\xef\xbb\xbf" + text.encode()):
        # Compared as JSON text: NaN equals nothing, itself included.
        assert json.dumps(loads_in_pieces(data)) == json.dumps(json.loads(data))


@pytest.mark.parametrize(
    "text",
    [
        "",
        '{"a": 1,}',
        "[1, 2,]",
        '{"a" 1}',
        '{"a": 1 "b": 2}',
        "[1 2]",
        '{"a": [1, 2}',
        "{1: 2}",
        '{"a": 1} x',
        '{"messages": [{"role": "user", "content": "\x01"}]}',
        '{"a": [',
    ],
)
def test_bad_json_fails_where_json_loads_fails(text):
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text.encode())
    with pytest.raises(json.JSONDecodeError) as got:
        loads_in_pieces(text.encode())
    assert (got.value.msg, got.value.pos) == (expected.value.msg, expected.value.pos)


def test_a_list_is_emptied_in_slices():
    items = [{"role": "user"}] * 2500
    free_in_pieces(items)
    assert items == []
