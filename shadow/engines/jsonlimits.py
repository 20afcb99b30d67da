"""JSON read within limits: what an engine or a client sends, and the files a user names.

`loads` raises one `JSONLimitError` (a ValueError) for anything it will not hand on: text that
is not JSON (or not UTF-8), a number of more than `MAX_DIGITS` characters (Python refuses ints
past 4,300 digits with a ValueError of its own, and reads a float of any length), nesting deeper
than `max_depth` (a nesting past Python's recursion limit would raise RecursionError, which is no
ValueError). The callers turn it into the engine's bytes passed through unread (the proxy), a 400
(a client's body), or exit code 2 (the CLI).
"""

from __future__ import annotations

import json

MAX_DEPTH = 64  # levels of nesting a request body or an engine's event may have
MAX_DIGITS = 256  # characters of one number (sign, digits, point and exponent)


class JSONLimitError(ValueError):
    """Not JSON, or JSON past a limit (the message says which)."""


def json_depth(value, limit: int) -> bool:
    """Whether `value` nests no deeper than `limit` (iteratively: a deep value cannot recurse here)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return False
        if isinstance(v, dict):
            stack += [(x, d + 1) for x in v.values()]
        elif isinstance(v, list):
            stack += [(x, d + 1) for x in v]
    return True


def loads(data: bytes | str, max_depth: int = MAX_DEPTH, max_digits: int = MAX_DIGITS):
    """The JSON value of `data`, within the limits; JSONLimitError otherwise. The depth is walked
    only when `data` holds more brackets than `max_depth` (fewer cannot nest deeper)."""

    def number(kind):
        def parse(text: str):
            if len(text) > max_digits:
                raise JSONLimitError(f"a number of {len(text):,} characters (at most {max_digits:,})")
            return kind(text)

        return parse

    try:
        value = json.loads(data, parse_int=number(int), parse_float=number(float))
    except JSONLimitError:
        raise
    except RecursionError:
        raise JSONLimitError(f"nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, not UTF-8
        raise JSONLimitError(f"not valid JSON: {e}") from None
    square, curly = (b"[", b"{") if isinstance(data, bytes) else ("[", "{")
    if data.count(square) + data.count(curly) > max_depth and not json_depth(value, max_depth):
        raise JSONLimitError(f"nests deeper than {max_depth} levels")
    return value
