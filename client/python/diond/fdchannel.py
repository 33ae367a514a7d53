"""The daemon's fd channel and a memfd arena (docs/DATA_PLANE.md).

gRPC cannot carry file descriptors, so a MEMFD region's fd goes over a second Unix socket first
(the path is CreateSessionResponse.fd_channel_socket): ``send_fd`` sends it with SCM_RIGHTS and
returns the one-time token that RegisterRegion then presents. Linux only.

Wire protocol (little-endian): request = b"DIONDFD1" + u32 version (1) + u32 kind (1 = memfd,
2 = CUDA VMM fd), with exactly one fd attached; reply = b"DIONDFD1" + u32 code (a gRPC status
code number; 0 = OK) + u32 length, then `length` bytes: the token when OK, else the error.
"""
import fcntl
import mmap
import os
import socket
import struct

import grpc

from .errors import DiondError

MAGIC = b"DIONDFD1"
VERSION = 1
KIND_MEMFD = 1
KIND_CUDA_VMM = 2

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def supported():
    """True where this Python can make sealed memfds and pass fds (Linux, Python >= 3.9)."""
    return (hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
            and hasattr(fcntl, "F_ADD_SEALS"))


def _recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise DiondError(grpc.StatusCode.UNAVAILABLE,
                             "the daemon's fd channel closed the connection before answering")
        out += chunk
    return out


def send_fd(path, fd, kind=KIND_MEMFD, timeout=10.0, sock=None):
    """Sends `fd` over the fd channel at `path` (or on the connected `sock`) and returns its
    token. Raises DiondError with the channel's code and message when it refuses the fd."""
    own = sock is None
    if own:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as e:
            sock.close()
            raise DiondError(grpc.StatusCode.UNAVAILABLE,
                             "cannot connect to the daemon's fd channel at %s: %s" % (path, e))
    try:
        socket.send_fds(sock, [MAGIC + struct.pack("<II", VERSION, kind)], [fd])
        head = _recv_exact(sock, 16)
        if head[:8] != MAGIC:
            raise DiondError(grpc.StatusCode.INTERNAL,
                             "the fd channel at %s answered something that is not its reply"
                             % path)
        code, length = struct.unpack("<II", head[8:16])
        text = _recv_exact(sock, length).decode("utf-8", "replace") if length else ""
    finally:
        if own:
            sock.close()
    if code != 0:
        raise DiondError(_CODES.get(code, grpc.StatusCode.UNKNOWN), text, "fd channel")
    return text


class MemfdArena:
    """One sealed memfd of `size` bytes, mapped (MAP_SHARED) into this process.

    Created with MFD_ALLOW_SEALING, sized, then sealed with F_SEAL_SHRINK | F_SEAL_GROW: nobody
    can change its size any more, so the daemon's mapping can never fault. ``buf`` is a writable
    memoryview of the whole memfd. ``close()`` closes the fd; the mapping goes with the last view
    of ``buf`` (diond.host_arena says why it is never unmapped explicitly)."""

    def __init__(self, size, name="diond-arena"):
        if size <= 0:
            raise ValueError("a memfd arena needs a positive size, got %d" % size)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.buf = memoryview(self._map)

    def send(self, path, timeout=10.0):
        """Sends the memfd over the fd channel at `path`; returns the token for RegisterRegion."""
        return send_fd(path, self.fd, KIND_MEMFD, timeout=timeout)

    # The same two calls as multiprocessing.shared_memory.SharedMemory, so that the optimizer
    # frees either arena the same way.
    def unlink(self):
        pass  # a memfd has no name to remove

    def close(self):
        """Closes the fd and drops this object's references to the mapping, which goes with the
        last view of ``buf`` (a tensor made by torch.frombuffer holds one; unmapping under it
        would crash its next use). The daemon keeps its own fd and mapping until the region is
        unregistered."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.buf = None
        self._map = None
