"""Build hook of the diond Python package: generates the gRPC stubs at build time.

The stubs (diond/v1/optimizer_pb2.py, optimizer_pb2_grpc.py) are never committed. `pip install`
runs build_py, which calls Debian's `protoc` and `grpc_python_plugin` on proto/diond/v1/optimizer.proto
(found at ../../proto, or $DIOND_PROTO_DIR) and writes the result into the package's build output.
Without protoc it copies already generated stubs from $DIOND_PROTO_PATH (a CMake build's
<build>/python). Everything else is in pyproject.toml.
"""
import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        out = os.path.join(self.build_lib, "diond", "v1")
        os.makedirs(out, exist_ok=True)
        proto_dir = os.environ.get("DIOND_PROTO_DIR") or os.path.join(HERE, "..", "..", "proto")
        proto = os.path.join(proto_dir, "diond", "v1", "optimizer.proto")
        protoc = shutil.which("protoc")
        plugin = shutil.which("grpc_python_plugin")
        if os.path.isfile(proto) and protoc and plugin:
            subprocess.check_call([
                protoc, "-I", proto_dir, "--python_out=" + self.build_lib,
                "--grpc_python_out=" + self.build_lib,
                "--plugin=protoc-gen-grpc_python=" + plugin, proto])
            return
        pre = os.environ.get("DIOND_PROTO_PATH", "")
        src = os.path.join(pre, "diond", "v1")
        if pre and os.path.isfile(os.path.join(src, "optimizer_pb2.py")):
            for f in ("optimizer_pb2.py", "optimizer_pb2_grpc.py"):
                shutil.copy(os.path.join(src, f), os.path.join(out, f))
            return
        raise SystemExit(
            "diond: cannot generate the gRPC stubs: need %s plus protoc and grpc_python_plugin "
            "(Debian: protobuf-compiler protobuf-compiler-grpc), or DIOND_PROTO_PATH=<build>/python "
            "from a CMake build (target diond_proto_python)" % proto)


setup(cmdclass={"build_py": BuildPyWithStubs})
