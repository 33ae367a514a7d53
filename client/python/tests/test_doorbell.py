"""The trainer's half of the doorbells (diond/doorbell.py) on its own; the handshake with the
daemon's half across processes is server/memory/doorbell_test.cc."""
import mmap
import struct
import threading
import time

import pytest

from diond.doorbell import DoorbellError, Doorbells, bytes_for


def page(buckets):
    return mmap.mmap(-1, bytes_for(buckets))


def test_the_header_is_the_daemons_layout():
    m = page(3)
    m[:] = b"\xff" * len(m)
    bells = Doorbells(m, 3)
    assert m[:16] == b"DIONDDB1" + struct.pack("<II", 1, 3)
    assert all(bells.gradients(k) == 0 and bells.weights(k) == 0 for k in range(3))
    bells.ring_gradients(2, 41)
    assert struct.unpack_from("<q", m, 64 + 2 * 64)[0] == 41
    struct.pack_into("<q", m, 64 + 1 * 64 + 8, 40)
    assert bells.weights(1) == 40


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="buckets must be 1 to 65536"):
        Doorbells(page(1), 0)
    with pytest.raises(ValueError, match="3 buckets need 256 bytes"):
        Doorbells(page(2), 3)


def test_a_wait_returns_on_the_step_raises_on_failure_and_times_out():
    m = page(2)
    bells = Doorbells(m, 2)

    def daemon():
        time.sleep(0.02)
        struct.pack_into("<q", m, 64 + 8, 5)             # bucket 0: step 5 written
        struct.pack_into("<q", m, 64 + 64 + 8, -5)       # bucket 1: step 5 failed
    t = threading.Thread(target=daemon)
    t.start()
    bells.wait_weights(0, 5, timeout=30)
    t.join()
    with pytest.raises(DoorbellError, match="step 5 failed"):
        bells.wait_weights(1, 5, timeout=30)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="bucket 0's weights of step 6"):
        bells.wait_weights(0, 6, timeout=0.05)
    assert time.monotonic() - start >= 0.05
