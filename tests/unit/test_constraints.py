"""Every spelling of a constraint (vLLM's guided_* fields, its structured_outputs object, OpenAI's
response_format as the door turns it) becomes one Constraint; equal schemas become equal keys (one
compile); and what is not a constraint is refused naming the field."""

from __future__ import annotations

import json

import pytest

from server.doors.http.response_format import structured_of
from server.errors import InvalidInputError
from server.runners.constraints import ANY_OBJECT, constraint_of
from server.scheduling.sequence import Constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_every_spelling_of_a_schema_is_one_key():
    reordered = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    keys = {constraint_of({"guided_json": SCHEMA}), constraint_of({"guided_json": json.dumps(reordered)}),
            constraint_of({"structured_outputs": {"json": SCHEMA}}),
            constraint_of(structured_of({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": reordered, "strict": True}}}))}
    assert keys == {Constraint("json", json.dumps(SCHEMA, sort_keys=True))}


def test_the_other_kinds():
    assert constraint_of({"guided_regex": "a+"}) == Constraint("regex", "a+")
    assert constraint_of({"structured_outputs": {"choice": ["x", "y"]}}) == Constraint("choice", '["x", "y"]')
    assert constraint_of({"guided_grammar": 'start: "a"'}) == Constraint("grammar", 'start: "a"')
    assert constraint_of(structured_of({"response_format": {"type": "json_object"}})) == Constraint("json", ANY_OBJECT)
    assert constraint_of(structured_of({"response_format": {"type": "text"}})) is None
    assert constraint_of({"temperature": 0.5}) is None


@pytest.mark.parametrize("given, named", [
    ({"guided_regex": "a", "guided_json": SCHEMA}, "one structured-output constraint"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
    ({"structured_outputs": "json"}, "'structured_outputs' must be an object"),
    ({"structured_outputs": {"json_object": "yes"}}, "must be true"),
    ({"guided_json": [1, 2]}, "must be a JSON schema"),
    ({"guided_choice": ["a", 1]}, "non-empty list of strings"),
    ({"guided_regex": ""}, "non-empty string"),
])
def test_refusals_name_the_field(given, named):
    with pytest.raises(InvalidInputError, match=named):
        constraint_of(given)


def test_response_format_refusals():
    with pytest.raises(InvalidInputError, match="'schema'"):
        structured_of({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})
    with pytest.raises(InvalidInputError, match="not both"):
        structured_of({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
