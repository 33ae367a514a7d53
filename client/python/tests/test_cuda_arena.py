"""diond.torch.Optimizer over CUDA arenas against a GPU daemon (docs/DATA_PLANE.md "Python CUDA
arenas"). These tests need a GPU and a daemon built with the CUDA plugin next to it
(scripts/gpu-check.sh runs them); elsewhere they skip. The GPU-free half is test_cuda_region.py.

  * both kinds (VMM fd, legacy IPC), shm and remote mode on the same GPU daemon, fed the same
    gradient bytes, end bit for bit equal (the daemon steps every region kind with the same
    device kernels);
  * a model trained on the GPU through a CUDA arena follows the same model trained on the CPU
    over shm against a CPU daemon, within a derived tolerance;
  * gradients written late on the trainer's stream (behind torch.cuda._sleep) are the ones the
    daemon reads: the ready event orders them;
  * the allocation is freed on close, the fd closed after registration, the UUID from torch and
    from the driver agree; a daemon without fd channel gets legacy IPC; mixed devices refused;
  * overlap=True (per-bucket doorbells and interprocess events) trains as overlap=False does,
    bit for bit, on both kinds; so does the daemon-side clip (max_grad_norm), whose norm is
    the GPU's within 1e-5.
"""
import gc

import pytest
import torch

import diond
import diond.torch
from diond import cuda_arena, cudadrv

from test_overlap_step import groups_for
from test_torch_optimizer import assert_bitwise, batch, groups, make_model, mse, snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False)")

DEV = torch.device("cuda:0")
KINDS = ("cuda_vmm", "cuda_ipc")


@pytest.fixture(scope="module")
def gpu_daemon():
    d = diond.Daemon(device="cuda:0", compute_threads=2).start()
    yield d
    rc = d.stop()
    d.cleanup()
    assert rc == 0, "diond did not exit cleanly after SIGTERM: %s\n%s" % (rc, d.log_tail())


def _grads(step, model):
    """The same gradient bytes for every run (made on the CPU from a seeded generator)."""
    g = torch.Generator().manual_seed(500 + step)
    return [torch.randn(p.shape, generator=g) * 0.1 for p in model.parameters()]


def _feed(model, step):
    for p, g in zip(model.parameters(), _grads(step, model)):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        p.grad.copy_(g)


def test_cuda_arenas_step_like_shm_and_remote_bit_for_bit(gpu_daemon):
    runs = {}
    for mode in KINDS + ("shm", "remote"):
        model = make_model()
        if mode != "shm":
            model = model.to(DEV)
        kw = dict(remote=True) if mode == "remote" else dict(arena=mode)
        with diond.torch.Optimizer(groups(model, ("dion2", "muon")), target=gpu_daemon.target,
                                   **kw) as opt:
            assert opt.arena == (None if mode == "remote" else mode)
            for s in range(1, 5):
                opt.zero_grad()
                _feed(model, s)
                opt.step()
                assert not opt.last_step.skipped
            sd = opt.state_dict()
        runs[mode] = ([p.cpu() for p in snapshot(model)], sd)
    for mode in KINDS + ("remote",):
        assert_bitwise(runs[mode][0], runs["shm"][0])
        for i, st in runs["shm"][1]["state"].items():
            for k, v in st.items():
                assert torch.equal(runs[mode][1]["state"][i][k], v), (mode, i, k)


@pytest.mark.parametrize("kind", KINDS)
def test_gpu_training_follows_the_cpu_run_over_shm(gpu_daemon, daemon, kind):
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 GEMMs on both sides
    try:
        results = []
        for target, device, arena in ((daemon.target, "cpu", "shm"),
                                      (gpu_daemon.target, DEV, kind)):
            model = make_model().to(device)
            with diond.torch.Optimizer(groups(model, ("muon", "muon")), target=target,
                                       arena=arena) as opt:
                losses = []
                for s in range(1, 6):
                    x, y = batch(s)
                    opt.zero_grad()
                    loss = mse(model(x.to(device)), y.to(device))
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
            results.append(([p.detach().cpu() for p in model.parameters()], losses))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    # Tolerance: the GPU's fp32 forward/backward and the daemon's GPU kernels sum in other orders
    # than the CPU's, a relative error of about K * 2^-24 ~ 3e-6 (K <= 48) in each gradient. The
    # orthogonalizer (Polar Express, 5 iterations, slopes at most ~8.3, 4.1, 4.0, 3.3, 2.3)
    # amplifies it at most ~1000x in the update's smallest directions: <= 3e-3 in an update of
    # unit spectral norm, times lr 0.02 and the spectral-norm scale (<= 2) per step, 1.2e-4,
    # over 5 steps 6e-4. atol 2e-3 keeps a 3x margin and stays 10x under a wrong hand-off (a lost
    # or stale gradient moves weights by ~lr = 0.02 in one step).
    for i, (a, b) in enumerate(zip(results[0][0], results[1][0])):
        assert torch.allclose(a, b, rtol=0, atol=2e-3), "parameter %d: max |d| = %g" % (
            i, (a - b).abs().max().item())
    for la, lb in zip(results[0][1], results[1][1]):
        assert abs(la - lb) <= 1e-3 * max(1.0, abs(la)), (results[0][1], results[1][1])


def _late_gradient_run(gpu_daemon, kind, G, late, asynchronous):
    init = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)) * 0.1
    W = torch.nn.Parameter(init.to(DEV))
    with diond.torch.Optimizer([W], target=gpu_daemon.target, arena=kind, algorithm="adamw",
                               lr=0.01) as opt:
        opt.zero_grad()
        torch.cuda.synchronize()
        pending = None
        if late:
            # ~0.25 s of GPU time on the trainer's stream, then the gradient write behind it; the
            # host goes straight on to step(): only the ready event makes the daemon wait.
            torch.cuda._sleep(500_000_000)
            W.grad.copy_(G)
            written = torch.cuda.Event()
            written.record()
            pending = not written.query()
        else:
            W.grad.copy_(G)
            torch.cuda.synchronize()
        opt.step(asynchronous=asynchronous)
        if asynchronous:
            opt.synchronize()
        after = W.detach().clone()  # the current stream waited on "weights done"
    return after, pending


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_late_gradient_writes_are_ordered_by_the_ready_event(gpu_daemon, kind, asynchronous):
    G = (torch.randn(64, 64, generator=torch.Generator().manual_seed(8)) * 0.5).to(DEV)
    late, pending = _late_gradient_run(gpu_daemon, kind, G, True, asynchronous)
    assert pending, "the gradient write finished before step(): lengthen the sleep"
    synced, _ = _late_gradient_run(gpu_daemon, kind, G, False, asynchronous)
    zero, _ = _late_gradient_run(gpu_daemon, kind, torch.zeros_like(G), False, asynchronous)
    assert torch.equal(late, synced)
    assert not torch.equal(late, zero)  # a daemon that read the old (zero) gradient would differ


@pytest.mark.parametrize("kind", KINDS)
def test_arena_is_freed_on_close_and_the_fd_after_registration(gpu_daemon, kind):
    model = make_model().to(DEV)
    opt = diond.torch.Optimizer(groups(model), target=gpu_daemon.target, arena=kind)
    arena = opt._cuda_arena
    assert arena.kind == kind and arena.fd == -1 and len(arena.region_ids) == 2
    assert arena.plan.total_bytes % arena.granularity == 0
    base = arena.tensor.data_ptr()
    w = model[0].weight
    assert w.data_ptr() == base + opt._layout["p0"].param_offset_bytes
    assert w.grad.data_ptr() == base + arena.plan.grad_offset + opt._layout["p0"].grad_offset_bytes
    drv = cudadrv.load_driver()
    assert arena.uuid == drv.uuid(drv.device(0))  # torch's UUID (if it has one) = the driver's
    before = [p.detach().clone() for p in model.parameters()]
    opt.close()
    gc.collect()
    assert arena.freed
    assert_bitwise([p.detach() for p in model.parameters()], before)
    model[0].weight.data.add_(1.0)  # ordinary tensors again


def test_daemon_without_fd_channel_gets_legacy_ipc(daemon_factory):
    d = daemon_factory(device="cuda:0", extra_args=["--fd_channel_socket=none"])
    model = make_model().to(DEV)
    with diond.torch.Optimizer(groups(model), target=d.target) as opt:
        assert opt.arena == "cuda_ipc"
    with pytest.raises(ValueError, match="does not offer REGION_KIND_CUDA_VMM_FD"):
        diond.torch.Optimizer(groups(make_model().to(DEV)), target=d.target, arena="cuda_vmm")
    with pytest.raises(ValueError, match="arena='memfd' is host memory"):
        diond.torch.Optimizer(groups(make_model().to(DEV)), target=d.target, arena="memfd")


def test_mixed_devices_are_refused_by_name(gpu_daemon):
    model = make_model().to(DEV)
    model[4].bias.data = model[4].bias.data.cpu()
    with pytest.raises(ValueError, match=r"on 2 devices: .* on cuda:0; param group 2, parameter "
                                         r"2 \(shape \[8\]\) on cpu"):
        diond.torch.Optimizer(groups(model), target=gpu_daemon.target)
    if torch.cuda.device_count() > 1:
        model = make_model().to(DEV)
        model[4].weight.data = model[4].weight.data.to("cuda:1")
        with pytest.raises(ValueError, match="on cuda:1"):
            diond.torch.Optimizer(groups(model), target=gpu_daemon.target)


def test_cuda_arena_on_its_own_frees_on_error_and_close():
    arena = cuda_arena.CudaArena(DEV, "cuda_vmm", 1000, 500)
    assert arena.plan.grad_offset == 1024 and arena.fd >= 0
    t = arena.view(arena.plan.grad_offset, 500)
    t.fill_(3)
    assert int(arena.tensor[1024:1524].sum().item()) == 1500
    del t
    arena.close()
    gc.collect()
    assert arena.freed and arena.fd == -1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("algo", ["muon", "dion2", "adamw"])
def test_overlapped_step_on_cuda_arenas_equals_the_synchronous_one(gpu_daemon, kind, algo):
    runs = []
    for overlap in (False, True):
        model = make_model().to(DEV)
        with diond.torch.Optimizer(groups_for(model, algo), target=gpu_daemon.target,
                                   arena=kind, overlap=overlap,
                                   overlap_bucket_bytes=3000 if overlap else None) as opt:
            losses = []
            for s in range(1, 7):
                x, y = batch(s)
                opt.zero_grad()
                loss = mse(model(x.to(DEV)), y.to(DEV))
                loss.backward()
                opt.step()
                losses.append(loss.item())
            stats = opt.overlap_stats
            state = opt.state_dict()
        runs.append(([p.cpu() for p in snapshot(model)], losses, state, stats))
    sync, ov = runs
    assert ov[3]["buckets"] >= 2 and ov[3]["overlapped"] == 5 and ov[3]["synchronous"] == 0
    assert_bitwise(ov[0], sync[0])
    assert ov[1] == sync[1]
    for i, st in sync[2]["state"].items():
        for k, v in st.items():
            assert torch.equal(ov[2]["state"][i][k], v), (i, k)


@pytest.mark.parametrize("kind", KINDS)
def test_daemon_clip_on_cuda_arenas_follows_torch_and_overlaps(gpu_daemon, kind):
    """max_grad_norm on a device session: the GPU's norm (each gradient's in f32) within 1e-5 of
    the norm in double of the same gradients, the clip engaged, and overlap=True equal to
    overlap=False bit for bit."""
    runs = []
    for overlap in (False, True):
        model = make_model().to(DEV)
        with diond.torch.Optimizer(groups_for(model, "muon"), target=gpu_daemon.target,
                                   arena=kind, overlap=overlap, max_grad_norm=0.05,
                                   overlap_bucket_bytes=3000 if overlap else None) as opt:
            for s in range(1, 6):
                x, y = batch(s)
                opt.zero_grad()
                mse(model(x.to(DEV)), y.to(DEV)).backward()
                want = torch.stack([p.grad.double().norm() for p in model.parameters()
                                    if p.grad is not None]).norm().item()
                opt.step()
                opt.synchronize()
                assert want > 0.05, want  # the clip engages
                assert abs(opt.last_grad_norm - want) <= 1e-5 * want, (s, opt.last_grad_norm, want)
            stats = opt.overlap_stats
        runs.append(([p.cpu() for p in snapshot(model)], stats))
    # The first step records backward's order: the other 4 overlap.
    assert runs[1][1]["overlapped"] == 4 and runs[1][1]["synchronous"] == 0
    assert_bitwise(runs[1][0], runs[0][0])
