"""The DSV4 chat encoding: exact strings (format of DeepSeek's encoding/encoding_dsv4.py)."""
import pytest

from dsv4lab.text.chat import (
    ASSISTANT,
    BOS,
    EOS,
    REASONING_EFFORT_MAX,
    THINK_END,
    THINK_START,
    USER,
    encode_messages,
    encode_prompt,
    parse_completion,
)

B = "<｜begin▁of▁sentence｜>"
E = "<｜end▁of▁sentence｜>"
U = "<｜User｜>"
A = "<｜Assistant｜>"

MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)

MULTI = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "Hello! I am DeepSeek.", "reasoning_content": "thinking..."},
    {"role": "user", "content": "1+1=?"},
]


def test_special_token_strings():
    # the bars are U+FF5C, the word separator U+2581
    assert (BOS, EOS, USER, ASSISTANT) == (B, E, U, A)
    assert "\uff5c" in BOS and "\u2581" in BOS
    assert (THINK_START, THINK_END) == ("<think>", "</think>")
    assert REASONING_EFFORT_MAX == MAX


def test_single_turn_chat():
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert encode_messages(msgs, "chat") == B + U + "What is the capital of France?" + A + "</think>"
    assert encode_messages(msgs) == encode_messages(msgs, "chat")


def test_single_turn_thinking():
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert encode_messages(msgs, "thinking") == B + U + "What is the capital of France?" + A + "<think>"


def test_multi_turn_thinking_drops_earlier_reasoning():
    assert encode_messages(MULTI, "thinking") == (
        B + "You are a helpful assistant." + U + "hello" + A + "</think>" + "Hello! I am DeepSeek." + E
        + U + "1+1=?" + A + "<think>"
    )


def test_multi_turn_chat():
    assert encode_messages(MULTI, "chat") == (
        B + "You are a helpful assistant." + U + "hello" + A + "</think>" + "Hello! I am DeepSeek." + E
        + U + "1+1=?" + A + "</think>"
    )


def test_multi_turn_thinking_keep_reasoning():
    assert encode_messages(MULTI, "thinking", drop_thinking=False) == (
        B + "You are a helpful assistant." + U + "hello" + A + "<think>thinking...</think>Hello! I am DeepSeek." + E
        + U + "1+1=?" + A + "<think>"
    )


def test_completed_turns():
    conv = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris", "reasoning_content": "France's capital is Paris."},
    ]
    assert encode_messages(conv, "thinking") == (
        B + U + "What is the capital of France?" + A + "<think>France's capital is Paris.</think>Paris" + E
    )
    assert encode_messages(conv, "chat") == B + U + "What is the capital of France?" + A + "</think>Paris" + E
    # the prompt is a prefix of the completed conversation
    assert encode_messages(conv, "thinking").startswith(encode_messages(conv[:1], "thinking"))


def test_system_prompt():
    msgs = [{"role": "system", "content": "You are a geography expert."}, {"role": "user", "content": "hi"}]
    assert encode_messages(msgs, "chat") == B + "You are a geography expert." + U + "hi" + A + "</think>"
    assert encode_messages(msgs, "thinking") == B + "You are a geography expert." + U + "hi" + A + "<think>"


def test_reasoning_effort_max():
    msgs = [{"role": "user", "content": "hi"}]
    assert encode_messages(msgs, "thinking", reasoning_effort="max") == B + MAX + U + "hi" + A + "<think>"
    sys_msgs = [{"role": "system", "content": "Be brief."}] + msgs
    assert encode_messages(sys_msgs, "thinking", reasoning_effort="max") == B + MAX + "Be brief." + U + "hi" + A + "<think>"
    # chat mode and "high" render nothing
    assert encode_messages(msgs, "chat", reasoning_effort="max") == B + U + "hi" + A + "</think>"
    assert encode_messages(msgs, "thinking", reasoning_effort="high") == encode_messages(msgs, "thinking")


def test_consecutive_users_and_no_bos():
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert encode_messages(msgs, "chat", add_bos=False) == U + "a" + U + "b" + A + "</think>"


def test_errors():
    with pytest.raises(ValueError):
        encode_messages([{"role": "user", "content": "x"}], "reasoning")
    with pytest.raises(ValueError):
        encode_messages([{"role": "user", "content": "x"}], "thinking", reasoning_effort="low")
    with pytest.raises(ValueError):
        encode_messages([{"role": "robot", "content": "x"}])


def test_encode_prompt():
    assert encode_prompt("The capital of France is", "plain") == B + "The capital of France is"
    assert encode_prompt("hi", "chat") == B + U + "hi" + A + "</think>"
    assert encode_prompt("hi", "thinking", system="S") == B + "S" + U + "hi" + A + "<think>"
    assert encode_prompt("hi", "thinking", reasoning_effort="max") == B + MAX + U + "hi" + A + "<think>"
    assert encode_prompt(MULTI, "thinking") == encode_messages(MULTI, "thinking")


def test_parse_completion():
    assert parse_completion("France's capital is Paris.</think>Paris" + E + "junk", "thinking") == {
        "reasoning_content": "France's capital is Paris.", "content": "Paris"}
    assert parse_completion("Paris" + E, "chat") == {"reasoning_content": "", "content": "Paris"}
    assert parse_completion("still thinking", "thinking") == {"reasoning_content": "still thinking", "content": ""}
