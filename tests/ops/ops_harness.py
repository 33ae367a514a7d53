"""Shared harness of the operations tests (tests/ops): real diond daemons forming a 2-rank world
on loopback, a local session and a world session stepped by trainer threads through the Python
client (remote mode: SetState, PushGradients, Step), and helpers to read /metrics.

Environment (set by tests/CMakeLists.txt): DIOND_BINARY, DIONDCTL_BINARY, DIOND_REPO, and
PYTHONPATH with <repo>/client/python and <build>/python (the generated stubs).
"""
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request

import numpy as np

import diond
from diond.v1 import optimizer_pb2 as pb

REPO = os.environ.get("DIOND_REPO") or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
DIONDCTL = os.environ.get("DIONDCTL_BINARY") or os.path.join(REPO, "build", "bin", "diondctl")

PARAMS = {"w1": (32, 24), "w2": (16, 32), "b": (16,)}


def session_spec(client_name):
    return dict(
        parameters=[pb.ParameterSpec(name=n, shape=list(s), dtype=pb.DTYPE_F32,
                                     group="matrices" if len(s) == 2 else "vectors")
                    for n, s in PARAMS.items()],
        groups=[pb.ParameterGroup(name="matrices", algorithm=pb.ALGORITHM_MUON,
                                  hyperparameters=pb.Hyperparameters(lr=0.02)),
                pb.ParameterGroup(name="vectors", algorithm=pb.ALGORITHM_ADAMW,
                                  hyperparameters=pb.Hyperparameters(lr=1e-3))],
        client_name=client_name)


def weights(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in PARAMS.items()}


def grads(step, nan=False):
    rng = np.random.default_rng(1000 + step)
    g = {n: rng.standard_normal(s).astype(np.float32) for n, s in PARAMS.items()}
    if nan:
        g["w1"][0, 0] = np.nan
    return g


def scrape(port):
    """{family: {"type": t, "samples": [(name, {labels}, value)]}} from /metrics."""
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        text = r.read().decode()
    families = {}
    current = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            current = families.setdefault(name, {"type": kind, "samples": []})
        elif line and not line.startswith("#"):
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
            if not m:
                continue
            labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"',
                                     m.group(3) or ""))
            fam = families.get(m.group(1))
            if fam is None:  # _bucket/_sum/_count of a histogram, or a summary's parts
                fam = current
            if fam is not None:
                fam["samples"].append((m.group(1), labels, float(m.group(4))))
    return families


class Trainer(threading.Thread):
    """Steps one session until stopped: gradients every step, a NaN step (skipped) every 13th,
    a replay of the previous step and a wrong step index (FAILED_PRECONDITION) every 7th, so
    every step outcome and an error code keep appearing. The trainers of one world session step in
    lockstep (each world Step waits for the other rank's), so they must stop after the same step:
    `last_step`, set by OpsWorld.stop_trainers before the stop event, is the step they both finish
    first (None: stop after the current step)."""

    def __init__(self, target, session_id, pause=0.05, name="trainer"):
        super().__init__(name=name, daemon=True)
        self.client = diond.Client(target, timeout=60)
        self.session_id = session_id
        self.pause = pause
        self.stop_event = threading.Event()
        self.last_step = None
        self.steps = 0
        self.error = None

    def _stopping(self, done):
        return self.stop_event.is_set() and (self.last_step is None or done >= self.last_step)

    def run(self):
        try:
            step = 0
            while not self._stopping(step):
                step += 1
                self.client.push_gradients(self.session_id, grads(step, nan=step % 13 == 0))
                self.client.step(self.session_id, step)
                self.steps = step
                if step % 7 == 0:
                    self.client.step(self.session_id, step)  # replayed
                    try:
                        self.client.step(self.session_id, step + 5)
                    except diond.DiondError:
                        pass  # FAILED_PRECONDITION, counted by the daemon
                time.sleep(self.pause)
        except Exception as e:  # surfaced by stop()
            self.error = e

    def stop(self):
        self.stop_event.set()
        self.join(120)
        self.client.close()
        if self.is_alive():
            raise RuntimeError("%s hung" % self.name)
        if self.error is not None:
            raise self.error


class OpsWorld:
    """Two daemons (rank 0 on TCP loopback) with metrics, a state dir and automatic checkpoints,
    JSON logs, a memory budget; a local session on rank 0 and a world session on both ranks,
    each stepped by a Trainer."""

    def __init__(self, checkpoint_every=5, memory_budget=64 << 20):
        self.dir = tempfile.mkdtemp(prefix="diond-ops-")
        self.checkpoint_every = checkpoint_every
        self.memory_budget = memory_budget
        self.daemons = []
        self.trainers = []
        self.local_session = None
        self.world_sessions = []

    def _flags(self, rank):
        return ["--world_size=2", "--rank=%d" % rank, "--metrics_address=127.0.0.1:0",
                "--health_address=127.0.0.1:0", "--heartbeat_interval=200ms",
                "--peer_timeout=5s", "--checksum_every=3",
                "--state_dir=" + os.path.join(self.dir, "state%d" % rank),
                "--checkpoint_every=%d" % self.checkpoint_every,
                "--memory_budget_bytes=%d" % self.memory_budget, "--log_format=json"]

    def start(self, trainers=True):
        d0 = diond.Daemon(tcp=True, compute_threads=1, extra_args=self._flags(0),
                          workdir=self._workdir("d0")).start()
        self.daemons.append(d0)
        port = d0.tcp_target.rsplit(":", 1)[1]
        d1 = diond.Daemon(compute_threads=1, workdir=self._workdir("d1"),
                          extra_args=self._flags(1) + ["--coordinator=127.0.0.1:" + port]).start()
        self.daemons.append(d1)
        self._wait_world_ready()
        # A local session on rank 0 and a world session on both ranks (created concurrently:
        # the ranks agree on its shard plan).
        with diond.Client(d0.target) as c:
            self.local_session = c.create_session(**session_spec("ops-local")).session_id
            c.set_state(self.local_session, weights())
        created = [None, None]

        def create(i):
            with diond.Client(self.daemons[i].target, timeout=60) as c:
                sid = c.create_session(world_key="ops-world", **session_spec("ops-world")).session_id
                c.set_state(sid, weights())
                created[i] = sid
        threads = [threading.Thread(target=create, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        if None in created:
            raise RuntimeError("world session not created:\n%s\n%s" % (d0.log_tail(),
                                                                        d1.log_tail()))
        self.world_sessions = created
        if trainers:
            self.trainers = [Trainer(d0.target, self.local_session, name="local")]
            self.trainers += [Trainer(self.daemons[i].target, created[i], name="world%d" % i)
                              for i in range(2)]
            for t in self.trainers:
                t.start()
        return self

    def _workdir(self, name):
        d = os.path.join(self.dir, name)
        os.makedirs(d, exist_ok=True)
        return d

    def _wait_world_ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.metric(i, "diond_world_generation") > 0 for i in range(2)):
                return
            time.sleep(0.1)
        raise RuntimeError("world did not form:\n" + "\n".join(d.log_tail() for d in self.daemons))

    def metrics_port(self, i):
        return self.daemons[i].ready["metrics_port"]

    def metric(self, i, family, **labels):
        """Sum of a family's samples (named `family`) matching `labels` on daemon i."""
        fam = scrape(self.metrics_port(i)).get(family)
        if fam is None:
            return 0.0
        return sum(v for n, l, v in fam["samples"]
                   if n == family and all(l.get(k) == w for k, w in labels.items()))

    def wait_steps(self, n, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(t.steps >= n for t in self.trainers):
                return
            for t in self.trainers:
                if t.error is not None:
                    raise t.error
            time.sleep(0.1)
        raise RuntimeError("trainers did not reach step %d: %s" %
                           (n, [t.steps for t in self.trainers]))

    def stop_trainers(self):
        trainers, self.trainers = self.trainers, []
        # The world trainers stop after one common step. Had each stopped after its own current
        # step, one could already be in the next step, which then waits for a peer that never
        # comes and fails with the peer timeout (seen in CI: "lost rank 0 ... Read timeout").
        # They are at most one step apart (lockstep) and a step takes at least `pause`, so two
        # steps past the furthest completed one is a step neither has entered yet.
        world = [t for t in trainers if t.name.startswith("world")]
        if world:
            last = max(t.steps for t in world) + 2
            for t in world:
                t.last_step = last
        for t in trainers:
            t.stop_event.set()
        for t in trainers:
            t.stop()

    def close(self):
        try:
            self.stop_trainers()
        finally:
            rcs = [d.stop() for d in self.daemons]
            shutil.rmtree(self.dir, ignore_errors=True)
        return rcs


def diondctl(*args, check=True, timeout=60):
    """Runs diondctl; returns (rc, stdout, stderr)."""
    p = subprocess.run([DIONDCTL] + list(args), capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError("diondctl %s exited %d:\n%s%s" % (" ".join(args), p.returncode,
                                                              p.stdout, p.stderr))
    return p.returncode, p.stdout, p.stderr


def free_port():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def json_lines(text):
    return [json.loads(line) for line in text.splitlines() if line.strip()]
