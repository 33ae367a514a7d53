"""The non-CUDA half of the Python CUDA arenas (docs/DATA_PLANE.md "CUDA regions").

How one device allocation holds both arenas, and the RegisterRegion requests that name it. The
same rules as the C++ client's ``PlanCudaArena``, ``CudaIpcRegionRequest`` and
``CudaVmmRegionRequest`` (client/cpp/diond/cuda_region_request.h), so that both clients lay the
memory out alike. Nothing here touches a GPU: it is tested on machines without one.
"""
import collections

from .client import pb

CUDA_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t / CUipcMemHandle
CUDA_EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t
GPU_UUID_BYTES = 16  # cudaDeviceProp::uuid / CUuuid
REGION_ALIGN = 256  # the layout's alignment; the gradients start at the next multiple of it

# param_offset is always 0; grad_offset the first multiple of 256 at or after the parameter
# arena's end; total_bytes the allocation's size, rounded up to the granularity.
CudaArenaPlan = collections.namedtuple("CudaArenaPlan", "param_offset grad_offset total_bytes")


def _power_of_two(g):
    return isinstance(g, int) and not isinstance(g, bool) and g > 0 and g & (g - 1) == 0


def plan_cuda_arena(param_arena_bytes, grad_arena_bytes, granularity):
    """The layout of one allocation holding both arenas: parameters at offset 0, gradients at the
    first multiple of 256 after them, the whole rounded up to `granularity` (1 for a legacy
    cuMemAlloc allocation; the VMM allocation's granularity, a power of two, otherwise).
    ValueError for an empty arena or a granularity that is not a positive power of two."""
    if param_arena_bytes <= 0 or grad_arena_bytes <= 0:
        raise ValueError("plan_cuda_arena: the layout has an empty arena (parameters %d bytes, "
                         "gradients %d bytes)" % (param_arena_bytes, grad_arena_bytes))
    if not _power_of_two(granularity):
        raise ValueError("plan_cuda_arena: granularity %r is not a positive power of two"
                         % (granularity,))
    grad_offset = (param_arena_bytes + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN
    end = grad_offset + grad_arena_bytes
    total = (end + granularity - 1) // granularity * granularity
    return CudaArenaPlan(0, grad_offset, total)


def _check_bytes(what, value, n):
    if not isinstance(value, (bytes, bytearray)):
        raise TypeError("%s must be bytes, got %s" % (what, type(value).__name__))
    if len(value) != n:
        raise ValueError("%s is %d bytes, got %d" % (what, n, len(value)))
    return bytes(value)


def _check_range(offset, size):
    if offset < 0 or offset % REGION_ALIGN != 0 or size <= 0:
        raise ValueError("region offset %d and size %d: need a non-negative multiple of %d and a "
                         "positive size" % (offset, size, REGION_ALIGN))


def cuda_ipc_region_request(session_id, role, mem_handle, gpu_uuid, offset_bytes, size_bytes):
    """RegisterRegionRequest for a legacy IPC handle of the allocation base (`mem_handle`: 64
    bytes, `gpu_uuid`: 16 bytes) and the role's range in it. ValueError / TypeError otherwise."""
    handle = _check_bytes("a CUDA IPC memory handle", mem_handle, CUDA_IPC_HANDLE_BYTES)
    uuid = _check_bytes("a GPU UUID", gpu_uuid, GPU_UUID_BYTES)
    _check_range(offset_bytes, size_bytes)
    return pb.RegisterRegionRequest(
        session_id=session_id, role=role, kind=pb.REGION_KIND_CUDA_IPC,
        cuda_ipc=pb.CudaIpcRegion(mem_handle=handle, gpu_uuid=uuid, offset_bytes=offset_bytes,
                                  size_bytes=size_bytes))


def cuda_vmm_region_request(session_id, role, fd_token, gpu_uuid, offset_bytes, size_bytes,
                            granularity):
    """RegisterRegionRequest for a VMM allocation whose exported fd went over the fd channel
    (`fd_token`, non-empty), with the allocation's granularity (a power of two)."""
    if not fd_token:
        raise ValueError("a CUDA_VMM_FD region needs the fd channel's token for its fd")
    if not _power_of_two(granularity):
        raise ValueError("granularity %r is not a positive power of two" % (granularity,))
    uuid = _check_bytes("a GPU UUID", gpu_uuid, GPU_UUID_BYTES)
    _check_range(offset_bytes, size_bytes)
    return pb.RegisterRegionRequest(
        session_id=session_id, role=role, kind=pb.REGION_KIND_CUDA_VMM_FD,
        cuda_vmm_fd=pb.CudaVmmFdRegion(gpu_uuid=uuid, offset_bytes=offset_bytes,
                                       size_bytes=size_bytes, granularity_bytes=granularity,
                                       fd_token=fd_token))


def check_event_handle(what, handle):
    """The 64 bytes of a cudaIpcEventHandle_t for StepRequest.ready_event / done_event."""
    return _check_bytes("%s (a CUDA IPC event handle)" % what, handle, CUDA_EVENT_HANDLE_BYTES)


def format_uuid(uuid):
    """GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx, as nvidia-smi -L and the daemon print it."""
    h = bytes(uuid).hex()
    return "GPU-%s-%s-%s-%s-%s" % (h[:8], h[8:12], h[12:16], h[16:20], h[20:32])
