"""Open the model a triage notebook works on, with its tokenizer and the probe encodings.

``open_session(MODEL, DEVICE)``: ``None``/``"tiny"`` = the embedded model in ``data/tiny-dsv4``
(falls back to seeded random weights of the same architecture, flagged ``trained=False``, while
the trained checkpoint is not there); ``"random"`` = that fallback on purpose; anything else a
checkpoint path for :func:`dsv4lab.load`. ``reference=PATH``: a second checkpoint holding the
original weights (official FP8 + MXFP4, or BF16): ``orig`` reads them from it one linear at a
time (:meth:`Originals.from_checkpoint`), so no second model is held in memory. Without one, a
checkpoint whose originals are known (``checkpoint.locate.originals_of``: the embedded NVFP4
export, an export written by ``checkpoint.synth.quantize_checkpoint``) gets them: otherwise a
quantised checkpoint could only be compared with its own weights dequantised (KL 0 by construction).
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..checkpoint.locate import TINY_DIR, originals_of, quantized_from, resolve_path
from ..loading import load, materialize
from ..model.validate import check_new_tokens
from ..plan import plan
from ..precision import Originals, quantize_linears
from ..quant.fp4 import NVFP4_BLOCK
from ..quant.weights import quantize_nvfp4
from ..text import load_tokenizer
from ..text.chat import encode_prompt
from ..text.corpus import make_filler
from ..train.tiny_config import tiny_dsv4_config
from ..workbench import random_model

MODES = ("plain", "chat", "thinking")


@dataclass
class Session:
    model: object
    tokenizer: object
    source: str                 # what was loaded (path or "random:...")
    trained: bool               # the embedded trained model (behaviour metrics are meaningful)
    path: Path | None = None    # checkpoint directory when loaded from disk
    notes: list = field(default_factory=list)
    reference: Path | None = None  # checkpoint of the original weights (``orig`` source), if given

    def originals(self) -> Originals | None:
        """The ``orig`` source read from the reference checkpoint (None without one)."""
        if self.reference is None:
            return None
        return Originals.from_checkpoint(self.reference, self.model.dtype)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self):
        return self.model.device

    # ------------------------------------------------------------------ text
    def prompt_text(self, prompt, mode: str = "plain", **kw) -> str:
        return encode_prompt(prompt, mode, **kw)

    def encode(self, prompt, mode: str = "plain", **kw) -> torch.Tensor:
        """Token ids [1, S] of ``prompt`` encoded in ``mode`` (plain / chat / thinking)."""
        ids = self.tokenizer.encode(self.prompt_text(prompt, mode, **kw), add_special_tokens=False)
        return torch.tensor([list(ids)], dtype=torch.long, device=self.device)

    def token_id(self, text: str) -> int | None:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def tok(self, i: int) -> str:
        """Readable text of one token id (leading space shown as a space)."""
        return self.tokenizer.decode([int(i)])

    def toks(self, ids) -> list[str]:
        return [self.tok(i) for i in (ids.flatten().tolist() if hasattr(ids, "flatten") else ids)]

    def describe(self) -> str:
        c = self.config
        n = sum(p.numel() for p in self.model.parameters() if p is not None)
        state = "trained" if self.trained else "RANDOM WEIGHTS (behaviour checks are meaningless)"
        return (f"{self.source}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {c.n_routed_experts} experts "
                f"top-{c.num_experts_per_tok}, vocab {c.vocab_size}, {n / 1e6:.1f}M params on {self.device} [{state}]")


def embedded_dir() -> Path:
    return TINY_DIR


def embedded_available() -> bool:
    d = embedded_dir()
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def random_tiny(tokenizer=None, seed: int = 0, device="cpu", dtype=torch.float32):
    vocab = len(tokenizer) if tokenizer is not None else 2048
    return random_model(tiny_dsv4_config(vocab), seed=seed, dtype=dtype, device=device)


def set_threads(device: str = "cpu", threads: int | None = None) -> int:
    """CPU thread count for torch: 1 by default on CPU. The tiny model's ops are too small to
    gain from threads, and on a shared 2-core box oversubscribed OpenMP threads made forwards
    ~100x slower (measured: 2 s vs 20 ms)."""
    if str(device).startswith("cpu"):
        n = threads or 1
        torch.set_num_threads(n)
        return n
    return torch.get_num_threads()


def session_dtype(model, device: str, dtype) -> torch.dtype:
    """``dtype="auto"``: fp32 for the embedded model and on CPU (the blessed baselines are fp32),
    bf16 for a checkpoint on CUDA -- a full-size model's BF16 tensors (embedding, head, norms,
    ``orig`` weights) would take twice their memory in fp32, and bf16 is what the release runs."""
    if dtype != "auto":
        return dtype
    name = None if model is None or not isinstance(model, (str, Path)) else str(model)
    embedded = name in (None, "tiny", "random", "tiny-nvfp4")
    return torch.float32 if embedded or not str(device).startswith("cuda") else torch.bfloat16


def session_device(model, device, gpus: int | None = None, gpu_memory=None, context: int = 65536):
    """``device="auto"``: where a notebook's model goes. CPU without CUDA; one CUDA device when one
    is visible or the model is the embedded one; for a checkpoint over several visible GPUs the
    device map of :func:`dsv4lab.plan` (headers only) with each GPU's own memory, so notebooks
    run unchanged on 1..8 GPUs. Anything else is returned as given."""
    if str(device) != "auto":
        return device
    n = torch.cuda.device_count() if gpus is None else int(gpus)
    if n == 0:
        return "cpu"
    name = None if model is None or not isinstance(model, (str, Path)) else str(model)
    if n == 1 or name in (None, "tiny", "random", "tiny-nvfp4"):
        return "cuda"
    if gpu_memory is None:
        gpu_memory = [torch.cuda.get_device_properties(i).total_memory for i in range(n)]
    return plan(str(resolve_path(name)), gpus=n, gpu_memory=gpu_memory, context=context).device_map()


def open_session(model=None, device: str = "cpu", dtype="auto", progress: bool = False,
                 threads: int | None = None, reference: str | Path | None = None) -> Session:
    """The model a notebook works on: ``device`` a device, a device map, or ``"auto"``
    (:func:`session_device`); ``dtype="auto"``: :func:`session_dtype`; ``reference``: the
    checkpoint of the original weights (None: :func:`default_reference`)."""
    device = session_device(model, device)
    first = device if not isinstance(device, (dict, list)) else next(iter(device.values() if isinstance(device, dict) else device))
    set_threads(str(first), threads)
    ref = default_reference(model) if reference is None else resolve_path(str(reference))
    session = _open(model, device, session_dtype(model, str(first), dtype), progress)
    session.reference = ref
    return session


def default_reference(model) -> Path | None:
    """The reference checkpoint of ``model`` when none is given: its originals when they are known
    (``checkpoint.locate.originals_of``), else None (an in-memory model, random weights, a release)."""
    if model is not None and not isinstance(model, (str, Path)) or str(model) == "random":
        return None
    return originals_of(model)


def _open(model, device, dtype, progress: bool) -> Session:
    if model is not None and not isinstance(model, (str, Path)):  # an already built model
        tok = load_tokenizer()
        return Session(model, tok, getattr(model, "source", "in-memory model"), True)
    name = None if model is None else str(model)
    if name in (None, "tiny") and not embedded_available():
        warnings.warn("the embedded model (data/tiny-dsv4) is not there yet: using seeded random weights", stacklevel=2)
        name = "random"
    if name == "random":
        tok = load_tokenizer()
        m = random_tiny(tok, device=device, dtype=dtype)
        return Session(m, tok, "random:tiny-dsv4-architecture(seed 0)", False,
                       notes=["embedded trained model absent: random weights"])
    path = resolve_path(name)
    placed = {"device_map": device} if isinstance(device, (dict, list)) else {"device": device}
    m = load(name, dtype=dtype, progress=progress, **placed)
    tok_dir = path if (path / "tokenizer.json").is_file() else (path.parent if (path.parent / "tokenizer.json").is_file() else None)
    tok = load_tokenizer(tok_dir)
    # the embedded weights, as shipped or quantised (its NVFP4 export, a quantize_checkpoint export of it)
    trained = embedded_dir().resolve() in (path.resolve(), (quantized_from(path) or path).resolve())
    return Session(m, tok, str(path), trained, path=path)


def quantized_twin(session: Session):
    """The model under test in NVFP4 next to the session's (reference) model.

    When the session holds plain weights: the embedded NVFP4 export if the session is the
    embedded model and the export exists, else the checkpoint (or seeded random weights) built
    again and quantised in memory (ModelOpt recipe); a model handed in already built gets a
    twin that shares all its non-linear tensors (:func:`nvfp4_twin`). When the session model is
    already quantised it is returned as is (``reference_of`` runs it in ``bf16``)."""
    m = session.model
    if any(ql.quantized for _, ql in m.qlinears()):
        return m
    nv = embedded_dir() / "nvfp4"
    if session.trained and session.path is not None and session.path.resolve() == embedded_dir().resolve() \
            and (nv / "config.json").is_file():
        return load("tiny-nvfp4", device=m.device, dtype=m.dtype, progress=False)
    if session.path is not None:
        q = load(str(session.path), device=m.device, dtype=m.dtype, progress=False)
    elif session.source.startswith("random:"):
        q = random_tiny(session.tokenizer, device=m.device, dtype=m.dtype)
    else:
        return nvfp4_twin(m)
    quantize_linears(q, fmt="nvfp4")
    return q


def nvfp4_twin(model):
    """A second model whose linears are ``model``'s weights quantised to NVFP4 (ModelOpt recipe)
    and whose every other tensor IS ``model``'s (same storage): the only new memory is the FP4
    weights, never a copy of the model. Linears whose in_features do not block by 16 share too."""
    linears = dict(model.qlinears())
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def weight(base: str, device):
        w = linears[base].weight.detach()
        return quantize_nvfp4(w.float()) if linears[base].in_features % NVFP4_BLOCK == 0 else w

    return materialize(model.config, weight, lambda name, device: tensors[name].detach(), dtype=model.dtype,
                       layer_devices=model.layer_devices(), progress=False)


def reference_of(session: Session, model_q):
    """The model whose ``bf16`` run is the reference for ``model_q``: the session model if it
    holds plain weights, else ``model_q`` itself (its ``bf16`` mode runs the dequantised weights:
    what a dequantised copy would, without the copy). With a reference checkpoint the reference
    is ``model_q`` under ``orig`` (see :func:`reference_policy`)."""
    if not any(ql.quantized for _, ql in session.model.qlinears()):
        return session.model
    return model_q


def reference_policy(session: Session, model_q) -> str:
    """The policy the reference model runs under: ``orig`` (weights of the reference checkpoint)
    when the session has one and ``model_q`` is quantised, else ``bf16``."""
    quantised = any(ql.quantized for _, ql in model_q.qlinears())
    return "orig" if session.reference is not None and quantised and reference_of(session, model_q) is model_q else "bf16"


def filler_prompt(session: Session, n_tokens: int = 96, seed: int = 0) -> torch.Tensor:
    """A deterministic natural-ish prompt of about ``n_tokens`` tokens (facts from the corpus)."""
    check_new_tokens(n_tokens, "n_tokens")
    rng = random.Random(seed)
    text = ""
    while len(session.tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += make_filler(rng)
    ids = session.tokenizer.encode(session.prompt_text(text, "plain"), add_special_tokens=False)[:n_tokens]
    return torch.tensor([ids], dtype=torch.long, device=session.device)
