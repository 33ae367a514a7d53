"""The doorbells of an overlapped step: the trainer's half (docs/DATA_PLANE.md "Overlapped
step"; the daemon's half is server/memory/doorbell.h, which holds the layout).

A page of shared memory with one 64-byte slot per bucket: the trainer rings ``gradients[k] = N``
once bucket k's gradients of step N are written, the daemon answers ``weights[k] = N`` once
bucket k's weights of step N are written, or ``-N`` when step N failed.

A ring is one aligned 8-byte store, made after the gradients' writes by the same thread. On
x86-64 stores are seen in program order, which makes it a release; on weakly ordered CPUs (arm64)
this module does not yet fence, and ``Doorbells`` refuses to run there.
"""
import ctypes
import platform
import struct
import time

MAGIC = b"DIONDDB1"
VERSION = 1
HEADER_BYTES = 64
SLOT_BYTES = 64
MAX_BUCKETS = 65536


class DoorbellError(RuntimeError):
    """The daemon said the step failed (its weights word is -N)."""


def bytes_for(buckets):
    """Bytes a page of `buckets` doorbells takes."""
    return HEADER_BYTES + SLOT_BYTES * buckets


class Doorbells:
    """Doorbells over `buf`, a writable buffer of shared memory (an arena's ``buf``), laid out for
    `buckets` buckets: the header is written and every word zeroed."""

    def __init__(self, buf, buckets):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise OSError("diond doorbells need x86-64's store order; %s is not supported yet"
                          % platform.machine())
        if not 1 <= buckets <= MAX_BUCKETS:
            raise ValueError("buckets must be 1 to %d, got %d" % (MAX_BUCKETS, buckets))
        view = memoryview(buf).cast("B")
        if view.nbytes < bytes_for(buckets):
            raise ValueError("%d buckets need %d bytes, the buffer has %d"
                             % (buckets, bytes_for(buckets), view.nbytes))
        view[:bytes_for(buckets)] = bytes(bytes_for(buckets))
        view[:16] = MAGIC + struct.pack("<II", VERSION, buckets)
        self.buckets = buckets
        self._words = [(ctypes.c_int64.from_buffer(view, HEADER_BYTES + SLOT_BYTES * k),
                        ctypes.c_int64.from_buffer(view, HEADER_BYTES + SLOT_BYTES * k + 8))
                       for k in range(buckets)]

    def ring_gradients(self, k, step):
        """Bucket k's gradients of `step` are written (call after the writes, on their thread)."""
        self._words[k][0].value = step

    def gradients(self, k):
        return self._words[k][0].value

    def weights(self, k):
        return self._words[k][1].value

    def wait_weights(self, k, step, timeout=None):
        """Waits until bucket k's weights of `step` are written. DoorbellError when the daemon
        failed the step; TimeoutError after `timeout` seconds (None: no limit)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = 20e-6
        while True:
            w = self._words[k][1].value
            if w >= step:
                return
            if w == -step:
                raise DoorbellError("step %d failed in the daemon (bucket %d's weights are the "
                                    "previous step's)" % (step, k))
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("bucket %d's weights of step %d were not written in %.3g s"
                                   % (k, step, timeout))
            time.sleep(poll)
            poll = min(poll * 2, 1e-3)
