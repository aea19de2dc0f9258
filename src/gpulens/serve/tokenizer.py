"""The byte-level tokenizer of the generative tenant: token id = one UTF-8 byte (0..255).

The built-in language models are randomly initialised and have no trained vocabulary, so the
server tokenizes text as UTF-8 bytes (like ByT5): a prompt of N bytes is N tokens, and generation
only picks among the first 256 ids (the model still computes its full vocabulary's logits, so the
cost per token is the model's). Prompts given as token ids may use the model's whole vocabulary.
Standard library only.
"""

from __future__ import annotations

import codecs

VOCAB_SIZE = 256
NAME = "byte-level UTF-8 (token id = byte value, 256 ids)"


def encode(text: str) -> list[int]:
    """The prompt's token ids: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


class StreamDecoder:
    """Token ids -> text, one at a time: a multi-byte character comes out with its last byte;
    bytes that form no valid UTF-8 come out as U+FFFD."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        if 0 <= token < VOCAB_SIZE:
            return self._decoder.decode(bytes((token,)))
        return "\ufffd"  # an id beyond the bytes (only prompts can hold one)

    def flush(self) -> str:
        """What an unfinished multi-byte sequence left (U+FFFD), at the end of a completion."""
        return self._decoder.decode(b"", final=True)
