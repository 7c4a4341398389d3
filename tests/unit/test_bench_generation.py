"""bench/prefix.py's arithmetic bound on what a prefix cache can save, checked by hand."""

from __future__ import annotations

from bench.prefix import fewest_computed


def test_a_chat_turn_finds_at_most_the_full_blocks_computed_before_it():
    # turn 1: 6 prompt tokens, all computed; 3 answer tokens, the last never fed: 8 computed, 2 full blocks
    # turn 2: 9 + 5 = 14 tokens sent, 8 of them cached: 6 computed
    assert fewest_computed([[(6, 3), (5, 2)]], system_len=0, block=4) == (6 + 14, 6 + 6)


def test_a_shared_system_prompt_is_computed_once():
    # two one-turn requests after an 8-token system prompt: the first computes all 11, the second its 3
    assert fewest_computed([[(3, 1)], [(3, 1)]], system_len=8, block=4) == (22, 11 + 3)


def test_the_last_prompt_token_is_always_computed():
    # the second prompt is exactly the cached block: its last token must be fed, and that block with it
    assert fewest_computed([[(4, 4)], [(0, 1)]], system_len=4, block=4) == (8 + 4, 8 + 4)
