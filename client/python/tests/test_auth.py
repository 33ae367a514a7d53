"""Credentials from Python against the real daemon (docs/OPERATIONS.md "Security"): TCP needs a
token, sessions belong to their creator, TLS works with a CA made here by openssl."""
import os
import subprocess

import grpc
import pytest
import torch

import diond
import diond.torch


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def test_tcp_needs_a_token_and_sessions_belong_to_their_creator(daemon_factory):
    d = daemon_factory(tcp=True)
    assert d.token
    with pytest.raises(diond.DiondError) as e:
        diond.Client(d.tcp_target, token="").list_sessions()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(diond.DiondError) as e:
        diond.Client(d.tcp_target, token="x" * 32).list_sessions()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED

    lin = _linear()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=d.tcp_target,
                               token=d.token) as opt:
        lin(torch.randn(2, 8)).sum().backward()
        opt.step()
        mine = diond.Client(d.tcp_target, token=d.token).list_sessions()
        assert [(s.session_id, s.owner) for s in mine] == [(opt.session_id, "diond-python")]
        # The Unix socket's root caller is an admin and sees it too; the owner is the token's.
        everyone = diond.Client(d.target).list_sessions()
        assert [s.owner for s in everyone] == ["diond-python"]


def test_token_from_the_environment(daemon_factory, monkeypatch):
    d = daemon_factory(tcp=True)
    monkeypatch.setenv("DIOND_TOKEN", d.token)
    assert diond.Client(d.tcp_target).list_sessions() == []


def test_tls_with_the_daemons_ca(daemon_factory, tmp_path):
    run = lambda *a: subprocess.run(a, cwd=tmp_path, check=True, capture_output=True)  # noqa
    run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
        "ca.pem", "-days", "1", "-subj", "/CN=py-test-ca")
    run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
        "server.csr", "-subj", "/CN=server")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", "server.pem")
    d = daemon_factory(tcp=True, extra_args=["--tls_cert=%s" % (tmp_path / "server.pem"),
                                             "--tls_key=%s" % (tmp_path / "server.key")])
    ca = str(tmp_path / "ca.pem")
    c = diond.Client(d.tcp_target, token=d.token, tls_ca=ca)
    assert c.list_sessions() == []
    lin = _linear()
    with diond.torch.Optimizer(lin.parameters(), algorithm="adamw", target=d.tcp_target,
                               token=d.token, tls_ca=open(ca, "rb").read()) as opt:
        lin(torch.randn(2, 8)).sum().backward()
        opt.step()
        assert [s.owner for s in c.list_sessions()] == ["diond-python"]
    # Plaintext to a TLS listener does not connect.
    with pytest.raises(diond.DiondError) as e:
        diond.Client(d.tcp_target, token=d.token, connect_timeout=2)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert os.path.exists(ca)
