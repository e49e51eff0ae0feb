"""Text side of the workbench: the DSV4 chat encoding and the tiny model's tokenizer.

``dsv4lab.text.chat`` needs nothing beyond the standard library; the tokenizer helpers import
``tokenizers`` / ``transformers`` on first use.
"""
from __future__ import annotations

from .chat import (
    ASSISTANT,
    BOS,
    EOS,
    PAD,
    REASONING_EFFORT_MAX,
    SPECIAL_TOKENS,
    THINK_END,
    THINK_START,
    USER,
    encode_messages,
    encode_prompt,
    parse_completion,
)

__all__ = [
    "ASSISTANT", "BOS", "EOS", "PAD", "REASONING_EFFORT_MAX", "SPECIAL_TOKENS", "THINK_END",
    "THINK_START", "USER", "encode_messages", "encode_prompt", "parse_completion",
    "load_tokenizer", "encode_chat",
]


def load_tokenizer(path_or_dir=None):
    """See :func:`dsv4lab.text.tokenizer.load_tokenizer`."""
    from .tokenizer import load_tokenizer as _load

    return _load(path_or_dir)


def encode_chat(tokenizer, messages, thinking_mode="chat", reasoning_effort=None, **kwargs):
    """See :func:`dsv4lab.text.tokenizer.encode_chat`."""
    from .tokenizer import encode_chat as _enc

    return _enc(tokenizer, messages, thinking_mode, reasoning_effort, **kwargs)
