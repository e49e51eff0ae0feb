"""Reference runs computed once and kept on disk (logits + the captured hook tensors).

A reference run of V4-Pro in ``bf16`` / ``orig`` streams every dense weight (minutes); the triage
flows ask for the same one again and again (every notebook run, every nightly). So
:func:`cached_reference_run` keys a run by everything that decides its numbers and keeps it as
one safetensors file plus a small JSON manifest:

* the model's checkpoint identity (path + header digest, dsv4lab.checkpoint.identity) and its
  structure (every module's type and every linear's weight format: an in-memory quantisation or
  an injected bug changes the key);
* the reference checkpoint's identity when the policy uses ``orig`` (where the originals come from);
* the prompt ids, the policy, the hook-name set, the model dtype and device types;
* the code that computes the numbers (the sources of dsv4lab.model / quant / kernels) and the
  torch version: a fix to the math must not be answered from yesterday's cache.

In-memory models without a checkpoint path (and ``orig`` sources that are not a checkpoint or a
model loaded from one) are not cached: the run is computed and ``how`` says why it was not kept.
The key does not see weights edited by hand in place: pass ``cache=False`` then. An entry whose
file does not match the digest in its manifest, or does not load, is recomputed, never trusted.

Where: ``cache=`` a directory, else ``$DSV4LAB_CACHE``, else ``$XDG_CACHE_HOME/dsv4lab`` (default
``~/.cache/dsv4lab``); entries live under ``reference_runs/``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..analysis.cache import ActivationCache, caching_hook
from ..checkpoint.identity import checkpoint_identity
from ..quant.modes import Mode
from .apply import CheckpointOriginals, ModelOriginals, Originals
from .policy import PrecisionPolicy
from .sweep import SWEEP_HOOKS, ReferenceRun, reference_run

CACHE_ENV = "DSV4LAB_CACHE"
FORMAT_VERSION = 1
SUBDIR = "reference_runs"
CODE_PACKAGES = ("model", "quant", "kernels")


def cache_dir(cache: "bool | str | os.PathLike | None" = True) -> Path | None:
    """The directory entries go to (None: caching off). ``cache``: True (``$DSV4LAB_CACHE`` or the
    user's cache dir), False / None (off) or a directory."""
    if cache is None or cache is False:
        return None
    if cache is True:
        env = os.environ.get(CACHE_ENV)
        base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv4lab"
        return base / SUBDIR
    if isinstance(cache, (str, os.PathLike)):
        return Path(cache) / SUBDIR
    raise ValueError(f"cache={cache!r}: expected True, False or a directory path")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """The sources of the packages that compute a forward, and the torch version (read once per
    process: every reference request asks for it)."""
    pkg = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for sub in CODE_PACKAGES:
        for f in sorted((pkg / sub).rglob("*.py")):
            h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def structure_digest(model) -> str:
    """Every module's type and every linear's weight format (cheap: no tensor is read)."""
    h = hashlib.sha256()
    for name, mod in model.named_modules():
        h.update(f"{name}:{type(mod).__module__}.{type(mod).__qualname__};".encode())
    for name, ql in model.qlinears():
        h.update(f"{name}={ql.format};".encode())
    return h.hexdigest()


def model_identity(model) -> dict | None:
    """Checkpoint identity + structure of a model loaded from disk; None for an in-memory one."""
    source = getattr(model, "source", None)
    if not source or not os.path.exists(str(source)):
        return None
    return {"checkpoint": checkpoint_identity(source).as_dict(), "structure": structure_digest(model)}


def originals_identity(originals: Originals | None) -> dict | None:
    """Where ``orig`` weights come from, as a key part; None when that cannot be named."""
    if isinstance(originals, CheckpointOriginals):
        return {"checkpoint": checkpoint_identity(originals.reader.root).as_dict(), "dtype": str(originals.dtype)}
    if isinstance(originals, ModelOriginals):
        ident = model_identity(originals.model)
        return None if ident is None else {"model": ident, "dtype": str(originals.model.dtype)}
    return None


def reference_key(model, ids: torch.Tensor, policy, originals: Originals | None = None,
                  names=tuple(SWEEP_HOOKS)) -> tuple[str | None, dict | str]:
    """(digest, its parts) of a reference run, or (None, why it cannot be cached)."""
    policy = PrecisionPolicy.parse(policy)
    names = (names,) if isinstance(names, str) else tuple(names)
    ident = model_identity(model)
    if ident is None:
        return None, "not cached: in-memory model without a checkpoint path"
    parts = {"version": FORMAT_VERSION, "model": ident, "policy": policy.describe(),
             "ids": {"shape": list(ids.shape),
                     "sha256": _sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())},
             "names": sorted(names), "dtype": str(model.dtype),
             "devices": sorted({torch.device(d).type for d in model.layer_devices()}), "code": code_digest()}
    if policy.uses(Mode.ORIG):
        ref = originals_identity(originals)
        if ref is None:
            return None, f"not cached: the orig source {type(originals).__name__} has no checkpoint identity"
        parts["reference"] = ref
    return _sha256(json.dumps(parts, sort_keys=True).encode()), parts


def _paths(root: Path, key: str) -> tuple[Path, Path]:
    return root / f"{key}.safetensors", root / f"{key}.json"


def read_entry(root: Path, key: str, parts: dict) -> tuple[ReferenceRun | None, str]:
    """(the cached run, "") or (None, why not: absent / which check failed)."""
    tensors_path, manifest_path = _paths(root, key)
    if not manifest_path.is_file():
        return None, "absent"
    try:
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("key") != parts:
            return None, "manifest key differs"
        if _file_sha256(tensors_path) != manifest["sha256"]:
            return None, "file digest differs from its manifest"
        tensors = load_file(str(tensors_path))
        cache = ActivationCache()
        _, add = caching_hook(cache, names=None, device="cpu", clone=False)   # the public way in
        for j, name in enumerate(manifest["entries"]):
            add(tensors[f"t{j}"], name)
        cache.order = list(manifest["order"])
        cache.steps = list(manifest["steps"])
        cache.skipped = list(manifest["skipped"])
        cache.reduced = dict(manifest["reduced"])
        logits = tensors["logits"]
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:   # a damaged entry
        return None, f"unreadable ({type(e).__name__}: {e})"
    return ReferenceRun(logits, cache, bool(manifest["streamed"]),
                        f"cache hit {tensors_path.name} (computed {manifest['how']})"), ""


def write_entry(root: Path, key: str, parts: dict, run: ReferenceRun) -> None:
    """Tensors first, then the manifest (each written under a temporary name and renamed): a
    half-written entry has no manifest, or a manifest whose digest does not match."""
    entries, tensors = [], {"logits": run.logits.contiguous()}
    for name in run.cache:
        for v in run.cache.all(name):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"hook {name!r} captured a {type(v).__name__}, not a tensor")
            tensors[f"t{len(entries)}"] = v.contiguous()
            entries.append(name)
    root.mkdir(parents=True, exist_ok=True)
    tensors_path, manifest_path = _paths(root, key)
    tmp = tensors_path.with_name(f".{key}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp))
    digest = _file_sha256(tmp)
    os.replace(tmp, tensors_path)
    manifest = {"key": parts, "sha256": digest, "entries": entries, "order": run.cache.order,
                "steps": run.cache.steps, "skipped": run.cache.skipped, "reduced": run.cache.reduced,
                "streamed": run.streamed, "how": run.how}
    tmp = manifest_path.with_name(f".{key}.{os.getpid()}.json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, manifest_path)


@torch.no_grad()
def cached_reference_run(model, ids: torch.Tensor, policy=Mode.BF16, originals: Originals | None = None,
                         cache: "bool | str | os.PathLike | None" = True, streaming="auto",
                         free: "int | dict | None" = None, names=tuple(SWEEP_HOOKS)) -> ReferenceRun:
    """The reference run of ``model`` under ``policy`` on ``ids`` (dsv4lab.precision.sweep.reference_run,
    streamed when the dense weights do not fit), read from the on-disk cache when an identical one
    was computed before, else computed and stored. ``how`` says which, and why not cached."""
    root = cache_dir(cache)
    if root is None:
        return reference_run(model, ids, policy, originals, streaming, free, names)
    key, parts = reference_key(model, ids, policy, originals, names)
    if key is None:
        run = reference_run(model, ids, policy, originals, streaming, free, names)
        run.how += f"; {parts}"
        return run
    hit, why = read_entry(root, key, parts)
    if hit is not None:
        return hit
    if why != "absent":
        warnings.warn(f"cached reference run {key[:12]} in {root} not used ({why}): recomputing it", stacklevel=2)
    run = reference_run(model, ids, policy, originals, streaming, free, names)
    try:
        write_entry(root, key, parts, run)
        run.how += f"; cached as {key[:12]}" + ("" if why == "absent" else f" (recomputed: cached entry {why})")
    except (OSError, TypeError, RuntimeError) as e:
        warnings.warn(f"reference run not cached in {root}: {e}", stacklevel=2)
        run.how += f"; not cached ({e})"
    return run


__all__ = ["CACHE_ENV", "cache_dir", "cached_reference_run", "code_digest", "model_identity", "originals_identity",
           "read_entry",
           "reference_key", "structure_digest", "write_entry"]
