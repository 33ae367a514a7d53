"""The few CUDA driver API calls the Python CUDA arenas need, through ctypes on libcuda.so.1.

No new Python dependency and no CUDA toolkit: libcuda.so.1 comes with the NVIDIA driver on every
machine that can run CUDA at all, under that one soname, whatever CUDA version torch was built
for (the runtime library's name and location change with each torch build). The arenas use:

  * legacy IPC (REGION_KIND_CUDA_IPC): cuMemAlloc + cuIpcGetMemHandle on the device's primary
    context (the one torch and the runtime API use), so the handle names an allocation of our
    own whose base is the arena's offset 0 (a block of torch's caching allocator may sit inside
    a larger segment, and under expandable segments has no legacy handle at all);
  * VMM (REGION_KIND_CUDA_VMM_FD): cuMemCreate with the POSIX-fd handle type,
    cuMemAddressReserve, cuMemMap, cuMemSetAccess, cuMemExportToShareableHandle.

Every failed call raises CudaDriverError naming the call and the driver's error name. Not
thread-safe beyond what the driver itself guarantees; callers keep one arena per optimizer.
"""
import ctypes

LIBCUDA = "libcuda.so.1"

CU_MEM_ALLOCATION_TYPE_PINNED = 0x1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103

CUdeviceptr = ctypes.c_ulonglong
CUmemGenericAllocationHandle = ctypes.c_ulonglong


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CUipcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_char * 16)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed, or the driver library cannot be loaded.

    Attributes: call (the driver function, or None for the loader), code (the CUresult, or
    None), message."""

    def __init__(self, call, code, message):
        self.call, self.code, self.message = call, code, message
        super().__init__(message)


_P = ctypes.POINTER
_SIZE = ctypes.c_size_t
_ULL = ctypes.c_ulonglong
# name -> (argument types, the versioned symbol first: cuda.h #defines the plain names to them)
_SIGNATURES = {
    "cuInit": ([ctypes.c_uint], ()),
    "cuGetErrorName": ([ctypes.c_int, _P(ctypes.c_char_p)], ()),
    "cuDeviceGet": ([_P(ctypes.c_int), ctypes.c_int], ()),
    "cuDeviceGetAttribute": ([_P(ctypes.c_int), ctypes.c_int, ctypes.c_int], ()),
    "cuDeviceGetUuid": ([_P(CUuuid), ctypes.c_int], ("cuDeviceGetUuid_v2",)),
    "cuDevicePrimaryCtxRetain": ([_P(ctypes.c_void_p), ctypes.c_int], ()),
    "cuDevicePrimaryCtxRelease": ([ctypes.c_int], ("cuDevicePrimaryCtxRelease_v2",)),
    "cuCtxPushCurrent": ([ctypes.c_void_p], ("cuCtxPushCurrent_v2",)),
    "cuCtxPopCurrent": ([_P(ctypes.c_void_p)], ("cuCtxPopCurrent_v2",)),
    "cuCtxSynchronize": ([], ()),
    "cuMemAlloc": ([_P(CUdeviceptr), _SIZE], ("cuMemAlloc_v2",)),
    "cuMemFree": ([CUdeviceptr], ("cuMemFree_v2",)),
    "cuIpcGetMemHandle": ([_P(CUipcMemHandle), CUdeviceptr], ()),
    "cuMemGetAllocationGranularity": ([_P(_SIZE), _P(CUmemAllocationProp), ctypes.c_int], ()),
    "cuMemCreate": ([_P(CUmemGenericAllocationHandle), _SIZE, _P(CUmemAllocationProp), _ULL],
                    ()),
    "cuMemRelease": ([CUmemGenericAllocationHandle], ()),
    "cuMemAddressReserve": ([_P(CUdeviceptr), _SIZE, _SIZE, CUdeviceptr, _ULL], ()),
    "cuMemAddressFree": ([CUdeviceptr, _SIZE], ()),
    "cuMemMap": ([CUdeviceptr, _SIZE, _SIZE, CUmemGenericAllocationHandle, _ULL], ()),
    "cuMemUnmap": ([CUdeviceptr, _SIZE], ()),
    "cuMemSetAccess": ([CUdeviceptr, _SIZE, _P(CUmemAccessDesc), _SIZE], ()),
    "cuMemExportToShareableHandle": ([ctypes.c_void_p, CUmemGenericAllocationHandle,
                                      ctypes.c_int, _ULL], ()),
}


# Names for the codes that arrive when cuGetErrorName cannot answer (a stub answers nothing).
_KNOWN_ERRORS = {
    34: "CUDA_ERROR_STUB_LIBRARY (this libcuda is the CUDA toolkit's link stub, not the driver)",
    100: "CUDA_ERROR_NO_DEVICE",
}


class Driver:
    """libcuda.so.1, loaded and initialized (cuInit; init=False skips it). ``call(name, *args)``
    runs a driver function and raises CudaDriverError unless it returns CUDA_SUCCESS; a function
    this driver lacks is a CudaDriverError when called. ``missing()`` lists those."""

    def __init__(self, path=LIBCUDA, init=True):
        try:
            self._lib = ctypes.CDLL(path)
        except OSError as e:
            raise CudaDriverError(
                None, None,
                "cannot load the CUDA driver library %s (%s): CUDA arenas need the NVIDIA "
                "driver's %s, installed with the driver (not the CUDA toolkit); use CPU "
                "parameters or remote=True where there is none" % (path, e, LIBCUDA)) from None
        self.path = path
        self._fns = {}
        for name, (argtypes, versioned) in _SIGNATURES.items():
            for symbol in versioned + (name,):
                fn = getattr(self._lib, symbol, None)
                if fn is not None:
                    fn.argtypes = argtypes
                    fn.restype = ctypes.c_int
                    self._fns[name] = fn
                    break
        if init:
            self.call("cuInit", 0)

    def missing(self):
        return sorted(set(_SIGNATURES) - set(self._fns))

    def error_name(self, code):
        fn = self._fns.get("cuGetErrorName")
        out = ctypes.c_char_p()
        if fn is not None and fn(code, ctypes.byref(out)) == 0 and out.value:
            return out.value.decode("ascii", "replace")
        return _KNOWN_ERRORS.get(code, "CUresult %d" % code)

    def call(self, name, *args):
        fn = self._fns.get(name)
        if fn is None:
            raise CudaDriverError(name, None, "the CUDA driver at %s has no %s (driver too old "
                                  "for CUDA arenas?)" % (self.path, name))
        code = fn(*args)
        if code != 0:
            raise CudaDriverError(name, code, "%s failed: %s" % (name, self.error_name(code)))

    def device(self, index):
        """The CUdevice of a device ordinal (the same ordinal torch uses: both honour
        CUDA_VISIBLE_DEVICES)."""
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), int(index))
        return dev.value

    def attribute(self, attr, dev):
        v = ctypes.c_int()
        self.call("cuDeviceGetAttribute", ctypes.byref(v), attr, dev)
        return v.value

    def uuid(self, dev):
        u = CUuuid()
        self.call("cuDeviceGetUuid", ctypes.byref(u), dev)
        return ctypes.string_at(ctypes.addressof(u), 16)  # c_char arrays stop at a NUL


_default = None


def load_driver(path=None):
    """The Driver of libcuda.so.1 (one per process), or of `path` (a fresh one). Raises
    CudaDriverError with the loader's reason when it cannot be loaded or initialized."""
    global _default
    if path is not None:
        return Driver(path)
    if _default is None:
        _default = Driver(LIBCUDA)
    return _default
