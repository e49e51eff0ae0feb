"""The DeepSeek-V4 chat encoding (prompt text for chat and thinking mode).

This re-implements the format defined by DeepSeek's own ``encoding/encoding_dsv4.py`` (shipped
next to the DeepSeek-V4 checkpoints; the V3.2 ``encoding_dsv32.py`` is the same scheme without the
reasoning-effort prefix).  It is written from the format, not copied; tool calls, tool results,
"latest_reminder" messages and the internal task tokens of the official file are left out.

The format, for ``messages = [system?, user, assistant, user, ...]``::

    <｜begin▁of▁sentence｜>                      (unless add_bos=False)
    [REASONING_EFFORT_MAX]                        (thinking mode with reasoning_effort="max" only,
                                                   before the first message whatever its role)
    {system content}                              (raw, no role token; several are concatenated)
    <｜User｜>{user content}<｜Assistant｜></think>  (a user turn answered in chat mode, or an
                                                   *earlier* turn in thinking mode)
    {assistant content}<｜end▁of▁sentence｜>
    <｜User｜>{user content}<｜Assistant｜><think>   (the last user turn in thinking mode)
    {reasoning}</think>{assistant content}<｜end▁of▁sentence｜>   (a completed thinking turn)

Rules (those of the official encoder):

* A user (or developer) turn followed by an assistant turn, or ending the list, is closed by
  ``<｜Assistant｜>`` plus ``</think>`` (chat mode, and earlier turns in thinking mode) or
  ``<think>`` (thinking mode, the last user turn).  Consecutive user turns are simply
  concatenated (each with its own ``<｜User｜>``).
* Thinking mode drops the ``reasoning_content`` of every assistant turn before the last user turn
  (``drop_thinking=True``, the default), and developer messages before it; assistant turns after
  the last user turn keep ``{reasoning}</think>`` before their content.  Chat mode never renders
  reasoning.
* ``reasoning_effort``: ``None`` or ``"high"`` render nothing; ``"max"`` prepends
  :data:`REASONING_EFFORT_MAX` right after BOS, in thinking mode only.

The same strings feed a real DSV4 tokenizer (``tokenizer.json`` of a checkpoint dir): every
marker above is one of its special tokens.  Tokenise the result with ``add_special_tokens=False``
(the text already carries the BOS).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..patterns import did_you_mean

__all__ = [
    "BOS",
    "EOS",
    "PAD",
    "USER",
    "ASSISTANT",
    "THINK_START",
    "THINK_END",
    "SPECIAL_TOKENS",
    "REASONING_EFFORT_MAX",
    "THINKING_MODES",
    "encode_messages",
    "encode_prompt",
    "parse_completion",
]

BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"  # <｜begin▁of▁sentence｜>
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"  # <｜end▁of▁sentence｜>
PAD = "<\uff5c\u2581pad\u2581\uff5c>"  # <｜▁pad▁｜> (id 2 in the real vocabulary too)
USER = "<\uff5cUser\uff5c>"  # <｜User｜>
ASSISTANT = "<\uff5cAssistant\uff5c>"  # <｜Assistant｜>
THINK_START = "<think>"
THINK_END = "</think>"

#: Special tokens of the tiny tokenizer, in id order (BOS 0, EOS 1, PAD 2 as in the real DSV4 vocab).
SPECIAL_TOKENS = (BOS, EOS, PAD, USER, ASSISTANT, THINK_START, THINK_END)

#: The prefix the official encoder inserts for ``reasoning_effort="max"`` in thinking mode.
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

THINKING_MODES = ("chat", "thinking")
PROMPT_MODES = ("plain", *THINKING_MODES)   # encode_prompt: a raw completion prompt, or a chat one
_EFFORTS = (None, "high", "max")
_USER_ROLES = ("user", "developer")
_ROLES = ("system", "user", "developer", "assistant")


def _last_user_index(messages: Sequence[Mapping[str, Any]]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") in _USER_ROLES:
            return i
    return -1


def _check(messages: Sequence[Mapping[str, Any]]) -> None:
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in _ROLES:
            raise ValueError(f"message {i}: role {role!r} is not supported (one of {_ROLES})")
        if m.get("tool_calls") or m.get("tools"):
            raise NotImplementedError(f"message {i}: tool calls / tools are not supported here")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise TypeError(f"message {i}: content must be a str, got {type(content).__name__}")


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: str = "chat",
    reasoning_effort: str | None = None,
    add_bos: bool = True,
    drop_thinking: bool = True,
) -> str:
    """Encode ``messages`` (dicts with ``role``, ``content`` and, for the assistant, an optional
    ``reasoning_content``) as DeepSeek-V4 prompt text.

    ``thinking_mode``: ``"chat"`` (the prompt ends ``<｜Assistant｜></think>``) or ``"thinking"``
    (ends ``<｜Assistant｜><think>``).  A list that ends with an assistant turn encodes a complete
    conversation (a training sample), ending with ``<｜end▁of▁sentence｜>``.
    """
    if thinking_mode not in THINKING_MODES:
        hint = did_you_mean(str(thinking_mode), THINKING_MODES)
        raise ValueError(f"thinking_mode={thinking_mode!r} is not a chat mode{hint} (choose from "
                         f"{', '.join(THINKING_MODES)})")
    if reasoning_effort not in _EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {_EFFORTS}, got {reasoning_effort!r}")
    _check(messages)
    thinking = thinking_mode == "thinking"

    msgs = [dict(m) for m in messages]
    if thinking and drop_thinking:
        last = _last_user_index(msgs)
        kept = []
        for i, m in enumerate(msgs):
            if i < last and m["role"] == "assistant":
                m.pop("reasoning_content", None)
            elif i < last and m["role"] == "developer":
                continue  # the official encoder drops earlier developer turns
            kept.append(m)
        msgs = kept
    last_user = _last_user_index(msgs)

    parts: list[str] = [BOS] if add_bos else []
    for i, m in enumerate(msgs):
        role, content = m["role"], m.get("content") or ""
        if i == 0 and thinking and reasoning_effort == "max":
            parts.append(REASONING_EFFORT_MAX)
        if role == "system":
            parts.append(content)
        elif role in _USER_ROLES:
            parts.append(USER + content)
        else:  # assistant
            if thinking and (not drop_thinking or i > last_user):
                parts.append((m.get("reasoning_content") or "") + THINK_END)
            parts.append(content + EOS)
        # a user turn that is answered next (or ends the list) opens the assistant turn
        nxt = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if role in _USER_ROLES and nxt in (None, "assistant"):
            opens_thinking = thinking and (not drop_thinking or i >= last_user)
            parts.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
    return "".join(parts)


def encode_prompt(
    text_or_messages: str | Sequence[Mapping[str, Any]],
    mode: str = "chat",
    *,
    system: str | None = None,
    reasoning_effort: str | None = None,
    add_bos: bool = True,
) -> str:
    """The prompt text for one query.

    ``mode``: ``"plain"`` (BOS + the raw text: a completion prompt, no chat markers), ``"chat"`` or
    ``"thinking"`` (a str becomes one user message; a list of messages is encoded as is).
    """
    if mode not in PROMPT_MODES:
        hint = did_you_mean(str(mode), PROMPT_MODES)
        raise ValueError(f"mode={mode!r} is not a prompt mode{hint} (choose from {', '.join(PROMPT_MODES)})")
    if mode == "plain":
        if not isinstance(text_or_messages, str):
            raise TypeError("plain mode takes a str")
        return (BOS if add_bos else "") + text_or_messages
    if isinstance(text_or_messages, str):
        messages: list[Mapping[str, Any]] = [{"role": "user", "content": text_or_messages}]
    else:
        messages = list(text_or_messages)
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    return encode_messages(messages, mode, reasoning_effort=reasoning_effort, add_bos=add_bos)


def parse_completion(text: str, thinking_mode: str = "chat") -> dict[str, str]:
    """Split generated text (what follows an :func:`encode_prompt` prompt) into
    ``{"reasoning_content", "content"}``; the text stops at the first EOS if there is one."""
    text = text.split(EOS, 1)[0]
    reasoning = ""
    if thinking_mode == "thinking":
        if THINK_END in text:
            reasoning, text = text.split(THINK_END, 1)
        else:  # still thinking when generation stopped
            reasoning, text = text, ""
    elif text.startswith(THINK_END):
        text = text[len(THINK_END):]
    return {"reasoning_content": reasoning, "content": text}

