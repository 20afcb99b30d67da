"""JSON read within limits: what an engine or a client sends, and the files a user names.

`loads` raises one `JSONLimitError` (a ValueError) for anything it will not hand on: text that
is not JSON (or not UTF-8), a number of more than `MAX_DIGITS` characters (Python refuses ints
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


_STRING_TEXT = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_STRING_BYTES = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET_TEXT = re.compile(r"[^\[\]{}]+")
_NOT_BRACKET_BYTES = re.compile(rb"[^\[\]{}]+")
_ONE_KIND = str.maketrans("{}", "[]")  # depth does not depend on the kind of bracket


def nests_deeper(data: bytes | str, limit: int) -> bool:
    """Whether JSON text nests deeper than `limit`, brackets inside strings not counted. Measured
    on the text, a level a pass (at most `limit` + 1 passes), so any depth is safe to ask about.
    Exact for valid JSON; for other text, True where a parser could recurse past `limit` on it."""
    if isinstance(data, str):
        brackets = _NOT_BRACKET_TEXT.sub("", _STRING_TEXT.sub("", data))
    else:
        brackets = _NOT_BRACKET_BYTES.sub(b"", _STRING_BYTES.sub(b"", data)).decode("ascii")
    brackets = brackets.translate(_ONE_KIND)
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

    square, curly = (b"[", b"{") if isinstance(data, bytes) else ("[", "{")
    if data.count(square) + data.count(curly) > max_depth and nests_deeper(data, max_depth):
        raise JSONLimitError(f"nests deeper than {max_depth} levels")
    try:
        return json.loads(data, parse_int=number(int), parse_float=number(float))
    except JSONLimitError:
        raise
    except RecursionError:  # a max_depth set past Python's recursion limit
        raise JSONLimitError(f"nests deeper than {max_depth} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, not UTF-8
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
