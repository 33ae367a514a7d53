"""examples/python/bench_overlap.py runs end to end at tiny sizes: its table and JSON have the
documented shape and every ratio is a positive finite number. No timing is judged here."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import diond.torch

from conftest import REPO

EXAMPLE = os.path.join(REPO, "examples", "python", "bench_overlap.py")
TINY = ["--steps", "2", "--warmup", "1", "--block", "1", "--layers", "1", "--d-model", "32",
        "--heads", "2", "--context", "16", "--batch", "2"]
ALGORITHMS = ["muon", "dion2", "adamw"]


def check(result, overlap_built):
    assert result["fwd_bwd_ms"] > 0 and math.isfinite(result["fwd_bwd_ms"])
    assert [r["algorithm"] for r in result["rows"]] == ALGORITHMS
    assert result["model"]["layers"] == 1 and result["steps"] == 2
    for name, samples in result["samples"].items():
        assert len(samples) == 2, name
    for row in result["rows"]:
        assert row["sync_ms"] > 0 and math.isfinite(row["sync_ratio"]) and row["sync_ratio"] > 0
        assert 0 < row["sync_fwd_bwd_ms"] <= row["sync_ms"] and row["sync_wait_ms"] > 0
        if overlap_built:
            assert row["overlap"] == "measured", row
            assert math.isfinite(row["overlap_ratio"]) and row["overlap_ratio"] > 0
        else:
            # A refusal, never a number.
            assert row["overlap"] == "not built" and "overlap" in row["overlap_why"], row
            assert "overlap_ratio" not in row


@pytest.mark.parametrize("own_daemon", [False, True], ids=["target", "own-daemon"])
def test_bench_overlap_smoke(daemon, tmp_path, own_daemon):
    out = tmp_path / "bench.json"
    argv = [sys.executable, EXAMPLE, *TINY, "--json", str(out)]
    if not own_daemon:
        argv += ["--target", daemon.target]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    result = json.loads(out.read_text())
    check(result, overlap_built=True)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("model: GPT 1 layers d=32")
    assert lines[1].startswith("fwd+bwd alone: ")
    assert lines[2].startswith("| algorithm | sync step ms | sync ÷ fwd+bwd |")
    table = [ln for ln in lines if ln.startswith("| ") and "---" not in ln][1:]
    assert len(table) == len(ALGORITHMS)
    for ln in table:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert len(cells) == 8, ln
        assert float(cells[2]) > 0 and float(cells[7]) > 0
    if own_daemon and {0, 1} <= os.sched_getaffinity(0):
        assert result["pinned"] == {"trainer": [0], "daemon": [1]}
        c = result["contention"]
        assert c["alone_ms"] > 0 and c["busy_ms"] > 0
        assert any(ln.startswith("fwd+bwd with the daemon's CPU idle") for ln in lines)


def test_bench_overlap_says_not_built_where_refused(daemon, monkeypatch, capsys):
    """A client that refuses overlap=True (an older one, or a mode not built) gets "not built"
    in the column and the refusal's reason, and the synchronous columns still measured."""
    sys.path.insert(0, os.path.dirname(EXAMPLE))
    import bench_overlap

    class Refusing(diond.torch.Optimizer):
        def __init__(self, params, overlap=False, **kw):
            if overlap:
                raise ValueError("overlap=True is not built for this test")
            super().__init__(params, **kw)

    monkeypatch.setattr(diond.torch, "Optimizer", Refusing)
    # In-process: --no-pin keeps pytest's CPU affinity, and the thread count is put back.
    threads = torch.get_num_threads()
    try:
        result = bench_overlap.main([*TINY, "--target", daemon.target, "--no-pin"])
    finally:
        torch.set_num_threads(threads)
    check(result, overlap_built=False)
    assert set(result["samples"]) == {"fwd+bwd"} | set(ALGORITHMS)
    assert "overlap not built: diond.torch.Optimizer refused overlap=True" in \
        capsys.readouterr().out
