#!/usr/bin/env python3
"""Steps two or more diond binaries (e.g. main's and a branch's) on one workload, interleaved.

Same-run comparison for a change to the daemon: every round steps each daemon once with the same
gradients (and, with --reference, the reference optimizer too), so the ratios survive a machine
shared with other work better than timings taken one after the other. Prints, per side, the
median and min step time seen by the trainer (`diond.torch.Optimizer.step()`), its ratio to the
first binary, and the daemon's own `compute_micros` / `total_micros` of the step (StepResponse):
wall − total is the RPC and the client, total − compute the session's phases around the update
(validation, the finiteness scan, region checks). Also per side, from /proc, the daemon's
context switches per step (every thread's voluntary + involuntary switches: idle OpenMP
workers sleeping and being woken show up here, docs/TOOLCHAIN.md P22) and the CPUs it kept
busy while stepping (its CPU time ÷ the step's wall time). Workloads and reference settings are those of
bench/compare_reference.py (`--algo adamw`: every GPT-2-small parameter; the matrix rules: its
hidden matrices, fraction ¼ for dion2/dion3). Nothing asserts on time.

  PYTHONPATH=build/python:client/python /usr/bin/python3 bench/compare_daemons.py \\
      --diond old/bin/diond build/bin/diond --algo adamw --layers 1 --rounds 6 \\
      [--reference /path/to/dion]
"""
import argparse
import glob
import importlib
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import compare_reference as cr  # noqa: E402  (workloads, reference loader)


def switches(pid):
    """Context switches of every thread of `pid` so far (exited threads are not counted)."""
    n = 0
    for status in glob.glob("/proc/%d/task/*/status" % pid):
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        n += int(line.split()[1])
        except OSError:
            pass  # a thread that exited meanwhile
    return n


def cpu_seconds(pid):
    """utime + stime of the whole process (all threads, exited ones included)."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--diond", nargs="+", required=True, help="daemon binaries (first = base)")
    ap.add_argument("--algo", default="adamw",
                    choices=["adamw", "dion2", "dion3", "muon", "normuon", "dion_r1", "dion_r4"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16_reference"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reference", help="microsoft/dion checkout: step the reference too")
    args = ap.parse_args()
    if args.rounds < 1 or args.layers < 1:
        ap.error("--rounds >= 1, --layers >= 1")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch
    torch.set_num_threads(args.threads)
    import diond.daemon
    import diond.torch as dt

    if args.algo == "adamw":
        shapes, opts = cr.gpt2_shapes(args.layers), dict(algorithm="adamw")
    else:
        row = [r for r in cr.MATRIX_ROWS if r[0] == args.algo][0]
        shapes, opts = cr.matrix_shapes(args.layers), dict(algorithm=row[4], **row[5])
    work = cr.Workload(torch, shapes, pool=2)
    daemons, sides = [], []
    try:
        for b in args.diond:
            d = diond.daemon.Daemon(b, compute_threads=args.threads).start()
            daemons.append(d)
            ps = work.params()
            sides.append((b, dt.Optimizer([dict(params=ps)], target=d.target,
                                          precision=args.precision, **opts), ps, d.pid))
        if args.reference:
            cr.reference_classes(torch, args.reference)
            ps = work.params()
            if args.algo == "adamw":
                ref = torch.optim.AdamW(ps, lr=0.01, betas=(0.9, 0.95), weight_decay=0.01,
                                        eps=1e-8, foreach=True)
            else:
                mod = importlib.import_module("dion." + row[2])
                ref = getattr(mod, row[3])(ps, **row[5])
            sides.append(("reference", ref, ps, None))
        times = {i: [] for i in range(len(sides))}
        inner = {i: [] for i in range(len(sides))}
        procs = {i: [] for i in range(len(sides))}  # (switches, busy CPUs) per step
        for r in range(args.rounds + 1):  # round 0: warm-up (state creation, first touch)
            for i, (_, opt, ps, pid) in enumerate(sides):
                work.load_grads(ps, r)
                if pid is not None:
                    sw0, cpu0 = switches(pid), cpu_seconds(pid)
                t0 = time.perf_counter()
                opt.step()
                dt_s = time.perf_counter() - t0
                if r == 0:
                    continue
                times[i].append(dt_s)
                if pid is not None:
                    procs[i].append((switches(pid) - sw0, (cpu_seconds(pid) - cpu0) / dt_s))
                last = getattr(opt, "last_step", None)
                if last is not None:
                    inner[i].append((last.compute_micros / 1e6, last.total_micros / 1e6))
        n = sum(cr.numel(s) for s in shapes)
        base = statistics.median(times[0])
        print("%s %s, %d layers (%.1fM parameters), %d rounds, %d threads; 1-min load %s"
              % (args.algo, args.precision, args.layers, n / 1e6, args.rounds, args.threads,
                 open("/proc/loadavg").read().split()[0]))
        for i, (name, _, _, _) in enumerate(sides):
            med = statistics.median(times[i])
            line = "%-40s median %.4f s  min %.4f s  ÷ first %.3f" % (name, med, min(times[i]),
                                                                       med / base)
            if inner[i]:
                line += "  compute %.4f s  total %.4f s" % (
                    statistics.median(c for c, _ in inner[i]),
                    statistics.median(t for _, t in inner[i]))
            if procs[i]:
                line += "  %d switches/step  %.2f CPUs busy" % (
                    statistics.median(w for w, _ in procs[i]),
                    statistics.median(c for _, c in procs[i]))
            if args.algo == "adamw":
                line += "  %.1f GB/s at 28 B/param" % (28.0 * n / med / 1e9)
            print(line)
    finally:
        for _, opt, _, _ in sides:
            if hasattr(opt, "close"):
                opt.close()
        for d in daemons:
            d.stop()
            d.cleanup()


if __name__ == "__main__":
    main()
