"""Weight-format detection from header facts (dtype + shape of ``X.weight`` and its aux tensors).

Formats (DESIGN.md section 3):

* ``plain``: a float ``weight`` and no scale;
* ``nvfp4`` (ModelOpt): ``weight`` uint8 ``[out, in/2]``, ``weight_scale`` e4m3 ``[out, in/16]``,
  ``weight_scale_2`` fp32 scalar, optional ``input_scale`` fp32 scalar;
* ``fp8_block``: ``weight`` e4m3 ``[out, in]`` + ``scale`` (or ``weight_scale_inv``) fp32 / e8m0
  ``[ceil(out/128), ceil(in/128)]``;
* ``mxfp4``: ``weight`` int8/uint8 ``[out, in/2]`` + e8m0 (or uint8) ``scale`` ``[out, in/32]``.

Packed FP4 weights come in two encodings of the same bytes (low nibble = even element): the
release's ``I8``/``U8`` with the BYTE shape ``[out, in/2]``, and safetensors' ``F4``
(``float4_e2m1fn_x2``, what DeepSeek's ``convert.py`` writes) whose header gives the ELEMENT
shape ``[out, in]`` (torch reads it back as ``[out, in/2]`` x2).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .errors import CheckpointError
from .safetensors_index import FLOAT_DTYPES

FORMATS = ("plain", "nvfp4", "mxfp4", "fp8_block")
NVFP4_GROUP = 16
MXFP4_GROUP = 32
FP8_BLOCK = 128
_PACKED = {"U8", "I8", "F4"}
_SCALAR = ()


@dataclass(frozen=True)
class FormatInfo:
    format: str
    logical_shape: tuple[int, ...]          # shape of the dequantised weight
    roles: dict                             # role -> suffix in the checkpoint ("scale" may be "weight_scale_inv")
    fp4_elements: bool = False              # packed FP4 stored as F4: the header shape counts elements


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(s) for s in shape)


def detect_format(parts: Mapping[str, tuple[str, Sequence[int]]], where: str = "") -> FormatInfo:
    """Format of one linear from ``{suffix: (safetensors dtype, shape)}`` of its tensors.

    ``where`` (e.g. ``"shard.safetensors: tensor 'layers.0.attn.wq_a'"``) prefixes error messages.
    Raises :class:`CheckpointError` saying what was found when no known format fits.
    """
    found = ", ".join(f"{s}={d}{list(sh)}" for s, (d, sh) in sorted(parts.items()))
    if "weight" not in parts:
        raise CheckpointError(f"{where}: scale tensors without a weight (found {found})")
    wd, ws = parts["weight"][0], tuple(int(s) for s in parts["weight"][1])
    aux = set(parts) - {"weight"}

    def unknown(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: unknown weight format ({why}); found {found}. Known: plain float; "
                               "NVFP4 = uint8 weight + e4m3 weight_scale + fp32 weight_scale_2; FP8 block = "
                               "e4m3 weight + scale/weight_scale_inv; MXFP4 = int8/uint8 weight + e8m0 scale")

    if wd in FLOAT_DTYPES:
        if aux - {"input_scale"}:
            raise unknown("float weight with scale tensors")
        return FormatInfo("plain", ws, {"weight": "weight"})
    if len(ws) != 2:
        raise unknown(f"a {wd} weight must be 2-D")
    out, cols = ws
    f4 = wd == "F4"               # header shape [out, in] (elements), not [out, in/2] (bytes)
    packed_in = cols if f4 else cols * 2
    if wd in _PACKED and "weight_scale" in parts and "weight_scale_2" in parts:
        sd = parts["weight_scale"][0]
        if sd != "F8_E4M3":
            raise unknown(f"NVFP4 weight_scale must be F8_E4M3, got {sd}")
        if _numel(parts["weight_scale_2"][1]) != 1:
            raise unknown("NVFP4 weight_scale_2 must be a scalar")
        roles = {"weight": "weight", "weight_scale": "weight_scale", "weight_scale_2": "weight_scale_2"}
        if "input_scale" in parts:
            roles["input_scale"] = "input_scale"
        extra = aux - set(roles)
        if extra:
            raise unknown(f"unexpected extra tensors {sorted(extra)} next to an NVFP4 weight")
        return FormatInfo("nvfp4", (out, packed_in), roles, f4)
    scale_key = "scale" if "scale" in parts else ("weight_scale_inv" if "weight_scale_inv" in parts else None)
    if wd == "F8_E4M3" and scale_key is not None:
        sd = parts[scale_key][0]
        if sd not in ("F32", "F8_E8M0", "BF16", "U8"):
            raise unknown(f"FP8 block scale must be F32 or F8_E8M0, got {sd}")
        if aux - {scale_key, "input_scale"}:
            raise unknown(f"unexpected extra tensors {sorted(aux - {scale_key})} next to an FP8 weight")
        return FormatInfo("fp8_block", ws, {"weight": "weight", "scale": scale_key})
    if wd in _PACKED and scale_key == "scale" and parts["scale"][0] in ("F8_E8M0", "U8"):
        if aux - {"scale"}:
            raise unknown(f"unexpected extra tensors {sorted(aux - {'scale'})} next to an MXFP4 weight")
        return FormatInfo("mxfp4", (out, packed_in), {"weight": "weight", "scale": "scale"}, f4)
    raise unknown("no rule matches")


def stored_shapes(fmt: str, logical: Sequence[int], fp4_elements: bool = False) -> dict[str, tuple[int, ...]]:
    """The shape each stored tensor of a linear must have for a logical ``[out, in]`` weight
    (``fp4_elements``: a packed FP4 weight stored as ``F4``, whose header shape is ``[out, in]``).

    Scalars (``weight_scale_2``, ``input_scale``) are ``()``; any one-element shape is accepted.
    """
    logical = tuple(int(s) for s in logical)
    if fmt == "plain":
        return {"weight": logical}
    out, inp = logical
    packed = (out, inp) if fp4_elements else (out, inp // 2)
    if fmt == "nvfp4":
        return {"weight": packed, "weight_scale": (out, inp // NVFP4_GROUP),
                "weight_scale_2": _SCALAR, "input_scale": _SCALAR}
    if fmt == "mxfp4":
        return {"weight": packed, "scale": (out, inp // MXFP4_GROUP)}
    if fmt == "fp8_block":
        return {"weight": (out, inp), "scale": (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))}
    raise ValueError(f"unknown format {fmt!r}")


def shape_matches(expected: tuple[int, ...], found: Sequence[int]) -> bool:
    found = tuple(int(s) for s in found)
    if expected == _SCALAR:
        return _numel(found) == 1
    return found == expected
