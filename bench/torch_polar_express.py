"""Plain-PyTorch bf16 Polar Express (eager, CPU) on the benchmark shapes, for comparison.

Written from ALGORITHMS.md §3.3 (not copied from microsoft/dion): Y = bf16(G); tall inputs use
A = YᵀY; Y /= (1.02·‖Y‖_F + ε); 5 iterations Y = a·Y + B·Y (or Y·B) with B = b·A + c·A·A.
Prints one JSON object per shape: {"m", "n", "threads", "ms", "eff_gflops"}.
Usage: /usr/bin/python3 bench/torch_polar_express.py [--threads N] [--min-time S]
"""
import argparse
import json
import time

import torch

COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def polar_express(g, eps=1e-8):
    x = g.to(torch.bfloat16)
    tall = g.size(-2) > g.size(-1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + eps)
    for a, b, c in COEFFS:
        if tall:
            A = x.mT @ x
            B = b * A + c * (A @ A)
            x = a * x + x @ B
        else:
            A = x @ x.mT
            B = b * A + c * (A @ A)
            x = a * x + B @ x
    return x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-time", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    for m, n in [(1024, 1024), (1024, 4096), (4096, 1024)]:
        g = torch.randn(m, n)
        polar_express(g)  # warm-up
        iters, total = 0, 0.0
        while total < args.min_time or iters < 2:
            t0 = time.perf_counter()
            polar_express(g)
            total += time.perf_counter() - t0
            iters += 1
        s, l = min(m, n), max(m, n)
        flop = 5 * (4 * s * s * l + 2 * s ** 3)
        ms = total / iters * 1e3
        print(json.dumps({"m": m, "n": n, "threads": args.threads, "ms": ms,
                          "eff_gflops": flop / (ms / 1e3) / 1e9,
                          "torch": torch.__version__}))


if __name__ == "__main__":
    main()
