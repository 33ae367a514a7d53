"""A world of two daemons on ONE compute device, as scripts/gpu-check.sh runs it on a one-GPU
machine (DIOND_WORLD_DEVICE=cuda:0). NCCL refuses two ranks on one GPU (a duplicate device), so
the daemons exchange over Gloo, staged through host memory (--world_device_collectives=gloo),
while their steps run on the device. Two trainers step one world session and each must end with
the weights of one daemon on the same device, bit for bit (the owners' math is the same code on
the same device; the staged sums are the host collective's). On a device daemon the log must say
that the world exchanges over Gloo, and the daemon must really compute on that device.

Environment: DIOND_WORLD_DEVICE (--device; default "cpu": what CI runs), DIOND_CUDA_PLUGIN (the
plugin of a cuda device; the daemon's default lookup otherwise), DIOND_WORLD_COMPUTE (where the
steps must run, as the ready file names it; default: DIOND_WORLD_DEVICE when it is a cuda
device, else unchecked; "test-device:0" with DIOND_BINARY=diond_testdevice), DIOND_BINARY as for
every suite."""
import os
import threading

import pytest
import torch

import diond
import diond.torch
from test_world import _square_loss_steps

DEVICE = os.environ.get("DIOND_WORLD_DEVICE", "cpu")
PLUGIN = os.environ.get("DIOND_CUDA_PLUGIN", "")
COMPUTE = os.environ.get("DIOND_WORLD_COMPUTE", DEVICE if DEVICE.startswith("cuda") else "")


def _device_args():
    args = ["--world_device_collectives=gloo"]
    if DEVICE.startswith("cuda") and PLUGIN:
        args.append("--cuda_plugin=" + PLUGIN)
    return args


def _start(daemon_factory, **kw):
    d = daemon_factory(device=DEVICE, **kw)
    if COMPUTE:
        # A daemon that fell back to the CPU would pass without testing the device.
        assert d.ready.get("compute_device") == COMPUTE, (d.ready, d.log_tail())
    return d


def _world(daemon_factory):
    flags = ["--world_size=2", "--heartbeat_interval=200ms", "--peer_timeout=10s"]
    flags += _device_args()
    d0 = _start(daemon_factory, tcp=True, extra_args=flags + ["--rank=0"])
    port = d0.tcp_target.rsplit(":", 1)[1]
    d1 = _start(daemon_factory, extra_args=flags + ["--rank=1", "--coordinator=127.0.0.1:" + port])
    return [d0, d1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))


def _groups(model):
    mats = [p for p in model.parameters() if p.ndim == 2]
    vecs = [p for p in model.parameters() if p.ndim != 2]
    return [dict(params=mats), dict(params=vecs, algorithm="adamw", lr=1e-3)]


def _on_both_ranks(trainer, daemons):
    """trainer(rank) on a thread per rank; a failure is raised here with both daemons' logs."""
    errors = []

    def run(rank):
        try:
            trainer(rank)
        except Exception as e:  # surfaced below, with its rank
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a trainer hung"
    assert not errors, "%s\n%s\n%s" % (errors, daemons[0].log_tail(), daemons[1].log_tail())


def _train(opt, model, steps):
    for step in range(1, steps + 1):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.grad.copy_(torch.randn(p.shape, generator=g))
        opt.step()


@pytest.mark.parametrize("algorithm,sync,clip", [
    ("muon", "average", None), ("dion2", "replicated", None), ("muon", "average", 1.0)])
def test_a_world_of_two_on_one_device_matches_one_daemon(daemon_factory, algorithm, sync, clip):
    """With max_grad_norm (clip) the world's owners norm their averaged gradients (on a device
    daemon, on the device) and all-gather the squares: the same total as one daemon's, and the
    same clipped weights."""
    steps = 3
    ref_model = _model()
    ref_daemon = _start(daemon_factory, extra_args=_device_args())
    with diond.torch.Optimizer(_groups(ref_model), target=ref_daemon.target,
                               algorithm=algorithm, lr=0.02, max_grad_norm=clip) as ref:
        for p in ref_model.parameters():
            p.grad = torch.zeros_like(p)
        _train(ref, ref_model, steps)
        ref_norm = ref.last_grad_norm
    expected = [p.detach().clone() for p in ref_model.parameters()]
    if clip:
        assert ref_norm > 4 * clip, ref_norm  # every step clips
    norms = {}

    daemons = _world(daemon_factory)
    models = [_model(), _model()]

    def trainer(rank):
        model = models[rank]
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        # Both trainers hold the same gradients, so AVERAGE gives them back unchanged.
        with diond.torch.Optimizer(_groups(model), target=daemons[rank].target,
                                   algorithm=algorithm, lr=0.02, gradient_sync=sync,
                                   max_grad_norm=clip,
                                   world_key="one-device-%s-%s-%s" % (algorithm, sync, clip)) as opt:
            _train(opt, model, steps)
            norms[rank] = opt.last_grad_norm

    _on_both_ranks(trainer, daemons)
    for rank in (0, 1):
        for got, want in zip(models[rank].parameters(), expected):
            assert torch.equal(got.detach(), want), "rank %d differs from one daemon" % rank
        if clip:
            assert norms[rank] == ref_norm, (rank, norms[rank], ref_norm)
    if COMPUTE:
        for d in daemons:
            with open(d.log_path, errors="replace") as f:
                log = f.read()
            assert ("world: device sessions exchange over Gloo, staged through host memory "
                    "(--world_device_collectives=gloo)") in log, d.log_tail()


@pytest.mark.parametrize("params", ["cpu", "cuda"])
@pytest.mark.parametrize("algorithm,sync,clip", [
    ("muon", "average", None), ("dion2", "replicated", None), ("dion", "dion_compressed", None),
    ("muon", "average", 0.05)])
def test_overlapped_steps_of_a_world_on_one_device_equal_synchronous_ones(daemon_factory,
                                                                          algorithm, sync, clip,
                                                                          params):
    """overlap=True in the same world (docs/DISTRIBUTED.md "Overlapped step", "On device
    daemons": on a device daemon each bucket is reduced and exchanged in device buffers): each
    trainer's weights after 4 steps equal overlap=False's, bit for bit. Under AVERAGE each
    trainer has its own data; under REPLICATED both the same; under DION_COMPRESSED each rank
    steps Dion on its own data, averaging P and R bucket by bucket. With max_grad_norm (clip)
    the daemons clip the averaged gradients after the last bucket. CUDA parameters (CUDA
    arenas, an event pair per bucket) need the GPU daemons of the GPU check."""
    if params == "cuda" and not DEVICE.startswith("cuda"):
        pytest.skip("CUDA parameters need DIOND_WORLD_DEVICE=cuda:N (the GPU check)")
    dev = torch.device(DEVICE if params == "cuda" else "cpu")
    steps = 4
    daemons = _world(daemon_factory)
    models = {(rank, overlap): _model().to(dev) for rank in (0, 1) for overlap in (False, True)}
    result = {}

    def trainer(rank):
        for overlap in (False, True):
            model = models[(rank, overlap)]
            with diond.torch.Optimizer(
                    _groups(model), target=daemons[rank].target, algorithm=algorithm,
                    lr=0.02, gradient_sync=sync, overlap=overlap, overlap_bucket_bytes=1500,
                    max_grad_norm=clip,
                    world_key="one-device-ov-%s-%s-%s-%s" % (algorithm, sync, clip,
                                                             overlap)) as opt:
                _square_loss_steps(opt, model, steps,
                                   0 if sync == "replicated" else 1000 * rank, dev)
                if clip:
                    assert opt.last_grad_norm > clip, opt.last_grad_norm  # the clip engaged
            result[(rank, overlap)] = [p.detach().cpu() for p in model.parameters()]

    _on_both_ranks(trainer, daemons)
    for rank in (0, 1):
        for got, want in zip(result[(rank, True)], result[(rank, False)]):
            assert torch.equal(got, want), "rank %d: overlap=True differs" % rank
