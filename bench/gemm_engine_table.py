#!/usr/bin/env python3
"""Per-shape f32 engine ratios from diond_bench's BM_F32Gemm / BM_F32Symmetric rows.

  build/bench/diond_bench --benchmark_filter='BM_F32' --benchmark_format=csv | \\
      python3 bench/gemm_engine_table.py

Prints, per shape, GFLOP/s of OpenBLAS and oneDNN (each the median over repetitions when the
run used --benchmark_repetitions) and their time ratio oneDNN ÷ OpenBLAS (< 1: oneDNN faster).
"""
import csv
import statistics
import sys


def main():
    rows = {}
    header = None
    for row in csv.reader(sys.stdin):
        if row and row[0] == "name":
            header = row
            continue
        if not header or not row or not row[0].startswith("BM_F32"):
            continue
        d = dict(zip(header, row))
        name = d["name"]
        if name.endswith(("_mean", "_median", "_stddev", "_cv")):
            continue
        kind, engine, rest = name.split("/", 2)
        shape = rest.split("/min_time")[0]
        try:
            g = float(d["GFLOP/s"])
        except (KeyError, ValueError):
            continue
        rows.setdefault((kind, shape), {}).setdefault(engine, []).append(g)
    print(f"{'case':<72} {'openblas':>9} {'onednn':>9} {'dnn/blas time':>14}")
    for (kind, shape), e in rows.items():
        blas = statistics.median(e.get("openblas", [0])) or 0
        dnn = statistics.median(e.get("onednn", [0])) or 0
        ratio = blas / dnn if dnn else float("nan")
        print(f"{kind + '/' + shape:<72} {blas:9.1f} {dnn:9.1f} {ratio:14.2f}")


if __name__ == "__main__":
    main()
