"""Train the embedded tiny DSV4 on the synthetic corpus (one GPU, minutes; CPU for smoke tests).

    python -m dsv4lab.train.train_tiny --device cuda --steps 2400 --out /tmp/run
    python -m dsv4lab.train.train_tiny --device cpu --steps 3 --batch 2 --seq-len 96 --out /tmp/smoke

Why it learns retrieval: (1) the loss is masked to predictable tokens (answers, and the
corpus's own mask), so random filler does not drown the signal; (2) the lightning indexer gets
a distillation loss (KL to the main attention over compressed entries, DeepSeek's recipe) --
without it top-k selection is discrete and the indexer never learns; it trains densely (all
closed entries visible) for the first part, then with its top-k selection, as at inference;
(3) a curriculum moves planted keys from short to long distances. Router biases follow
DeepSeek's loss-free balancing (bias nudged toward under-used experts).
Writes ``state-*.safetensors`` (bf16, canonical names, shards < 12 MB) and ``train_log.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..model import DSV4Model
from ..text import corpus
from ..text.tokenizer import load_tokenizer
from .evaluate import accuracy, compressed_branch_off
from .tiny_config import tiny_dsv4_config


@torch.no_grad()
def init_for_training(model: DSV4Model, seed: int) -> DSV4Model:
    """Standard init: linears N(0, 0.02) (output projections scaled down), norms 1, mHC identity-ish."""
    g = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.ndim >= 2:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("wo_b.weight", "w2.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
        elif "norm" in name:
            p.fill_(1.0)
        elif name.endswith(".scale"):
            p.fill_(1.0)
        else:
            p.zero_()
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.copy_(torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                                 for _ in range(b.shape[0])]))
        elif name.endswith("router.bias"):
            b.zero_()
    return model


def save_state(model: DSV4Model, out_dir: str, shard_bytes: int = 12 * 2**20) -> list[str]:
    """bf16 canonical-name shards (plain linears: ``X.weight``)."""
    sd = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() and not k.endswith(("_hc.fn", "_hc.base", "_hc.scale", "hc_head.fn", "hc_head.base", "hc_head.scale", "attn.sink", ".ape", "router.bias")) else v.detach()).contiguous().cpu()
          for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    files, cur, size = [], {}, 0
    for k in sorted(sd):
        n = sd[k].numel() * sd[k].element_size()
        if cur and size + n > shard_bytes:
            files.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += n
    files.append(cur)
    names = []
    for i, part in enumerate(files):
        fn = os.path.join(out_dir, f"state-{i:02d}.safetensors")
        save_file(part, fn)
        names.append(fn)
    return names


def load_state(model: DSV4Model, files: list[str]) -> DSV4Model:
    sd = {}
    for f in files:
        sd.update(load_file(f))
    own = model.state_dict()
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=False)
    return model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--dense-indexer-frac", type=float, default=0.6)
    ap.add_argument("--aux-weight", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="a narrower 4-layer model for CPU experiments")
    ap.add_argument("--mix", default=None, help="JSON mix of sample kinds (see corpus.DEFAULT_MIX)")
    ap.add_argument("--max-distance", type=int, default=0, help="cap retrieval/repeat distances (0: seq_len-96)")
    ap.add_argument("--bootstrap-frac", type=float, default=0.15,
                    help="first part of training on induction-dense data at in-window distances (repeats + "
                         "short retrieval): the copy circuit forms there first, then carries to long range")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader workers generating the corpus")
    ap.add_argument("--autocast", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=0,
                    help="wall-time budget: the schedule (lr, indexer phase) follows max(step/steps, time/budget) "
                         "and training ends when either reaches 1 (0: steps only)")
    args = ap.parse_args(argv)


    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    tok = load_tokenizer()
    cfg = tiny_dsv4_config(len(tok))
    if args.small:  # CPU experiments: same mechanisms, a quarter of the width
        cfg = cfg.replace(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64, q_lora_rank=64,
                          o_groups=2, o_lora_rank=32, n_routed_experts=4, moe_intermediate_size=64,
                          layer_types=cfg.layer_types[:4], mlp_layer_types=cfg.mlp_layer_types[:4], index_n_heads=4)
    dev = torch.device(args.device)
    model = init_for_training(DSV4Model(cfg), args.seed).to(dev).train()
    for _, p in model.named_parameters():
        p.requires_grad_(True)
    # no decay on norms/biases/mHC scales: kv_norm's weight is the only attention temperature
    # (queries are RMS-normalised without a weight), decaying it blunts every attention head
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and not n.endswith(("_hc.fn", "hc_head.fn"))]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and not n.endswith(("_hc.fn", "hc_head.fn")))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, min(100, args.steps // 10))
    t_start = time.time()

    def progress(s: int) -> float:
        p = s / args.steps
        if args.minutes:
            p = max(p, (time.time() - t_start) / (60 * args.minutes))
        return min(1.0, p)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress(s)))))
    stream_kw = {}
    if args.mix:
        stream_kw["mix"] = json.loads(args.mix)
    if args.max_distance:
        stream_kw["retrieval_distance"] = (8, args.max_distance)
    boot_kw = {"mix": {"repeat_plain": 0.5, "retrieval_plain": 0.3, "fact_plain": 0.1, "fact_chat": 0.1},
               "retrieval_distance": (4, max(8, cfg.sliding_window - 8))}

    def make_stream(kw, seed):
        if args.workers:
            return iter(torch.utils.data.DataLoader(
                corpus.training_dataset(tok, seq_len=args.seq_len, seed=seed,
                                        total_steps=args.steps * args.batch // args.workers, **kw),
                batch_size=None, num_workers=args.workers, prefetch_factor=8))
        return corpus.training_stream(tok, seq_len=args.seq_len, seed=seed, total_steps=args.steps * args.batch, **kw)

    stream = make_stream(stream_kw, args.seed)
    boot_stream = make_stream(boot_kw, args.seed + 1) if args.bootstrap_frac > 0 else None
    evals = corpus.eval_sets(tok, seed=1234)
    short = corpus.make_retrieval_samples(48, 512, 8, seed=99, max_distance=28, tokenizer=tok, modes=("plain",),
                                          n_queries=(1, 1))
    evals["retrieval_short"] = [(s.ids[: s.meta["queries"][0]["answer_pos"]], s.ids[s.meta["queries"][0]["answer_pos"]],
                                 {"distance": s.meta["queries"][0]["distance"]}) for s in short]
    routers = [layer.mlp.router for layer in model.layers if not layer.mlp.router.is_hash]
    loads: dict[int, torch.Tensor] = {}
    handles = [r.hook_ids.register_forward_hook(lambda m, i, o, k=k: loads.__setitem__(k, o.detach()))
               for k, r in enumerate(routers)]
    indexers = [layer.attn.indexer for layer in model.layers if layer.attn.indexer is not None]
    log = {"config": cfg.to_transformers_dict(), "args": vars(args), "steps": [], "evals": []}
    t0 = time.time()
    use_ac = args.autocast == "on" or (args.autocast == "auto" and dev.type == "cuda")
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_ac)
    step = 0
    for step in range(args.steps):
        prog = progress(step)
        dense = prog < args.dense_indexer_frac
        for ix in indexers:
            ix.train_dense = dense
            ix.aux_loss = None
        src = boot_stream if boot_stream is not None and prog < args.bootstrap_frac else stream
        batch = [next(src) for _ in range(args.batch)]
        ids = torch.stack([b[0] for b in batch]).to(dev, non_blocking=True)
        mask = torch.stack([b[1] for b in batch]).to(dev, non_blocking=True)
        with autocast:
            logits = model(ids)
        tgt_mask = mask[:, 1:].float()
        ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1), reduction="none")
        loss = (ce * tgt_mask.reshape(-1)).sum() / tgt_mask.sum().clamp_min(1)
        aux = sum(ix.aux_loss for ix in indexers if ix.aux_loss is not None) if indexers else torch.zeros((), device=dev)
        total = loss + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():  # loss-free load balancing of the top-k routers
            for k, r in enumerate(routers):
                if k in loads:
                    cnt = torch.bincount(loads[k].reshape(-1), minlength=cfg.n_routed_experts).float()
                    r.bias.add_(1e-3 * torch.sign(cnt.mean() - cnt))
        if step % 20 == 0 or step == args.steps - 1:
            rec = {"step": step, "progress": round(prog, 4), "loss": float(loss.detach()), "aux": float(aux.detach()) if torch.is_tensor(aux) else float(aux), "lr": sched.get_last_lr()[0],
                   "dense_indexer": dense, "elapsed_s": time.time() - t0}
            log["steps"].append(rec)
            print(json.dumps(rec), flush=True)
        last = step == args.steps - 1
        out_of_time = bool(args.minutes) and progress(step + 1) >= 1.0
        if (args.eval_every and step and step % args.eval_every == 0) or last or out_of_time:
            model.eval()
            with autocast:
                ev = {"step": step}
                for name, probes in evals.items():
                    if not args.small or name in ("facts", "retrieval", "retrieval_short"):
                        ev[name] = accuracy(model, probes[:200])["accuracy"]
                with compressed_branch_off(model):
                    ev["retrieval_no_compressed"] = accuracy(model, evals["retrieval"][:200])["accuracy"]
            model.train()
            log["evals"].append(ev)
            print(json.dumps(ev), flush=True)
        if out_of_time:
            break
    for h in handles:
        h.remove()
    log["train_seconds"] = time.time() - t0
    log["tokens_per_second"] = (step + 1) * args.batch * args.seq_len / log["train_seconds"]
    model.eval()
    log["files"] = save_state(model, args.out)
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    return log


if __name__ == "__main__":
    main()
