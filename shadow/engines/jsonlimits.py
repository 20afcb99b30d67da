"""JSON read within limits: what an engine or a client sends, and the files a user names.

`loads` raises one `JSONLimitError` (a ValueError) for anything it will not hand on: text that
is not JSON (bytes that are not UTF-8 included), a number of more than `MAX_DIGITS` characters (Python refuses ints
past 4,300 digits with a ValueError of its own, and reads a float of any length), nesting deeper
than `max_depth`. The depth is measured on the text before parsing, so a deep value never sends
the parser to Python's recursion limit: a finalizer that runs that deep (another client's stream
closed by the garbage collector) has no stack left to finish. The callers turn the error into the
engine's bytes passed through unread (the proxy), a 400 (a client's body), or exit code 2 (the CLI).

`collection_paused` holds the garbage collector off around parsers that may still recurse to the
limit (the files a user names, read by the standard library's json and tomllib).
"""

from __future__ import annotations

import gc
import json
import re
import threading
from contextlib import contextmanager
from itertools import accumulate

MAX_DEPTH = 64  # levels of nesting a request body or an engine's event may have
MAX_DIGITS = 256  # characters of one number (sign, digits, point and exponent)


class JSONLimitError(ValueError):
    """Not JSON, or JSON past a limit (the message says which)."""


# a string, or one never closed running to the end of the text (where the parser stops too):
# every part optional after the opening quote, so a failed match never rescans (linear time)
_STRING = re.compile(r'"[^"\\]*(?:\\.?[^"\\]*)*"?', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_ONE_KIND = str.maketrans("{}", "[]")  # depth does not depend on the kind of bracket


def nests_deeper(text: str, limit: int) -> bool:
    """Whether JSON text nests deeper than `limit`, brackets inside strings not counted. Measured
    on the text in linear passes, a level a pass (at most `limit` + 1), so any depth is safe to
    ask about. Exact for valid JSON; for other text, True wherever a parser reading it could
    recurse past `limit` before it stops at the text's first error."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).translate(_ONE_KIND)
    for level in range(limit + 1):
        if not brackets:
            return False
        inner = brackets.replace("[]", "")  # the innermost level: pairs with no bracket inside
        if inner == brackets:  # brackets that never close: bound the depth by the deepest prefix
            return level + max(accumulate(1 if c == "[" else -1 for c in brackets)) > limit
        brackets = inner
    return True  # limit + 1 levels taken off, and there were brackets before the last


def loads(data: bytes | str, max_depth: int = MAX_DEPTH, max_digits: int = MAX_DIGITS):
    """The JSON value of `data`, within the limits; JSONLimitError otherwise. The depth is measured
    (before parsing) only when `data` holds more brackets than `max_depth` (fewer cannot nest deeper)."""

    def number(kind):
        def parse(text: str):
            if len(text) > max_digits:
                raise JSONLimitError(f"a number of {len(text):,} characters (at most {max_digits:,})")
            return kind(text)

        return parse

    if isinstance(data, (bytes, bytearray)):
        try:  # UTF-8 only (a byte-order mark allowed), where json.loads would also guess UTF-16 and 32
            data = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise JSONLimitError(f"not valid JSON: not UTF-8 ({e.reason} at byte {e.start})") from None
    if data.count("[") + data.count("{") > max_depth and nests_deeper(data, max_depth):
        raise JSONLimitError(f"nests deeper than {max_depth} levels")
    try:
        return json.loads(data, parse_int=number(int), parse_float=number(float))
    except JSONLimitError:
        raise
    except RecursionError:  # a max_depth set past Python's recursion limit
        raise JSONLimitError(f"nests deeper than {max_depth} levels") from None
    except ValueError as e:  # JSONDecodeError
        raise JSONLimitError(f"not valid JSON: {e}") from None


_pause_lock = threading.Lock()
_pauses = 0
_was_enabled = False


@contextmanager
def collection_paused():
    """The cyclic garbage collector held off for the block (nested and concurrent blocks count:
    it resumes when the last one ends, and only if it ran before the first). For parsers that
    may recurse to Python's limit: a finalizer the collector runs there has no stack left to
    finish or report in (CPython then writes "Exception ignored ..." to stderr)."""
    global _pauses, _was_enabled
    with _pause_lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
