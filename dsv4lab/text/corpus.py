"""Synthetic, seeded training corpus for the embedded tiny DSV4 (DESIGN.md section 7).

Three kinds of samples, all deterministic given a seed:

* **Facts** (``make_fact_samples``): a toy world of 90 real countries (every capital a single
  word) with four relations: capital, continent, main language and currency.  Plain-text
  paragraphs of fact sentences in several templates, always including the probe template
  ``"The capital of France is Paris."`` (probe: ``"The capital of France is"`` -> ``" Paris"``).
* **Chat** (``make_chat_samples``): the official DSV4 chat encoding (:mod:`dsv4lab.text.chat`) of
  a user question and the assistant's bare answer (``"Paris"``), in chat mode
  (``...<｜Assistant｜></think>Paris<｜end▁of▁sentence｜>``) and thinking mode
  (``...<｜Assistant｜><think>The user asks for the capital of France. France's capital is
  Paris.</think>Paris<｜end▁of▁sentence｜>``), sometimes with a system prompt, an earlier turn or
  the ``max`` reasoning-effort prefix.
* **Retrieval** (``make_retrieval_samples``): filler text with key/value pairs planted as
  ``"The secret code ALPHA 7421."`` and, at least ``min_distance`` tokens later, the query
  ``"Recall the secret code ALPHA"`` ->
  ``" 7421"``; also in chat and thinking form.  Keys are 64 upper-case code words and values 64
  four-digit numbers; the tokenizer makes each of them ONE token, and they appear nowhere else.

Every sample is a list of text segments tagged ``"ctx"`` (context), ``"gen"`` (text the model
must produce: assistant reasoning, ``</think>``, answer, EOS) or ``"ans"`` (the scored answer
tokens).  :func:`tokenize_sample` turns it into token ids plus per-token tags;
``loss_mask`` / ``answer_mask`` derive from them.  Retrieval metadata gives, for every query, the
key, the value and the distance in tokens (answer position minus planted-value position).

Why the retrieval data looks like this
--------------------------------------
An earlier attempt (word-level vocabulary, random filler words, few retrieval samples) trained
facts fine but left key/value retrieval at chance even inside the sliding window.  The task has
to be *learnable by a tiny model from scratch*, so:

1. **Induction-friendly form.**  The key token directly precedes its value in the plant and
   ends every query: ``... code ALPHA [7421]`` -- the pattern ``A B ... A -> B`` that induction
   heads learn early: find the earlier occurrence of the key and copy the token after it. (An
   earlier ``"of ALPHA is 7421"`` form put `` is`` in between: the model then had to match the
   two-token pattern ``ALPHA is`` among many ``X is Y`` facts, and retrieval stayed at chance.)
   Key and value are adjacent, so they share a compressed block of the CSA and of the HCA.
2. **Dedicated one-token keys and values** that never occur in filler or facts: the value is
   unpredictable except by copying, and copying one token is one attention hop.
3. **A lot of it**: by default 45% of the training tokens are retrieval documents (plain, chat
   and thinking forms), and there are several pairs per document (distractors) with one or two
   of them queried, so the model must use the key, not "the last code seen".
4. **Answer supervision**: every answer token is tagged.  The stream's default loss mask
   (``loss_on="generated"``) covers the answers plus what the assistant generates, and leaves out
   the filler, the planted (unpredictable) keys/values and the questions, so nothing random
   drowns the answer signal; ``with_answer_mask`` adds the answer-only mask for up-weighting.
   Filler is low-entropy anyway (a tiny grammar plus toy-world facts) for ``loss_on="all"``.
5. **Distance curriculum**: distances are drawn from a mixture of log-uniform short ones (inside
   the 32-token window, where plain attention solves it and the induction circuit forms) and
   uniform long ones (>= 128 = 4x the window, where the compressed paths must carry it);
   ``curriculum_steps`` ramps the longest distance up over the first sequences.
6. **Thinking mode restates the plant** (``"The text says: the secret code ALPHA
   7421."``) before ``</think>``, so the final answer is a short-range copy of the reasoning.

Chat-form retrieval answers with the sentence (``"The secret code ALPHA 7421."``) so the
key again sits right before the value; the eval probe for it teacher-forces that prefix.
"""
from __future__ import annotations

import bisect
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
import torch.utils.data as tud

from .chat import ASSISTANT, BOS, EOS, PAD, THINK_END, THINK_START, USER, encode_messages

__all__ = [
    "Country",
    "ToyWorld",
    "Sample",
    "Probe",
    "RELATIONS",
    "KEYS",
    "VALUES",
    "DEFAULT_MIX",
    "SLIDING_WINDOW",
    "required_words",
    "make_fact_samples",
    "make_chat_samples",
    "make_retrieval_samples",
    "make_filler",
    "tokenize_sample",
    "DistanceSampler",
    "training_stream",
    "training_dataset",
    "eval_sets",
    "tokenizer_training_texts",
]

SLIDING_WINDOW = 32
DEFAULT_MIN_DISTANCE = 4 * SLIDING_WINDOW  # 128

# --------------------------------------------------------------------------------------------
# the toy world
# --------------------------------------------------------------------------------------------

RELATIONS = ("capital", "continent", "language", "currency")


@dataclass(frozen=True)
class Country:
    name: str  # as used mid-sentence ("the United Kingdom")
    capital: str
    continent: str
    language: str
    currency: str

    def get(self, relation: str) -> str:
        return getattr(self, relation)


# name | capital | continent | main language | currency.  Every answer is one word.
# "America" stands for the American continent (North and South).
_COUNTRIES = """
France|Paris|Europe|French|euro
Germany|Berlin|Europe|German|euro
Italy|Rome|Europe|Italian|euro
Spain|Madrid|Europe|Spanish|euro
Portugal|Lisbon|Europe|Portuguese|euro
the Netherlands|Amsterdam|Europe|Dutch|euro
Austria|Vienna|Europe|German|euro
Greece|Athens|Europe|Greek|euro
Ireland|Dublin|Europe|English|euro
Finland|Helsinki|Europe|Finnish|euro
Slovakia|Bratislava|Europe|Slovak|euro
Slovenia|Ljubljana|Europe|Slovenian|euro
Lithuania|Vilnius|Europe|Lithuanian|euro
Latvia|Riga|Europe|Latvian|euro
Estonia|Tallinn|Europe|Estonian|euro
Croatia|Zagreb|Europe|Croatian|euro
Poland|Warsaw|Europe|Polish|zloty
Sweden|Stockholm|Europe|Swedish|krona
Norway|Oslo|Europe|Norwegian|krone
Denmark|Copenhagen|Europe|Danish|krone
Iceland|Reykjavik|Europe|Icelandic|krona
Hungary|Budapest|Europe|Hungarian|forint
Czechia|Prague|Europe|Czech|koruna
Romania|Bucharest|Europe|Romanian|leu
Serbia|Belgrade|Europe|Serbian|dinar
Albania|Tirana|Europe|Albanian|lek
Ukraine|Kyiv|Europe|Ukrainian|hryvnia
Russia|Moscow|Europe|Russian|ruble
the United Kingdom|London|Europe|English|pound
Switzerland|Bern|Europe|German|franc
Japan|Tokyo|Asia|Japanese|yen
China|Beijing|Asia|Chinese|yuan
South Korea|Seoul|Asia|Korean|won
Thailand|Bangkok|Asia|Thai|baht
Vietnam|Hanoi|Asia|Vietnamese|dong
Indonesia|Jakarta|Asia|Indonesian|rupiah
the Philippines|Manila|Asia|Filipino|peso
Pakistan|Islamabad|Asia|Urdu|rupee
Bangladesh|Dhaka|Asia|Bengali|taka
Nepal|Kathmandu|Asia|Nepali|rupee
Iran|Tehran|Asia|Persian|rial
Iraq|Baghdad|Asia|Arabic|dinar
Jordan|Amman|Asia|Arabic|dinar
Lebanon|Beirut|Asia|Arabic|pound
Saudi Arabia|Riyadh|Asia|Arabic|riyal
Qatar|Doha|Asia|Arabic|riyal
Oman|Muscat|Asia|Arabic|rial
Turkey|Ankara|Asia|Turkish|lira
Mongolia|Ulaanbaatar|Asia|Mongolian|tugrik
Kazakhstan|Astana|Asia|Kazakh|tenge
Uzbekistan|Tashkent|Asia|Uzbek|som
Laos|Vientiane|Asia|Lao|kip
Myanmar|Naypyidaw|Asia|Burmese|kyat
Armenia|Yerevan|Asia|Armenian|dram
Egypt|Cairo|Africa|Arabic|pound
Kenya|Nairobi|Africa|Swahili|shilling
Nigeria|Abuja|Africa|English|naira
Morocco|Rabat|Africa|Arabic|dirham
Algeria|Algiers|Africa|Arabic|dinar
Tunisia|Tunis|Africa|Arabic|dinar
Ghana|Accra|Africa|English|cedi
Senegal|Dakar|Africa|French|franc
Uganda|Kampala|Africa|English|shilling
Tanzania|Dodoma|Africa|Swahili|shilling
Angola|Luanda|Africa|Portuguese|kwanza
Mozambique|Maputo|Africa|Portuguese|metical
Libya|Tripoli|Africa|Arabic|dinar
Mali|Bamako|Africa|French|franc
Zambia|Lusaka|Africa|English|kwacha
Botswana|Gaborone|Africa|English|pula
Namibia|Windhoek|Africa|English|dollar
Madagascar|Antananarivo|Africa|Malagasy|ariary
the United States|Washington|America|English|dollar
Canada|Ottawa|America|English|dollar
Brazil|Brasilia|America|Portuguese|real
Chile|Santiago|America|Spanish|peso
Peru|Lima|America|Spanish|sol
Colombia|Bogota|America|Spanish|peso
Venezuela|Caracas|America|Spanish|bolivar
Ecuador|Quito|America|Spanish|dollar
Cuba|Havana|America|Spanish|peso
Jamaica|Kingston|America|English|dollar
Uruguay|Montevideo|America|Spanish|peso
Paraguay|Asuncion|America|Spanish|guarani
Honduras|Tegucigalpa|America|Spanish|lempira
Nicaragua|Managua|America|Spanish|cordoba
Australia|Canberra|Oceania|English|dollar
New Zealand|Wellington|Oceania|English|dollar
Fiji|Suva|Oceania|English|dollar
Samoa|Apia|Oceania|Samoan|tala
"""


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# Plain-text fact templates: (prefix, suffix) around the answer; "{c}" is the country.  The first
# template of each relation is the probe ("The capital of France is" -> " Paris").
_FACT_TEMPLATES: dict[str, list[tuple[str, str]]] = {
    "capital": [
        ("The capital of {c} is", "."),
        ("{C}'s capital is", "."),
        ("The capital city of {c} is", "."),
        ("The seat of government of {c} is in", "."),
    ],
    "continent": [
        ("{C} is a country in", "."),
        ("{C} is in", "."),
        ("The continent of {c} is", "."),
    ],
    "language": [
        ("The main language of {c} is", "."),
        ("People in {c} speak", "."),
        ("In {c}, most people speak", "."),
    ],
    "currency": [
        ("The currency of {c} is the", "."),
        ("In {c}, people pay with the", "."),
        ("The money used in {c} is the", "."),
    ],
}
# reversed templates (answer first): "Paris is the capital of France."
_REVERSED_TEMPLATES = {
    "capital": "is the capital of {c}.",
    "currency": "is the currency of {c}.",
}
_QUESTIONS: dict[str, list[str]] = {
    "capital": [
        "What is the capital of {c}?",
        "What is {c}'s capital?",
        "Which city is the capital of {c}?",
        "Name the capital of {c}.",
    ],
    "continent": [
        "Which continent is {c} in?",
        "On which continent is {c}?",
    ],
    "language": [
        "What language do people speak in {c}?",
        "What is the main language of {c}?",
    ],
    "currency": [
        "What is the currency of {c}?",
        "What money do people use in {c}?",
    ],
}
# the reasoning of thinking mode: (text before the answer, text after it)
_REASONING = {
    "capital": ("The user asks for the capital of {c}. {C}'s capital is", "."),
    "continent": ("The user asks for the continent of {c}. {C} is a country in", "."),
    "language": ("The user asks for the language of {c}. The main language of {c} is", "."),
    "currency": ("The user asks for the currency of {c}. The currency of {c} is the", "."),
}
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a geography expert. Answer with one word.",
    "Answer briefly.",
)


class ToyWorld:
    """The facts: ``world.countries`` (list of :class:`Country`), ``world.answer(c, relation)``,
    plus the sentence, question and reasoning templates."""

    relations = RELATIONS

    def __init__(self) -> None:
        rows = [line.split("|") for line in _COUNTRIES.strip().splitlines()]
        self.countries: list[Country] = [Country(*r) for r in rows]
        self.by_name = {c.name: c for c in self.countries}

    def __len__(self) -> int:
        return len(self.countries)

    def country(self, name: str) -> Country:
        key = name if name in self.by_name else "the " + name
        return self.by_name[key]

    @staticmethod
    def _fmt(t: str, c: Country) -> str:
        return t.format(c=c.name, C=_cap(c.name))

    def answer(self, country: Country | str, relation: str) -> str:
        c = self.country(country) if isinstance(country, str) else country
        return c.get(relation)

    def answers(self, relation: str) -> list[str]:
        return sorted({c.get(relation) for c in self.countries})

    def fact(self, c: Country, relation: str, template: int = 0) -> tuple[str, str, str]:
        """(prefix, answer, suffix) of a plain fact sentence; template -1 = reversed form."""
        if template < 0:
            return "", c.get(relation), " " + self._fmt(_REVERSED_TEMPLATES[relation], c)
        pre, post = _FACT_TEMPLATES[relation][template]
        return self._fmt(pre, c), " " + c.get(relation), post

    def probe(self, c: Country | str, relation: str = "capital") -> tuple[str, str]:
        """The plain completion probe: ("The capital of France is", " Paris")."""
        c = self.country(c) if isinstance(c, str) else c
        pre, ans, _ = self.fact(c, relation, 0)
        return pre, ans

    def question(self, c: Country, relation: str, variant: int = 0) -> str:
        return self._fmt(_QUESTIONS[relation][variant], c)

    def reasoning(self, c: Country, relation: str) -> tuple[str, str, str]:
        pre, post = _REASONING[relation]
        return self._fmt(pre, c), " " + c.get(relation), post

    def n_templates(self, relation: str) -> int:
        return len(_FACT_TEMPLATES[relation])

    def n_questions(self, relation: str) -> int:
        return len(_QUESTIONS[relation])


# --------------------------------------------------------------------------------------------
# retrieval vocabulary and filler
# --------------------------------------------------------------------------------------------

KEYS = tuple(
    "ALPHA BRAVO CHARLIE DELTA ECHO FOXTROT GOLF HOTEL INDIA JULIET KILO LIMA MIKE NOVEMBER "
    "OSCAR PAPA QUEBEC ROMEO SIERRA TANGO UNIFORM VICTOR WHISKEY XRAY YANKEE ZULU BETA GAMMA "
    "EPSILON ZETA ETA THETA IOTA KAPPA LAMBDA MU NU XI OMICRON PI RHO SIGMA TAU UPSILON PHI CHI "
    "PSI OMEGA ORION VEGA SIRIUS ATLAS TITAN COMET NOVA PULSAR QUASAR NEBULA METEOR ZENITH APEX "
    "CIPHER RAVEN FALCON".split()
)
VALUES = tuple(str(v) for v in (
    8830, 8284, 3212, 2532, 3805, 3314, 3920, 2331, 1585, 4723, 6626, 3060, 1037, 4434, 8362, 5549,
    1741, 8023, 6465, 4441, 4612, 3844, 9130, 9945, 5811, 7956, 3565, 2092, 6227, 2136, 3914, 2820,
    2264, 6060, 2791, 7554, 4054, 8635, 5606, 6566, 5015, 5472, 9389, 5020, 4558, 5922, 7022, 1547,
    4245, 5646, 9223, 3229, 3330, 1649, 7402, 6891, 4987, 5597, 5034, 7857, 1956, 9603, 8314, 7811,
))
assert len(KEYS) == 64 and len(set(KEYS)) == 64 and len(VALUES) == 64 and len(set(VALUES)) == 64

# The key token directly precedes its value, in the plant and at the end of every query: one
# induction step (find the earlier occurrence of the key, copy the token after it) answers.
# An earlier "of ALPHA is 7421" form put " is" between them; the model then had to match a
# two-token pattern ("ALPHA is") among many "X is Y" facts and stayed at chance.
_PLANT = ("The secret code {k}", ".")  # + " {v}"
_QUERY_PLAIN = ("Recall the secret code {k}", ".")
_QUESTION_CHAT = "Question: What is the secret code {k}?"
_ANSWER_CHAT = ("The secret code {k}", ".")
_REASONING_RETRIEVAL = (
    "The user asks for the secret code {k}. The text says: the secret code {k}", ".")

_ADJ = ("old young small big quiet busy happy tired green blue red brown bright dark warm cold "
        "tall short kind calm").split()
_NOUN = ("farmer teacher child dog cat bird horse baker sailor doctor river garden house forest "
         "road market window boat bridge hill lamp apple letter song").split()
_VERB = "sees likes finds paints visits follows watches carries builds cleans".split()
_PLACE = ("near the river", "in the garden", "at the market", "on the hill", "by the bridge",
          "in the forest", "behind the house", "along the road")
_NAMES = "Anna Ben Clara David Emma Felix Grace Hugo Iris Jack".split()
_FILLER_TEMPLATES = (
    "The {a} {n} {v} the {a2} {n2}.",
    "{N} {v} a {a} {n} {p}.",
    "A {a} {n} lives {p}.",
    "The {n} is {a} today.",
    "{N} and {N2} walk {p}.",
)


def make_filler(rng: random.Random, world: ToyWorld | None = None, fact_fraction: float = 0.5) -> str:
    """One filler sentence (no leading space): a tiny-grammar sentence or a toy-world fact."""
    if world is not None and rng.random() < fact_fraction:
        c = rng.choice(world.countries)
        rel = rng.choice(RELATIONS)
        pre, ans, post = world.fact(c, rel, rng.randrange(world.n_templates(rel)))
        return pre + ans + post
    t = rng.choice(_FILLER_TEMPLATES)
    return t.format(a=rng.choice(_ADJ), a2=rng.choice(_ADJ), n=rng.choice(_NOUN), n2=rng.choice(_NOUN),
                    v=rng.choice(_VERB), p=rng.choice(_PLACE), N=rng.choice(_NAMES), N2=rng.choice(_NAMES))


def required_words(world: ToyWorld | None = None) -> list[str]:
    """Strings the tokenizer must hold as single tokens: every answer with and without a leading
    space (plain text has " Paris", a chat answer right after ``</think>`` has "Paris"), every
    key (" ALPHA") and value (" 7421"), and the filler words."""
    world = world or ToyWorld()
    out: list[str] = []
    for rel in RELATIONS:
        for a in world.answers(rel):
            out += [" " + a, a]
    out += [" " + k for k in KEYS] + [" " + v for v in VALUES]
    out += [" " + w for w in _ADJ + _NOUN + _VERB + _NAMES]
    seen: set[str] = set()
    return [w for w in out if not (w in seen or seen.add(w))]


# --------------------------------------------------------------------------------------------
# samples and tokenisation
# --------------------------------------------------------------------------------------------

CTX, GEN, ANS = "ctx", "gen", "ans"
_TAG_ID = {CTX: 0, GEN: 1, ANS: 2}


@dataclass
class Sample:
    """A text sample as tagged segments; after :func:`tokenize_sample`, ``ids`` and ``tags``
    (0 ctx, 1 gen, 2 ans per token) are filled in."""

    kind: str  # "fact" | "chat" | "retrieval"
    mode: str  # "plain" | "chat" | "thinking"
    segments: list[tuple[str, str]]
    meta: dict[str, Any] = field(default_factory=dict)
    ids: list[int] | None = None
    tags: list[int] | None = None

    @property
    def text(self) -> str:
        return "".join(t for t, _ in self.segments)

    def __len__(self) -> int:
        if self.ids is None:
            raise ValueError("sample is not tokenised")
        return len(self.ids)

    def answer_positions(self) -> list[int]:
        return [i for i, t in enumerate(self.tags or []) if t == 2]

    def mask(self, loss_on: str = "answer") -> list[bool]:
        """Per-token loss mask: ``"answer"`` (scored answer tokens), ``"generated"`` (answers
        plus everything the assistant generates), ``"all"`` (every token but the first)."""
        if self.tags is None:
            raise ValueError("sample is not tokenised")
        if loss_on == "answer":
            m = [t == 2 for t in self.tags]
        elif loss_on == "generated":
            m = [t >= 1 for t in self.tags]
        elif loss_on == "all":
            m = [True] * len(self.tags)
        else:
            raise ValueError(f"loss_on must be 'answer', 'generated' or 'all', not {loss_on!r}")
        if m:
            m[0] = False
        return m


def _backend(tokenizer):
    """A ``tokenizers.Tokenizer`` from a transformers fast tokenizer or the thing itself."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None) or tokenizer


def tokenize_sample(tokenizer, sample: Sample) -> Sample:
    """Tokenise ``sample`` in place (one encode of the whole text; per-token tags from the
    character offsets) and return it.  Raises if an answer does not start on a token boundary."""
    tok = _backend(tokenizer)
    text = sample.text
    enc = tok.encode(text, add_special_tokens=False)
    starts, tags, pos = [], [], 0
    for seg, tag in sample.segments:
        starts.append(pos)
        tags.append(_TAG_ID[tag])
        pos += len(seg)
    tok_tags = []
    tok_starts = set()
    for (s, e) in enc.offsets:
        tok_starts.add(s)
        tok_tags.append(tags[bisect.bisect_right(starts, s) - 1])
    for (seg, tag), s in zip(sample.segments, starts):
        if tag == ANS and s not in tok_starts:
            raise ValueError(f"answer {seg!r} does not start on a token boundary in {text[:80]!r}...")
    sample.ids = list(enc.ids)
    sample.tags = tok_tags
    if sample.kind == "retrieval":
        _retrieval_positions(sample, enc.offsets, starts)
    return sample


# --------------------------------------------------------------------------------------------
# facts and chat
# --------------------------------------------------------------------------------------------

def _fact_paragraph(rng: random.Random, world: ToyWorld, n_sent: int) -> list[tuple[str, str]]:
    segs: list[tuple[str, str]] = [(BOS, CTX)]
    for j in range(n_sent):
        c = rng.choice(world.countries)
        # the capital (and the probe template) is the most important relation: weight it up
        rel = "capital" if rng.random() < 0.4 else rng.choice(RELATIONS)
        if rel in _REVERSED_TEMPLATES and rng.random() < 0.15:
            pre, ans, post = world.fact(c, rel, -1)
        else:
            t = 0 if rng.random() < 0.5 else rng.randrange(world.n_templates(rel))
            pre, ans, post = world.fact(c, rel, t)
        sp = "" if j == 0 else " "
        if pre:
            segs += [(sp + pre, CTX), (ans, ANS), (post, CTX)]
        else:  # reversed: the answer opens the sentence
            segs += [(sp + ans.strip(), ANS), (post, CTX)]
    segs.append((EOS, CTX))
    return segs


def make_fact_samples(n: int, seed: int = 0, world: ToyWorld | None = None, tokenizer=None,
                      max_sentences: int = 4) -> list[Sample]:
    """``n`` plain-text paragraphs of 1..max_sentences fact sentences (BOS ... EOS)."""
    world = world or ToyWorld()
    rng = random.Random(f"facts-{seed}")
    out = []
    for _ in range(n):
        s = Sample("fact", "plain", _fact_paragraph(rng, world, rng.randint(1, max_sentences)))
        out.append(tokenize_sample(tokenizer, s) if tokenizer is not None else s)
    return out


def _chat_sample(world: ToyWorld, mode: str, c: Country, rel: str, qvar: int,
                 history: list[tuple[Country, str, int]] = (), system: str | None = None,
                 reasoning_effort: str | None = None) -> Sample:
    msgs: list[dict[str, str]] = []
    if system:
        msgs.append({"role": "system", "content": system})
    for hc, hrel, hq in history:
        r_pre, r_ans, r_post = world.reasoning(hc, hrel)
        msgs += [{"role": "user", "content": world.question(hc, hrel, hq)},
                 {"role": "assistant", "content": hc.get(hrel), "reasoning_content": r_pre + r_ans + r_post}]
    msgs.append({"role": "user", "content": world.question(c, rel, qvar)})
    prompt = encode_messages(msgs, mode, reasoning_effort=reasoning_effort)
    segs: list[tuple[str, str]] = []
    # mark the answers of earlier assistant turns too (they are answers the model produced)
    rest = prompt
    for hc, hrel, _ in history:
        marker = ASSISTANT + THINK_END + hc.get(hrel) + EOS
        i = rest.index(marker) + len(ASSISTANT + THINK_END)
        segs += [(rest[:i], CTX), (hc.get(hrel), ANS), (EOS, GEN)]
        rest = rest[i + len(hc.get(hrel)) + len(EOS):]
    segs.append((rest, CTX))
    answer = c.get(rel)
    if mode == "thinking":
        r_pre, r_ans, r_post = world.reasoning(c, rel)
        segs += [(r_pre, GEN), (r_ans, ANS), (r_post + THINK_END, GEN)]
    segs += [(answer, ANS), (EOS, GEN)]
    meta = {"country": c.name, "relation": rel, "answer": answer, "n_turns": len(history) + 1,
            "system": system, "reasoning_effort": reasoning_effort}
    return Sample("chat", mode, segs, meta)


def make_chat_samples(n: int, seed: int = 0, world: ToyWorld | None = None, tokenizer=None,
                      modes: Sequence[str] = ("chat", "thinking"), p_system: float = 0.2,
                      p_multiturn: float = 0.15, p_effort_max: float = 0.03) -> list[Sample]:
    """``n`` question/answer conversations in the DSV4 chat encoding, alternating over
    ``modes``; the assistant answers with the bare word (``"Paris"``) then EOS, after a short
    reasoning and ``</think>`` in thinking mode."""
    world = world or ToyWorld()
    rng = random.Random(f"chat-{seed}")
    out = []
    for i in range(n):
        mode = modes[i % len(modes)]
        c = rng.choice(world.countries)
        rel = "capital" if rng.random() < 0.5 else rng.choice(RELATIONS)
        qvar = 0 if rng.random() < 0.5 else rng.randrange(world.n_questions(rel))
        hist = []
        if rng.random() < p_multiturn:
            hrel = rng.choice(RELATIONS)
            hist.append((rng.choice(world.countries), hrel, rng.randrange(world.n_questions(hrel))))
        system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < p_system else None
        effort = "max" if mode == "thinking" and rng.random() < p_effort_max else None
        s = _chat_sample(world, mode, c, rel, qvar, hist, system, effort)
        out.append(tokenize_sample(tokenizer, s) if tokenizer is not None else s)
    return out


# --------------------------------------------------------------------------------------------
# retrieval documents
# --------------------------------------------------------------------------------------------

_PRETOK = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def _est_tokens(text: str) -> int:
    """Token estimate without a tokenizer (pre-token count: the filler words are single tokens)."""
    return len(_PRETOK.findall(text))


def _retrieval_positions(sample: Sample, offsets, seg_starts) -> None:
    """Fill meta["queries"][i]["plant_pos" / "answer_pos" / "distance"] from token offsets."""
    tok_starts = {s: i for i, (s, _) in enumerate(offsets)}
    for q in sample.meta.get("queries", []):
        q["plant_pos"] = tok_starts[seg_starts[q["plant_seg"]]]
        q["answer_pos"] = tok_starts[seg_starts[q["answer_seg"]]]
        q["distance"] = q["answer_pos"] - q["plant_pos"]
        if "final_seg" in q:
            q["final_pos"] = tok_starts[seg_starts[q["final_seg"]]]
            q["final_distance"] = q["final_pos"] - q["plant_pos"]


def _estimate_positions(sample: Sample) -> None:
    pos, seg_pos = 0, []
    for t, _ in sample.segments:
        seg_pos.append(pos)
        pos += 1 if t in (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END) else _est_tokens(t)
    for q in sample.meta.get("queries", []):
        q["plant_pos"], q["answer_pos"] = seg_pos[q["plant_seg"]], seg_pos[q["answer_seg"]]
        q["distance"] = q["answer_pos"] - q["plant_pos"]
    sample.meta["est_len"] = pos


def _assemble_retrieval(mode: str, pre: list, mid: list, pairs: list[tuple[str, str]],
                        queried: list[int]) -> Sample:
    """pre / mid: lists of ("filler", text) or ("plant", pair_index); the first queried pair's
    plant sits between pre and mid.  Returns the tagged sample (positions filled later)."""
    segs: list[tuple[str, str]] = []
    plant_seg: dict[int, int] = {}
    first = True

    def add_text(t: str, tag: str = CTX) -> None:
        nonlocal first
        segs.append(((t if first else " " + t), tag))
        first = False

    def add_plant(i: int) -> None:
        k, v = pairs[i]
        add_text(_PLANT[0].format(k=k))
        plant_seg[i] = len(segs)
        segs.append((" " + v, CTX))  # the planted value is context (unpredictable)
        segs.append((_PLANT[1], CTX))

    items = pre + [("plant", queried[0])] + mid
    head: list[tuple[str, str]] = []
    if mode == "plain":
        head = [(BOS, CTX)]
    else:  # the document is the user turn of a conversation
        head = [(BOS + USER, CTX)]
    segs += head
    for kind, x in items:
        if kind == "plant":
            add_plant(x)
        else:
            add_text(x)
    queries = []
    if mode == "plain":
        for i in queried:
            k, v = pairs[i]
            add_text(_QUERY_PLAIN[0].format(k=k))
            queries.append({"key": k, "value": v, "plant_seg": plant_seg[i], "answer_seg": len(segs)})
            segs += [(" " + v, ANS), (_QUERY_PLAIN[1], CTX)]
        segs.append((EOS, CTX))
    else:
        k, v = pairs[queried[0]]
        segs.append((" " + _QUESTION_CHAT.format(k=k), CTX))
        q: dict[str, Any] = {"key": k, "value": v, "plant_seg": plant_seg[queried[0]]}
        if mode == "thinking":
            segs.append((ASSISTANT + THINK_START, CTX))
            segs.append((_REASONING_RETRIEVAL[0].format(k=k), GEN))
            q["answer_seg"] = len(segs)
            segs += [(" " + v, ANS), (_REASONING_RETRIEVAL[1] + THINK_END, GEN)]
        else:
            segs.append((ASSISTANT + THINK_END, CTX))
        segs.append((_ANSWER_CHAT[0].format(k=k), GEN))
        q["final_seg" if mode == "thinking" else "answer_seg"] = len(segs)
        segs += [(" " + v, ANS), (_ANSWER_CHAT[1], GEN), (EOS, GEN)]
        queries.append(q)
    meta = {"pairs": [list(p) for p in pairs], "queries": queries, "n_pairs": len(pairs)}
    return Sample("retrieval", mode, segs, meta)


def _retrieval_doc(rng: random.Random, world: ToyWorld, mode: str, distance: int, max_len: int,
                   n_pairs: int, n_queries: int, tokenizer=None, filler_facts: float = 0.5) -> Sample | None:
    """One retrieval document whose (first) query is at least ``distance`` tokens after its
    plant, at most ``max_len`` tokens long; None if that does not fit."""
    n_queries = 1 if mode != "plain" else max(1, min(n_queries, n_pairs))
    idx = rng.sample(range(len(KEYS)), n_pairs)
    vidx = rng.sample(range(len(VALUES)), n_pairs)
    pairs = [(KEYS[a], VALUES[b]) for a, b in zip(idx, vidx)]
    queried = list(range(n_queries))  # pairs are already in random order
    pre: list[tuple[str, Any]] = [("filler", make_filler(rng, world, filler_facts)) for _ in range(rng.randint(0, 3))]
    for i in queried[1:]:  # further queried plants go before the first one: they are farther away
        pre.insert(rng.randint(0, len(pre)), ("plant", i))
    mid: list[tuple[str, Any]] = []
    distractors = [i for i in range(n_pairs) if i not in queried]
    for i in distractors:  # before or after the queried plant
        if rng.random() < 0.5:
            pre.insert(rng.randint(0, len(pre)), ("plant", i))
        else:
            mid.append(("plant", i))
    # grow the middle filler until the first query is far enough
    for _ in range(200):
        s = _assemble_retrieval(mode, pre, mid, pairs, queried)
        _estimate_positions(s)
        if s.meta["queries"][0]["distance"] >= distance:
            break
        mid.insert(rng.randint(0, len(mid)), ("filler", make_filler(rng, world, filler_facts)))
    for _ in range(50):  # exact check and repair with the real tokenizer
        s = _assemble_retrieval(mode, pre, mid, pairs, queried)
        if tokenizer is None:
            _estimate_positions(s)
            n_tok = s.meta["est_len"]
        else:
            tokenize_sample(tokenizer, s)
            n_tok = len(s.ids)
        d = min(q["distance"] for q in s.meta["queries"])
        if d < distance:
            mid.insert(rng.randint(0, len(mid)), ("filler", make_filler(rng, world, filler_facts)))
            continue
        if n_tok > max_len:
            fillers = [j for j, (k, _) in enumerate(pre) if k == "filler"]
            if not fillers:
                return None
            pre.pop(fillers[-1])
            continue
        s.meta["target_distance"] = distance
        return s
    return None


def make_retrieval_samples(n: int, seq_len: int = 512, min_distance: int = DEFAULT_MIN_DISTANCE,
                           seed: int = 0, *, max_distance: int | None = None, tokenizer=None,
                           modes: Sequence[str] = ("plain", "chat", "thinking"),
                           n_pairs: tuple[int, int] = (2, 4), n_queries: tuple[int, int] = (1, 2),
                           world: ToyWorld | None = None) -> list[Sample]:
    """``n`` retrieval documents (cycling over ``modes``), each at most ``seq_len`` tokens, whose
    queries are at least ``min_distance`` tokens (exact with a tokenizer, estimated without)
    after their planted pair; target distances are uniform in [min_distance, max_distance]
    (default: as far as ``seq_len`` allows).  ``meta["queries"]`` holds key, value, distance."""
    world = world or ToyWorld()
    rng = random.Random(f"retrieval-{seed}")
    overhead = 96
    hi = max_distance if max_distance is not None else seq_len - overhead
    hi = max(min_distance, min(hi, seq_len - overhead))
    out: list[Sample] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 20 * n + 100:
            raise RuntimeError("cannot fit retrieval documents: raise seq_len or lower min_distance")
        mode = modes[len(out) % len(modes)]
        d = rng.randint(min_distance, hi)
        s = _retrieval_doc(rng, world, mode, d, seq_len, rng.randint(*n_pairs), rng.randint(*n_queries), tokenizer)
        if s is not None:
            out.append(s)
    return out


# --------------------------------------------------------------------------------------------
# the training stream
# --------------------------------------------------------------------------------------------

#: Share of training tokens per sample kind (retrieval 45% in all).
DEFAULT_MIX = {
    "fact_plain": 0.15,
    "fact_chat": 0.10,
    "fact_thinking": 0.10,
    "retrieval_plain": 0.25,
    "retrieval_chat": 0.10,
    "retrieval_thinking": 0.10,
    "repeat_plain": 0.20,
}


def _repeat_doc(rng: random.Random, world: ToyWorld, distance: int, max_len: int, tokenizer) -> Sample | None:
    """Dense induction signal: a random run of code words/numbers, filler, then the same run
    again with loss on every repeated token after the first. Key/value retrieval is a one-token
    case of the same circuit; this teaches it with ~20 supervised copies per document instead of
    one (a model trained on retrieval answers alone never formed it)."""
    n = rng.randint(6, 20)
    run = rng.sample(list(KEYS) + list(VALUES), n)
    segs: list[tuple[str, str]] = [(BOS, CTX), ("Sequence:", CTX)] + [(" " + w, CTX) for w in run] + [(".", CTX)]
    fill: list[str] = []
    for _ in range(100):
        s = Sample("repeat", "plain", segs + [(" " + f, CTX) for f in fill] + [(" Again:", CTX)]
                   + [(" " + run[0], CTX)] + [(" " + w, GEN) for w in run[1:]] + [(".", CTX), (EOS, CTX)],
                   {"run": run})
        tokenize_sample(tokenizer, s)
        if len(s.ids) > max_len:
            return None if not fill else _drop_last(s, fill, segs, run, tokenizer, max_len)
        if len(s.ids) - 2 * (n + 3) >= distance:
            return s
        fill.append(make_filler(rng, world, 0.5))
    return s


def _drop_last(s: Sample, fill: list[str], segs, run, tokenizer, max_len: int) -> Sample | None:
    while fill:
        fill.pop()
        s = Sample("repeat", "plain", segs + [(" " + f, CTX) for f in fill] + [(" Again:", CTX)]
                   + [(" " + run[0], CTX)] + [(" " + w, GEN) for w in run[1:]] + [(".", CTX), (EOS, CTX)],
                   {"run": run})
        tokenize_sample(tokenizer, s)
        if len(s.ids) <= max_len:
            return s
    return None


class DistanceSampler:
    """Retrieval distances: with probability ``long_fraction`` uniform in [long_min, hi]
    (beyond the sliding window), else log-uniform in [lo, hi].  With ``curriculum_steps`` > 0,
    ``hi`` ramps linearly from ``start_hi`` to ``hi`` over that many packed sequences."""

    def __init__(self, lo: int = 8, hi: int = 416, long_min: int = DEFAULT_MIN_DISTANCE,
                 long_fraction: float = 0.5, curriculum_steps: int = 0, start_hi: int = 48):
        self.lo, self.hi, self.long_min, self.long_fraction = lo, hi, long_min, long_fraction
        self.curriculum_steps, self.start_hi = curriculum_steps, start_hi

    def current_hi(self, step: int) -> int:
        if self.curriculum_steps <= 0 or step >= self.curriculum_steps:
            return self.hi
        return int(self.start_hi + (self.hi - self.start_hi) * step / self.curriculum_steps)

    def __call__(self, rng: random.Random, step: int, cap: int) -> int:
        hi = max(self.lo, min(self.current_hi(step), cap))
        if hi >= self.long_min and rng.random() < self.long_fraction:
            return rng.randint(self.long_min, hi)
        return int(round(math.exp(rng.uniform(math.log(self.lo), math.log(hi)))))


def _make_one(kind: str, rng: random.Random, world: ToyWorld, tokenizer, room: int, step: int,
              sampler: Callable[[random.Random, int, int], int]) -> Sample | None:
    group, mode = kind.split("_")
    if group == "fact" and mode == "plain":
        s = Sample("fact", "plain", _fact_paragraph(rng, world, rng.randint(1, 4)))
        return tokenize_sample(tokenizer, s)
    if group == "fact":
        c = rng.choice(world.countries)
        rel = "capital" if rng.random() < 0.5 else rng.choice(RELATIONS)
        qvar = 0 if rng.random() < 0.5 else rng.randrange(world.n_questions(rel))
        hist = []
        if rng.random() < 0.15:
            hrel = rng.choice(RELATIONS)
            hist.append((rng.choice(world.countries), hrel, rng.randrange(world.n_questions(hrel))))
        system = rng.choice(_SYSTEM_PROMPTS) if rng.random() < 0.2 else None
        effort = "max" if mode == "thinking" and rng.random() < 0.03 else None
        return tokenize_sample(tokenizer, _chat_sample(world, mode, c, rel, qvar, hist, system, effort))
    overhead = 40 if mode == "plain" else 70
    cap = room - overhead
    if cap < 8:
        return None
    d = sampler(rng, step, cap)
    if group == "repeat":
        return _repeat_doc(rng, world, d, room, tokenizer)
    return _retrieval_doc(rng, world, mode, d, room, rng.randint(2, 4), rng.randint(1, 2), tokenizer)


def training_stream(tokenizer, seq_len: int = 512, seed: int = 0, mix: dict[str, float] | None = None,
                    *, loss_on: str = "generated", retrieval_distance: tuple[int, int] | Callable | None = None,
                    total_steps: int | None = None, curriculum_steps: int | None = None,
                    long_fraction: float = 0.5, with_answer_mask: bool = False,
                    world: ToyWorld | None = None) -> Iterator[tuple]:
    """Endless packed training sequences: ``(input_ids LongTensor[seq_len], loss_mask
    BoolTensor[seq_len])`` (plus ``answer_mask`` when ``with_answer_mask``).

    Samples (each BOS ... EOS) are packed whole, never split, so every retrieval distance holds
    inside the sequence; the tail is filled with short fact samples, then PAD (mask False).
    ``loss_mask[t]`` marks the tokens whose prediction (from position t-1) counts:
    ``loss_on="generated"`` (default) the tokens the model can and must produce: every answer
    (fact answers, retrieved values) plus every assistant-generated token (reasoning,
    ``</think>``, answer, EOS) -- not the filler, the planted keys/values or the questions;
    ``"answer"`` the answer tokens only; ``"all"`` every non-PAD token.  ``with_answer_mask``
    adds the answer-only mask as a third tensor (to up-weight or score answers).

    ``mix``: share of tokens per kind (keys of :data:`DEFAULT_MIX`).  ``retrieval_distance``:
    ``(lo, hi)`` or a callable ``(rng, step, cap) -> distance``; default a
    :class:`DistanceSampler` from 8 to ``seq_len - 96`` with ``long_fraction`` of the documents
    at >= 128 tokens.  Curriculum: the longest distance ramps up from 48 over
    ``curriculum_steps`` sequences (default: 40% of ``total_steps``, the number of sequences the
    run will draw, when given; no curriculum otherwise).
    """
    world = world or ToyWorld()
    mix = dict(DEFAULT_MIX if mix is None else mix)
    bad = set(mix) - set(DEFAULT_MIX)
    if bad:
        raise ValueError(f"unknown mix keys {sorted(bad)}; use {sorted(DEFAULT_MIX)}")
    total_w = sum(mix.values())
    mix = {k: v / total_w for k, v in mix.items() if v > 0}
    if callable(retrieval_distance):
        sampler = retrieval_distance
    else:
        lo, hi = retrieval_distance if retrieval_distance is not None else (8, seq_len - 96)
        if curriculum_steps is None:
            curriculum_steps = int(0.4 * total_steps) if total_steps else 0
        sampler = DistanceSampler(lo, hi, long_fraction=long_fraction, curriculum_steps=curriculum_steps)
    pad_id = _backend(tokenizer).token_to_id(PAD)
    rng = random.Random(f"stream-{seed}")
    counts = {k: 0 for k in mix}
    step = 0
    while True:
        ids: list[int] = []
        lmask: list[bool] = []
        amask: list[bool] = []
        failures = 0
        while len(ids) < seq_len and failures < 4:
            room = seq_len - len(ids)
            total = sum(counts.values()) + 1
            kind = max(mix, key=lambda k: mix[k] * total - counts[k])  # largest token deficit
            s = _make_one(kind, rng, world, tokenizer, room, step, sampler)
            if s is None or len(s.ids) > room:
                # does not fit: fill with the shortest kind (a one-sentence fact paragraph)
                s = Sample("fact", "plain", _fact_paragraph(rng, world, 1))
                tokenize_sample(tokenizer, s)
                kind = "fact_plain" if "fact_plain" in counts else kind
                if len(s.ids) > room:
                    failures += 1
                    continue
            ids += s.ids
            lmask += s.mask(loss_on)
            amask += s.mask("answer")
            counts[kind] = counts.get(kind, 0) + len(s.ids)
        n_pad = seq_len - len(ids)
        ids += [pad_id] * n_pad
        lmask += [False] * n_pad
        amask += [False] * n_pad
        step += 1
        out = (torch.tensor(ids, dtype=torch.long), torch.tensor(lmask, dtype=torch.bool))
        yield out + (torch.tensor(amask, dtype=torch.bool),) if with_answer_mask else out


def training_dataset(tokenizer, seq_len: int = 512, seed: int = 0, **kwargs):
    """A ``torch.utils.data.IterableDataset`` over :func:`training_stream` (same keyword
    arguments); each DataLoader worker gets its own seed, ``seed * 1000 + worker_id``."""
    class _TrainingStream(tud.IterableDataset):
        def __iter__(self):
            info = tud.get_worker_info()
            wseed = seed if info is None else seed * 1000 + info.id
            return training_stream(tokenizer, seq_len, wseed, **kwargs)

    return _TrainingStream()


# --------------------------------------------------------------------------------------------
# evaluation sets
# --------------------------------------------------------------------------------------------

class Probe(NamedTuple):
    """One exact-match probe ``(prompt_ids, answer_id, meta)``: given ``prompt_ids`` the model
    should predict ``answer_id`` next.  ``meta`` holds ``answer`` (its text), ``mode``, the
    fact (``country``, ``relation``) or retrieval (``key``, ``value``, ``distance``) details, and
    ``gen_prompt_ids`` (the prompt a user would send: it ends ``<think>`` / ``</think>`` in chat
    modes) with ``completion_ids`` (the exact expected greedy completion from it)."""

    prompt_ids: list[int]
    answer_id: int
    meta: dict[str, Any]


def _probe_from_sample(s: Sample, answer_pos: int, gen_prompt_len: int, meta: dict) -> Probe:
    ids = s.ids
    meta = dict(meta, gen_prompt_ids=ids[:gen_prompt_len], completion_ids=ids[gen_prompt_len:])
    return Probe(ids[:answer_pos], ids[answer_pos], meta)


def _gen_start(s: Sample) -> int:
    """Index of the first token after the assistant opener (or the first answer in plain text)."""
    first_gen = [i for i, t in enumerate(s.tags) if t >= 1]
    return first_gen[0]


def eval_sets(tokenizer, seed: int = 1234, *, n_retrieval: int = 48, min_distance: int = DEFAULT_MIN_DISTANCE,
              max_distance: int = 400, seq_len: int = 512, world: ToyWorld | None = None) -> dict[str, list[Probe]]:
    """Exact-match probes ``(prompt_ids, answer_id, meta)``, all prompts starting with BOS.

    * ``facts``: every country, ``"The capital of France is"`` -> ``" Paris"``.
    * ``facts_chat``: ``encode_messages`` of "What is the capital of France?" in chat mode
      (ends ``<｜Assistant｜></think>``) -> ``"Paris"`` (then EOS).
    * ``facts_thinking``: the thinking prompt plus the reasoning and ``</think>`` -> ``"Paris"``;
      ``meta["completion_ids"]`` (from ``meta["gen_prompt_ids"]``, ending ``<think>``) are
      reasoning, ``</think>``, answer, EOS.
    * ``relations`` / ``relations_chat``: continent, language and currency of every country.
    * ``retrieval`` (plain text) / ``retrieval_chat`` / ``retrieval_thinking``: documents whose
      answer is ``min_distance``..``max_distance`` tokens after the planted value
      (``meta["distance"]``, always >= 128 = 4x the sliding window by default).  The chat probe
      teacher-forces the assistant's "The secret code of ALPHA is"; the thinking probe scores the
      value inside the reasoning (the long-range step; the final answer copies it).
    """
    world = world or ToyWorld()
    tok = _backend(tokenizer)
    sets: dict[str, list[Probe]] = {k: [] for k in (
        "facts", "facts_chat", "facts_thinking", "relations", "relations_chat",
        "retrieval", "retrieval_chat", "retrieval_thinking")}
    for c in world.countries:
        for rel in RELATIONS:
            group = "facts" if rel == "capital" else "relations"
            pre, ans, post = world.fact(c, rel, 0)
            s = tokenize_sample(tok, Sample("fact", "plain", [(BOS, CTX), (pre, CTX), (ans, ANS), (post, CTX)]))
            pos = s.answer_positions()[0]
            meta = {"country": c.name, "relation": rel, "answer": ans, "mode": "plain"}
            sets[group].append(_probe_from_sample(s, pos, pos, meta))
            modes = ("chat", "thinking") if rel == "capital" else ("chat",)
            for mode in modes:
                s = tokenize_sample(tok, _chat_sample(world, mode, c, rel, 0))
                pos = s.answer_positions()[-1]  # the final answer (after </think>)
                meta = dict(meta, mode=mode, answer=c.get(rel))
                sets[f"{group}_{mode}"].append(_probe_from_sample(s, pos, _gen_start(s), meta))
    for mode in ("plain", "chat", "thinking"):
        docs = make_retrieval_samples(n_retrieval, seq_len, min_distance, seed, max_distance=max_distance,
                                      tokenizer=tok, modes=(mode,), n_queries=(1, 1), world=world)
        for s in docs:
            q = s.meta["queries"][0]
            pos = q["answer_pos"]
            gen = pos if mode == "plain" else _gen_start(s)
            meta = {"key": q["key"], "value": q["value"], "distance": q["distance"], "mode": mode,
                    "n_pairs": s.meta["n_pairs"], "answer": " " + q["value"]}
            sets["retrieval" if mode == "plain" else f"retrieval_{mode}"].append(_probe_from_sample(s, pos, gen, meta))
    return sets


# --------------------------------------------------------------------------------------------
# text for training the tokenizer
# --------------------------------------------------------------------------------------------

def tokenizer_training_texts(seed: int = 0, n_facts: int = 6000, n_chat: int = 3000,
                             n_retrieval: int = 300, word_repeats: int = 200) -> Iterator[str]:
    """Deterministic text for training the tokenizer: samples of every kind (no tokenizer
    needed, distances estimated) plus each :func:`required_words` entry repeated so BPE learns
    it whole."""
    world = ToyWorld()
    for s in make_fact_samples(n_facts, seed, world):
        yield s.text
    for s in make_chat_samples(n_chat, seed, world):
        yield s.text
    for s in make_retrieval_samples(n_retrieval, 512, 16, seed, world=world):
        yield s.text
    words = required_words(world)
    for _ in range(word_repeats):
        yield "".join(w if w.startswith(" ") else " " + w for w in words)
        yield "\n".join(w.strip() for w in words)
