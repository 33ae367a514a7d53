"""MEMFD arenas and the fd channel from Python (docs/DATA_PLANE.md), against a real daemon:
diond.torch.Optimizer picks a sealed memfd by default on Linux and trains bit for bit like the
shm arena; the memfd is sealed and shared in place; the daemon's refusals come back with their
codes; a daemon without an fd channel falls back to shm."""
import fcntl
import mmap
import os

import grpc
import pytest
import torch

import diond
import diond.torch
from diond import fdchannel
from diond.client import pb

from test_torch_optimizer import assert_bitwise, groups, make_model, snapshot, train

pytestmark = pytest.mark.skipif(not fdchannel.supported(), reason="memfd needs Linux")


def test_memfd_is_the_default_and_matches_shm_bitwise(daemon):
    runs = []
    for arena in (None, "shm"):
        model = make_model()
        with diond.torch.Optimizer(groups(model, ("dion2", "muon")), target=daemon.target,
                                   arena=arena) as opt:
            assert opt.arena == ("memfd" if arena is None else "shm")
            losses = train(model, opt, 5)
            sd = opt.state_dict()
        runs.append((snapshot(model), losses, sd))
    assert_bitwise(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    for i in runs[0][2]["state"]:
        for k in runs[0][2]["state"][i]:
            assert torch.equal(runs[0][2]["state"][i][k], runs[1][2]["state"][i][k])


def test_memfd_arena_is_sealed_and_shared_in_place(daemon):
    model = make_model()
    opt = diond.torch.Optimizer(groups(model), target=daemon.target, arena="memfd")
    fd = opt._shm.fd
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    assert os.readlink("/proc/self/fd/%d" % fd).startswith("/memfd:")
    # Bytes written through another mapping of the memfd show up in the parameter.
    other = mmap.mmap(fd, opt._shm.size)
    w = model[0].weight
    view = torch.frombuffer(other, dtype=torch.float32, count=w.numel(),
                            offset=opt._layout["p0"].param_offset_bytes).view(w.shape)
    view[0, 0] = 42.0
    assert w[0, 0].item() == 42.0
    del view
    other.close()
    before = snapshot(model)
    train(model, opt, 2)  # the daemon writes the new weights into the memfd
    assert not torch.equal(snapshot(model)[0], before[0])
    after = snapshot(model)
    opt.close()
    assert_bitwise(snapshot(model), after)
    model[0].weight.data.add_(1.0)  # ordinary tensors again


def _session(client):
    spec = pb.ParameterSpec(name="w", shape=[4, 4], dtype=pb.DTYPE_F32, group="g")
    group = pb.ParameterGroup(name="g", algorithm=pb.ALGORITHM_ADAMW)
    return client.create_session(parameters=[spec], groups=[group])


def test_fd_channel_refusals_keep_their_codes(daemon):
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        path = resp.fd_channel_socket
        assert path and pb.REGION_KIND_MEMFD in resp.region_kinds
        size = resp.param_arena_bytes
        r, w = os.pipe()
        try:
            token = fdchannel.send_fd(path, r)
            with pytest.raises(diond.DiondError) as e:
                c.register_memfd_region(resp.session_id, pb.REGION_ROLE_PARAMETERS, token, 0, size)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "is a pipe, not a memfd" in e.value.message
        finally:
            os.close(r)
            os.close(w)
        unsealed = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
        os.ftruncate(unsealed, size)
        token = fdchannel.send_fd(path, unsealed)
        os.close(unsealed)
        with pytest.raises(diond.DiondError) as e:
            c.register_memfd_region(resp.session_id, pb.REGION_ROLE_PARAMETERS, token, 0, size)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "lacks F_SEAL_SHRINK and F_SEAL_GROW" in e.value.message
        # A token is one-time, even after a refusal.
        with pytest.raises(diond.DiondError) as e:
            c.register_memfd_region(resp.session_id, pb.REGION_ROLE_PARAMETERS, token, 0, size)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "already used" in e.value.message
        with pytest.raises(diond.DiondError) as e:
            fdchannel.send_fd(path + ".missing", 0)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
        c.close_session(resp.session_id)


def test_daemon_without_fd_channel_falls_back_to_shm(daemon_factory):
    d = daemon_factory(extra_args=["--fd_channel_socket=none"])
    model = make_model()
    with diond.torch.Optimizer(groups(model), target=d.target) as opt:
        assert opt.arena == "shm"
        train(model, opt, 1)
    with pytest.raises(ValueError, match="offers no MEMFD regions"):
        diond.torch.Optimizer(groups(make_model()), target=d.target, arena="memfd")
    with pytest.raises(ValueError, match="arena must be"):
        diond.torch.Optimizer(groups(make_model()), target=d.target, arena="tmpfs")
