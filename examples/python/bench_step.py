#!/usr/bin/python3
"""Per-step overhead of diond in a Python trainer: one training step (forward, backward,
optimizer) of the train_gpt.py model, through diond and with torch.optim.AdamW in-process, in
the same run.

Configurations (same model, same batches):
  torch-adamw       torch.optim.AdamW in the trainer (foreach=False; the baseline)
  diond-adamw       diond.torch.Optimizer, every parameter AdamW, shared memory: the same
                    algorithm, so the difference to torch-adamw is the service's overhead
  diond-adamw-remote  the same in remote mode (PushGradients/Step/PullParameters over the socket)
  diond-dion2       the example's grouping (Dion2 hidden matrices + AdamW), shared memory

The blocks are interleaved (A B C D A B C D ...) so that load from other processes hits every
configuration alike; medians are reported. For diond the optimizer time is split into the
daemon's compute (StepResponse.compute_micros), the rest of its Step handling (total_micros -
compute_micros) and the client side and transport (wall time of opt.step() - total_micros).

    /usr/bin/python3 examples/python/bench_step.py [--target unix:/path] [--steps 40]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "..", "client", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import train_gpt  # noqa: E402


def make(args, data, kind, target):
    torch.manual_seed(0)
    model = train_gpt.GPT(data.vocab, args.context, args.d_model, args.layers, args.heads)
    if kind == "torch-adamw":
        kw = {"foreach": False} if "foreach" in torch.optim.AdamW.__init__.__code__.co_varnames \
            else {}
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                        weight_decay=0.0, **kw)
    import diond.torch
    if kind.startswith("diond-adamw"):
        groups = [dict(params=list(model.parameters()), algorithm="adamw", lr=1e-3,
                       weight_decay=0.0)]
    else:
        a = argparse.Namespace(optimizer="dion2", lr=0.02, adam_lr=1e-3)
        groups = train_gpt.param_groups(model, a)
    return model, diond.torch.Optimizer(groups, target=target, remote=kind.endswith("remote"),
                                        client_name="bench_step")


def run_block(model, opt, data, n, rec):
    for _ in range(n):
        x, y = data.batch("train", args.batch)
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        rec["step"].append(t2 - t0)
        rec["opt"].append(t2 - t1)
        last = getattr(opt, "last_step", None)
        if last is not None:
            rec["compute"].append(last.compute_micros / 1e6)
            rec["daemon"].append(last.total_micros / 1e6)


def med_ms(v):
    return 1000 * statistics.median(v) if v else float("nan")


def min_ms(v):
    return 1000 * min(v) if v else float("nan")


def main():
    global args
    ap = argparse.ArgumentParser()
    ap.add_argument("--target")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per configuration")
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = train_gpt.CharData(train_gpt.load_corpus([train_gpt.DEFAULT_CORPUS]), args.context, 0)
    daemon = None
    target = args.target
    if not target:
        import diond
        daemon = diond.Daemon(compute_threads=args.threads).start()
        target = daemon.target
    kinds = ["torch-adamw", "diond-adamw", "diond-adamw-remote", "diond-dion2"]
    setups = {k: make(args, data, k, target) for k in kinds}
    recs = {k: {"step": [], "opt": [], "compute": [], "daemon": []} for k in kinds}
    n_params = sum(p.numel() for p in setups[kinds[0]][0].parameters())
    for k in kinds:  # warm-up, not recorded
        run_block(*setups[k], data, args.warmup, {"step": [], "opt": [], "compute": [],
                                                   "daemon": []})
    done = 0
    while done < args.steps:
        n = min(args.block, args.steps - done)
        for k in kinds:
            run_block(*setups[k], data, n, recs[k])
        done += n
    for _, opt in setups.values():
        if hasattr(opt, "close"):
            opt.close()
    if daemon is not None:
        daemon.cleanup()

    base = med_ms(recs["torch-adamw"]["step"])
    base_opt = med_ms(recs["torch-adamw"]["opt"])
    print("model: GPT %d layers d=%d context %d batch %d (%.2fM params, %d tensors), torch %s, "
          "%d threads; %d steps each, medians" % (
              args.layers, args.d_model, args.context, args.batch, n_params / 1e6,
              len(list(setups["torch-adamw"][0].parameters())), torch.__version__, args.threads,
              args.steps))
    print("| configuration | step ms (median / min) | optimizer ms (median / min) | "
          "daemon compute ms | daemon other ms | client + transport ms | "
          "step overhead vs torch-adamw (median / min) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base_min = min_ms(recs["torch-adamw"]["step"])
    for k in kinds:
        r = recs[k]
        step, o = med_ms(r["step"]), med_ms(r["opt"])
        comp = med_ms(r["compute"])
        dmn = med_ms(r["daemon"])
        if r["daemon"]:
            client = 1000 * statistics.median(a - b for a, b in zip(r["opt"], r["daemon"]))
            cols = "%.2f | %.2f | %.2f" % (comp, dmn - comp, client)
        else:
            cols = "- | - | -"
        smin, omin = min_ms(r["step"]), min_ms(r["opt"])
        over = "baseline" if k == "torch-adamw" else "%+.1f ms (%+.0f%%) / %+.1f ms (%+.0f%%)" % (
            step - base, 100 * (step - base) / base, smin - base_min,
            100 * (smin - base_min) / base_min)
        print("| %s | %.1f / %.1f | %.2f / %.2f | %s | %s |" % (k, step, smin, o, omin, cols,
                                                                 over))
    print("optimizer-only difference, diond-adamw vs torch-adamw: %+.2f ms per step (median), "
          "%+.2f ms (min)" % (med_ms(recs["diond-adamw"]["opt"]) - base_opt,
                              min_ms(recs["diond-adamw"]["opt"]) - min_ms(recs["torch-adamw"]["opt"])))


if __name__ == "__main__":
    main()
