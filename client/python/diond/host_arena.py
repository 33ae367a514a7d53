"""Host shared memory whose mapping lives as long as the tensors that view it.

A tensor made with ``torch.frombuffer(arena.buf, ...)`` holds a reference to ``buf`` (a
memoryview of the arena's ``mmap``), which holds the ``mmap``; torch releases the buffer export
at once, so an explicit ``mmap.close()`` would still unmap the memory under live tensors. The
arenas here therefore never unmap explicitly: ``close()`` gives up the name (POSIX shm) or the
fd (memfd) and drops the arena's own references, and the mapping goes with the last view, as any
Python buffer. The daemon's own mapping goes when its region is unregistered (CloseSession).
"""
import mmap
import os
import secrets

try:
    import _posixshmem  # CPython's shm_open/shm_unlink, as multiprocessing.shared_memory uses
except ImportError:  # pragma: no cover - not a POSIX CPython
    _posixshmem = None


class ShmArena:
    """A POSIX shared-memory segment of `size` bytes (mode 0600, a fresh random name), mapped
    MAP_SHARED. ``name`` (no leading slash) is what RegisterRegion takes; ``buf`` a writable
    memoryview of the whole segment."""

    def __init__(self, size, prefix="diond"):
        if _posixshmem is None:
            raise OSError("POSIX shared memory is not available in this Python; use arena='memfd'")
        if size <= 0:
            raise ValueError("a shm arena needs a positive size, got %d" % size)
        for _ in range(8):
            name = "%s-%d-%s" % (prefix, os.getpid(), secrets.token_hex(6))
            try:
                fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR,
                                          mode=0o600)
                break
            except FileExistsError:
                continue
        else:  # pragma: no cover - 48 random bits collided 8 times
            raise FileExistsError("could not find a free shm name")
        self.name = name
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)  # the mapping keeps the segment
        self.size = size
        self.buf = memoryview(self._map)

    def unlink(self):
        """Removes the name (the memory stays while a mapping does). Idempotent."""
        if self.name is not None:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass
            self.name = None

    def close(self):
        """Drops this object's references; the mapping goes with the last tensor over it."""
        self.unlink()
        self.buf = None
        self._map = None
