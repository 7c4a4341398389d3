"""The response cache's key and its byte-bounded, least-recently-used store."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from server.__main__ import _cache_bytes
from server.response_cache import ResponseCache, request_key

X = np.arange(6, dtype=np.float32).reshape(2, 3)


def key(inputs=None, scope="m\x001\x000", requested=()):
    return request_key(scope, {"x": X} if inputs is None else inputs, requested)


def test_the_key_covers_everything_that_decides_the_answer():
    same = key({"x": X.copy()})
    assert same == key()
    different = [
        key(scope="other\x001\x000"), key(scope="m\x002\x000"), key(scope="m\x001\x001"),  # model, version, load
        key(requested=("y",)),
        key({"y": X}),  # the input's name
        key({"x": X.reshape(3, 2)}),  # its shape, same bytes
        key({"x": X.view(np.int32)}),  # its datatype, same bytes
        key({"x": X + 1}),  # its values
        key({"x": X, "z": X}),  # one more input
    ]
    assert same not in different and len(set(different)) == len(different)
    assert key({"x": np.asfortranarray(X)}) == same  # memory layout is not part of the request


def test_bytes_tensors_are_keyed_element_by_element():
    a = np.array([b"ab", b"c"], dtype=object)
    b = np.array([b"a", b"bc"], dtype=object)  # the same bytes joined, cut elsewhere
    assert key({"s": a}) != key({"s": b})
    assert key({"s": a}) == key({"s": np.array([b"ab", b"c"], dtype=object)})


def test_least_recently_used_entries_leave_first_and_the_bytes_stay_bounded():
    row = {"y": np.zeros(100, np.float32)}  # 400 bytes of tensor
    cache = ResponseCache(3 * 700)
    for name in "abc":
        assert cache.put(name.encode(), row)
    assert len(cache) == 3 and cache.evictions == 0
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"d", row)
    assert cache.get(b"b") is None and cache.get(b"a") is not None and cache.evictions == 1
    assert cache.used <= cache.capacity
    assert (cache.hits, cache.misses) == (2, 1)


def test_an_answer_larger_than_the_cache_is_not_kept():
    cache = ResponseCache(1024)
    assert not cache.put(b"k", {"y": np.zeros(1024, np.uint8)})
    assert len(cache) == 0 and cache.used == 0 and cache.too_large == 1


def test_entries_are_read_only_copies():
    outputs = {"y": np.ones(4, np.float32)}
    cache = ResponseCache(4096)
    cache.put(b"k", outputs)
    outputs["y"][:] = 7  # the batch's buffer is reused: the cached answer must not change
    kept = cache.get(b"k")["y"]
    assert kept.tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        kept[0] = 3


@pytest.mark.parametrize("values, size", [([], 0), (["local,size=1048576"], 1048576)])
def test_cache_config_flag(values, size):
    assert _cache_bytes(argparse.ArgumentParser(), values) == size


@pytest.mark.parametrize("value", ["redis,size=10", "local", "local,size=0", "local,size=ten", "local,limit=10"])
def test_cache_config_flag_refuses(value, capsys):
    with pytest.raises(SystemExit):
        _cache_bytes(argparse.ArgumentParser(), [value])
    assert "--cache-config" in capsys.readouterr().err
