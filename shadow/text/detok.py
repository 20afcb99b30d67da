"""Text of a stream of token ids, piece by piece, as a streamed response sends it."""

from __future__ import annotations

from shadow.text.tokenizer import Tokenizer


class TextStream:
    """Text of a stream of ids, piece by piece: each `push` returns what the new id adds, holding
    back a character split over ids until it is whole; `rest` returns what is still held. Work
    per id stays constant (a short window is decoded, never the whole output)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        text = self.tokenizer.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done) :]
        return ""

    def rest(self) -> str:
        done = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(done) :]

