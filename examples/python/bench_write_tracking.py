#!/usr/bin/python3
"""Cost of noticing the trainer's own writes (diond.torch.Optimizer(track_writes=True), the
default): with fp32 master weights (and in remote mode) step() reads every parameter's torch
version counter and re-sends the written ones. Measured as the wall time of opt.step() with
tracking on and off, same optimizer, same model, blocks interleaved (A B A B ...), medians; plus
the scan alone. No parameter is written here, so this is the price every step pays.

    /usr/bin/python3 examples/python/bench_write_tracking.py [--blocks 48] [--steps 15]
"""
import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))

import torch  # noqa: E402

import diond  # noqa: E402
import diond.torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=48, help="Linear+LayerNorm blocks (4 params)")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15, help="steps per block")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--target", default=None)
    args = ap.parse_args()
    daemon = None if args.target else diond.Daemon(compute_threads=2).start()
    try:
        torch.manual_seed(0)
        layers = []
        for _ in range(args.blocks):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.LayerNorm(args.width)]
        model = torch.nn.Sequential(*layers).to(torch.bfloat16)
        mats = [p for p in model.parameters() if p.dim() == 2]
        vecs = [p for p in model.parameters() if p.dim() < 2]
        opt = diond.torch.Optimizer(
            [dict(params=mats, algorithm="muon", lr=0.01),
             dict(params=vecs, algorithm="adamw", lr=1e-3)],
            fp32_master_weights=True, target=args.target or daemon.target)
        x = torch.randn(16, args.width).to(torch.bfloat16)
        times = {True: [], False: []}
        for r in range(args.rounds):
            for track in (True, False):
                opt.track_writes = track
                for _ in range(args.steps):
                    opt.zero_grad()
                    model(x).float().pow(2).mean().backward()
                    t = time.perf_counter()
                    opt.step()
                    times[track].append(time.perf_counter() - t)
        params = list(model.parameters())
        scan = []
        for _ in range(200):
            t = time.perf_counter()
            [p._version for p in params]
            scan.append(time.perf_counter() - t)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print("parameters: %d (%d blocks of width %d, bf16, fp32 master weights)"
              % (len(params), args.blocks, args.width))
        print("opt.step() median: tracking on %.3f ms, off %.3f ms, ratio on/off %.3f"
              % (on * 1e3, off * 1e3, on / off))
        print("the version scan alone: %.1f us (%.2f%% of a step without tracking)"
              % (statistics.median(scan) * 1e6, 100 * statistics.median(scan) / off))
        opt.close()
    finally:
        if daemon is not None:
            daemon.stop()
            daemon.cleanup()


if __name__ == "__main__":
    main()
