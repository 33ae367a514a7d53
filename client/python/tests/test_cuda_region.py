"""The parts of the Python CUDA arenas that need no GPU (docs/DATA_PLANE.md "Python CUDA
arenas"): the allocation plan against hand-computed layouts and the C++ PlanCudaArena rules, the
RegisterRegion requests and their validation, the CPU daemon's refusal of CUDA regions and events
surfacing as DiondError, the refusal of mixed devices and of arena kinds that do not fit, and the
driver loader's error without libcuda.so.1. The GPU half is test_cuda_arena.py."""
import ctypes.util
import os
from multiprocessing import shared_memory

import grpc
import pytest
import torch

import diond
import diond.torch
from diond import cuda_arena, cudadrv, fdchannel
from diond.client import pb
from diond.cuda_region import (cuda_ipc_region_request, cuda_vmm_region_request,
                               format_uuid, plan_cuda_arena)

HANDLE = bytes((i * 7) % 256 for i in range(64))
UUID = bytes(255 - i for i in range(16))


def test_plan_matches_hand_computed_layouts():
    # Gradients at the first multiple of 256 at or after the parameters; the whole rounded up to
    # the granularity (the C++ client's PlanCudaArena cases, plus exact multiples).
    assert plan_cuda_arena(1000, 500, 1) == (0, 1024, 1524)
    assert plan_cuda_arena(1000, 500, 2 << 20) == (0, 1024, 2 << 20)
    assert plan_cuda_arena(3 << 20, 1 << 20, 2 << 20) == (0, 3 << 20, 4 << 20)
    assert plan_cuda_arena(256, 256, 1) == (0, 256, 512)
    assert plan_cuda_arena(257, 1, 512) == (0, 512, 1024)
    assert plan_cuda_arena(2 << 20, 2 << 20, 2 << 20) == (0, 2 << 20, 4 << 20)
    for g in (3, 0, -4, 6, 1.0, True):
        with pytest.raises(ValueError, match="not a positive power of two"):
            plan_cuda_arena(1000, 500, g)
    with pytest.raises(ValueError, match="empty arena"):
        plan_cuda_arena(0, 500, 1)
    with pytest.raises(ValueError, match="empty arena"):
        plan_cuda_arena(1000, 0, 1)


def _session(client, shapes=((48, 24), (5,), (32, 48))):
    specs = [pb.ParameterSpec(name="p%d" % i, shape=list(s), dtype=pb.DTYPE_F32, group="g")
             for i, s in enumerate(shapes)]
    group = pb.ParameterGroup(name="g", algorithm=pb.ALGORITHM_ADAMW)
    return client.create_session(parameters=specs, groups=[group])


def test_plan_of_a_daemon_layout_keeps_every_tensor_inside_its_arena(daemon):
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        c.close_session(resp.session_id)
    for g in (1, 4096, 2 << 20):
        plan = plan_cuda_arena(resp.param_arena_bytes, resp.grad_arena_bytes, g)
        assert plan.grad_offset >= resp.param_arena_bytes
        assert plan.grad_offset % 256 == 0 and plan.grad_offset - resp.param_arena_bytes < 256
        assert plan.total_bytes % g == 0
        assert plan.total_bytes >= plan.grad_offset + resp.grad_arena_bytes
        assert plan.total_bytes - (plan.grad_offset + resp.grad_arena_bytes) < g
        for t in resp.layout:
            n = 4 * max(1, _numel(t.shape))
            assert t.param_offset_bytes + n <= resp.param_arena_bytes
            assert plan.grad_offset + t.grad_offset_bytes + n <= plan.total_bytes


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_ipc_request_carries_the_handle_uuid_and_range():
    r = cuda_ipc_region_request("s-1", pb.REGION_ROLE_GRADIENTS, HANDLE, UUID, 1024, 500)
    assert r.session_id == "s-1" and r.role == pb.REGION_ROLE_GRADIENTS
    assert r.kind == pb.REGION_KIND_CUDA_IPC and r.WhichOneof("region") == "cuda_ipc"
    assert r.cuda_ipc.mem_handle == HANDLE and r.cuda_ipc.gpu_uuid == UUID
    assert (r.cuda_ipc.offset_bytes, r.cuda_ipc.size_bytes) == (1024, 500)
    back = pb.RegisterRegionRequest.FromString(r.SerializeToString())
    assert back == r
    assert cuda_ipc_region_request("s", 2, bytearray(HANDLE), UUID, 0, 1).cuda_ipc.mem_handle \
        == HANDLE
    with pytest.raises(ValueError, match="memory handle is 64 bytes, got 63"):
        cuda_ipc_region_request("s", 2, HANDLE[:63], UUID, 0, 1)
    with pytest.raises(ValueError, match="memory handle is 64 bytes, got 65"):
        cuda_ipc_region_request("s", 2, HANDLE + b"x", UUID, 0, 1)
    with pytest.raises(ValueError, match="GPU UUID is 16 bytes, got 15"):
        cuda_ipc_region_request("s", 2, HANDLE, UUID[:15], 0, 1)
    with pytest.raises(TypeError, match="must be bytes, got str"):
        cuda_ipc_region_request("s", 2, HANDLE, "GPU-" + "0" * 12, 0, 1)
    with pytest.raises(ValueError, match="offset 100 and size 1"):
        cuda_ipc_region_request("s", 2, HANDLE, UUID, 100, 1)
    with pytest.raises(ValueError, match="offset 0 and size 0"):
        cuda_ipc_region_request("s", 2, HANDLE, UUID, 0, 0)
    with pytest.raises(ValueError, match="offset -256"):
        cuda_ipc_region_request("s", 2, HANDLE, UUID, -256, 1)


def test_vmm_request_carries_the_token_and_granularity():
    r = cuda_vmm_region_request("s-2", pb.REGION_ROLE_PARAMETERS, "tok", b"\x09" * 16, 0, 4096,
                                2 << 20)
    assert r.kind == pb.REGION_KIND_CUDA_VMM_FD and r.WhichOneof("region") == "cuda_vmm_fd"
    v = r.cuda_vmm_fd
    assert (v.fd_token, v.granularity_bytes, v.size_bytes, v.offset_bytes) == (
        "tok", 2 << 20, 4096, 0)
    assert v.gpu_uuid == b"\x09" * 16
    with pytest.raises(ValueError, match="needs the fd channel's token"):
        cuda_vmm_region_request("s", 2, "", UUID, 0, 1, 1)
    with pytest.raises(ValueError, match="granularity 6 is not"):
        cuda_vmm_region_request("s", 2, "t", UUID, 0, 1, 6)
    with pytest.raises(ValueError, match="GPU UUID is 16 bytes, got 17"):
        cuda_vmm_region_request("s", 2, "t", UUID + b"\0", 0, 1, 1)
    with pytest.raises(ValueError, match="offset 8 and size 1"):
        cuda_vmm_region_request("s", 2, "t", UUID, 8, 1, 1)
    assert format_uuid(bytes(range(16))) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"


def test_cpu_daemon_refuses_cuda_regions_with_failed_precondition(daemon):
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        sid, size = resp.session_id, resp.param_arena_bytes
        assert pb.REGION_KIND_CUDA_IPC not in resp.region_kinds
        assert pb.REGION_KIND_CUDA_VMM_FD not in resp.region_kinds
        with pytest.raises(diond.DiondError) as e:
            c.register_cuda_ipc_region(sid, pb.REGION_ROLE_PARAMETERS, HANDLE, UUID, 0, size)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert e.value.method == "RegisterRegion"
        assert "REGION_KIND_CUDA_IPC needs a daemon that computes on a GPU" in e.value.message
        assert format_uuid(UUID) in e.value.message
        # Malformed fields never reach the daemon.
        with pytest.raises(ValueError, match="64 bytes, got 16"):
            c.register_cuda_ipc_region(sid, pb.REGION_ROLE_PARAMETERS, UUID, UUID, 0, size)
        if fdchannel.supported():
            # A VMM fd (a memfd stands in for it: the CPU daemon refuses before opening it) is
            # redeemed first, then refused; its token is spent.
            fd = os.memfd_create("stand-in", os.MFD_CLOEXEC)
            try:
                token = fdchannel.send_fd(resp.fd_channel_socket, fd, fdchannel.KIND_CUDA_VMM)
            finally:
                os.close(fd)
            for expect in ("needs a daemon that computes on a GPU", "already used"):
                with pytest.raises(diond.DiondError) as e:
                    c.register_cuda_vmm_region(sid, pb.REGION_ROLE_GRADIENTS, token, UUID, 0,
                                               resp.grad_arena_bytes, 2 << 20)
                assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert expect in e.value.message
        c.close_session(sid)


def test_events_are_checked_by_the_client_and_refused_by_a_host_session(daemon):
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        sid = resp.session_id
        with pytest.raises(ValueError, match="ready_event .*64 bytes, got 63"):
            c.step(sid, 1, ready_event=b"\1" * 63, done_event=b"\2" * 64)
        with pytest.raises(ValueError, match="done_event .*64 bytes, got 65"):
            c.step(sid, 1, ready_event=b"\1" * 64, done_event=b"\2" * 65)
        # With its regions bound, a host session refuses the events before anything runs.
        shm = shared_memory.SharedMemory(create=True, size=resp.param_arena_bytes
                                         + resp.grad_arena_bytes)
        try:
            c.register_region(sid, pb.REGION_ROLE_PARAMETERS, shm.name, 0, resp.param_arena_bytes)
            c.register_region(sid, pb.REGION_ROLE_GRADIENTS, shm.name, resp.param_arena_bytes,
                              resp.grad_arena_bytes)
            with pytest.raises(diond.DiondError) as e:
                c.step(sid, 1, ready_event=b"\1" * 64, done_event=b"\2" * 64)
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "step 1: ready_event / done_event order a device session's" in e.value.message
            c.step(sid, 1)  # nothing was stepped: step 1 is still the next one
            c.close_session(sid)
        finally:
            shm.close()
            shm.unlink()


def test_bucket_events_are_checked_by_the_client_and_refused_by_a_host_session(daemon):
    """The overlapped step's per-bucket events (RegisterRegion DOORBELLS, Bucket.ready_event /
    done_event): the client checks their count and length; a host session refuses them."""
    from diond import doorbell
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        sid = resp.session_id
        n = len(resp.layout)
        buckets = [list(range(n))]
        page = shared_memory.SharedMemory(create=True, size=doorbell.bytes_for(1))
        try:
            doorbell.Doorbells(page.buf, 1)
            with pytest.raises(ValueError, match="2 pairs for 1 buckets"):
                c.register_region(sid, pb.REGION_ROLE_DOORBELLS, page.name, 0, page.size,
                                  buckets=buckets, bucket_events=[(HANDLE, HANDLE)] * 2)
            with pytest.raises(ValueError, match="done_event .*64 bytes, got 63"):
                c.register_region(sid, pb.REGION_ROLE_DOORBELLS, page.name, 0, page.size,
                                  buckets=buckets, bucket_events=[(HANDLE, HANDLE[:63])])
            with pytest.raises(diond.DiondError) as e:
                c.register_region(sid, pb.REGION_ROLE_DOORBELLS, page.name, 0, page.size,
                                  buckets=buckets, bucket_events=[(HANDLE, HANDLE)])
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION, e.value.message
            # Without events the same page binds: nothing was left bound by the refusal.
            c.register_region(sid, pb.REGION_ROLE_DOORBELLS, page.name, 0, page.size,
                              buckets=buckets)
            c.close_session(sid)
        finally:
            page.close()
            page.unlink()


def test_parameters_on_several_devices_are_refused_by_name():
    dev = diond.torch._arena_device
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert dev([("a", gpu1), ("b", gpu1)]) == gpu1
    assert dev([("a", cpu)]) == cpu
    with pytest.raises(ValueError) as e:
        dev([("w0", cpu), ("w1", gpu0), ("w2", cpu)])
    msg = str(e.value)
    assert "on 2 devices" in msg and "w0, w2 on cpu" in msg and "w1 on cuda:0" in msg
    assert "remote=True" in msg
    with pytest.raises(ValueError, match=r"on 2 devices: a on cuda:0; b on cuda:1"):
        dev([("a", gpu0), ("b", gpu1)])
    with pytest.raises(ValueError, match="p0, p1, p2, p3 and 2 more on cuda:0; q on cuda:1"):
        dev([("p%d" % i, gpu0) for i in range(6)] + [("q", gpu1)])
    with pytest.raises(ValueError, match="takes CPU or CUDA parameters; m is on meta"):
        dev([("c", cpu), ("m", torch.device("meta"))])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))


def test_optimizer_refuses_mixed_devices_and_kinds_that_do_not_fit(daemon):
    with diond.Client(daemon.target) as c:
        before = {s.session_id for s in c.list_sessions()}
    model = _model()
    odd = torch.nn.Parameter(torch.empty(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"param group 0, parameter 2 \(shape \[4, 4\]\) is on "
                                         "meta: use remote=True"):
        diond.torch.Optimizer(list(model.parameters())[:2] + [odd], target=daemon.target,
                              algorithm="adamw")
    for kind in ("cuda_ipc", "cuda_vmm"):
        with pytest.raises(ValueError, match="arena='%s' is GPU memory, but the parameters are "
                                             "on the CPU" % kind):
            diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                                  arena=kind)
    with pytest.raises(ValueError, match="arena must be 'memfd', 'shm', 'cuda_vmm', 'cuda_ipc'"):
        diond.torch.Optimizer(model.parameters(), target=daemon.target, arena="cuda")
    with diond.Client(daemon.target) as c:
        # Every refusal came before a session existed.
        assert {s.session_id for s in c.list_sessions()} == before
    # remote=True takes any device set: the arena checks do not apply.
    with diond.torch.Optimizer(model.parameters(), target=daemon.target, algorithm="adamw",
                               remote=True, arena="cuda_ipc") as opt:
        assert opt.remote and opt.arena is None


def test_kind_choice_follows_what_the_daemon_offers(daemon):
    with diond.Client(daemon.target) as c:
        resp = _session(c)
        c.close_session(resp.session_id)
    cpu_kinds = list(resp.region_kinds)
    for choice in ("cuda_ipc", "cuda_vmm"):
        with pytest.raises(ValueError) as e:
            cuda_arena.candidate_kinds(choice, cpu_kinds, True, daemon.target)
        assert "arena=%r" % choice in str(e.value)
        assert "REGION_KIND_SYSTEM_SHM, REGION_KIND_MEMFD" in str(e.value)
    with pytest.raises(ValueError, match="need a daemon computing on their GPU .* lists "
                                         "REGION_KIND_SYSTEM_SHM, REGION_KIND_MEMFD"):
        cuda_arena.candidate_kinds(None, cpu_kinds, True, daemon.target)
    with pytest.raises(ValueError, match="older than the data plane"):
        cuda_arena.candidate_kinds(None, [], True, daemon.target)
    gpu = [pb.REGION_KIND_SYSTEM_SHM, pb.REGION_KIND_MEMFD, pb.REGION_KIND_CUDA_IPC,
           pb.REGION_KIND_CUDA_VMM_FD]
    assert cuda_arena.candidate_kinds(None, gpu, True, "t") == ["cuda_vmm", "cuda_ipc"]
    assert cuda_arena.candidate_kinds(None, gpu, False, "t") == ["cuda_ipc"]
    assert cuda_arena.candidate_kinds(None, gpu[:3], True, "t") == ["cuda_ipc"]
    assert cuda_arena.candidate_kinds("cuda_ipc", gpu, True, "t") == ["cuda_ipc"]
    with pytest.raises(ValueError, match="fd channel cannot be used from this process"):
        cuda_arena.candidate_kinds("cuda_vmm", gpu, False, "t")


def test_driver_loader_reports_a_missing_or_broken_libcuda(tmp_path):
    missing = str(tmp_path / "libcuda.so.1")
    with pytest.raises(cudadrv.CudaDriverError) as e:
        cudadrv.load_driver(missing)
    assert e.value.call is None and e.value.code is None
    assert "cannot load the CUDA driver library %s" % missing in str(e.value)
    assert "NVIDIA driver's libcuda.so.1" in str(e.value)
    (tmp_path / "libcuda.so.1").write_bytes(b"not an ELF file")
    with pytest.raises(cudadrv.CudaDriverError, match="cannot load the CUDA driver library"):
        cudadrv.load_driver(missing)
    if ctypes.util.find_library("cuda") is None:
        # This machine has no NVIDIA driver: the default loader and a CUDA arena say so.
        with pytest.raises(cudadrv.CudaDriverError, match="cannot load the CUDA driver library "
                                                          "libcuda.so.1"):
            cudadrv.load_driver()
        with pytest.raises(cudadrv.CudaDriverError, match="libcuda.so.1"):
            cuda_arena.CudaArena(torch.device("cuda:0"), "cuda_vmm", 1024, 1024)
    # The toolkit's link stub (where a toolkit is installed) is a real libcuda without a
    # driver behind it: every call binds, and cuInit names the stub.
    stub = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "stubs",
                        "libcuda.so")
    if os.path.isfile(stub):
        drv = cudadrv.Driver(stub, init=False)
        assert drv.missing() == []
        with pytest.raises(cudadrv.CudaDriverError) as e:
            drv.call("cuInit", 0)
        assert (e.value.call, e.value.code) == ("cuInit", 34)
        assert "cuInit failed: CUDA_ERROR_STUB_LIBRARY" in str(e.value)
        with pytest.raises(cudadrv.CudaDriverError, match="CUDA_ERROR_STUB_LIBRARY"):
            cudadrv.load_driver(stub)
    with pytest.raises(ValueError, match="needs a CUDA device with an index, got cpu"):
        cuda_arena.CudaArena(torch.device("cpu"), "cuda_ipc", 1024, 1024)
    with pytest.raises(ValueError, match="kind must be one of cuda_vmm, cuda_ipc"):
        cuda_arena.CudaArena(torch.device("cuda:0"), "shm", 1024, 1024)


def test_device_memory_is_released_once_in_reverse_order_whatever_fails():
    # The cleanup machinery of CudaArena, with Python callables in place of driver calls: the
    # release order and the run-once rule do not depend on the GPU.
    calls = []

    def step(name, fail=False):
        calls.append(name)
        if fail:
            raise cudadrv.CudaDriverError(name, 1, "%s failed" % name)

    undo = cuda_arena._Undo()
    for name in ("retain", "create", "reserve", "map"):
        undo.push(step, "undo " + name, name == "reserve")
    mem = cuda_arena._DeviceMemory(0x1000, 4096, undo)
    assert mem.__cuda_array_interface__["data"] == (0x1000, False)
    assert mem.__cuda_array_interface__["shape"] == (4096,)
    finalizer = mem.finalizer
    del mem  # the last reference: freed now
    assert not finalizer.alive
    assert calls == ["undo map", "undo reserve", "undo create", "undo retain"]
    assert undo() == []  # nothing left to run twice
    mem = cuda_arena._DeviceMemory(0x2000, 256, lambda: calls.append("free"))
    mem.release()
    mem.release()
    assert calls[-1] == "free" and calls.count("free") == 1
