"""CUDA arenas of diond.torch.Optimizer (docs/DATA_PLANE.md "Python CUDA arenas").

Both arenas of a session in ONE device allocation on the parameters' GPU, laid out by
``plan_cuda_arena`` (as the C++ CudaArena), exported to the daemon as

  * "cuda_vmm" (REGION_KIND_CUDA_VMM_FD): a VMM allocation (cuMemCreate, POSIX-fd handle type,
    the recommended granularity) whose exported fd goes over the fd channel once per region
    (the channel's tokens are single-use);
  * "cuda_ipc" (REGION_KIND_CUDA_IPC): a cuMemAlloc allocation named by its legacy IPC handle,
    the same handle for both regions (the daemon opens it once).

The allocation becomes a uint8 torch tensor through ``__cuda_array_interface__``; the model's
parameters and gradients are views of it. The memory is freed (after a cuCtxSynchronize: the
trainer's stream may still use it) when the arena is closed and no view of it is left, i.e. with
the last tensor over it, as a shm arena's mapping goes with its last view. Not thread-safe.
"""
import contextlib
import ctypes
import os
import weakref

import torch

from . import fdchannel
from .client import pb
from .cuda_region import plan_cuda_arena
from .cudadrv import (
    CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED, CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_LOCATION_TYPE_DEVICE, CUdeviceptr,
    CUipcMemHandle, CUmemAccessDesc, CUmemAllocationProp, CUmemGenericAllocationHandle,
    CudaDriverError, load_driver)

# Best first: a VMM allocation works under every allocator setting and cannot be reached by a
# legacy handle's one-open-per-process rule; the legacy handle needs no fd channel.
KINDS = ("cuda_vmm", "cuda_ipc")
REGION_KINDS = {"cuda_vmm": pb.REGION_KIND_CUDA_VMM_FD, "cuda_ipc": pb.REGION_KIND_CUDA_IPC}


def candidate_kinds(choice, region_kinds, fd_channel_usable, target):
    """The CUDA arena kinds to try, best first. choice: None (every kind the daemon offers),
    "cuda_vmm" or "cuda_ipc". region_kinds: the session's RegionKind values; fd_channel_usable:
    this process can send fds to the daemon's fd channel (VMM fds need it). ValueError naming
    what the daemon lists when the choice, or for None every kind, is not available."""
    offered = []
    if pb.REGION_KIND_CUDA_VMM_FD in region_kinds and fd_channel_usable:
        offered.append("cuda_vmm")
    if pb.REGION_KIND_CUDA_IPC in region_kinds:
        offered.append("cuda_ipc")
    listed = ", ".join(pb.RegionKind.Name(k) for k in region_kinds) or (
        "nothing (a daemon older than the data plane: SYSTEM_SHM only)")
    if choice is None:
        if not offered:
            raise ValueError(
                "CUDA parameters in shared-memory mode need a daemon computing on their GPU (a "
                "device session lists REGION_KIND_CUDA_VMM_FD / REGION_KIND_CUDA_IPC); the "
                "daemon at %s lists %s. Start it with --device=cuda:N on the parameters' GPU, "
                "or use remote=True" % (target, listed))
        return offered
    if choice not in offered:
        why = "it lists %s" % listed
        if choice == "cuda_vmm" and pb.REGION_KIND_CUDA_VMM_FD in region_kinds:
            why = "its fd channel cannot be used from this process (VMM fds travel over it)"
        raise ValueError("arena=%r: the daemon at %s does not offer %s (%s); use arena=None to "
                         "take what it offers, or remote=True"
                         % (choice, target, pb.RegionKind.Name(REGION_KINDS[choice]), why))
    return [choice]


def gpu_uuid(index, driver):
    """The 16 bytes of the GPU's UUID (cudaDeviceProp::uuid): from torch where its device
    properties have it, else cuDeviceGetUuid."""
    u = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    try:
        raw = bytes(u.bytes)  # torch's _CUuuid: .bytes is the 16 bytes (a list of ints)
    except (AttributeError, TypeError, ValueError):
        raw = b""  # a torch without the property, or another form of it
    return raw if len(raw) == 16 else driver.uuid(driver.device(index))


class _Undo:
    """What to release, in reverse order of acquisition; each step runs once, errors go on."""

    def __init__(self):
        self._steps = []

    def push(self, fn, *args):
        self._steps.append((fn, args))

    def __call__(self):
        errors = []
        while self._steps:
            fn, args = self._steps.pop()
            try:
                fn(*args)
            except Exception as e:  # release the rest anyway
                errors.append(e)
        return errors


@contextlib.contextmanager
def _current(driver, ctx):
    driver.call("cuCtxPushCurrent", ctx)
    try:
        yield
    finally:
        driver.call("cuCtxPopCurrent", ctypes.byref(ctypes.c_void_p()))


def _in_context(driver, ctx, name, *args):
    with _current(driver, ctx):
        driver.call(name, *args)


class _DeviceMemory:
    """One device allocation, seen by torch through ``__cuda_array_interface__`` (torch keeps
    this object alive for as long as a tensor made from it lives). ``release`` frees it at once;
    otherwise it is freed when the object is collected."""

    def __init__(self, ptr, nbytes, free):
        self.ptr, self.nbytes = ptr, nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "strides": None,
                                         "data": (ptr, False), "version": 2}
        self.finalizer = weakref.finalize(self, free)

    def release(self):
        self.finalizer()


class CudaArena:
    """Both arenas in one allocation on `device` (a CUDA torch.device), exported as `kind`.

    Attributes: kind, device, plan (param_offset, grad_offset, total_bytes), granularity,
    uuid (16 bytes), tensor (uint8, the whole allocation), region_ids (after register()).
    Raises CudaDriverError (naming the driver call), ValueError, or RuntimeError when torch
    cannot wrap the memory in place, leaving nothing allocated.
    """

    def __init__(self, device, kind, param_arena_bytes, grad_arena_bytes, driver=None):
        if kind not in KINDS:
            raise ValueError("CUDA arena kind must be one of %s, got %r" % (", ".join(KINDS), kind))
        if device.type != "cuda" or device.index is None:
            raise ValueError("a CUDA arena needs a CUDA device with an index, got %s" % device)
        self.kind, self.device = kind, device
        self.region_ids = []
        self.fd = -1
        self.tensor = None
        self._memory = None
        self._finalizer = None  # the allocation's (it holds no reference to the memory)
        drv = driver or load_driver()
        undo = _Undo()
        try:
            self._allocate(drv, undo, param_arena_bytes, grad_arena_bytes)
            self.uuid = gpu_uuid(device.index, drv)
            self._wrap()
        except BaseException:
            self._close_fd()
            if self._memory is not None:
                self.tensor = None
                self._memory.release()
                self._memory = None
            else:
                undo()
            raise

    def _allocate(self, drv, undo, param_bytes, grad_bytes):
        dev = drv.device(self.device.index)
        ctx = ctypes.c_void_p()
        drv.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        undo.push(drv.call, "cuDevicePrimaryCtxRelease", dev)
        with _current(drv, ctx):
            if self.kind == "cuda_ipc":
                self.granularity = 1
                self.plan = plan_cuda_arena(param_bytes, grad_bytes, 1)
                ptr = CUdeviceptr()
                drv.call("cuMemAlloc", ctypes.byref(ptr), self.plan.total_bytes)
                undo.push(_in_context, drv, ctx, "cuMemFree", ptr)
                handle = CUipcMemHandle()
                drv.call("cuIpcGetMemHandle", ctypes.byref(handle), ptr)
                self.ipc_handle = ctypes.string_at(ctypes.addressof(handle), 64)
            else:
                ptr = self._allocate_vmm(drv, undo, ctx, dev, param_bytes, grad_bytes)
        undo.push(_in_context, drv, ctx, "cuCtxSynchronize")  # runs first: work on it is done
        self._memory = _DeviceMemory(ptr.value, self.plan.total_bytes, undo)
        self._finalizer = self._memory.finalizer

    def _allocate_vmm(self, drv, undo, ctx, dev, param_bytes, grad_bytes):
        for attr, what in ((CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                            "virtual memory management"),
                           (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                            "POSIX file descriptor export")):
            if not drv.attribute(attr, dev):
                raise CudaDriverError("cuDeviceGetAttribute", None,
                                      "%s does not support %s" % (self.device, what))
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = dev
        g = ctypes.c_size_t()
        drv.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(prop),
                 CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        self.granularity = g.value
        self.plan = plan_cuda_arena(param_bytes, grad_bytes, g.value)
        size = self.plan.total_bytes
        handle = CUmemGenericAllocationHandle()
        drv.call("cuMemCreate", ctypes.byref(handle), size, ctypes.byref(prop), 0)
        undo.push(_in_context, drv, ctx, "cuMemRelease", handle)
        va = CUdeviceptr()
        drv.call("cuMemAddressReserve", ctypes.byref(va), size, g.value, 0, 0)
        undo.push(_in_context, drv, ctx, "cuMemAddressFree", va, size)
        drv.call("cuMemMap", va, size, 0, handle, 0)
        undo.push(_in_context, drv, ctx, "cuMemUnmap", va, size)
        access = CUmemAccessDesc()
        access.location = prop.location
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        drv.call("cuMemSetAccess", va, size, ctypes.byref(access), 1)
        fd = ctypes.c_int(-1)
        drv.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle,
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
        self.fd = fd.value
        return va

    def _wrap(self):
        t = torch.as_tensor(self._memory, device=self.device)
        if (t.data_ptr() != self._memory.ptr or t.numel() != self._memory.nbytes
                or t.device != self.device):
            raise RuntimeError("torch did not wrap the CUDA arena in place (got a tensor at %#x "
                               "on %s for memory at %#x on %s)"
                               % (t.data_ptr(), t.device, self._memory.ptr, self.device))
        self.tensor = t

    def view(self, offset, nbytes):
        """The uint8 view [offset, offset + nbytes) of the allocation."""
        return self.tensor.narrow(0, offset, nbytes)

    def register(self, client, session_id, fd_channel_socket, param_arena_bytes,
                 grad_arena_bytes):
        """Registers the GRADIENTS then the PARAMETERS region. GRADIENTS goes first because a
        PARAMETERS registration takes over the weights a resumed session holds: if anything
        fails, they are still the daemon's. On failure the region registered is unregistered
        (best effort) and the error (DiondError, or fdchannel's) is raised."""
        roles = ((pb.REGION_ROLE_GRADIENTS, self.plan.grad_offset, grad_arena_bytes),
                 (pb.REGION_ROLE_PARAMETERS, self.plan.param_offset, param_arena_bytes))
        try:
            for role, offset, size in roles:
                if self.kind == "cuda_ipc":
                    rid = client.register_cuda_ipc_region(session_id, role, self.ipc_handle,
                                                          self.uuid, offset, size)
                else:
                    token = fdchannel.send_fd(fd_channel_socket, self.fd,
                                              fdchannel.KIND_CUDA_VMM)
                    rid = client.register_cuda_vmm_region(session_id, role, token, self.uuid,
                                                          offset, size, self.granularity)
                self.region_ids.append(rid)
        except BaseException:
            for rid in self.region_ids:
                try:
                    client.unregister_region(session_id, rid, timeout=5.0)
                except Exception:
                    pass  # the daemon drops it with the session anyway
            self.region_ids = []
            raise
        self._close_fd()  # the daemon holds its own copies; ours is not needed any more

    def _close_fd(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def freed(self):
        """True once the allocation is released (close() alone does not free it while a tensor
        over it lives)."""
        return self._finalizer is None or not self._finalizer.alive

    def unlink(self):
        pass  # nothing named to remove (the same two calls as a shm arena)

    def close(self):
        """Closes the exported fd and lets the allocation go: freed now when no tensor over it
        is left (the optimizer gives the model copies first), else with the last one."""
        self._close_fd()
        self.tensor = None
        self._memory = None
