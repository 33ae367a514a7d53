"""The package installs offline with pip and finds stubs it generated itself."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


def test_stubs_come_from_the_build_not_the_source_tree():
    import diond.v1.optimizer_pb2 as pb
    src = os.path.join(REPO, "client", "python", "diond")
    assert not os.path.exists(os.path.join(src, "v1")), "generated stubs must not be in the source"
    assert pb.DESCRIPTOR.package == "diond.v1"


def test_pip_install_offline(tmp_path):
    """pip install --no-build-isolation --no-index into a venv: the build runs protoc and
    grpc_python_plugin, and the installed package works from any directory."""
    if not (shutil.which("protoc") and shutil.which("grpc_python_plugin")):
        pytest.skip("protoc / grpc_python_plugin not installed")
    pytest.importorskip("setuptools", reason="python3-setuptools not installed")
    pytest.importorskip("wheel", reason="python3-wheel not installed")
    venv = tmp_path / "venv"
    r = subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip("python3-venv not available: " + r.stderr[-200:])
    src = tmp_path / "src"
    shutil.copytree(os.path.join(REPO, "client", "python"), src,
                    ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"))
    env = dict(os.environ, DIOND_PROTO_DIR=os.path.join(REPO, "proto"), PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)
    env.pop("DIOND_PROTO_PATH", None)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-build-isolation",
                        "--no-index", str(src)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import diond, diond.v1.optimizer_pb2 as p; print(p.__file__); "
                        "print(diond.Client, diond.DiondError)"],
                       capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert str(venv) in r.stdout.splitlines()[0]
