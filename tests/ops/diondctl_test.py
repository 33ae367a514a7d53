"""diondctl against real daemons: every command, text and --json, and its failures.

A 2-rank world on loopback (ops_harness.OpsWorld, rank 0 also on TCP) with a local session on
rank 0 and a world session on both ranks; the expectations come from what the test itself did
through the Python client (steps, checkpoints), not from diondctl.
"""
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops_harness as h  # noqa: E402
from diond.v1 import optimizer_pb2 as pb  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def world():
    w = h.OpsWorld(checkpoint_every=100).start(trainers=False)
    # STEPS steps on the local session and on the world session (both ranks in lockstep).
    with h.diond.Client(w.daemons[0].target) as c:
        for s in range(1, STEPS + 1):
            c.push_gradients(w.local_session, h.grads(s))
            c.step(w.local_session, s)

    def world_steps(i):
        with h.diond.Client(w.daemons[i].target, timeout=60) as c:
            for s in range(1, STEPS + 1):
                c.push_gradients(w.world_sessions[i], h.grads(s))
                c.step(w.world_sessions[i], s)
    threads = [threading.Thread(target=world_steps, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    yield w
    w.close()


def ctl(w, *args, rank=0, **kw):
    return h.diondctl("--target=" + w.daemons[rank].target, *args, **kw)


def test_health_text_json_and_the_health_only_listener(world):
    rc, out, _ = ctl(world, "health")
    assert rc == 0 and out.strip().endswith("SERVING")
    rc, out, _ = ctl(world, "--json", "health", "diond.v1.Optimizer")
    assert json.loads(out) == {"target": world.daemons[0].target, "service": "diond.v1.Optimizer",
                               "status": "SERVING"}
    hp = "127.0.0.1:%d" % world.daemons[0].ready["health_port"]
    rc, out, _ = h.diondctl("--target=" + hp, "health", "diond.v1.Optimizer")
    assert rc == 0 and "SERVING" in out
    # The health listener serves nothing else.
    rc, _, err = h.diondctl("--target=" + hp, "sessions", check=False)
    assert rc == 1 and "UNIMPLEMENTED" in err, err


def test_sessions_table_and_json(world):
    rc, out, _ = ctl(world, "sessions")
    lines = out.splitlines()
    header = lines[0].split()
    for col in ("SESSION", "CLIENT", "GROUPS", "STATE_BYTES", "STEP", "LAST_STEP", "STATE"):
        assert col in header, header
    assert lines[-1] == "2 session(s)"
    rows = {line.split()[0]: line for line in lines[1:-1]}
    assert set(rows) == {world.local_session, world.world_sessions[0]}
    for sid, client in ((world.local_session, "ops-local"), (world.world_sessions[0], "ops-world")):
        assert client in rows[sid]
        assert "matrices:muon,vectors:adamw" in rows[sid]
        assert " %d " % STEPS in rows[sid]
        assert "active" in rows[sid]

    rc, out, _ = ctl(world, "--json", "sessions")
    listed = {s["session_id"]: s for s in json.loads(out)["sessions"]}
    with h.diond.Client(world.daemons[0].target) as c:
        truth = {s.session_id: s for s in c.list_sessions()}
    assert set(listed) == set(truth)
    local = listed[world.local_session]
    assert int(local["last_step_index"]) == STEPS
    assert local["client_name"] == "ops-local"
    assert local["world_key"] == ""
    assert listed[world.world_sessions[0]]["world_key"] == "ops-world"
    assert [(g["name"], g["algorithm"], int(g["parameters"])) for g in local["groups"]] == [
        ("matrices", "ALGORITHM_MUON", 2), ("vectors", "ALGORITHM_ADAMW", 1)]
    assert int(local["state_bytes"]) == truth[world.local_session].state_bytes > 0
    assert local["state"] == "SESSION_STATE_ACTIVE"
    assert abs(int(local["last_step_unix_micros"]) / 1e6 - time.time()) < 600


def test_session_inspect(world):
    rc, out, _ = ctl(world, "session", "inspect", world.local_session)
    fields = {}
    for line in out.splitlines():
        if line.startswith(("groups:", "  ")):
            continue
        key, _, value = line.partition("  ")
        fields[key.strip()] = value.strip()
    assert fields["session"] == world.local_session
    assert fields["client"] == "ops-local"
    assert fields["last step"] == str(STEPS)
    assert fields["world key"] == "- (local session)"
    assert "  matrices" in out and "muon" in out and "adamw" in out
    rc, out, _ = ctl(world, "--json", "session", "inspect", world.local_session)
    one = json.loads(out)
    rc, listing, _ = ctl(world, "--json", "sessions")
    same = [s for s in json.loads(listing)["sessions"] if s["session_id"] == world.local_session][0]
    one.pop("last_used_unix_micros"), same.pop("last_used_unix_micros")
    one.pop("state"), same.pop("state")
    assert one == same
    rc, _, err = ctl(world, "session", "inspect", "s-nope", check=False)
    assert rc == 1 and "no session 's-nope'" in err


def test_checkpoint_then_listing_shows_it(world):
    rc, out, _ = ctl(world, "--json", "checkpoint", world.local_session)
    saved = json.loads(out)
    assert int(saved["step_index"]) == STEPS
    assert os.path.isdir(saved["path"]) and saved["path"].endswith("step-%d" % STEPS)
    assert int(saved["bytes"]) > 0
    rc, out, _ = ctl(world, "checkpoint", world.local_session)
    assert "checkpoint of step %d written to" % STEPS in out
    rc, out, _ = ctl(world, "--json", "session", "inspect", world.local_session)
    info = json.loads(out)
    assert int(info["last_checkpoint_step"]) == STEPS
    assert info["last_checkpoint_path"] == saved["path"]
    rc, _, err = ctl(world, "checkpoint", "s-nope", check=False)
    assert rc == 1 and "NOT_FOUND" in err


def test_close(world):
    with h.diond.Client(world.daemons[0].target) as c:
        sid = c.create_session(**h.session_spec("to-close")).session_id
    rc, out, _ = ctl(world, "close", sid)
    assert out.strip() == "session %s closed" % sid
    with h.diond.Client(world.daemons[0].target) as c:
        assert sid not in {s.session_id for s in c.list_sessions()}
    rc, _, err = ctl(world, "--json", "close", sid, check=False)
    assert rc == 1 and "NOT_FOUND" in err
    with h.diond.Client(world.daemons[0].target) as c:
        sid = c.create_session(**h.session_spec("to-close")).session_id
    rc, out, _ = ctl(world, "--json", "close", sid)
    assert json.loads(out) == {"session_id": sid, "closed": True}


def test_top_bounded_refreshes(world):
    url = "http://127.0.0.1:%d/metrics" % world.metrics_port(0)
    # A trainer steps the local session on from where it is while top refreshes.
    with h.diond.Client(world.daemons[0].target) as c:
        info = {s.session_id: s for s in c.list_sessions()}[world.local_session]
    trainer = _TrainerFrom(world.daemons[0].target, world.local_session, info.last_step_index)
    trainer.start()
    try:
        rc, out, _ = h.diondctl("--metrics_url=" + url, "--interval=700ms", "--iterations=3",
                                "--json", "top")
    finally:
        trainer.stop()
    frames = h.json_lines(out)
    assert [f["iteration"] for f in frames] == [1, 2, 3]
    assert all(f["steps_per_second"]["applied"] > 0 for f in frames), frames
    assert all(f["step_ms"]["p50"] is not None and f["step_ms"]["p50"] <= f["step_ms"]["p99"]
               for f in frames), frames
    assert frames[-1]["sessions"] == 2 and frames[-1]["world"] == {"size": 2, "peers": 2}
    # Idle daemon: no steps between refreshes.
    rc, out, _ = h.diondctl("--metrics_url=" + url, "--interval=300ms", "--iterations=1",
                            "--json", "top")
    idle = h.json_lines(out)[0]
    assert idle["steps_per_second"]["applied"] == 0 and idle["step_ms"]["p50"] is None
    rc, out, _ = h.diondctl("--metrics_url=" + url, "--interval=100ms", "--iterations=2", "top")
    assert out.count("diond top") == 2 and "steps/s" in out and "world       2 of 2" in out
    rc, _, err = h.diondctl("--metrics_url=http://127.0.0.1:1/metrics", "--iterations=1", "top",
                            check=False)
    assert rc == 1 and "127.0.0.1:1" in err


class _TrainerFrom(h.Trainer):
    def __init__(self, target, sid, first):
        super().__init__(target, sid, pause=0.02, name="top-trainer")
        self.first = first

    def run(self):
        try:
            step = self.first
            while not self.stop_event.is_set():
                step += 1
                self.client.push_gradients(self.session_id, h.grads(step))
                self.client.step(self.session_id, step)
                time.sleep(self.pause)
        except Exception as e:
            self.error = e


def test_world_membership_and_lost_rank(world):
    rc, _, err = ctl(world, "world", rank=1, check=False)
    assert rc == 1 and "not the coordinator" in err
    tcp_only = "--target=" + world.daemons[0].tcp_target
    # The Peer service needs the world's secret (docs/OPERATIONS.md "Security").
    rc, _, err = h.diondctl(tcp_only, "world", check=False)
    assert rc == 1 and "UNAUTHENTICATED" in err, err
    secret = os.path.join(world.daemons[0].workdir, "ctl-world.secret")
    with open(secret, "w") as f:
        f.write(world.daemons[0].world_secret + "\n")
    tcp = [tcp_only, "--world_secret_file=" + secret]
    rc, out, _ = h.diondctl(*tcp, "--json", "world")
    m = json.loads(out)
    assert m["world_size"] == 2 and m["complete"] is True and m["lost_ranks"] == []
    assert int(m["generation"]) >= 1
    assert sorted((p["rank"], p["live"]) for p in m["members"]) == [(0, True), (1, True)]
    rc, out, _ = h.diondctl(*tcp, "world")
    assert "world of 2, generation" in out and "lost ranks: none" in out
    # Lose rank 1 (SIGKILL): within --peer_timeout (5 s) the coordinator declares it lost.
    world.daemons[1].kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rc, out, _ = h.diondctl(*tcp, "--json", "world", check=False)
        m = json.loads(out)
        if m["lost_ranks"] == [1]:
            break
        time.sleep(0.5)
    assert rc == 1 and m["lost_ranks"] == [1] and m["complete"] is False, out
    rc, out, _ = h.diondctl(*tcp, "world", check=False)
    assert rc == 1 and "lost ranks: 1" in out and "INCOMPLETE" in out


def test_json_logs_carry_session_and_step(world):
    # Rank 0 logs with --log_format=json: every line is one object with the five fields, and
    # the requested checkpoint of the local session above names the session.
    with open(world.daemons[0].log_path) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    objects = []
    for line in lines:
        if not line.startswith("{"):
            continue  # gRPC's own start-up chatter, if any
        o = json.loads(line)
        assert {"time", "level", "session", "step", "message"} <= set(o), o
        objects.append(o)
    assert objects, lines[:5]
    assert any(o["session"] == world.local_session and "checkpoint of step" in o["message"]
               for o in objects), objects[-10:]
    assert any(o["session"] is None and "serving on" in o["message"] for o in objects)
    # The requested checkpoints (of step STEPS, by test_checkpoint_then_listing_shows_it) happen
    # outside a Step: no step in their context. (Automatic ones, inside a Step, carry it.)
    requested = [o for o in objects if o["session"] == world.local_session
                 and "checkpoint of step %d written" % STEPS in o["message"]]
    assert len(requested) == 2 and all(o["step"] is None for o in requested), requested


def test_json_log_lines_inside_a_step_carry_its_index(tmp_path):
    d = h.diond.Daemon(compute_threads=1, workdir=str(tmp_path), extra_args=[
        "--log_format=json", "--state_dir=" + str(tmp_path / "state"), "--checkpoint_every=2"])
    d.start()
    try:
        with h.diond.Client(d.target) as c:
            sid = c.create_session(**h.session_spec("log-test")).session_id
            c.set_state(sid, h.weights())
            for s in (1, 2):
                c.push_gradients(sid, h.grads(s))
                c.step(sid, s)
    finally:
        assert d.stop() == 0
    objects = [json.loads(line) for line in open(d.log_path) if line.startswith("{")]
    auto = [o for o in objects if "checkpoint of step 2" in o["message"]]
    assert len(auto) == 1, objects
    assert auto[0]["session"] == sid and auto[0]["step"] == 2 and auto[0]["level"] == "INFO"
    assert auto[0]["source"].startswith("session_manager.cc:")


def test_token_file_is_sent_as_bearer(tmp_path):
    # A stand-in Optimizer server records the metadata diondctl sends.
    seen = []

    def list_sessions(request, context):
        seen.append(dict(context.invocation_metadata()))
        return pb.ListSessionsResponse()
    handler = grpc.method_handlers_generic_handler("diond.v1.Optimizer", {
        "ListSessions": grpc.unary_unary_rpc_method_handler(
            list_sessions, request_deserializer=pb.ListSessionsRequest.FromString,
            response_serializer=pb.ListSessionsResponse.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        token = tmp_path / "token"
        token.write_text("s3cret-token\n")
        rc, out, _ = h.diondctl("--target=127.0.0.1:%d" % port, "--token_file=" + str(token),
                                "sessions")
        assert out.strip().endswith("0 session(s)")
        rc, _, _ = h.diondctl("--target=127.0.0.1:%d" % port, "sessions")
    finally:
        server.stop(0)
    assert seen[0].get("authorization") == "Bearer s3cret-token"
    assert "authorization" not in seen[1]
    rc, _, err = h.diondctl("--token_file=" + str(tmp_path / "missing"), "sessions", check=False)
    assert rc == 1 and "cannot read --token_file" in err


def test_tls_flags_make_a_verified_tls_channel(tmp_path):
    # Certificates made now with openssl (never committed): a CA, a server certificate for
    # 127.0.0.1 and a client certificate; a stand-in server requires the client certificate.
    def run(*args):
        subprocess.run(["openssl"] + list(args), check=True, capture_output=True, cwd=tmp_path)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", "ca.key", "-out", "ca.pem")
    (tmp_path / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for who in ("server", "client"):
        run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=" + who, "-keyout",
            who + ".key", "-out", who + ".csr")
        run("x509", "-req", "-in", who + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-extfile", "san.cnf", "-out", who + ".pem")
    seen = []

    def list_sessions(request, context):
        seen.append(context.auth_context().get("x509_common_name"))
        return pb.ListSessionsResponse()
    handler = grpc.method_handlers_generic_handler("diond.v1.Optimizer", {
        "ListSessions": grpc.unary_unary_rpc_method_handler(
            list_sessions, request_deserializer=pb.ListSessionsRequest.FromString,
            response_serializer=pb.ListSessionsResponse.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    creds = grpc.ssl_server_credentials(
        [((tmp_path / "server.key").read_bytes(), (tmp_path / "server.pem").read_bytes())],
        root_certificates=(tmp_path / "ca.pem").read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    target = "--target=127.0.0.1:%d" % port
    tls = ["--tls_ca_file=%s" % (tmp_path / "ca.pem"),
           "--tls_cert_file=%s" % (tmp_path / "client.pem"),
           "--tls_key_file=%s" % (tmp_path / "client.key")]
    try:
        rc, out, _ = h.diondctl(target, *tls, "--timeout=10s", "sessions")
        assert out.strip().endswith("0 session(s)")
        # Without the client certificate the server refuses the handshake; without TLS too.
        rc1, _, _ = h.diondctl(target, tls[0], "--timeout=3s", "sessions", check=False)
        rc2, _, _ = h.diondctl(target, "--timeout=3s", "sessions", check=False)
    finally:
        server.stop(0)
    assert seen == [[b"client"]], seen
    assert rc1 == 1 and rc2 == 1
    rc, _, err = h.diondctl(target, tls[0], "--tls_cert_file=x.pem", "sessions", check=False)
    assert rc == 1 and "go together" in err


def test_usage_errors():
    for args in ([], ["bogus"], ["close"], ["session", "inspect"], ["top", "extra"]):
        rc, _, err = h.diondctl(*args, check=False)
        assert rc == 2, (args, err)
