"""Checks of what a caller hands the model, so a bad input fails at the boundary with ONE error
that names the argument, the bad value and the fix -- not deep inside torch (a reshape of 0
elements, an index out of range on the embedding).
"""
from __future__ import annotations

import numbers

import torch

from ..patterns import did_you_mean
from .state import DecodeState


class InputError(ValueError):
    """A bad argument to a public entry point; the message names the argument and the fix."""


def check_ids(ids, vocab_size: int, device: torch.device, argument: str = "input_ids") -> None:
    """``ids`` must be a 2-D integer tensor [B, S], S >= 1, values in [0, vocab_size), on ``device``."""
    if not isinstance(ids, torch.Tensor):
        raise InputError(f"{argument} must be a torch.Tensor of token ids [B, S], got {type(ids).__name__} "
                         f"(use torch.tensor([[...]]) or the tokenizer's return_tensors='pt')")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"{argument} must hold integer token ids, got dtype {ids.dtype} (use {argument}.long())")
    if ids.dim() != 2:
        fix = f"{argument}.unsqueeze(0) for one sequence" if ids.dim() == 1 else "shape [batch, seq_len]"
        raise InputError(f"{argument} must be 2-D [B, S], got shape {list(ids.shape)} (use {fix})")
    if ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"{argument} is empty (shape {list(ids.shape)}): give at least one sequence of "
                         f"at least one token")
    if ids.device != torch.device(device):
        raise InputError(f"{argument} is on {ids.device} but the model's embedding is on {device} "
                         f"(use {argument}.to(model.device))")
    if ids.device.type == "meta":
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"{argument} holds token id {bad}, outside the vocabulary [0, {vocab_size}) "
                         f"(ids come from this model's tokenizer)")


def check_embeds(x, hidden_size: int, device: torch.device, argument: str = "inputs_embeds") -> None:
    """``x`` must be a floating [B, S, hidden_size] tensor, S >= 1, on ``device``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = type(x).__name__ if not isinstance(x, torch.Tensor) else f"dtype {x.dtype}"
        raise InputError(f"{argument} must be a floating torch.Tensor [B, S, {hidden_size}], got {what}")
    if x.dim() != 3 or x.shape[-1] != hidden_size or x.shape[0] < 1 or x.shape[1] < 1:
        raise InputError(f"{argument} must have shape [B, S, {hidden_size}] with B, S >= 1, got {list(x.shape)}")
    if x.device != torch.device(device):
        raise InputError(f"{argument} is on {x.device} but the model's embedding is on {device} "
                         f"(use {argument}.to(model.device))")


def check_new_tokens(n, argument: str = "max_new_tokens") -> None:
    """A count of tokens to generate: a positive int."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise InputError(f"{argument} must be a positive int, got {n!r} ({type(n).__name__})")
    if n < 1:
        raise InputError(f"{argument} must be >= 1, got {n}")


def check_int(value, argument: str, minimum: int, meaning: str = "") -> None:
    """An int (not a bool) >= ``minimum``; ``meaning`` says what it counts in the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InputError(f"{argument} must be an int >= {minimum}{f' ({meaning})' if meaning else ''}, got {value!r}")


def check_layers(layers, n_layers: int | None, argument: str = "layers") -> list[int] | None:
    """Layer indices (one int or several; None: every layer) -> a list, each in 0..n_layers-1
    (``n_layers`` None: only their type is checked)."""
    if layers is None:
        return None
    got = [layers] if isinstance(layers, numbers.Integral) else list(layers)
    for x in got:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral) or (n_layers is not None
                                                                            and not 0 <= x < n_layers):
            span = "0..N-1" if n_layers is None else f"0..{n_layers - 1}"
            raise InputError(f"{argument}={got!r}: {x!r} is no layer index of this model (use ints in {span}, "
                             f"or None for all layers)")
    return got


DEVICE_FORMS = "'cpu', 'cuda', 'cuda:N' or a GPU index"


def as_device(value, argument: str = "device", forms: str = DEVICE_FORMS) -> torch.device:
    """``torch.device(value)``, or one error naming the argument and the forms a device takes."""
    try:
        return torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"{argument}={value!r} is not a device (use {forms})") from None


def check_token_id(token_id, vocab_size: int, argument: str = "eos_token_id") -> None:
    """One token id in [0, vocab_size), or None."""
    if token_id is None:
        return
    if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
        raise InputError(f"{argument} must be one int token id or None, got {token_id!r} ({type(token_id).__name__}) "
                         f"(e.g. tokenizer.eos_token_id)")
    if not 0 <= token_id < vocab_size:
        raise InputError(f"{argument}={token_id} is outside the vocabulary [0, {vocab_size})")


def check_state(state, batch: int, tokens: int, argument: str = "state") -> None:
    """A DecodeState for ``batch`` sequences with room for ``tokens`` more positions from its own."""
    if not isinstance(state, DecodeState):
        raise InputError(f"{argument} must be a DecodeState or None, got {type(state).__name__} "
                         f"(make one with model.new_state(batch, max_len))")
    if state.batch != batch:
        raise InputError(f"{argument} holds {state.batch} sequences but input_ids has {batch} "
                         f"(use model.new_state({batch}, max_len))")
    if state.pos + tokens > state.max_len:
        raise InputError(f"{argument} holds {state.max_len} positions; {tokens} more from position {state.pos} "
                         f"need {state.pos + tokens} (use model.new_state({batch}, {state.pos + tokens}) or a "
                         f"shorter max_new_tokens)")


def check_chunk(chunk, argument: str = "chunk") -> None:
    """Tokens per prefill call: a positive int, or None (chosen from free memory)."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1):
        raise InputError(f"{argument} must be a positive int or None (chosen from free memory), got {chunk!r}")


# names a dtype argument takes besides a torch.dtype (notebook parameters and CLI flags are strings)
DTYPE_NAMES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
               "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
               "fp8": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn}
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # what a model's activations may be


def parse_dtype(value, argument: str = "dtype", allowed: tuple[torch.dtype, ...] | None = None) -> torch.dtype:
    """A torch.dtype or one of ``DTYPE_NAMES`` ("bf16", "torch.float32", ...) -> the torch.dtype,
    one of ``allowed`` when given; else an InputError naming the argument, with did-you-mean."""
    if isinstance(value, torch.dtype):
        dt = value
    else:
        key = str(value).lower().removeprefix("torch.")
        dt = DTYPE_NAMES.get(key)
        if dt is None:
            names = [n for n, d in DTYPE_NAMES.items() if allowed is None or d in allowed]
            hint = did_you_mean(key, names)
            raise InputError(f"{argument}={value!r} is not a dtype{hint} (use a torch.dtype or one of "
                             f"{', '.join(names)})")
    if allowed is not None and dt not in allowed:
        raise InputError(f"{argument}={value!r} is not allowed here (use one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in allowed)})")
    return dt
