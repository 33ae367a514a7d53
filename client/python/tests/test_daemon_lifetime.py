"""diond.Daemon ties the daemon's life to the process that started it (--exit_on_stdin_eof).

A real parent process starts a real daemon and is then SIGKILLed: with tie_to_parent (the
default) the daemon must stop by itself, cleanly, and say why in its log; without it the daemon
runs on as an orphan (the behaviour the tie exists to prevent, checked so that this test can
fail).
"""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import diond
from conftest import REPO
from diond.daemon import find_binary

PARENT = textwrap.dedent("""
    import sys, time
    import diond
    d = diond.Daemon(compute_threads=1, tie_to_parent=(sys.argv[1] == "tie")).start()
    print(d.pid, d.log_path, flush=True)
    time.sleep(600)
""")


def _alive(pid):
    """True while pid exists and is not a zombie waiting for its (new) parent to reap it."""
    try:
        with open("/proc/%d/stat" % pid) as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _orphan_after_parent_sigkill(mode):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE,
                              env=env, text=True)
    try:
        line = parent.stdout.readline().split()
        assert len(line) == 2, "the parent process did not start its daemon"
        pid, log_path = int(line[0]), line[1]
        assert _alive(pid)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        parent.stdout.close()
    return pid, log_path


def test_a_tied_daemon_stops_when_its_parent_is_sigkilled():
    pid, log_path = _orphan_after_parent_sigkill("tie")
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        raise AssertionError("the daemon outlived its SIGKILLed parent by 30 s")
    with open(log_path) as f:
        log = f.read()
    assert "reached end-of-file (--exit_on_stdin_eof)" in log, log[-2000:]
    assert "stopped cleanly" in log, log[-2000:]


def test_an_untied_daemon_outlives_its_parent():
    pid, _ = _orphan_after_parent_sigkill("free")
    try:
        time.sleep(1.0)
        assert _alive(pid), "an untied daemon stopped with its parent"
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)


def test_a_tied_daemon_still_stops_on_sigterm_and_its_pipe_is_closed():
    d = diond.Daemon(compute_threads=1).start()
    try:
        assert d.proc.stdin is not None
        with diond.Client(d.target) as c:
            c.health()
    finally:
        rc = d.stop()
        d.cleanup()
    assert rc == 0
    assert d.proc.stdin.closed


def test_find_binary_falls_back_to_this_checkouts_build(monkeypatch):
    """Without an argument, DIOND_BINARY or a diond on PATH, find_binary() takes the checkout's
    build/bin/diond, where scripts/build.sh puts it (docs/BENCHMARKS.md's commands rely on it)."""
    want = os.path.join(REPO, "build", "bin", "diond")
    if not os.access(want, os.X_OK):
        pytest.skip("this checkout has no build/bin/diond (built elsewhere)")
    monkeypatch.delenv("DIOND_BINARY", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_binary() == want
