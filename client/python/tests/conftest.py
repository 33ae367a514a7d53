"""Fixtures: a real diond daemon per test module (or per test where it gets killed).

The binary: $DIOND_BINARY, else <repo>/build/bin/diond. The conformance vectors:
$DIOND_CONFORMANCE_DIR, else <repo>/tests/conformance (committed with the repository).
"""
import json
import os
import struct

import numpy as np
import pytest

import diond

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def conformance_dir():
    for d in (os.environ.get("DIOND_CONFORMANCE_DIR"),
              os.path.join(REPO, "tests", "conformance")):
        if d and os.path.isfile(os.path.join(d, "manifest.json")):
            return os.path.abspath(d)
    raise RuntimeError("conformance vectors not found: set DIOND_CONFORMANCE_DIR or restore "
                       "tests/conformance/manifest.json")


def read_safetensors(path):
    """{name: float32 array}, {metadata}: 8-byte LE header length, JSON header, raw data."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = raw[8 + n:]
    out = {}
    for name, info in header.items():
        assert info["dtype"] == "F32", (name, info["dtype"])
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(info["shape"]).copy()
    return out, meta


@pytest.fixture(scope="module")
def daemon():
    d = diond.Daemon(compute_threads=2).start()
    yield d
    rc = d.stop()
    d.cleanup()
    assert rc == 0, "diond did not exit cleanly after SIGTERM: %s\n%s" % (rc, d.log_tail())


@pytest.fixture
def fresh_daemon():
    d = diond.Daemon(compute_threads=2).start()
    yield d
    d.kill()
    d.cleanup()


@pytest.fixture
def daemon_factory():
    """Starts daemons on demand; all are killed at the end of the test."""
    started = []

    def make(**kw):
        kw.setdefault("compute_threads", 2)
        d = diond.Daemon(**kw).start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.kill()
        d.cleanup()
