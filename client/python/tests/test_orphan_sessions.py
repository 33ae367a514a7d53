"""Orphan sessions (docs/OPERATIONS.md "Orphan sessions"), against a real daemon and real
processes: a daemon with a short --orphan_grace; trainer processes create sessions over the Unix
socket. A trainer that is SIGKILLed leaves an orphan, which the daemon closes once the grace has
passed: it leaves ListSessions, diond_sessions_reaped_total{reason="orphan"} counts it on
/metrics and the log names the session and the pid. A live trainer's session, a TCP session and
a session that another live process uses (a trainer's forked helper) stay; the last is reaped
once its helper is gone too.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import diond
from diond.client import pb

GRACE_S = 2

# argv: target, mode, [session id]. Prints the session id (or "used"), then sleeps until killed.
TRAINER = textwrap.dedent("""
    import sys, time
    target, mode = sys.argv[1], sys.argv[2]
    if mode == "torch":  # a real trainer: diond.torch.Optimizer, with its memfd arenas
        import torch
        import diond.torch
        model = torch.nn.Linear(8, 4)
        opt = diond.torch.Optimizer(model.parameters(), algorithm="adamw", target=target)
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        print(opt.session_id, flush=True)
    else:
        import diond
        from diond.client import pb
        c = diond.Client(target)
        if mode == "create":
            spec = pb.ParameterSpec(name="w", shape=[4, 4], dtype=pb.DTYPE_F32, group="g")
            group = pb.ParameterGroup(name="g", algorithm=pb.ALGORITHM_ADAMW)
            print(c.create_session(parameters=[spec], groups=[group]).session_id, flush=True)
        else:  # "use": another process calls on a session by its id
            c.set_hyperparameters(sys.argv[3], "g", lr=0.01)
            print("used", flush=True)
    time.sleep(600)
""")


def _start(target, *args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, target] + list(args),
                            stdout=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline().strip()
    assert line, "the trainer process %s exited without a session" % (args,)
    return proc, line


def _kill(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def _session_ids(d):
    with diond.Client(d.target) as c:  # the daemon's own uid: an admin, sees every session
        return {s.session_id for s in c.list_sessions()}


def _wait_until(what, predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not within %g s: %s" % (timeout, what)
        time.sleep(0.1)


def _metrics(d):
    url = "http://127.0.0.1:%d/metrics" % d.ready["metrics_port"]
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _reaped(d, reason):
    m = re.search(r'^diond_sessions_reaped_total\{reason="%s"\} (\S+)$' % reason, _metrics(d),
                  re.M)
    assert m, "diond_sessions_reaped_total{reason=%r} missing from /metrics" % reason
    return float(m.group(1))


def _log(d):
    with open(d.log_path, errors="replace") as f:
        return f.read()


def test_a_sigkilled_trainers_session_is_reaped_and_the_others_stay(daemon_factory):
    d = daemon_factory(tcp=True, extra_args=["--orphan_grace=%ds" % GRACE_S,
                                             "--metrics_address=127.0.0.1:0"])
    procs = []
    try:
        crashing, crashed_id = _start(d.target, "torch")
        procs.append(crashing)
        living, living_id = _start(d.target, "create")
        procs.append(living)
        parent, shared_id = _start(d.target, "create")
        procs.append(parent)
        helper, used = _start(d.target, "use", shared_id)
        procs.append(helper)
        assert used == "used"
        tcp = diond.Client(d.tcp_target, token=d.token)
        spec = pb.ParameterSpec(name="w", shape=[4, 4], dtype=pb.DTYPE_F32, group="g")
        group = pb.ParameterGroup(name="g", algorithm=pb.ALGORITHM_ADAMW)
        tcp_id = tcp.create_session(parameters=[spec], groups=[group]).session_id
        tcp.close()
        everyone = {crashed_id, living_id, shared_id, tcp_id}
        assert _session_ids(d) == everyone
        assert _reaped(d, "orphan") == 0 and _reaped(d, "idle") == 0

        crashed_pid = crashing.pid
        _kill(crashing)  # a crash: no CloseSession
        _kill(parent)    # its helper still uses the session
        _wait_until("the crashed trainer's session is reaped",
                    lambda: crashed_id not in _session_ids(d))
        _wait_until("the reaped session is counted", lambda: _reaped(d, "orphan") == 1)
        log = _log(d)
        line = [l for l in log.splitlines() if "session %s reaped (orphan)" % crashed_id in l]
        assert line, log[-3000:]
        assert "pid %d" % crashed_pid in line[0], line[0]

        # The reaper looks every GRACE_S / 4 s: give it two more graces to get anything wrong.
        time.sleep(2 * GRACE_S + 1)
        assert _session_ids(d) == {living_id, shared_id, tcp_id}
        assert _reaped(d, "orphan") == 1

        _kill(helper)  # the last process that used the shared session
        _wait_until("the shared session is reaped once its helper is gone too",
                    lambda: shared_id not in _session_ids(d))
        _wait_until("it is counted", lambda: _reaped(d, "orphan") == 2)
        assert _session_ids(d) == {living_id, tcp_id}
        assert _reaped(d, "idle") == 0
    finally:
        for p in procs:
            _kill(p)


def test_orphan_grace_zero_keeps_a_crashed_trainers_session(daemon_factory):
    d = daemon_factory(extra_args=["--orphan_grace=0"])
    proc, sid = _start(d.target, "create")
    _kill(proc)
    time.sleep(3.0)  # what a 2 s grace would have reaped by now is kept
    assert sid in _session_ids(d)
