"""bf16_reference's matmul engine (group option bf16_matmul, docs/CONFORMANCE.md "bf16 matmul
engine"): the value reaches the daemon, auto resolves as PyTorch's own check would on this CPU,
and bad values or groups without a bf16 path are refused by name before anything is sent.
"""
import numpy as np
import pytest
import torch

import diond.errors
import diond.torch


def relf(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def steps(daemon, algorithm="muon", shape=(384, 256), n=3, **options):
    g = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(0.02 * torch.randn(shape, generator=g))
    grads = [torch.randn(shape, generator=g) for _ in range(n)]
    with diond.torch.Optimizer([p], target=daemon.target, algorithm=algorithm,
                               precision="bf16_reference", **options) as opt:
        for grad in grads:
            p.grad.copy_(grad)
            opt.step()
        return p.detach().clone()


def avx512_core():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    return False


# Dion2 at fraction 1/2: 192 of the 384 rows, so that its Polar Express sums 256 products per Gram
# entry over a 192x192 Gram. At the default 1/4 (a 96x96 Gram) both engines gave the same bits
# on an AMD EPYC with avx512_bf16 (0 of 98,304 elements differ after 3 steps), while 1/2 differs
# in 47,812 there and Muon's full 384x256 in 96,857.
@pytest.mark.parametrize("algorithm,options", [("muon", {}), ("dion2", {"fraction": 0.5})],
                         ids=["muon", "dion2"])
def test_engines_differ_in_order_only_and_auto_follows_the_cpu(daemon, algorithm, options):
    f32 = steps(daemon, algorithm, bf16_matmul="float32_gemm", **options)
    auto = steps(daemon, algorithm, **options)  # the default
    assert torch.equal(steps(daemon, algorithm, bf16_matmul="auto", **options), auto)
    if not avx512_core():
        # oneDNN 2.6 has no bf16 matmul without the AVX-512 core: auto is the float32 GEMM, and
        # asking for oneDNN by name is refused with the reason, not answered with other numbers.
        assert torch.equal(auto, f32)
        with pytest.raises(diond.errors.DiondError, match="FAILED_PRECONDITION.*AVX-512"):
            steps(daemon, algorithm, bf16_matmul="onednn", **options)
        return
    dnn = steps(daemon, algorithm, bf16_matmul="onednn", **options)
    # Another float32 accumulation order: bf16 roundings flip somewhere in 3 steps of a 384x256
    # Polar Express (were the option ignored, the two would be identical), yet the updates agree
    # to bf16 accuracy.
    assert not torch.equal(f32, dnn)
    p0 = 0.02 * torch.randn((384, 256), generator=torch.Generator().manual_seed(3))
    assert relf(dnn - p0, f32 - p0) < 0.05
    assert torch.equal(auto, dnn)


def test_bad_values_and_groups_without_a_bf16_path_are_refused(daemon):
    p = torch.nn.Parameter(torch.zeros(8, 4))
    with pytest.raises(ValueError, match="bf16_matmul"):
        diond.torch.Optimizer([p], target=daemon.target, bf16_matmul="mkldnn")
    for algorithm in ("dion", "adamw"):
        with pytest.raises(ValueError, match="bf16_matmul"):
            diond.torch.Optimizer([p], target=daemon.target, algorithm=algorithm,
                                  bf16_matmul="onednn")
