"""FERRY_PROCESS_NICE as a config gives it: `auto` (or nothing) leaves the priority to the model's behaviour,
0-19 fixes it, anything else is refused at load with what to write instead."""

import pytest

from server.backends.python import priority
from server.errors import ConfigError


@pytest.mark.parametrize("given", [None, "auto", " AUTO "])
def test_auto_is_the_default_and_can_be_written(given):
    assert priority.parse("m", given) is None


@pytest.mark.parametrize("given, fixed", [("0", 0), ("7", 7), ("19", 19)])
def test_a_number_fixes_the_priority(given, fixed):
    assert priority.parse("m", given) == fixed


@pytest.mark.parametrize("given", ["-5", "20", "high", ""])
def test_anything_else_is_refused_with_the_values_that_work(given):
    with pytest.raises(ConfigError) as info:
        priority.parse("m", given)
    assert f"FERRY_PROCESS_NICE is {given!r}" in str(info.value) and "'auto'" in str(info.value)
