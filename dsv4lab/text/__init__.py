"""Text side of the workbench: the DSV4 chat encoding and the tiny model's tokenizer.

``chat`` (the official encoding; standard library only) < ``corpus`` (the synthetic texts the
embedded model is trained on and probed with: training, triage and the bug zoo all read it) <
``tokenizer`` (imports ``tokenizers`` / ``transformers`` on first use) < ``suite`` (the prompt
suite: plain, chat, thinking, retrieval, one length per compression-window residue).
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
from .tokenizer import encode_chat, load_tokenizer

__all__ = [
    "ASSISTANT", "BOS", "EOS", "PAD", "REASONING_EFFORT_MAX", "SPECIAL_TOKENS", "THINK_END",
    "THINK_START", "USER", "encode_messages", "encode_prompt", "parse_completion",
    "load_tokenizer", "encode_chat",
]

