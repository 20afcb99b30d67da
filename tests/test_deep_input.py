"""Deep JSON never takes the process to Python's recursion limit with work still to do there.

A finalizer that the garbage collector runs while a parser is near the limit has no stack left:
it fails (a generator's cleanup cut short, "Exception ignored ..." on stderr). `jsonlimits.loads`
measures the depth on the text before parsing; the CLI's file readers pause the collector.
"""

from __future__ import annotations

import gc
import json
import random

import pytest

from shadow.cli.common import ShadowInputError, user_text_file
from shadow.engines import jsonlimits
from shadow.text.conversations import load_conversation

DEEP = "[" * 100_000 + "]" * 100_000


class Finalized:
    """Cyclic garbage whose finalizer needs a little stack (as a socket's ResourceWarning does)."""

    __slots__ = ("me", "__weakref__")
    outcomes: list[str] = []

    def __init__(self):
        self.me = self

    def __del__(self):
        def down(n):
            return n if n == 0 else down(n - 1)

        try:
            down(40)
            Finalized.outcomes.append("finished")
        except RecursionError:
            Finalized.outcomes.append("cut short")


def finalizers_at_every_depth(parse) -> list[str]:
    """`parse()` run once for each of many collector thresholds, with 2,000 finalizers waiting in
    the youngest generation: the collector runs 700 to 1,000 allocations into the parse, a step of
    20, which covers the depths near the recursion limit (about 920 to 955 under pytest here; the
    probe below fails where they move out of reach). The finalizers' outcomes."""
    Finalized.outcomes = []
    thresholds = gc.get_threshold()
    gc.collect()
    try:
        for extra in range(700, 1001, 20):
            gc.collect(0)
            gc.set_threshold(2000 + extra)
            for _ in range(2000):
                Finalized()
            try:
                parse()
            except (ShadowInputError, jsonlimits.JSONLimitError, RecursionError):
                pass
            gc.set_threshold(*thresholds)
            gc.collect(0)
    finally:
        gc.set_threshold(*thresholds)
    return Finalized.outcomes


def test_the_probe_catches_a_parse_that_recurses_to_the_limit():
    """The check below is a real one: the standard parser, unguarded, cuts finalizers short."""
    outcomes = finalizers_at_every_depth(lambda: json.loads(DEEP))
    assert "cut short" in outcomes


@pytest.mark.slow
def test_loads_refuses_deep_text_without_recursing():
    outcomes = finalizers_at_every_depth(lambda: jsonlimits.loads(DEEP))
    assert outcomes and set(outcomes) == {"finished"}
    with pytest.raises(jsonlimits.JSONLimitError, match="nests deeper than 64 levels"):
        jsonlimits.loads(DEEP.encode())


def test_a_deep_file_a_user_names_is_refused_with_every_finalizer_finished(tmp_path):
    path = tmp_path / "deep.traj.json"
    path.write_text('{"messages": ' + DEEP + "}")
    outcomes = finalizers_at_every_depth(lambda: user_text_file(path, load_conversation))
    assert outcomes and set(outcomes) == {"finished"}
    with pytest.raises(ShadowInputError, match="nests too deeply to read"):
        user_text_file(path, load_conversation)


def walked_depth(value) -> int:
    """The reference: the nesting of a parsed value, walked."""
    if isinstance(value, dict):
        return 1 + max((walked_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((walked_depth(v) for v in value), default=0)
    return 0


def random_value(rng: random.Random, depth: int):
    pieces = ['[', ']', '{', '}', '"', '\\', 'a', ' ', '\u00e9', '\U0001f600', '\n']
    if depth == 0 or rng.random() < 0.25:
        return rng.choice([1, -2.5, True, None, "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))])
    if rng.random() < 0.5:
        return [random_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    return {"".join(rng.choice(pieces) for _ in range(rng.randrange(4))): random_value(rng, depth - 1)
            for _ in range(rng.randrange(4))}


def test_loads_reads_utf8_only():
    """json.loads guesses UTF-16 and 32 from bytes, where a stray quote byte would hide brackets
    from a measure of the bytes; `loads` reads UTF-8 (a byte-order mark allowed) and refuses the rest."""
    deep = '["\u2200", "x", ' + "[" * 200 + "]" * 200 + ', "y"]'
    for encoding in ("utf-16-le", "utf-16", "utf-32"):
        with pytest.raises(jsonlimits.JSONLimitError, match="not valid JSON"):
            jsonlimits.loads(deep.encode(encoding))
    with pytest.raises(jsonlimits.JSONLimitError, match="nests deeper than 64 levels"):
        jsonlimits.loads(deep.encode())
    with pytest.raises(jsonlimits.JSONLimitError, match="not UTF-8"):
        jsonlimits.loads(b'{"a": "\xff"}')
    assert jsonlimits.loads('\ufeff{"a": ["\u2200"]}'.encode()) == {"a": ["\u2200"]}


def test_nests_deeper_agrees_with_a_walk_of_the_value():
    rng = random.Random(7)
    for _ in range(3000):
        value = random_value(rng, rng.randrange(1, 12))
        depth = walked_depth(value)
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False), json.dumps(value, indent=1)):
            for limit in (max(depth - 1, 0), depth, depth + 1):
                assert jsonlimits.nests_deeper(text, limit) == (depth > limit), (text, limit)


@pytest.mark.parametrize("text, limit, deeper", [
    ("[" * 70, 64, True),  # never closed
    ("[" * 60 + "}" * 60, 64, False),  # brackets that do not pair, shallow: the parser refuses it quickly
    ("[" * 70 + "}" * 70, 64, True),
    ('"' + "[" * 70, 64, False),  # a string never closed runs to the end, as the parser reads it
    ("[" * 70 + '"', 64, True),
    ("[" * 65 + '"' + '\\"' * 5000, 64, True),  # escaped quotes in a string never closed
    ('["\\\\", ' + "[" * 70 + "]" * 70 + "]", 64, True),  # an escaped backslash closes nothing
    ("[" * 64 + "]" * 64, 64, False),
    ("[" * 65 + "]" * 65, 64, True),
])
def test_nests_deeper_at_the_edges_bounds_what_a_parser_could_reach(text, limit, deeper):
    assert jsonlimits.nests_deeper(text, limit) is deeper


def test_the_collector_resumes_after_the_last_pause_and_only_if_it_ran():
    assert gc.isenabled()
    with jsonlimits.collection_paused():
        with jsonlimits.collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with jsonlimits.collection_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
