#!/usr/bin/python3
"""How much of the optimizer step a trainer waits for: the step time of train_gpt.py's model
through diond, divided by forward plus backward alone, with the trainer on one core and the
daemon on the other.

The model is bigger than the demo's: 6 layers, d=256, 8 heads (4.79M parameters against 0.82M),
with the demo's context 64 and batch 16, so 1024 tokens a step; one forward and backward takes
roughly 150-300 ms on one core of a 2-core AMD EPYC (Zen 4). Tokens a step against width set how
large the optimizer's share is (Muon's cost grows with d^3 per matrix, forward and backward with
tokens x d^2), so a smaller batch makes every algorithm look worse than in real training.

Configurations (same model and seed, same batches):
  fwd+bwd        forward, zero_grad, backward; no optimizer (the denominator)
  muon           diond.torch.Optimizer with the example's groups: Muon for the hidden matrices
                 of the blocks, AdamW for embeddings, LM head and norms (train_gpt.param_groups)
  dion2          the same groups with Dion2
  adamw          every parameter AdamW, one group
  <algo>+overlap the same with diond.torch.Optimizer(..., overlap=True), which is meant to run
                 the update while backward goes on. Where the client refuses overlap=True, the
                 column says "not built" and no configuration runs.

A step's time is the interval from one iteration's start to the next's, and each block ends by
waiting for its last update (opt.synchronize()), so waits that an overlapped step moves into the
next forward are counted. Blocks are interleaved (A B C ... A B C ...) so that load from other
processes hits every configuration alike; medians are reported, and the ratios are the result.

Pinning: the trainer runs on --trainer-cpu (os.sched_setaffinity, torch.set_num_threads(1)); the
daemon it starts inherits --daemon-cpu as under `taskset -c 1` and gets --compute_threads=1. With
--target the daemon is yours to pin, e.g.
    taskset -c 1 diond --compute_threads=1 --listen=unix:/tmp/d/diond.sock

    /usr/bin/python3 examples/python/bench_overlap.py [--steps 40] [--warmup 3] [--json out.json]

On a GPU (scripts/gpu-check.sh's step overlap_bench): --device cuda:0 --target unix:SOCKET of a
daemon started with --device=cuda:0. The model and batches live on the GPU and the arenas are
CUDA arenas; nothing is pinned, and each iteration ends with torch.cuda.synchronize() (the
trainer's own work only: an overlapped step's weights are waited for by the next forward), after
backward too, so that forward plus backward can be told apart.
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import train_gpt  # noqa: E402

ALGORITHMS = ("muon", "dion2", "adamw")
GOAL = 1.10  # overlapped step / fwd+bwd


def groups_for(model, algo):
    if algo == "adamw":
        return [dict(params=list(model.parameters()), algorithm="adamw", lr=3e-3,
                     betas=(0.9, 0.95), weight_decay=0.0, name="all")]
    return train_gpt.param_groups(model, argparse.Namespace(optimizer=algo, lr=0.02,
                                                            adam_lr=3e-3))


def new_model(args, vocab):
    torch.manual_seed(0)
    return train_gpt.GPT(vocab, args.context, args.d_model, args.layers,
                         args.heads).to(args.device)


def make_optimizer(model, algo, target, overlap, bucket_bytes=None):
    import diond.torch
    kw = {"overlap": True} if overlap else {}
    if overlap and bucket_bytes:
        kw["overlap_bucket_bytes"] = bucket_bytes
    return diond.torch.Optimizer(groups_for(model, algo), target=target, weight_decay=0.01,
                                 client_name="bench_overlap", **kw)


def try_overlap(model, algo, target, bucket_bytes):
    """(optimizer, None), or (None, why) when this client or daemon has no overlap=True."""
    import diond
    try:
        return make_optimizer(model, algo, target, overlap=True,
                              bucket_bytes=bucket_bytes), None
    except (TypeError, ValueError, diond.DiondError) as e:
        # Only a refusal of the option itself means "not built"; anything else is a real error.
        if "overlap" not in str(e):
            raise
        return None, "%s: %s" % (type(e).__name__, str(e).split(";")[0])


def _sync(model):
    p = next(model.parameters())
    if p.device.type == "cuda":
        torch.cuda.synchronize(p.device)


def draw(data, args):
    x, y = data.batch("train", args.batch)
    return x.to(args.device), y.to(args.device)


def run_block(model, opt, batches, rec):
    _sync(model)
    t = time.perf_counter()
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        # After forward, as in train_gpt.py: an overlapped step's gradients are free by then.
        if opt is None:
            # Zeroed in place, not freed: backward then accumulates into the same tensors, as
            # into the arena, so the denominator pays no allocation the optimizers do not.
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        loss.backward()
        _sync(model)
        t_bwd = time.perf_counter()
        if opt is not None:
            opt.step()
            last = getattr(opt, "last_step", None)
            if last is not None and not getattr(last, "queued", False):
                rec["compute"].append(last.compute_micros / 1e6)
        if opt is not None and i == len(batches) - 1:
            opt.synchronize()  # the block's last update lands inside its own timing
        _sync(model)
        now = time.perf_counter()
        rec["fb"].append(t_bwd - t)
        rec["step"].append(now - t)
        t = now


_HOG = ("import os, torch\nos.sched_setaffinity(0, {%d})\ntorch.set_num_threads(1)\n"
        "a = torch.randn(512, 512)\nwhile True:\n    a = torch.tanh(a @ a * 0.01)\n")


def contention(args, model, batches):
    """Forward plus backward with the daemon's CPU idle, then with a busy loop pinned to it:
    what any work the daemon does during backward costs the trainer on this machine (two
    vCPUs may share a physical core). None when nothing is pinned."""
    import subprocess
    if not args.pinned:
        return None
    alone = {"step": [], "fb": [], "compute": []}
    run_block(model, None, batches, alone)
    hog = subprocess.Popen([sys.executable, "-c", _HOG % args.daemon_cpu])
    try:
        time.sleep(0.5)
        busy = {"step": [], "fb": [], "compute": []}
        run_block(model, None, batches, busy)
    finally:
        hog.kill()
        hog.wait()
    return dict(alone_ms=med_ms(alone["step"]), busy_ms=med_ms(busy["step"]))


def pin(args):
    """Trainer on trainer_cpu; returns the CPU set a daemon started now should inherit, or None
    when this process may not use both CPUs (then nothing is pinned)."""
    if args.no_pin or not hasattr(os, "sched_setaffinity") or \
            args.trainer_cpu == args.daemon_cpu or \
            not {args.trainer_cpu, args.daemon_cpu} <= os.sched_getaffinity(0):
        return None
    return {args.daemon_cpu}


def daemon_cpus(pid):
    """Union of the CPUs the daemon's threads may run on (/proc), or None."""
    cpus = set()
    try:
        for tid in os.listdir("/proc/%d/task" % pid):
            cpus |= os.sched_getaffinity(int(tid))
    except OSError:
        return None
    return cpus


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def med_ms(v):
    return 1000 * statistics.median(v) if v else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="an existing daemon (unix:/path); default: start one")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="unrecorded steps per configuration")
    ap.add_argument("--block", type=int, default=5, help="steps per interleaved block")
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON here")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--corpus", nargs="+", default=[train_gpt.DEFAULT_CORPUS],
                    help="text files or folders the batches are drawn from")
    ap.add_argument("--device", default="cpu",
                    help="the model's device: cpu, or cuda:N with --target a GPU daemon's")
    ap.add_argument("--trainer-cpu", type=int, default=0)
    ap.add_argument("--daemon-cpu", type=int, default=1)
    ap.add_argument("--no-pin", action="store_true", help="leave both processes unpinned")
    ap.add_argument("--bucket-bytes", type=int, default=None,
                    help="overlap_bucket_bytes of the overlapped configurations (default: the "
                         "client's: 1/64 of the parameters' bytes, from 256 KiB)")
    ap.add_argument("--algorithms", default=",".join(ALGORITHMS),
                    help="which of %s to run (comma-separated)" % ", ".join(ALGORITHMS))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the trainer and --compute_threads of the daemon it "
                         "starts (with --no-pin: how sharing every core behaves)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.block < 1 or args.warmup < 0:
        ap.error("--steps and --block must be >= 1, --warmup >= 0")
    if args.threads < 1:
        ap.error("--threads must be >= 1")
    args.device = torch.device(args.device)
    if args.device.type == "cuda":
        if not args.target:
            ap.error("--device cuda needs --target: a daemon started with --device=cuda:N")
        args.no_pin = True
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    if not args.algorithms or set(args.algorithms) - set(ALGORITHMS):
        ap.error("--algorithms takes some of %s" % ", ".join(ALGORITHMS))
    torch.set_num_threads(args.threads)
    daemon_set = pin(args)
    args.pinned = daemon_set is not None
    import diond
    daemon, target = None, args.target
    if not target:
        if daemon_set is not None:
            os.sched_setaffinity(0, daemon_set)  # inherited by the daemon, as taskset does
        try:
            daemon = diond.Daemon(compute_threads=args.threads).start()
        finally:
            if daemon_set is not None:
                os.sched_setaffinity(0, {args.trainer_cpu})
        target = daemon.target
    elif daemon_set is not None:
        os.sched_setaffinity(0, {args.trainer_cpu})
    pinned = dict(trainer=sorted(os.sched_getaffinity(0)),
                  daemon=sorted(daemon_cpus(daemon.pid) or []) if daemon else "external")
    load0 = os.getloadavg()
    try:
        result = measure(args, target, pinned, load0)
    finally:
        if daemon is not None:
            daemon.cleanup()
    report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def measure(args, target, pinned, load0):
    data = train_gpt.CharData(train_gpt.load_corpus(args.corpus), args.context, 0)
    setups = {"fwd+bwd": (new_model(args, data.vocab), None)}
    overlap_why = {}
    try:
        for algo in args.algorithms:
            m = new_model(args, data.vocab)
            setups[algo] = (m, make_optimizer(m, algo, target, overlap=False))
            m = new_model(args, data.vocab)
            opt, why = try_overlap(m, algo, target, args.bucket_bytes)
            if opt is None:
                overlap_why[algo] = why
            else:
                setups[algo + "+overlap"] = (m, opt)
        kinds = list(setups)
        recs = {k: {"step": [], "fb": [], "compute": []} for k in kinds}
        model0 = setups["fwd+bwd"][0]
        n_params = sum(p.numel() for p in model0.parameters())
        n_tensors = len(list(model0.parameters()))
        for k in kinds:  # warm-up, not recorded
            batches = [draw(data, args) for _ in range(args.warmup)]
            if batches:
                run_block(*setups[k], batches, {"step": [], "fb": [], "compute": []})
        done = 0
        while done < args.steps:
            n = min(args.block, args.steps - done)
            # Every configuration gets the same batches, drawn before the clock starts.
            batches = [draw(data, args) for _ in range(n)]
            for k in kinds:
                run_block(*setups[k], batches, recs[k])
            done += n
        probe = contention(args, model0, [draw(data, args) for _ in range(8)])
    finally:
        for _, opt in setups.values():
            if opt is not None:
                opt.close()
    base = med_ms(recs["fwd+bwd"]["step"])
    rows = []
    for algo in args.algorithms:
        sync = med_ms(recs[algo]["step"])
        # The step's own fwd+bwd (zero_grad into the shared gradients included) and the wait
        # after it, so that a ratio can be told from the daemon's compute.
        row = dict(algorithm=algo, groups=describe_groups(algo), sync_ms=sync,
                   sync_ratio=sync / base, sync_fwd_bwd_ms=med_ms(recs[algo]["fb"]),
                   sync_wait_ms=med_ms([a - b for a, b in zip(recs[algo]["step"],
                                                              recs[algo]["fb"])]),
                   daemon_compute_ms=med_ms(recs[algo]["compute"]))
        if algo in overlap_why:
            row.update(overlap="not built", overlap_why=overlap_why[algo])
        else:
            ov = med_ms(recs[algo + "+overlap"]["step"])
            row.update(overlap="measured", overlap_ms=ov, overlap_ratio=ov / base)
        rows.append(row)
    return dict(
        model=dict(layers=args.layers, d_model=args.d_model, heads=args.heads,
                   context=args.context, batch=args.batch, vocab=data.vocab,
                   parameters=n_params, tensors=n_tensors),
        steps=args.steps, warmup=args.warmup, block=args.block, torch=torch.__version__,
        device=str(args.device),
        gpu=torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else None,
        bucket_bytes=args.bucket_bytes, threads=args.threads,
        torch_threads=torch.get_num_threads(), cpu=cpu_model(), cpus=os.cpu_count(),
        pinned=pinned, load_before=list(load0), load_after=list(os.getloadavg()),
        fwd_bwd_ms=base, goal=GOAL, rows=rows, contention=probe,
        samples={k: [1000 * s for s in r["step"]] for k, r in recs.items()})


def describe_groups(algo):
    if algo == "adamw":
        return "AdamW on every parameter"
    return "%s on the blocks' matrices, AdamW on the rest" % {"muon": "Muon",
                                                              "dion2": "Dion2"}[algo]


def fmt_ratio(r):
    return "%.2f" % r if math.isfinite(r) else "nan"


def report(r):
    m = r["model"]
    print("model: GPT %d layers d=%d %d heads context %d batch %d (%.2fM parameters, %d tensors), "
          "torch %s, %d thread; %s, %d CPUs; trainer on CPUs %s, daemon on %s; %d steps each "
          "(blocks of %d, %d warm-up), medians; load %s -> %s" % (
              m["layers"], m["d_model"], m["heads"], m["context"], m["batch"],
              m["parameters"] / 1e6, m["tensors"], r["torch"], r["torch_threads"], r["cpu"],
              r["cpus"], r["pinned"]["trainer"], r["pinned"]["daemon"], r["steps"], r["block"],
              r["warmup"], " ".join("%.2f" % x for x in r["load_before"]),
              " ".join("%.2f" % x for x in r["load_after"])))
    if r.get("gpu"):
        print("device: %s (%s)" % (r["device"], r["gpu"]))
    print("fwd+bwd alone: %.1f ms" % r["fwd_bwd_ms"])
    print("| algorithm | sync step ms | sync ÷ fwd+bwd | its fwd+bwd ms | step() wait ms | "
          "daemon compute ms | overlap step ms | overlap ÷ fwd+bwd (goal <= %.2f) |" % r["goal"])
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in r["rows"]:
        if row["overlap"] == "not built":
            ov = "not built | not built"
        else:
            ov = "%.1f | %s" % (row["overlap_ms"], fmt_ratio(row["overlap_ratio"]))
        print("| %s | %.1f | %s | %.1f | %.1f | %.1f | %s |" % (
            row["groups"], row["sync_ms"], fmt_ratio(row["sync_ratio"]), row["sync_fwd_bwd_ms"],
            row["sync_wait_ms"], row["daemon_compute_ms"], ov))
    c = r.get("contention")
    if c:
        print("fwd+bwd with the daemon's CPU idle: %.1f ms; with a busy loop on it: %.1f ms "
              "(x%.2f): what the daemon's work during backward costs the trainer here"
              % (c["alone_ms"], c["busy_ms"], c["busy_ms"] / c["alone_ms"]))
    why = {row["overlap_why"] for row in r["rows"] if row["overlap"] == "not built"}
    for w in sorted(why):
        print("overlap not built: diond.torch.Optimizer refused overlap=True (%s)" % w)


if __name__ == "__main__":
    main()
