"""The tokenizer of the embedded tiny DSV4: train it, save it, load it (or a real DSV4 one).

A byte-level BPE (``tokenizers``; ByteLevel pre-tokenizer, ``add_prefix_space=False``, so any
text round-trips) trained on :func:`dsv4lab.text.corpus.tokenizer_training_texts`, with the
official DSV4 special tokens at fixed ids::

    0 <｜begin▁of▁sentence｜>   1 <｜end▁of▁sentence｜>   2 <｜▁pad▁｜>   (as in the real vocabulary)
    3 <｜User｜>   4 <｜Assistant｜>   5 <think>   6 </think>

Every answer word of the toy world (" Paris" and "Paris"), every retrieval key (" ALPHA") and
value (" 7421") is ONE token: BPE learns most of them from the corpus; any it misses gets merges
appended after training (lowest priority, so they only join what is otherwise left split).  The
vocabulary is exactly :data:`VOCAB_SIZE` tokens.  Training is deterministic and takes seconds::

    python -m dsv4lab.text.tokenizer --out data/tiny-dsv4

Load with :func:`load_tokenizer` (the shipped one by default), ``PreTrainedTokenizerFast(
tokenizer_file=...)`` or ``AutoTokenizer.from_pretrained("data/tiny-dsv4")``.  Like the real DSV4
tokenizer it prepends BOS when ``add_special_tokens=True``; chat prompts from
:func:`dsv4lab.text.chat.encode_messages` already carry the BOS, so encode them with
``add_special_tokens=False`` (:func:`encode_chat` does).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .chat import ASSISTANT, BOS, EOS, PAD, SPECIAL_TOKENS, THINK_END, THINK_START, USER, encode_messages
from .corpus import required_words, tokenizer_training_texts

__all__ = [
    "VOCAB_SIZE",
    "DEFAULT_DIR",
    "train_tokenizer",
    "save_tokenizer",
    "build",
    "load_tokenizer",
    "encode_chat",
    "single_token_id",
]

VOCAB_SIZE = 2048
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / "data" / "tiny-dsv4"


def _train_bpe(texts: Sequence[str], vocab_size: int):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _force_single_tokens(tok, words: Iterable[str]):
    """Append merges so that each of ``words`` (one pre-token each) becomes one token.
    Returns (new Tokenizer, number of tokens added)."""
    data = json.loads(tok.to_str())
    model = data["model"]
    vocab: dict[str, int] = model["vocab"]
    merges: list = model["merges"]
    as_pairs = bool(merges) and isinstance(merges[0], list)
    added = 0
    for w in words:
        pieces = tok.encode(w, add_special_tokens=False).tokens
        if len(pieces) <= 1:
            continue
        pre = tok.pre_tokenizer.pre_tokenize_str(w)
        if len(pre) != 1:
            raise ValueError(f"{w!r} is not a single pre-token: {pre}")
        left = pieces[0]
        for right in pieces[1:]:
            new = left + right
            if new not in vocab:
                vocab[new] = len(vocab)
                added += 1
            merges.append([left, right] if as_pairs else f"{left} {right}")
            left = new
    # `added_tokens` ids must stay below the model vocab: special tokens are ids 0..6 already
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False)), added


def _finish(tok):
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def train_tokenizer(vocab_size: int = VOCAB_SIZE, seed: int = 0):
    """Train the tiny tokenizer (a ``tokenizers.Tokenizer``) with exactly ``vocab_size`` tokens,
    each required word (:func:`dsv4lab.text.corpus.required_words`) a single token."""

    texts = list(tokenizer_training_texts(seed))
    words = required_words()
    target = vocab_size
    tok, added = None, 0
    for _ in range(6):  # shrink the trained part until trained + forced == vocab_size
        tok = _train_bpe(texts, target)
        tok, added = _force_single_tokens(tok, words)
        size = tok.get_vocab_size(with_added_tokens=True)
        if size == vocab_size:
            break
        target -= size - vocab_size
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise RuntimeError(f"tokenizer has {size} tokens, wanted {vocab_size}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return _finish(tok)


def _configs(model_max_length: int) -> tuple[dict, dict]:
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": [USER, ASSISTANT, THINK_START, THINK_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    special_map = {**special, "additional_special_tokens": [USER, ASSISTANT, THINK_START, THINK_END]}
    return config, special_map


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int = 4096) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config, special_map = _configs(model_max_length)
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return out


def build(out_dir: str | Path = DEFAULT_DIR, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Path:
    """Train and save (what ``python -m dsv4lab.text.tokenizer`` does)."""
    return save_tokenizer(train_tokenizer(vocab_size, seed), out_dir)


def load_tokenizer(path_or_dir: str | Path | None = None):
    """A transformers ``PreTrainedTokenizerFast``: the shipped tiny tokenizer by default, else
    the one in ``path_or_dir`` (a directory with ``tokenizer.json``, e.g. a DSV4 checkpoint, or
    the ``tokenizer.json`` file itself)."""
    from transformers import PreTrainedTokenizerFast  # lazy: heavy optional dependency

    p = Path(path_or_dir) if path_or_dir is not None else DEFAULT_DIR
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        hint = " (rebuild: python -m dsv4lab.text.tokenizer --out data/tiny-dsv4)" if path_or_dir is None else ""
        raise FileNotFoundError(f"no tokenizer.json at {p}{hint}")
    kwargs: dict[str, Any] = {}
    cfg_file = file.parent / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    for k in ("bos_token", "eos_token", "pad_token", "model_max_length", "clean_up_tokenization_spaces"):
        v = cfg.get(k)
        if isinstance(v, dict):  # {"content": ...} form of older configs
            v = v.get("content")
        if v is not None:
            kwargs[k] = v
    if "bos_token" not in kwargs:
        kwargs.update(bos_token=BOS, eos_token=EOS)
    return PreTrainedTokenizerFast(tokenizer_file=str(file), **kwargs)


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]] | str, thinking_mode: str = "chat",
                reasoning_effort: str | None = None, **kwargs) -> list[int]:
    """Token ids of the DSV4 chat prompt (works with the tiny and with a real DSV4 tokenizer)."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = encode_messages(messages, thinking_mode, reasoning_effort=reasoning_effort, **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def single_token_id(tokenizer, text: str) -> int:
    """The id of ``text`` if it is exactly one token, else ValueError."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = getattr(ids, "ids", ids)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens: {ids}")
    return ids[0]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train the tiny DSV4 tokenizer on the synthetic corpus")
    ap.add_argument("--out", default=str(DEFAULT_DIR), help="output directory (default: data/tiny-dsv4)")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = build(args.out, args.vocab_size, args.seed)
    tok = load_tokenizer(out)
    print(f"wrote {out} ({len(tok)} tokens)")


if __name__ == "__main__":
    main()
