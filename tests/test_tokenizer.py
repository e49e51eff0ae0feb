"""The shipped tiny tokenizer (data/tiny-dsv4): special ids, single-token answers, round trips."""
import json
import random

import pytest

from dsv4lab.text.chat import SPECIAL_TOKENS, encode_messages, encode_prompt
from dsv4lab.text.tokenizer import DEFAULT_DIR, VOCAB_SIZE, encode_chat, load_tokenizer, single_token_id
from dsv4lab.text.corpus import KEYS, VALUES, ToyWorld, required_words

SPECIAL_IDS = {
    "<｜begin▁of▁sentence｜>": 0,
    "<｜end▁of▁sentence｜>": 1,
    "<｜▁pad▁｜>": 2,
    "<｜User｜>": 3,
    "<｜Assistant｜>": 4,
    "<think>": 5,
    "</think>": 6,
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_files_and_size(tok):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (DEFAULT_DIR / name).is_file()
    assert len(tok) == VOCAB_SIZE == 2048
    total = sum((DEFAULT_DIR / n).stat().st_size for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"))
    assert total < 1_000_000


def test_special_token_ids(tok):
    assert tuple(SPECIAL_IDS) == SPECIAL_TOKENS
    for text, i in SPECIAL_IDS.items():
        assert tok.convert_tokens_to_ids(text) == i
        assert tok.encode(text, add_special_tokens=False) == [i]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)


def test_loaders():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    auto = AutoTokenizer.from_pretrained(str(DEFAULT_DIR))
    assert (auto.bos_token, auto.eos_token) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_DIR / "tokenizer.json"))
    assert len(fast) == VOCAB_SIZE
    # like the real DSV4 tokenizer, add_special_tokens=True prepends BOS
    ids = auto("The capital of France is")["input_ids"]
    assert ids[0] == 0 and ids == fast("The capital of France is")["input_ids"]
    assert load_tokenizer(DEFAULT_DIR / "tokenizer.json").encode("Paris") == auto.encode("Paris")


def test_paris_and_every_answer_single_token(tok):
    assert len(tok.encode(" Paris", add_special_tokens=False)) == 1
    ids = tok.encode("The capital of France is Paris.", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[-2:] == ["ĠParis", "."]
    world = ToyWorld()
    for c in world.countries:
        single_token_id(tok, " " + c.capital)
        single_token_id(tok, c.capital)
    for w in required_words(world):
        single_token_id(tok, w)
    for k, v in zip(KEYS, VALUES):
        single_token_id(tok, " " + k)
        single_token_id(tok, " " + v)


def test_round_trip_ascii(tok):
    texts = [
        "The capital of France is Paris.",
        "Hello, world!  Two spaces, a tab\tand\nnew lines\n\n",
        "def f(x):\n    return x ** 2  # comment",
        "  leading and trailing  ",
        "UPPER lower 0123456789 {}[]()<>!?@#$%^&*_-+=~`|\\/'\";:,.",
    ]
    rng = random.Random(0)
    alphabet = "".join(chr(i) for i in range(32, 127)) + "\n\t"
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 80))) for _ in range(200)]
    for t in texts:
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t


def test_chat_prompt_special_tokens_single_ids(tok):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}]
    for mode, last in (("chat", 6), ("thinking", 5)):
        text = encode_messages(msgs, mode)
        ids = encode_chat(tok, msgs, mode)
        assert ids == tok.encode(text, add_special_tokens=False)
        assert ids[0] == 0 and ids[-2:] == [4, last]
        assert ids.count(3) == 1 and ids.count(0) == 1
        assert tok.decode(ids) == text
    ids = tok.encode(encode_prompt("hi", "thinking", reasoning_effort="max"), add_special_tokens=False)
    assert ids[0] == 0 and ids[-2:] == [4, 5]


def test_rebuild_is_deterministic_and_matches_shipped():
    from dsv4lab.text.tokenizer import train_tokenizer

    built = json.loads(train_tokenizer().to_str())
    shipped = json.loads((DEFAULT_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    assert built["model"]["vocab"] == shipped["model"]["vocab"]
    assert built["model"]["merges"] == shipped["model"]["merges"]
    assert built["added_tokens"] == shipped["added_tokens"]
