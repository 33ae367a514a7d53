"""Low-level client: one method per RPC of diond.v1.Optimizer, plus gRPC health.

Every call has a deadline (``timeout``, seconds; per call or the client's default), so nothing
waits forever on a daemon that hangs, and every failure is raised as ``diond.DiondError`` with the
gRPC status code and the daemon's message. Torch is not needed here; tensors go in as bytes-like
objects (bytes, memoryview, numpy arrays, CPU torch tensors) and come back as ``RawTensor``.
"""
import os

import grpc
import numpy as np

from .errors import DiondError

try:
    from diond.v1 import optimizer_pb2 as pb
    from diond.v1 import optimizer_pb2_grpc as pb_grpc
except ImportError as _e:  # pragma: no cover - depends on the installation
    raise ImportError(
        "diond: the generated gRPC stubs (diond.v1.optimizer_pb2) were not found. Build them with "
        "`DIOND_TARGETS=diond_proto_python bash scripts/build.sh` and put <build>/python on "
        "PYTHONPATH or in DIOND_PROTO_PATH, or `pip install --no-build-isolation client/python` "
        "(needs protoc and grpc_python_plugin). Original error: %s" % _e) from None

MAX_CHUNK_BYTES = 4 << 20  # the daemon's limit per TensorChunk
DEFAULT_PUSH_CHUNK_BYTES = 1 << 20

_NP_DTYPE = {pb.DTYPE_F32: np.float32, pb.DTYPE_F16: np.float16, pb.DTYPE_BF16: np.uint16}
_ELEM = {pb.DTYPE_F32: 4, pb.DTYPE_F16: 2, pb.DTYPE_BF16: 2}

_HEALTH = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def default_target():
    """$DIOND_TARGET, else the daemon's default Unix socket."""
    t = os.environ.get("DIOND_TARGET")
    if t:
        return t
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return "unix:" + os.path.join(run, "diond.sock")
    return "unix:/tmp/diond-%d.sock" % os.getuid()


class RawTensor:
    """A tensor as the daemon sent it: name, shape, dtype (a diond.v1.DType value), bytes."""

    __slots__ = ("name", "shape", "dtype", "data")

    def __init__(self, name, shape, dtype, data):
        self.name, self.shape, self.dtype, self.data = name, tuple(shape), dtype, data

    def numpy(self):
        """float32 for F32 and BF16 (widened exactly), float16 for F16."""
        a = np.frombuffer(self.data, dtype=_NP_DTYPE[self.dtype])
        if self.dtype == pb.DTYPE_BF16:
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.reshape(self.shape)

    def torch(self):
        """A torch tensor in the tensor's own dtype (bfloat16 stays bfloat16). It shares memory
        with .data when that is a bytearray (as the client's answers are), else it is a copy."""
        import torch
        dt = {pb.DTYPE_F32: torch.float32, pb.DTYPE_F16: torch.float16,
              pb.DTYPE_BF16: torch.bfloat16}[self.dtype]
        buf = self.data if isinstance(self.data, bytearray) else bytearray(self.data)
        if not buf:
            return torch.empty(self.shape, dtype=dt)
        return torch.frombuffer(buf, dtype=dt).reshape(self.shape)

    def __repr__(self):
        return "RawTensor(%r, shape=%s, dtype=%s, %d bytes)" % (
            self.name, list(self.shape), pb.DType.Name(self.dtype), len(self.data))


def as_bytes(x):
    """A flat byte view of bytes/bytearray/memoryview, a numpy array or a CPU torch tensor."""
    if isinstance(x, (bytes, bytearray)):
        return memoryview(x)
    if isinstance(x, memoryview):
        return x.cast("B") if x.format != "B" or x.ndim != 1 else x
    if isinstance(x, np.ndarray):
        return memoryview(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous().reshape(-1)
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        return memoryview(t.numpy().view(np.uint8))
    raise TypeError("expected bytes, a numpy array or a torch tensor, got %s" % type(x).__name__)


def writable_bytes(x):
    """A writable flat byte view of a bytearray, a numpy array or a contiguous CPU tensor."""
    if isinstance(x, (bytearray, memoryview)):
        mv = memoryview(x)
    elif isinstance(x, np.ndarray):
        if not x.flags["C_CONTIGUOUS"]:
            raise ValueError("destination array is not contiguous")
        mv = memoryview(x.reshape(-1).view(np.uint8))
    elif type(x).__module__.startswith("torch"):
        import torch
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError("destination tensor must be a contiguous CPU tensor")
        t = x.detach().reshape(-1)
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        mv = memoryview(t.numpy().view(np.uint8))
    else:
        raise TypeError("cannot write into %s" % type(x).__name__)
    if mv.readonly:
        raise ValueError("destination buffer is read-only")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _chunks(session_id, tensors, chunk_bytes):
    first = True
    for name, value in tensors.items():
        mv = as_bytes(value)
        n = len(mv)
        off = 0
        while True:
            c = pb.TensorChunk(name=name, offset_bytes=off, data=bytes(mv[off:off + chunk_bytes]))
            if first:
                c.session_id = session_id
                first = False
            yield c
            off += chunk_bytes
            if off >= n:
                break


def _buckets(buckets, events=None):
    """RegisterRegionRequest.buckets from [[parameter index, ...], ...] (None: none); events:
    None, or one (ready_event, done_event) pair of 64-byte CUDA IPC event handles per bucket."""
    buckets = list(buckets or ())
    if events is None:
        return [pb.Bucket(params=[int(i) for i in b]) for b in buckets]
    events = list(events)
    if len(events) != len(buckets):
        raise ValueError("bucket_events: %d pairs for %d buckets" % (len(events), len(buckets)))
    from .cuda_region import check_event_handle
    return [pb.Bucket(params=[int(i) for i in b],
                      ready_event=check_event_handle("ready_event", r),
                      done_event=check_event_handle("done_event", d))
            for b, (r, d) in zip(buckets, events)]


def _encode_health_request(service):
    b = service.encode()
    out = bytearray()
    if b:
        out.append(0x0A)  # field 1, length-delimited
        n = len(b)
        while True:
            if n < 0x80:
                out.append(n)
                break
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out += b
    return bytes(out)


def _decode_health_response(data):
    i = 0
    status = 0
    while i < len(data):
        tag = data[i]
        i += 1
        if tag == 0x08:  # field 1 varint
            v, shift = 0, 0
            while True:
                c = data[i]
                i += 1
                v |= (c & 0x7F) << shift
                shift += 7
                if c < 0x80:
                    break
            status = v
        else:  # unknown field: the health response has none; stop
            break
    return status


def _pem(value):
    """PEM bytes from bytes, PEM text, or the path of a PEM file (None stays None)."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if "-----BEGIN" in value:
        return value.encode()
    with open(value, "rb") as f:
        return f.read()


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the bearer token) to every call of a channel."""

    def __init__(self, metadata):
        self._md = list(metadata)

    def _details(self, d):
        md = list(d.metadata or []) + self._md
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(d, md)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method = d.method
        self.timeout = d.timeout
        self.metadata = metadata
        self.credentials = d.credentials
        self.wait_for_ready = getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class Client:
    """A connection to one daemon.

    Args:
      target: "unix:/path/diond.sock" or "host:port" (default: ``default_target()``).
      timeout: default deadline of every call, seconds.
      connect_timeout: how long the constructor waits for the connection; a daemon that is not
        running gives DiondError(UNAVAILABLE) after at most this long.
      token: bearer token for TCP targets (the daemon's --auth_token_file); default
        $DIOND_TOKEN, else the contents of $DIOND_TOKEN_FILE. Not sent on Unix sockets, where
        the caller's uid is its identity.
      tls: use TLS (implied by tls_ca / tls_cert). tls_ca: PEM (bytes, text or a file path) of
        the CA that signed the daemon's certificate (default: the system roots). tls_cert,
        tls_key: this client's certificate and key for mutual TLS (--tls_client_ca).
      tls_server_name: the name to check the daemon's certificate against, if not the host of
        `target`.
    """

    def __init__(self, target=None, *, timeout=60.0, connect_timeout=10.0, options=None,
                 token=None, tls=None, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None):
        self.target = target or default_target()
        self.timeout = float(timeout)
        opts = [("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20)]
        if options:
            opts.extend(options)
        if token is None and not self.is_unix:
            token = os.environ.get("DIOND_TOKEN") or None
            path = os.environ.get("DIOND_TOKEN_FILE")
            if token is None and path:
                with open(path) as f:
                    token = f.read().strip()
        if tls is None:
            tls = tls_ca is not None or tls_cert is not None
        if tls:
            if (tls_cert is None) != (tls_key is None):
                raise ValueError("tls_cert and tls_key go together")
            creds = grpc.ssl_channel_credentials(root_certificates=_pem(tls_ca),
                                                 private_key=_pem(tls_key),
                                                 certificate_chain=_pem(tls_cert))
            if tls_server_name:
                opts.append(("grpc.ssl_target_name_override", tls_server_name))
            self._channel = grpc.secure_channel(self.target, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(self.target, options=opts)
        self._raw_channel = self._channel
        if token and not self.is_unix:
            self._channel = grpc.intercept_channel(
                self._channel, _Metadata([("authorization", "Bearer " + token.strip())]))
        try:
            grpc.channel_ready_future(self._raw_channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._raw_channel.close()
            raise DiondError(
                grpc.StatusCode.UNAVAILABLE,
                "cannot connect to diond at %s within %g s: is the daemon running there?"
                % (self.target, connect_timeout), "connect") from None
        self.stub = pb_grpc.OptimizerStub(self._channel)
        self._health = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=lambda b: b, response_deserializer=lambda b: b)

    @property
    def is_unix(self):
        return self.target.startswith("unix:") or self.target.startswith("unix-abstract:")

    # -- plumbing ---------------------------------------------------------------------------
    def _t(self, timeout):
        return self.timeout if timeout is None else float(timeout)

    def _unary(self, method, request, timeout=None):
        try:
            return getattr(self.stub, method)(request, timeout=self._t(timeout))
        except grpc.RpcError as e:
            raise DiondError.from_rpc_error(e, method, self.target) from None

    def _read_stream(self, method, request, timeout=None, into=None):
        out = {}
        order = []
        try:
            for c in getattr(self.stub, method)(request, timeout=self._t(timeout)):
                t = out.get(c.name)
                if t is None:
                    if c.offset_bytes != 0:
                        raise DiondError(grpc.StatusCode.INTERNAL,
                                         "tensor %r started at offset %d" % (c.name, c.offset_bytes),
                                         method)
                    dest = None
                    if into is not None and c.name in into:
                        dest = writable_bytes(into[c.name])
                        if len(dest) != c.total_bytes:
                            raise ValueError("destination of %r has %d bytes, the daemon sends %d"
                                             % (c.name, len(dest), c.total_bytes))
                    t = [list(c.shape), c.dtype,
                         dest if dest is not None else bytearray(c.total_bytes)]
                    out[c.name] = t
                    order.append(c.name)
                end = c.offset_bytes + len(c.data)
                if end > len(t[2]):
                    raise DiondError(grpc.StatusCode.INTERNAL,
                                     "chunk of %r runs past its %d bytes" % (c.name, len(t[2])),
                                     method)
                t[2][c.offset_bytes:end] = c.data
        except grpc.RpcError as e:
            raise DiondError.from_rpc_error(e, method, self.target) from None
        return {n: RawTensor(n, out[n][0], out[n][1], out[n][2]) for n in order}

    def close(self):
        self._raw_channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- health -------------------------------------------------------------------------------
    def health(self, service="", timeout=5.0):
        """grpc.health.v1 status of `service` ("" = the server): "SERVING", "NOT_SERVING", ..."""
        try:
            resp = self._health(_encode_health_request(service), timeout=timeout)
        except grpc.RpcError as e:
            raise DiondError.from_rpc_error(e, "Health.Check", self.target) from None
        return _HEALTH.get(_decode_health_response(resp), "UNKNOWN")

    # -- Optimizer RPCs -------------------------------------------------------------------------
    def create_session(self, request=None, *, parameters=(), groups=(), fp32_master_weights=False,
                       non_finite_policy=pb.NON_FINITE_POLICY_SKIP, client_name="",
                       world_key="", gradient_sync=pb.GRADIENT_SYNC_REPLICATED, session_name="",
                       timeout=None):
        """CreateSession; pass a CreateSessionRequest or its fields. Returns the response.

        world_key: a session spanning the daemon world (docs/DISTRIBUTED.md); every rank's
        trainer creates it with the same key and spec. gradient_sync: GRADIENT_SYNC_* value.
        session_name: a stable name (e.g. "job-17/rank-0") a restarted trainer re-attaches by
        (attach_session); unique among the daemon's live sessions."""
        if request is None:
            request = pb.CreateSessionRequest(
                parameters=list(parameters), groups=list(groups),
                fp32_master_weights=fp32_master_weights, non_finite_policy=non_finite_policy,
                client_name=client_name, world_key=world_key, gradient_sync=gradient_sync,
                session_name=session_name)
        return self._unary("CreateSession", request, timeout)

    def attach_session(self, session_name, parameters=(), timeout=None):
        """AttachSession: take over the live session `session_name` after a trainer restart.
        Returns the AttachSessionResponse (.session: id and layout; .step_index: the last applied
        step). The previous trainer's regions are dropped; the next PARAMETERS region registered
        receives the daemon's current weights. DiondError NOT_FOUND if no live session has it.
        parameters: the ParameterSpecs the trainer declares; when given, a session that differs
        is refused (FAILED_PRECONDITION) and left untouched."""
        return self._unary("AttachSession", pb.AttachSessionRequest(
            session_name=session_name, parameters=list(parameters)), timeout)

    def register_region(self, session_id, role, name, offset_bytes, size_bytes, timeout=None,
                        buckets=None, bucket_events=None):
        """RegisterRegion of a POSIX shm segment `name` (no leading slash). Returns region_id.
        buckets: for REGION_ROLE_DOORBELLS, each bucket's parameter indices (docs/DATA_PLANE.md
        "Overlapped step"); bucket_events: for a device session's CUDA regions, each bucket's
        (ready_event, done_event) IPC event handles."""
        req = pb.RegisterRegionRequest(
            session_id=session_id, role=role, kind=pb.REGION_KIND_SYSTEM_SHM,
            system_shm=pb.SystemShmRegion(name=name, offset_bytes=offset_bytes,
                                          size_bytes=size_bytes),
            buckets=_buckets(buckets, bucket_events))
        return self._unary("RegisterRegion", req, timeout).region_id

    def register_memfd_region(self, session_id, role, fd_token, offset_bytes, size_bytes,
                              timeout=None, buckets=None, bucket_events=None):
        """RegisterRegion of a sealed memfd sent over the fd channel first (diond.fdchannel
        .send_fd returns `fd_token`). Returns region_id. buckets, bucket_events: as
        register_region's."""
        req = pb.RegisterRegionRequest(
            session_id=session_id, role=role, kind=pb.REGION_KIND_MEMFD,
            memfd=pb.MemfdRegion(offset_bytes=offset_bytes, size_bytes=size_bytes,
                                 fd_token=fd_token),
            buckets=_buckets(buckets, bucket_events))
        return self._unary("RegisterRegion", req, timeout).region_id

    def register_cuda_ipc_region(self, session_id, role, mem_handle, gpu_uuid, offset_bytes,
                                 size_bytes, timeout=None):
        """RegisterRegion of a legacy CUDA IPC allocation (REGION_KIND_CUDA_IPC): `mem_handle`
        (64 bytes) names the allocation base, `gpu_uuid` (16 bytes) the trainer's GPU, and the
        region is [offset_bytes, offset_bytes + size_bytes) of it. ValueError / TypeError for a
        malformed field, before anything is sent. Returns region_id."""
        from .cuda_region import cuda_ipc_region_request
        req = cuda_ipc_region_request(session_id, role, mem_handle, gpu_uuid, offset_bytes,
                                      size_bytes)
        return self._unary("RegisterRegion", req, timeout).region_id

    def register_cuda_vmm_region(self, session_id, role, fd_token, gpu_uuid, offset_bytes,
                                 size_bytes, granularity_bytes, timeout=None):
        """RegisterRegion of a CUDA VMM allocation (REGION_KIND_CUDA_VMM_FD) whose exported fd
        went over the fd channel first (diond.fdchannel.send_fd with KIND_CUDA_VMM returns
        `fd_token`; one token per region). ValueError / TypeError for a malformed field, before
        anything is sent. Returns region_id."""
        from .cuda_region import cuda_vmm_region_request
        req = cuda_vmm_region_request(session_id, role, fd_token, gpu_uuid, offset_bytes,
                                      size_bytes, granularity_bytes)
        return self._unary("RegisterRegion", req, timeout).region_id

    def unregister_region(self, session_id, region_id, timeout=None):
        self._unary("UnregisterRegion",
                    pb.UnregisterRegionRequest(session_id=session_id, region_id=region_id), timeout)

    def step(self, session_id, step_index, lr_override=None, gradient_scale=0.0, timeout=None,
             group_step=None, asynchronous=False, ready_event=b"", done_event=b"",
             params_without_grad=None, overlap=False, max_grad_norm=0.0):
        """Step; idempotent on step_index (repeat the last index to get its recorded answer).
        group_step: {group: the trainer's 1-based step number for it} (Dion's cqr warm-up counts
        it; groups not named use step_index).

        params_without_grad: the indices (in the order of CreateSessionRequest.parameters) of
        the parameters that have no gradient in this step, as torch.optim's ``p.grad is None``:
        the step leaves them and their optimizer state as they are and does not read their
        gradients (docs/ALGORITHMS.md §2.6). An index out of range or named twice fails the step
        with INVALID_ARGUMENT; in a world session under REPLICATED every rank must name the same
        ones (FAILED_PRECONDITION on every rank otherwise, nothing changed).

        asynchronous=True: the daemon validates the request, queues the step and answers at once
        (.queued is True); the result comes with the next step() (.previous) or wait_step().
        Until then the session's regions and state belong to the step: do not read or write the
        arenas (docs/DATA_PLANE.md "Asynchronous Step").

        ready_event, done_event: the 64-byte handles (torch.cuda.Event.ipc_handle()) of the
        trainer's interprocess events for CUDA regions (docs/DATA_PLANE.md "The event
        protocol"); empty = none. ValueError for another size, before anything is sent.

        overlap=True (with asynchronous=True and a REGION_ROLE_DOORBELLS page registered): the
        queued step stages each bucket as its gradients doorbell is rung (docs/DATA_PLANE.md
        "Overlapped step").

        max_grad_norm > 0: the daemon clips the gradients to this total L2 norm first, as
        torch's clip_grad_norm_ (docs/DATA_PLANE.md "Gradient clip"); the answer's grad_norm is
        the norm before clipping."""
        if ready_event or done_event:
            from .cuda_region import check_event_handle
            ready_event = check_event_handle("ready_event", ready_event) if ready_event else b""
            done_event = check_event_handle("done_event", done_event) if done_event else b""
        req = pb.StepRequest(session_id=session_id, step_index=step_index,
                             gradient_scale=gradient_scale, asynchronous=bool(asynchronous),
                             ready_event=ready_event, done_event=done_event,
                             overlap=bool(overlap), max_grad_norm=max_grad_norm)
        if lr_override:
            for g, lr in lr_override.items():
                req.lr_override[g] = float(lr)
        if group_step:
            for g, n in group_step.items():
                req.group_step[g] = int(n)
        if params_without_grad:
            req.params_without_grad.extend(int(i) for i in params_without_grad)
        return self._unary("Step", req, timeout)

    def wait_step(self, session_id, step_index=0, timeout=None):
        """Waits for the session's queued asynchronous step and returns its StepResponse; raises
        DiondError with its error if it failed. step_index: 0 or the queued step's. With nothing
        queued: the recorded last step's answer (.replayed = True)."""
        return self._unary("Step", pb.StepRequest(session_id=session_id, step_index=step_index,
                                                  wait=True), timeout)

    def push_gradients(self, session_id, tensors, chunk_bytes=DEFAULT_PUSH_CHUNK_BYTES,
                       timeout=None):
        """PushGradients of {parameter name: bytes in the parameter's dtype}."""
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError("chunk_bytes must be in 1..%d" % MAX_CHUNK_BYTES)
        try:
            return self.stub.PushGradients(_chunks(session_id, tensors, chunk_bytes),
                                           timeout=self._t(timeout))
        except grpc.RpcError as e:
            raise DiondError.from_rpc_error(e, "PushGradients", self.target) from None

    def pull_parameters(self, session_id, names=None, chunk_bytes=0, timeout=None, into=None):
        """PullParameters: {name: RawTensor in the trainer's dtype} (all parameters by default).

        into: optional {name: writable buffer} (contiguous CPU tensors or numpy arrays of the
        parameter's size): those tensors' bytes are written straight into it (no extra copy);
        their RawTensor.data is then a memoryview of it."""
        req = pb.PullParametersRequest(session_id=session_id, names=list(names or []),
                                       chunk_bytes=chunk_bytes)
        return self._read_stream("PullParameters", req, timeout, into)

    def set_hyperparameters(self, session_id, group, lr=None, weight_decay=None, timeout=None):
        """SetHyperparameters (the daemon changes lr and weight_decay only)."""
        h = pb.Hyperparameters()
        if lr is not None:
            h.lr = float(lr)
        if weight_decay is not None:
            h.weight_decay = float(weight_decay)
        self._unary("SetHyperparameters", pb.SetHyperparametersRequest(
            session_id=session_id, group=group, hyperparameters=h), timeout)

    def get_state(self, session_id, include_parameters=False, timeout=None):
        """GetState: {"<param>/state.<name>": RawTensor (float32)}, plus the parameters (float32
        master values) when include_parameters."""
        req = pb.GetStateRequest(session_id=session_id, include_parameters=include_parameters)
        return self._read_stream("GetState", req, timeout)

    def set_state(self, session_id, tensors, chunk_bytes=DEFAULT_PUSH_CHUNK_BYTES, timeout=None):
        """SetState of {name: bytes}: state tensors as float32, parameters in their own dtype.
        Returns the number of tensors set."""
        if not tensors:
            return 0
        try:
            return self.stub.SetState(_chunks(session_id, tensors, chunk_bytes),
                                      timeout=self._t(timeout)).tensors
        except grpc.RpcError as e:
            raise DiondError.from_rpc_error(e, "SetState", self.target) from None

    def save_checkpoint(self, session_id, directory="", timeout=None):
        return self._unary("SaveCheckpoint", pb.SaveCheckpointRequest(
            session_id=session_id, directory=directory), timeout)

    def load_checkpoint(self, path, shard_paths=(), timeout=None):
        """LoadCheckpoint. shard_paths: for a world session restored into a world of another
        size, the other old ranks' checkpoints of the same step (docs/DISTRIBUTED.md)."""
        return self._unary("LoadCheckpoint", pb.LoadCheckpointRequest(
            path=path, shard_paths=list(shard_paths)), timeout)

    def close_session(self, session_id, timeout=None):
        self._unary("CloseSession", pb.CloseSessionRequest(session_id=session_id), timeout)

    def describe_options(self, timeout=None):
        """The daemon's option table (DescribeOptionsResponse): every field of
        Hyperparameters with its type, range, algorithms, and every algorithm's defaults."""
        return self._unary("DescribeOptions", pb.DescribeOptionsRequest(), timeout)

    def option_schema(self):
        """diond.options.OptionSchema of this daemon, fetched once per connection."""
        if getattr(self, "_option_schema", None) is None:
            from .options import OptionSchema  # options imports this module
            self._option_schema = OptionSchema(self.describe_options())
        return self._option_schema

    def list_sessions(self, timeout=None):
        return list(self._unary("ListSessions", pb.ListSessionsRequest(), timeout).sessions)
