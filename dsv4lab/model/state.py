"""Fixed-shape decode state: nothing grows during decode, so a step can be graph-captured.

Per layer: the sliding-window KV ring (slot = pos % window), and for CSA/HCA layers the
compressor's raw-projection ring (the open window plus, for CSA, the previous window whose Ca
half overlaps) and the compressed-entry array; CSA layers also hold the indexer's own ring and
key array. The number of entries is derived from the position ((pos+1) // ratio), kept on the
device as ``pos_t`` so no host read decides what runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import CSA, SLIDING, DSV4Config


@dataclass
class CompressorState:
    ring_kv: torch.Tensor     # [B, R, c*d]  raw C projections of the last R positions (R = c*m)
    ring_gate: torch.Tensor   # [B, R, c*d]  fp32 Z + ape; -inf where no token was written
    entries: torch.Tensor     # [B, max_entries, d]

    @classmethod
    def empty(cls, batch: int, ratio: int, dim: int, overlap: bool, max_len: int, dtype, device) -> "CompressorState":
        c = 2 if overlap else 1
        return cls(
            ring_kv=torch.zeros(batch, c * ratio, c * dim, dtype=dtype, device=device),
            ring_gate=torch.full((batch, c * ratio, c * dim), float("-inf"), dtype=torch.float32, device=device),
            entries=torch.zeros(batch, max(max_len // ratio, 1), dim, dtype=dtype, device=device),
        )


@dataclass
class LayerState:
    kv_ring: torch.Tensor                       # [B, window, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer a decode step of this layer writes."""
        out = [self.kv_ring]
        for cs in (self.compressor, self.indexer):
            if cs is not None:
                out += [cs.ring_kv, cs.ring_gate, cs.entries]
        return out


@dataclass
class DecodeState:
    """All decode buffers of a model for ``batch`` sequences of at most ``max_len`` tokens."""

    layers: list[LayerState]
    pos_t: torch.Tensor          # 0-dim long on the first device: position of the next token
    pos: int = 0                 # host mirror, advanced by the host driver (never read back)
    max_len: int = 0
    batch: int = 1
    extra: dict = field(default_factory=dict)

    @classmethod
    def allocate(cls, config: DSV4Config, batch: int, max_len: int, dtype=torch.float32,
                 devices: list[torch.device] | torch.device | str = "cpu") -> "DecodeState":
        n = config.num_hidden_layers
        devs = devices if isinstance(devices, list) else [torch.device(devices)] * n
        layers = []
        for i in range(n):
            dev = devs[i]
            ls = LayerState(kv_ring=torch.zeros(batch, config.sliding_window, config.head_dim, dtype=dtype, device=dev))
            t = config.layer_types[i]
            if t != SLIDING:
                m = config.compress_ratio(i)
                ls.compressor = CompressorState.empty(batch, m, config.head_dim, t == CSA, max_len, dtype, dev)
                if t == CSA:
                    ls.indexer = CompressorState.empty(batch, m, config.index_head_dim, True, max_len, dtype, dev)
            layers.append(ls)
        st = cls(layers=layers, pos_t=torch.zeros((), dtype=torch.long, device=devs[0]), pos=0,
                 max_len=max_len, batch=batch)
        # one position counter per device, so a per-device CUDA graph never reads another GPU
        st.extra["pos_by_device"] = {devs[0]: st.pos_t}
        for d in devs:
            st.extra["pos_by_device"].setdefault(d, torch.zeros((), dtype=torch.long, device=d))
        return st

    def pos_on(self, device: torch.device) -> torch.Tensor:
        return self.extra["pos_by_device"][torch.device(device)]

    def set_pos(self, pos: int) -> None:
        """Host-driven reset/advance (prefill): every device counter gets ``pos``."""
        self.pos = pos
        for t in self.extra["pos_by_device"].values():
            t.fill_(pos)

    def tensors(self) -> list[torch.Tensor]:
        out = list(self.extra["pos_by_device"].values())
        for ls in self.layers:
            out += ls.tensors()
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def clone(self) -> "DecodeState":
        def cc(cs):
            return None if cs is None else CompressorState(cs.ring_kv.clone(), cs.ring_gate.clone(), cs.entries.clone())

        pbd = {d: t.clone() for d, t in self.extra["pos_by_device"].items()}
        first = next(iter(pbd))
        return DecodeState([LayerState(ls.kv_ring.clone(), cc(ls.compressor), cc(ls.indexer)) for ls in self.layers],
                           pbd[first], self.pos, self.max_len, self.batch, {"pos_by_device": pbd})
