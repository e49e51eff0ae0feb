"""DSV4Model: embedding -> decoder layers over hc streams -> hc head -> norm -> head.

Three ways in: ``forward(ids)`` (stateless full prefill, like the oracle without cache),
``prefill(ids, state)`` (a chunk against fixed-shape decode state) and ``decode_step(ids, state)``
(one token, device-side position, graph-capturable). ``generate`` = prefill + decode steps.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..config import DSV4Config
from .decoder import DecoderLayer
from .hooks import HookPoint
from .linear import QLinear
from .mhc import HyperHead
from .norms import RMSNorm
from .state import DecodeState
from .chunking import CPU_MAX_CHUNK, choose_chunk, free_bytes
from .component import Component
from .validate import (InputError, check_chunk, check_embeds, check_ids, check_new_tokens, check_state,
                       check_token_id)


class DSV4Model(Component):
    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = QLinear(config.hidden_size, config.vocab_size)
        self.hook_embed = HookPoint("token embeddings [B,S,D]")
        self.hook_final_hidden = HookPoint("final hidden after hc_head and norm [B,S,D]")
        self.hook_logits = HookPoint("logits [B,S,V] (fp32)")

    # ------------------------------------------------------------ utilities
    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def hook_points(self) -> Iterator[tuple[str, HookPoint]]:
        for name, mod in self.named_modules():
            if isinstance(mod, HookPoint):
                yield name, mod

    def hook_names(self) -> list[str]:
        return [n for n, _ in self.hook_points()]

    def qlinears(self) -> Iterator[tuple[str, QLinear]]:
        for name, mod in self.named_modules():
            if isinstance(mod, QLinear):
                yield name, mod

    def layer_devices(self) -> list[torch.device]:
        return [layer.attn_norm.weight.device for layer in self.layers]

    def new_state(self, batch: int, max_len: int) -> DecodeState:
        return DecodeState.allocate(self.config, batch, max_len, self.dtype, self.layer_devices())

    # -------------------------------------------------------------- compute
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.hook_embed(self.embed(input_ids))
        return x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def _final(self, h: torch.Tensor) -> torch.Tensor:
        h = h.to(self.head_device())
        x = self.hook_final_hidden(self.norm(self.hc_head(h)))
        return self.hook_logits(self.head(x).float())

    def head_device(self) -> torch.device:
        return self.norm.weight.device

    def check_ids(self, input_ids: torch.Tensor, argument: str = "input_ids") -> None:
        """Raise :class:`InputError` unless ``input_ids`` is [B, S] integer ids of this model, on its device."""
        check_ids(input_ids, self.config.vocab_size, self.device, argument)

    def prefill_chunk(self, n_tokens: int, start: int = 0, batch: int = 1, free: int | None = None) -> int:
        """Tokens per prefill call for ``n_tokens`` from ``start``, chosen from free memory: the
        largest chunk whose transient (``dsv4lab.model.chunking``; docs/memory_plan.md) fits half of
        the free memory of every device the model uses (``free`` overrides; unknown free memory on
        the CPU gives ``CPU_MAX_CHUNK``). Paths that materialise [H, C, L] (a probabilities hook,
        training, ``prefill_path="dense"``) are counted, so they get smaller chunks."""
        attns = [layer.attn for layer in self.layers]
        dense_attention = any(a.materialises_probs() for a in attns)
        dense_indexer = any(a.indexer is not None and any(h.active for h in (a.indexer.hook_q, a.indexer.hook_scores,
                                                                              a.indexer.hook_indices)) for a in attns)
        block = max((a.block_bytes for a in attns), default=0)
        chunks = []
        for dev in {*self.layer_devices(), self.head_device()}:
            f = free_bytes(dev) if free is None else free
            cap = CPU_MAX_CHUNK if dev.type == "cpu" else None
            if f <= 0:
                chunks.append(min(n_tokens, CPU_MAX_CHUNK))
                continue
            chunks.append(choose_chunk(self.config, n_tokens, f, start, batch, self.dtype.itemsize, block,
                                       dense_attention, dense_indexer, cap=cap))
        return min(chunks)

    def prefill(self, input_ids: torch.Tensor, state: DecodeState, chunk: int | None = None,
                last_only: bool = False) -> torch.Tensor:
        """Run tokens against ``state`` (host-known positions) in calls of ``chunk`` tokens
        (None: :meth:`prefill_chunk` from free memory; hooks fire once per call); returns logits
        [B,S,V], or [B,1,V] of the last token with ``last_only`` (what generation needs: a 32k-token
        V4-Pro prompt's fp32 logits are 17 GB)."""
        self.check_ids(input_ids)
        check_chunk(chunk)
        return self._prefill_chunks(input_ids, state, chunk, last_only=last_only)

    def _prefill_chunks(self, input_ids: torch.Tensor | None, state: DecodeState, chunk: int | None,
                        last_only: bool = False, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B,S,V] (``last_only``: [B,1,V], so a chunk's logits die with the chunk)."""
        B, S = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        chunk = chunk or self.prefill_chunk(S, state.pos, B)

        def run(i: int, j: int) -> torch.Tensor:
            return self._prefill(None if input_ids is None else input_ids[:, i:j], state,
                                 None if inputs_embeds is None else inputs_embeds[:, i:j])

        if chunk >= S:
            logits = run(0, S)
            return logits[:, -1:].clone() if last_only else logits
        out = None
        for i in range(0, S, chunk):
            logits = run(i, i + chunk)
            if last_only:
                out = logits[:, -1:].clone()
                continue
            if out is None:
                out = logits.new_empty(B, S, logits.shape[-1])
            out[:, i : i + logits.shape[1]] = logits
            del logits
        return out

    def _prefill(self, input_ids: torch.Tensor | None, state: DecodeState,
                 inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        B, S = (input_ids if inputs_embeds is None else inputs_embeds).shape[:2]
        start = state.pos
        if start + S > state.max_len:
            raise ValueError(f"state holds {state.max_len} tokens; {start}+{S} requested")
        if inputs_embeds is None:
            h = self._embed(input_ids)
        else:
            h = self.hook_embed(inputs_embeds).unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, st in zip(self.layers, state.layers):
            dev = st.kv_ring.device
            h = layer.prefill(h.to(dev), None if input_ids is None else input_ids.to(dev), start, st)
        state.set_pos(start + S)
        return self._final(h)

    def forward(self, input_ids: torch.Tensor | None = None, state: DecodeState | None = None,
                chunk: int | None = None, *, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B,S,V] for the whole sequence (fresh state unless one is given), prefilled in
        calls of ``chunk`` tokens (None: from free memory, see :meth:`prefill_chunk`).

        ``inputs_embeds`` [B,S,D] replaces the embedding lookup (soft prompts, another front end);
        the token ids still route the hash layers, so pass them too when the model has any
        (a hash router without ids raises)."""
        if inputs_embeds is None:
            self.check_ids(input_ids)
        else:
            check_embeds(inputs_embeds, self.config.hidden_size, self.device)
            if input_ids is not None:
                self.check_ids(input_ids)
                if tuple(input_ids.shape) != tuple(inputs_embeds.shape[:2]):
                    raise InputError(f"input_ids shape {list(input_ids.shape)} does not match inputs_embeds "
                                     f"{list(inputs_embeds.shape)} (the ids of the same tokens, [B, S])")
        check_chunk(chunk)
        x = input_ids if inputs_embeds is None else inputs_embeds
        if state is None:
            state = self.new_state(x.shape[0], x.shape[1])
        return self._prefill_chunks(input_ids, state, chunk, inputs_embeds=inputs_embeds)

    def decode_segments(self) -> list[tuple[torch.device, range]]:
        """Contiguous runs of layers on one device (one CUDA graph each)."""
        segs: list[tuple[torch.device, range]] = []
        devs = self.layer_devices()
        start = 0
        for i in range(1, len(devs) + 1):
            if i == len(devs) or devs[i] != devs[start]:
                segs.append((devs[start], range(start, i)))
                start = i
        return segs

    @torch.no_grad()
    def decode_segment(self, seg: int, h_or_ids: torch.Tensor, input_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Decode part ``seg`` of :meth:`decode_segments`: the first takes token ids and embeds,
        the last ends with the head (returns logits); each advances its device's position."""
        segs = self.decode_segments()
        dev, layers = segs[seg]
        pos = state.pos_on(dev)
        h = self._embed(h_or_ids) if seg == 0 else h_or_ids
        entered = None   # a layer's attention entry, computed in the previous layer's last launch
        for i in layers:
            nxt = self.layers[i + 1] if i + 1 in layers else None   # same device: the launches may chain
            h, entered = self.layers[i].decode_then(h, input_ids, pos, state.layers[i], entered, nxt)
        out = self._final(h) if seg == len(segs) - 1 else h
        pos.add_(1)
        return out

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """One token per sequence (input_ids [B,1]) at the state's device position; fixed
        shapes, no host syncs; advances the positions on the device. Returns logits [B,1,V].
        The host mirror ``state.pos`` is advanced by the caller (generate does it)."""
        h = input_ids
        for k, (dev, _) in enumerate(self.decode_segments()):
            h = self.decode_segment(k, h.to(dev), input_ids.to(dev), state)
        return h

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, state: DecodeState | None = None,
                 eos_token_id: int | None = None, prefill_chunk: int | None = None,
                 step_fn=None, return_logits: bool = False):
        """Greedy decoding -> [B, S+N] (and the per-step logits if asked).

        ``prefill_chunk``: tokens per prefill call (None: :meth:`prefill_chunk` from free memory).
        ``step_fn(ids, state)`` replaces ``decode_step`` (e.g. a CUDA-graph replay). The stop
        check on ``eos_token_id`` is the only host sync per step, outside the step itself.
        """
        self.check_ids(input_ids)
        check_new_tokens(max_new_tokens)
        check_chunk(prefill_chunk, "prefill_chunk")
        check_token_id(eos_token_id, self.config.vocab_size)
        B, S = input_ids.shape
        if state is None:
            state = self.new_state(B, S + max_new_tokens)
        check_state(state, B, S + max_new_tokens - 1)   # the last new token is not fed back
        logits = self._prefill_chunks(input_ids, state, prefill_chunk, last_only=True)
        step = step_fn or self.decode_step
        tokens = [input_ids]
        all_logits = [logits[:, -1]]
        nxt = logits[:, -1].argmax(-1, keepdim=True).to(input_ids.device)
        for t in range(max_new_tokens):
            tokens.append(nxt)
            if eos_token_id is not None and bool((nxt == eos_token_id).all()):
                break
            if t == max_new_tokens - 1:
                break
            lg = step(nxt, state)
            state.pos += 1
            all_logits.append(lg[:, -1].clone() if return_logits else None)  # a graph's buffer is reused
            nxt = lg[:, -1].argmax(-1, keepdim=True).to(input_ids.device)
        out = torch.cat(tokens, dim=1)
        return (out, torch.stack(all_logits, 1)) if return_logits else out
