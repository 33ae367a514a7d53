"""Start and stop a local diond daemon (tests, examples, benchmarks).

    with diond.Daemon() as d:               # CPU daemon on a private Unix socket
        opt = diond.torch.Optimizer(params, target=d.target)

The binary: the `binary` argument, else $DIOND_BINARY, else <repo>/build/bin/diond (source
checkout), else `diond` on PATH.
"""
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time


def find_binary(binary=None):
    cands = [binary, os.environ.get("DIOND_BINARY")]
    # This checkout's build (client/python/diond/daemon.py -> the repository root).
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    cands.append(os.path.join(repo, "build", "bin", "diond"))
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    w = shutil.which("diond")
    if w:
        return w
    raise FileNotFoundError(
        "diond binary not found (tried %s, PATH); build it with `bash scripts/build.sh` or set "
        "DIOND_BINARY" % ", ".join(c for c in cands if c))


class Daemon:
    """A diond process on a Unix socket in a fresh temporary folder.

    Args:
      binary: path of diond (see find_binary).
      device: --device (default "cpu").
      compute_threads: --compute_threads (None = the daemon's default, all cores).
      extra_args: more flags.
      tcp: also listen on a free loopback TCP port; unless extra_args name --auth_token_file or
        --allow_unauthenticated_tcp, the daemon gets a fresh token file, and ``token`` holds the
        token (principal "diond-python") for Client(tcp_target, token=d.token).
      world_secret: for a world (--world_size in extra_args, no --world_secret_file): the secret
        written to a --world_secret_file (every daemon of one world needs the same).
      ready_timeout: seconds to wait for the ready file.
      tie_to_parent: start the daemon with --exit_on_stdin_eof and a pipe on its standard input
        whose write end only this process holds, so the daemon stops (drained, as on SIGTERM)
        when this process exits for any reason, SIGKILL included, instead of running on as an
        orphan. Child processes forked later inherit the write end and keep the daemon alive
        until they exit too.
    """

    def __init__(self, binary=None, *, device="cpu", compute_threads=None, extra_args=(),
                 tcp=False, ready_timeout=60.0, workdir=None,
                 world_secret="diond-python-world-secret-0123456789", tie_to_parent=True):
        self.binary = find_binary(binary)
        self.device = device
        self.compute_threads = compute_threads
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        self._own_dir = workdir is None
        self.workdir = workdir or tempfile.mkdtemp(prefix="diond-")
        self.socket = os.path.join(self.workdir, "diond.sock")
        self.ready_file = os.path.join(self.workdir, "ready.json")
        self.log_path = os.path.join(self.workdir, "diond.log")
        self.tcp = tcp
        self.tcp_target = None  # "127.0.0.1:<port>" once started with tcp=True
        self.token = None  # the bearer token for tcp_target (tcp=True)
        self.world_secret = world_secret
        self.tie_to_parent = tie_to_parent
        self.proc = None

    @property
    def target(self):
        return "unix:" + self.socket

    def start(self):
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("daemon already running (pid %d)" % self.proc.pid)
        for p in (self.ready_file, self.socket):
            if os.path.exists(p):
                os.unlink(p)
        listen = "unix:" + self.socket + (",127.0.0.1:0" if self.tcp else "")
        args = [self.binary, "--device=" + self.device, "--listen=" + listen,
                "--metrics_address=", "--ready_file=" + self.ready_file]
        if self.compute_threads is not None:
            args.append("--compute_threads=%d" % self.compute_threads)
        if self.tie_to_parent:
            args.append("--exit_on_stdin_eof")
        args += self.extra_args
        named = [a.split("=", 1)[0] for a in self.extra_args]
        if (self.tcp and "--auth_token_file" not in named
                and "--allow_unauthenticated_tcp" not in named):
            self.token = secrets.token_hex(24)
            path = os.path.join(self.workdir, "tokens")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("%s diond-python\n" % self.token)
            args.append("--auth_token_file=" + path)
        if "--world_size" in named and "--world_secret_file" not in named:
            path = os.path.join(self.workdir, "world.secret")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.world_secret)
            args.append("--world_secret_file=" + path)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if self.tie_to_parent else subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if os.path.exists(self.ready_file) and os.path.getsize(self.ready_file) > 0:
                with open(self.ready_file) as f:
                    self.ready = json.load(f)
                for entry in self.ready.get("listen", []):
                    if "port" in entry:
                        self.tcp_target = entry["uri"]
                return self
            if self.proc.poll() is not None:
                raise RuntimeError("diond exited with status %d during start-up:\n%s"
                                   % (self.proc.returncode, self.log_tail()))
            time.sleep(0.02)
        self.kill()
        raise RuntimeError("diond did not become ready within %g s:\n%s"
                           % (self.ready_timeout, self.log_tail()))

    def log_tail(self, n=20):
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self):
        return self.proc.pid if self.proc else None

    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout=15.0):
        """SIGTERM and wait; returns the exit status (None if it was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        rc = self.proc.returncode
        self._close_pipes()
        return rc

    def kill(self):
        """SIGKILL (a crash, as far as clients can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            self._close_pipes()

    def _close_pipes(self):
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._log.close()

    def cleanup(self):
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.cleanup()
