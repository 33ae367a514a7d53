"""Python client of the diond optimizer daemon.

    import diond
    with diond.Client("unix:/run/user/1000/diond.sock") as c:
        print(c.health())                      # "SERVING"

    import diond.torch                         # the drop-in torch.optim.Optimizer
    opt = diond.torch.Optimizer(model.parameters(), algorithm="dion2", lr=0.02)

Where the generated gRPC stubs come from (they are generated at build time, never committed):
the subpackage ``diond.v1`` (optimizer_pb2, optimizer_pb2_grpc) is looked up, in this order, in
  1. the installed package itself (``pip install client/python`` generates it with protoc);
  2. ``<dir>/diond/v1`` for every ``<dir>`` on sys.path (e.g. ``PYTHONPATH=<build>/python``);
  3. ``<dir>/diond/v1`` for every ``<dir>`` in $DIOND_PROTO_PATH (os.pathsep-separated), where
     ``<dir>`` is a CMake build's ``python`` folder (target ``diond_proto_python``);
  4. from a source checkout, ``<repo>/build/python`` (the default build folder).
"""
import os
import pkgutil

# (2): every sys.path entry holding a diond/ folder contributes to this package's path, so the
# CMake build's <build>/python/diond/v1 becomes diond.v1 next to this source folder.
__path__ = pkgutil.extend_path(__path__, __name__)  # noqa: F821 (module attribute)


def _add_stub_dir(root):
    d = os.path.join(os.path.abspath(root), "diond")
    if os.path.isfile(os.path.join(d, "v1", "optimizer_pb2.py")) and d not in __path__:
        __path__.append(d)


def _find_stubs():
    for root in os.environ.get("DIOND_PROTO_PATH", "").split(os.pathsep):  # (3)
        if root:
            _add_stub_dir(root)
    # (4): client/python/diond/__init__.py -> <repo>
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    _add_stub_dir(os.path.join(repo, "build", "python"))


_find_stubs()

from .errors import DiondError  # noqa: E402
from .client import Client, RawTensor, default_target  # noqa: E402
from .daemon import Daemon, find_binary  # noqa: E402

__version__ = "0.1.0"
__all__ = ["Client", "DiondError", "Daemon", "RawTensor", "default_target", "find_binary"]
