"""The synthetic corpus: toy world, chat samples, retrieval documents, packing, eval sets."""
import itertools

import pytest
import torch

from dsv4lab.text.chat import EOS, encode_messages
from dsv4lab.text.tokenizer import load_tokenizer
from dsv4lab.text import corpus as C


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def evals(tok):
    return C.eval_sets(tok, seed=1234, n_retrieval=16)


def test_toy_world():
    w = C.ToyWorld()
    assert len(w.countries) >= 60
    assert len({c.name for c in w.countries}) == len(w.countries)
    assert w.answer("France", "capital") == "Paris" and w.answer("Japan", "capital") == "Tokyo"
    assert w.answer("the United Kingdom", "capital") == "London"
    assert set(C.RELATIONS) == {"capital", "continent", "language", "currency"}
    assert all(" " not in c.get(r) for c in w.countries for r in C.RELATIONS)
    assert w.probe("France") == ("The capital of France is", " Paris")
    pre, ans, post = w.fact(w.country("France"), "capital", 0)
    assert pre + ans + post == "The capital of France is Paris."


def test_fact_samples_deterministic():
    a = [s.text for s in C.make_fact_samples(50, seed=3)]
    b = [s.text for s in C.make_fact_samples(50, seed=3)]
    c = [s.text for s in C.make_fact_samples(50, seed=4)]
    assert a == b and a != c
    assert any("The capital of " in t for t in a)


def test_chat_samples_are_official_encoding(tok):
    w = C.ToyWorld()
    fr = w.country("France")
    s = C._chat_sample(w, "chat", fr, "capital", 0)
    msgs = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris"}]
    assert s.text == encode_messages(msgs, "chat")
    s = C._chat_sample(w, "thinking", fr, "capital", 0)
    msgs[1]["reasoning_content"] = "The user asks for the capital of France. France's capital is Paris."
    assert s.text == encode_messages(msgs, "thinking")
    assert s.text.endswith("France's capital is Paris.</think>Paris" + EOS)
    # every generated sample (system prompts, earlier turns, max effort) round-trips the encoder
    for s in C.make_chat_samples(60, seed=1, tokenizer=tok, p_system=0.5, p_multiturn=0.5, p_effort_max=0.3):
        assert s.text.endswith(s.meta["answer"] + EOS)
        assert tok.decode(s.ids) == s.text
        assert tok.decode([s.ids[s.answer_positions()[-1]]]) == s.meta["answer"]


def test_masks(tok):
    w = C.ToyWorld()
    s = C.tokenize_sample(tok, C._chat_sample(w, "thinking", w.country("Japan"), "capital", 1))
    ans, gen, all_ = s.mask("answer"), s.mask("generated"), s.mask("all")
    assert sum(ans) == 2  # the answer inside the reasoning and the final one
    assert all(g for a, g in zip(ans, gen) if a) and sum(gen) > sum(ans)
    assert not all_[0] and all(all_[1:])
    # generated = everything after <think>: reasoning, </think>, answer, EOS
    first = gen.index(True)
    assert s.ids[first - 1] == 5 and all(gen[first:]) and s.ids[-1] == 1


@pytest.mark.parametrize("mode", ["plain", "chat", "thinking"])
def test_retrieval_samples(tok, mode):
    docs = C.make_retrieval_samples(6, seq_len=512, min_distance=128, seed=5, tokenizer=tok, modes=(mode,))
    key_ids = {tok.convert_tokens_to_ids("Ġ" + k) for k in C.KEYS}
    for s in docs:
        assert len(s.ids) <= 512 and s.ids[0] == 0
        for q in s.meta["queries"]:
            assert q["distance"] >= 128
            v_id = tok.encode(" " + q["value"], add_special_tokens=False)
            assert s.ids[q["answer_pos"]] == s.ids[q["plant_pos"]] == v_id[0] and len(v_id) == 1
            # induction form: "<key> <value>" at the plant, the key right before the answer
            k_id = tok.encode(" " + q["key"], add_special_tokens=False)[0]
            assert k_id in key_ids
            assert s.ids[q["answer_pos"] - 1] == s.ids[q["plant_pos"] - 1] == k_id
        assert s.mask("answer")[s.meta["queries"][0]["answer_pos"]]
        assert 2 <= s.meta["n_pairs"] <= 4
        if mode != "plain":  # the exact chat encoding of document + question + answer
            k, v = s.meta["queries"][0]["key"], s.meta["queries"][0]["value"]
            user = s.text.split("<｜User｜>", 1)[1].split("<｜Assistant｜>", 1)[0]
            msg = {"role": "assistant", "content": f"The secret code {k} {v}."}
            if mode == "thinking":
                msg["reasoning_content"] = f"The user asks for the secret code {k}. The text says: the secret code {k} {v}."
            assert user.endswith(f"Question: What is the secret code {k}?")
            assert s.text == encode_messages([{"role": "user", "content": user}, msg], mode)


def test_retrieval_without_tokenizer_and_determinism():
    a = C.make_retrieval_samples(5, 512, 128, seed=9)
    b = C.make_retrieval_samples(5, 512, 128, seed=9)
    assert [s.text for s in a] == [s.text for s in b]
    assert all(q["distance"] >= 128 for s in a for q in s.meta["queries"])


def test_training_stream(tok):
    seqs = list(itertools.islice(C.training_stream(tok, seq_len=256, seed=0, with_answer_mask=True), 12))
    again = list(itertools.islice(C.training_stream(tok, seq_len=256, seed=0, with_answer_mask=True), 12))
    other = list(itertools.islice(C.training_stream(tok, seq_len=256, seed=1), 2))
    for (ids, lm, am), (ids2, lm2, am2) in zip(seqs, again):
        assert ids.shape == lm.shape == am.shape == (256,)
        assert ids.dtype == torch.long and lm.dtype == am.dtype == torch.bool
        assert torch.equal(ids, ids2) and torch.equal(lm, lm2) and torch.equal(am, am2)
        assert not lm[ids == 2].any() and not (am & ~lm).any()
        assert ids[0] == 0
    assert not torch.equal(seqs[0][0], other[0][0])
    ids = torch.stack([s[0] for s in seqs])
    assert (ids == 2).float().mean() < 0.05  # little padding
    assert sum(int(am.sum()) for _, _, am in seqs) > 12
    # loss_on="answer" gives the answer mask
    ids_a, lm_a = next(C.training_stream(tok, seq_len=256, seed=0, loss_on="answer"))
    assert torch.equal(ids_a, seqs[0][0]) and torch.equal(lm_a, seqs[0][2])


def test_mix_and_curriculum(tok):
    mix = {"retrieval_plain": 1.0}
    for ids, lm in itertools.islice(C.training_stream(tok, 384, seed=2, mix=mix, curriculum_steps=100), 3):
        text = tok.decode(ids.tolist())
        assert "secret code" in text
    sampler = C.DistanceSampler(8, 400, curriculum_steps=100)
    import random

    rng = random.Random(0)
    assert max(sampler(rng, 0, 1000) for _ in range(200)) <= 48
    assert max(sampler(rng, 100, 1000) for _ in range(200)) > 300
    with pytest.raises(ValueError):
        next(C.training_stream(tok, 256, mix={"bogus": 1.0}))


def test_eval_sets(tok, evals):
    w = C.ToyWorld()
    assert set(evals) == {"facts", "facts_chat", "facts_thinking", "relations", "relations_chat",
                          "retrieval", "retrieval_chat", "retrieval_thinking"}
    for name in ("facts", "facts_chat", "facts_thinking"):
        assert len(evals[name]) == len(w.countries)
    fr = evals["facts"][0]
    assert tok.decode(fr.prompt_ids) == "<｜begin▁of▁sentence｜>The capital of France is"
    assert tok.decode([fr.answer_id]) == " Paris"
    prompt, answer, meta = evals["facts_chat"][0]
    assert prompt[-2:] == [4, 6] and tok.decode([answer]) == "Paris"
    assert meta["completion_ids"] == [answer, 1]
    p = evals["facts_thinking"][0]
    assert p.meta["gen_prompt_ids"][-2:] == [4, 5] and p.prompt_ids[-1] == 6
    assert p.meta["completion_ids"][-2:] == [p.answer_id, 1]
    for name, probes in evals.items():
        for p in probes:
            assert p.prompt_ids[0] == 0
            assert tok.decode([p.answer_id]) == p.meta["answer"]
            full = p.meta["gen_prompt_ids"] + p.meta["completion_ids"]
            assert full[: len(p.prompt_ids) + 1] == p.prompt_ids + [p.answer_id]
            if name.startswith("retrieval"):
                assert p.meta["distance"] >= 128 and len(p.prompt_ids) <= 512
    assert len(evals["retrieval"]) == len(evals["retrieval_chat"]) == 16


def test_eval_sets_deterministic(tok, evals):
    again = C.eval_sets(tok, seed=1234, n_retrieval=16)
    assert [p.prompt_ids for p in again["retrieval"]] == [p.prompt_ids for p in evals["retrieval"]]
