#!/usr/bin/python3
"""Train a small character-level GPT through diond.

The corpus is offline and real: the license texts Debian installs with base-files
(/usr/share/common-licenses: GPL, LGPL, Apache, MPL, ... about 300 KB of English), or any text
files given with --corpus. Nothing is downloaded.

Parameter groups as microsoft/dion recommends: Dion2 (or Muon with --optimizer=muon, Dion with
--optimizer=dion, ...) for the 2-D hidden matrices of the transformer blocks, AdamW for the
embeddings, the LM head and the norms. --optimizer=torch-adamw trains everything with
torch.optim.AdamW in-process instead (the baseline, no daemon).

    /usr/bin/python3 examples/python/train_gpt.py --target unix:/tmp/x/diond.sock --steps 300

Without --target it starts its own daemon (diond.Daemon: $DIOND_BINARY or build/bin/diond).
Prints a progress line every --log-every steps and a final "summary:" line.
"""
import argparse
import glob
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
# From a source checkout, find the client package without installing it.
sys.path.insert(0, os.path.join(REPO, "client", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_CORPUS = "/usr/share/common-licenses"


# -- data ---------------------------------------------------------------------------------------
def load_corpus(paths):
    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(glob.glob(os.path.join(p, "*")))
        else:
            files.append(p)
    seen, texts = set(), []
    for f in files:
        real = os.path.realpath(f)
        if real in seen or not os.path.isfile(real):
            continue
        seen.add(real)
        with open(real, "rb") as fh:
            texts.append(fh.read().decode("utf-8", errors="replace"))
    text = "\n\n".join(texts)
    if len(text) < 10000:
        raise SystemExit("corpus too small (%d characters) from %s" % (len(text), paths))
    return text


class CharData:
    def __init__(self, text, context, seed):
        chars = sorted(set(text))
        self.vocab = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n = int(0.9 * len(data))
        self.train, self.val = data[:n], data[n:]
        self.context = context
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, split, batch_size, gen=None):
        d = self.train if split == "train" else self.val
        ix = torch.randint(len(d) - self.context - 1, (batch_size,), generator=gen or self.gen)
        x = torch.stack([d[i:i + self.context] for i in ix.tolist()])
        y = torch.stack([d[i + 1:i + 1 + self.context] for i in ix.tolist()])
        return x, y


# -- model --------------------------------------------------------------------------------------
def causal_attention(q, k, v, use_sdpa=None):
    """Causal self-attention. torch >= 2.0 has F.scaled_dot_product_attention; torch 1.13
    (Debian 12) does not, so the explicit softmax(QK^T/sqrt(d) + mask) V is the fallback
    (test_example.py checks both agree)."""
    if use_sdpa is None:
        use_sdpa = hasattr(F, "scaled_dot_product_attention")
    if use_sdpa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    att = att.masked_fill(mask, float("-inf"))
    return att.softmax(dim=-1) @ v


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=False)
        self.fc2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        shape = (B, T, self.heads, C // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab, context, d=128, layers=4, heads=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def param_groups(model, args):
    """Hidden 2-D matrices -> the orthonormal algorithm; embeddings, LM head, norms -> AdamW."""
    hidden, other = [], []
    for name, p in model.named_parameters():
        if name.startswith("blocks.") and p.dim() == 2:
            hidden.append(p)
        else:
            other.append(p)
    return [
        dict(params=hidden, algorithm=args.optimizer, lr=args.lr, name="hidden"),
        dict(params=other, algorithm="adamw", lr=args.adam_lr, betas=(0.9, 0.95),
             weight_decay=0.0, name="embed_head_norms"),
    ]


def build_optimizer(model, args, target):
    if args.optimizer == "torch-adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adam_lr, betas=(0.9, 0.95),
                                 weight_decay=0.0)
    import diond.torch
    overlap = {"off": False, "on": True, "delayed": "delayed"}[args.overlap]
    return diond.torch.Optimizer(param_groups(model, args), target=target,
                                 weight_decay=args.weight_decay, client_name="train_gpt",
                                 remote=args.remote or None, overlap=overlap,
                                 delayed_warmup_steps=args.delayed_warmup)


@torch.no_grad()
def evaluate(model, data, args):
    model.eval()
    gen = torch.Generator().manual_seed(1234)  # the same val batches every time
    losses = [model(*data.batch("val", args.batch, gen)).item() for _ in range(args.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def train(args, target):
    torch.manual_seed(args.seed)
    data = CharData(load_corpus(args.corpus), args.context, args.seed)
    model = GPT(data.vocab, args.context, args.d_model, args.layers, args.heads)
    n_params = sum(p.numel() for p in model.parameters())
    opt = build_optimizer(model, args, target)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) if args.warmup else 1.0)
    print("model: %d layers, d=%d, %d heads, context %d, vocab %d, %.2fM parameters; corpus %d "
          "chars; optimizer %s; %d threads" % (
              args.layers, args.d_model, args.heads, args.context, data.vocab, n_params / 1e6,
              len(data.train) + len(data.val), args.optimizer, torch.get_num_threads()),
          flush=True)
    val0 = evaluate(model, data, args)
    print("step %4d  val_loss %.4f" % (0, val0), flush=True)
    losses, t_start = [], time.perf_counter()
    t_opt = 0.0
    window_t, window_tok = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        x, y = data.batch("train", args.batch)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        opt.step()
        t_opt += time.perf_counter() - t0
        sched.step()
        losses.append(loss.item())
        window_tok += x.numel()
        if step % args.log_every == 0 or step == args.steps:
            now = time.perf_counter()
            recent = losses[-args.log_every:]
            print("step %4d  loss %.4f  tokens/s %6.0f  lr %.4g" % (
                step, sum(recent) / len(recent), window_tok / (now - window_t),
                opt.param_groups[0]["lr"]), flush=True)
            window_t, window_tok = now, 0
    if hasattr(opt, "synchronize"):
        opt.synchronize()  # an overlapped or delayed last step lands in the model
    elapsed = time.perf_counter() - t_start
    val1 = evaluate(model, data, args)
    k = min(10, len(losses))
    summary = dict(steps=args.steps, optimizer=args.optimizer, overlap=args.overlap,
                   delayed_warmup=args.delayed_warmup,
                   initial_loss=losses[0],
                   final_loss=sum(losses[-k:]) / k, initial_val_loss=val0, final_val_loss=val1,
                   seconds=elapsed, tokens_per_s=args.steps * args.batch * args.context / elapsed,
                   optimizer_ms_per_step=1000 * t_opt / args.steps, parameters=n_params)
    print("summary: %d steps in %.1f s, train loss %.3f -> %.3f, val loss %.3f -> %.3f, "
          "%.0f tokens/s, optimizer step %.1f ms" % (
              args.steps, elapsed, summary["initial_loss"], summary["final_loss"], val0, val1,
              summary["tokens_per_s"], summary["optimizer_ms_per_step"]), flush=True)
    if hasattr(opt, "close"):
        opt.close()
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f)
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="diond address (unix:/path or host:port); default: start one")
    ap.add_argument("--optimizer", default="dion2",
                    choices=["dion2", "muon", "normuon", "dion", "dion3", "lion", "adamw",
                             "torch-adamw"])
    ap.add_argument("--remote", action="store_true", help="no shared memory (Push/Pull)")
    ap.add_argument("--overlap", choices=("off", "on", "delayed"), default="off",
                    help="the optimizer step during backward (on: same numbers; delayed: one "
                         "step of staleness; client/python/README.md)")
    ap.add_argument("--delayed-warmup", type=int, default=0,
                    help="with --overlap delayed: the first steps that run synchronously")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.02, help="lr of the hidden matrices")
    ap.add_argument("--adam-lr", type=float, default=3e-3, help="lr of the AdamW group")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=20, help="linear lr warm-up steps (LambdaLR)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--corpus", nargs="+", default=[DEFAULT_CORPUS])
    ap.add_argument("--summary-json", help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    if args.overlap != "off" and 2 * args.threads > (os.cpu_count() or 1):
        print("note: --overlap %s runs the daemon during backward; with --threads %d on %d CPUs "
              "the trainer and the daemon share cores and both slow down (use --threads %d)"
              % (args.overlap, args.threads, os.cpu_count() or 1,
                 max(1, (os.cpu_count() or 2) // 2)), flush=True)
    torch.set_num_threads(args.threads)
    if args.target or args.optimizer == "torch-adamw":
        return train(args, args.target)
    import diond
    with diond.Daemon(compute_threads=args.threads) as d:
        return train(args, d.target)


if __name__ == "__main__":
    main()
