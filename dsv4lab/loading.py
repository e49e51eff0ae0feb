"""Build a WorkbenchModel from a checkpoint, tensor by tensor, straight to each layer's device.

The model is first built on the meta device (no memory), then every parameter is read lazily
from its shard and placed where the device map says. Quantised linears stay quantised.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .analysis.components import use_kernels
from .checkpoint.errors import DeviceUnavailableError
from .checkpoint.locate import TINY_DIR, resolve_path
from .checkpoint.reader import CheckpointReader
from .config import DSV4Config
from .kernels.device import have_triton_cuda, triton_importable
from .model.rope import Rotary, inverse_frequencies
from .model.validate import COMPUTE_DTYPES, parse_dtype
from .multidevice import normalize_device_map
from .precision import apply_precision
from .quant.weights import QuantWeight
from .workbench import WorkbenchModel

__all__ = ["load", "materialize", "device_for", "resolve_path", "TINY_DIR", "FP32_SUFFIXES"]

# parameters DSV4 keeps in fp32 whatever the compute dtype (their math runs in fp32)
FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.fn", "hc_head.base", "hc_head.scale",
                 "attn.sink", ".ape", "router.bias")


def device_for(name: str, layer_devices: list[torch.device], first: torch.device, last: torch.device) -> torch.device:
    """Where the tensor ``name`` goes: its layer's device, the embedding with ``first`` (layer 0),
    everything else (``head``, ``norm``, ``hc_head``) with ``last``."""
    if name.startswith("layers."):
        return layer_devices[int(name.split(".")[1])]
    if name.startswith("embed"):
        return first
    return last


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif attr in mod._buffers:
        mod._buffers[attr] = value
    else:
        raise KeyError(name)


def materialize(config: DSV4Config, get_weight: Callable, get_tensor: Callable, *, dtype: torch.dtype,
                layer_devices: list[torch.device], progress: bool = True, dequantize: bool = False) -> WorkbenchModel:
    """Fill a meta-built model. ``get_weight(base, device)`` -> Tensor|QuantWeight for a linear,
    ``get_tensor(name, device)`` -> Tensor for any other parameter/buffer."""
    with torch.device("meta"):
        model = WorkbenchModel(config)
    first, last = layer_devices[0], layer_devices[-1]
    qnames = {n for n, _ in model.qlinears()}
    names = [n for n, _ in model.named_parameters() if n.rpartition(".")[0] not in qnames or not n.endswith(".weight")]
    names += [n for n, b in model.named_buffers() if not n.endswith("inv_freq")]
    total = len(qnames) + len(names)
    nbytes = 0
    t0 = time.perf_counter()
    bar = tqdm(total=total, desc="loading", unit="tensor", disable=not progress, leave=False)
    for qname, ql in model.qlinears():
        dev = device_for(qname, layer_devices, first, last)
        w = get_weight(qname, dev)
        if isinstance(w, QuantWeight) and w.format == "plain":
            w = w.data
        if isinstance(w, torch.Tensor):
            w = w.to(dev, dtype)
            nbytes += w.numel() * w.element_size()
        else:
            nbytes += w.nbytes
            if dequantize:
                w = w.dequantize(dtype)
        ql.set_weight(w)
        bar.update(1)
        bar.set_postfix(GBps=f"{nbytes / max(time.perf_counter() - t0, 1e-9) / 1e9:.2f}", refresh=False)
    for name in names:
        dev = device_for(name, layer_devices, first, last)
        t = get_tensor(name, dev)
        if t.is_floating_point():
            t = t.to(dev, torch.float32 if name.endswith(FP32_SUFFIXES) else dtype)
        else:
            t = t.to(dev)
        nbytes += t.numel() * t.element_size()
        _set_tensor(model, name, t)
        bar.update(1)
    bar.close()
    for mname, mod in model.named_modules():
        if isinstance(mod, Rotary):
            dev = device_for(mname, layer_devices, first, last)
            mod._buffers["inv_freq"] = inverse_frequencies(config, mod.kind).to(dev)
    model.load_stats = {"bytes": nbytes, "seconds": time.perf_counter() - t0}
    return model.eval()


def load(path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
         dtype: torch.dtype | str = torch.float32, device_map: Mapping[int, str] | list | None = None,
         precision=None, dequantize: bool = False, progress: bool = True,
         kernels: bool | str = "auto") -> WorkbenchModel:
    """Load a DSV4 checkpoint (any supported layout/format) lazily, shard by shard.

    ``dtype``: the compute dtype, a torch.dtype or a name ("fp32", "bf16", "fp16": notebook
    parameters are strings).

    ``device_map``: layer index -> device (list or dict); embedding goes with layer 0, the head
    with the last layer. ``precision``: a mode for every linear ("bf16"/"w4a16"/"w4a4"/"w4a8"),
    "official" (DeepSeek's reference numerics: docs/precision.md), a round-trip name, or a policy
    (dsv4lab.precision). ``dequantize=True`` turns quantised weights dense at load.
    ``kernels``: ``"auto"`` installs the Triton kernels (``use_kernels``: NVFP4 linears and the
    fused MoE decode) on the components placed on CUDA when ``dsv4lab.kernels.dispatch.have_triton_cuda()``
    (``DSV4LAB_NO_KERNELS=1`` turns that off), the reference elsewhere; ``True`` requires them
    (RuntimeError without CUDA + triton or without a CUDA-placed layer); ``False`` keeps the
    reference everywhere. The count installed is ``model.load_stats["kernels"]``.
    """
    if kernels not in ("auto", True, False):
        raise ValueError(f"kernels must be 'auto', True or False, not {kernels!r}")
    kernels = "auto" if isinstance(kernels, str) else bool(kernels)
    dtype = parse_dtype(dtype, "dtype", COMPUTE_DTYPES)
    reader = CheckpointReader(resolve_path(path))
    config = reader.config
    # one CUDA graph / position counter per contiguous run of layers: the normaliser refuses others
    layer_devices = normalize_device_map(device if device_map is None else device_map, config.num_hidden_layers)
    if any(d.type == "cuda" for d in layer_devices) and not torch.cuda.is_available():
        raise DeviceUnavailableError(f"device={device if device_map is None else device_map!r}: CUDA is not available "
                                     f"on this machine (load with device='cpu')")
    reader.check()
    if kernels is True and (why := kernels_unavailable(layer_devices)) is not None:  # fail before reading weights
        raise RuntimeError(f"load(kernels=True) needs the model on CUDA with triton: {why}")
    model = materialize(config, lambda base, dev: reader.weight(base, dev), lambda name, dev: reader.tensor(name, dev),
                        dtype=dtype, layer_devices=layer_devices, progress=progress, dequantize=dequantize)
    model.source = str(reader.path)
    if precision is not None:
        apply_precision(model, precision)
    model.load_stats["kernels"] = install_kernels_for_load(model, kernels, layer_devices)
    return model


def kernels_unavailable(devices: list[torch.device]) -> str | None:
    """Why the Triton kernels cannot run on a model placed on ``devices`` (None: they can)."""
    on_cuda = any(torch.device(d).type == "cuda" for d in devices)
    if on_cuda and have_triton_cuda():
        return None
    why = []
    if os.environ.get("DSV4LAB_NO_KERNELS", "0") == "1":
        why.append("DSV4LAB_NO_KERNELS=1 is set")
    if not torch.cuda.is_available():
        why.append("CUDA is not available")
    elif not on_cuda:
        why.append(f"no layer is on a CUDA device ({', '.join(sorted({str(d) for d in devices}))})")
    if not triton_importable():
        why.append("triton cannot be imported (pip install 'dsv4lab[kernels]')")
    return "; ".join(why) or "unavailable"


def install_kernels_for_load(model: WorkbenchModel, kernels: bool | str, devices: list[torch.device]) -> int:
    """``load``'s ``kernels=`` switch (see :func:`load`); returns how many components got one."""
    if kernels is False:
        return 0
    why = kernels_unavailable(devices)
    if why is not None:
        if kernels == "auto":
            return 0
        raise RuntimeError(f"load(kernels=True) needs the model on CUDA with triton: {why}")

    return use_kernels(model, "**", True, strict=False)
