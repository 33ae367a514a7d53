"""A drop-in ``torch.optim.Optimizer`` whose update runs in the diond daemon.

    import diond.torch
    opt = diond.torch.Optimizer([
        dict(params=hidden_matrices),                       # algorithm from the constructor
        dict(params=embeddings + norms, algorithm="adamw", lr=3e-3, weight_decay=0.0),
    ], algorithm="dion2", lr=0.02, target="unix:/run/user/1000/diond.sock")
    loss.backward(); opt.step(); opt.zero_grad()

Parameter groups follow microsoft/dion: each group has an ``algorithm`` ("muon", "normuon",
"dion", "dion2", "dion3" = "nordion2", "adamw", "lion"); the constructor's keyword arguments are
the defaults of every group (the reference's defaults: lr 0.01, mu 0.95, betas (0.9, 0.95),
weight_decay 0.01, epsilon 1e-8, ...). An option a group's algorithm does not have, an unknown
option or a value out of range raises ValueError/TypeError before a session is created (the
options' defaults, ranges and algorithms are the daemon's: one DescribeOptions call per
connection, diond.options.OptionSchema).

Shared-memory mode (the default on a Unix socket): the constructor moves every parameter's
``.data`` and ``.grad`` into two arenas in one shared buffer, so the model's tensors become
views of memory the daemon maps as well (docs/DATA_PLANE.md). CPU parameters: a host buffer
(``arena="memfd"``: a sealed memfd passed over the daemon's fd channel, the default on Linux when
the daemon offers it; ``arena="shm"``: a POSIX shared-memory segment). CUDA parameters: one
allocation on their GPU (``arena="cuda_vmm"``: a VMM allocation whose fd goes over the fd
channel; ``arena="cuda_ipc"``: a legacy CUDA IPC handle), for a daemon computing on that GPU;
``step()`` then orders the daemon's work and the trainer's stream with two interprocess events,
without a host synchronization. ``backward()`` accumulates into the gradient arena and
``step()`` is one small ``Step`` RPC after which the daemon has written the new weights in
place. All parameters must be on one device (CPU or one GPU). Remote mode (``remote=True``,
the default for TCP targets; any devices): weights go up with ``SetState`` once, gradients with
``PushGradients`` every step, and the new weights come back with ``PullParameters`` (both modes
give bit-identical numbers).

Overlapped step (``overlap=True``; local sessions: CPU parameters over memfd or shm, CUDA
parameters over CUDA arenas, whose buckets are ordered with interprocess events; world sessions
of either, every trainer overlapping the same steps, docs/DISTRIBUTED.md): the
daemon updates each bucket of parameters while backward still produces the gradients of earlier
layers, and the next forward waits for each layer's weights just before the layer runs, with the
numbers of a synchronous step, bit for bit (docs/DATA_PLANE.md "Overlapped step",
diond/torch_overlap.py). The first step is synchronous and records backward's order. Then
``step()`` returns at once; the gradients are the trainer's own tensors (as plain torch's), so
``zero_grad()`` never waits. Use ``with opt.no_sync():`` for the micro-batches of gradient
accumulation before the last. Forward and ``model.state_dict()`` wait for the weights by
themselves; anything else that reads or writes them (a parameter read directly) calls
``opt.synchronize()`` first. A write to the gradients after backward (``clip_grad_norm_``,
accumulation outside ``no_sync()``) or a new set of parameters without a gradient makes that step
synchronous, with a warning, never a different number; ``opt.overlap_stats`` counts both kinds of
steps. A failed overlapped step raises its error from the next forward (or ``synchronize()``) with
nothing applied.

Lifetime: the model outlives the optimizer. However the optimizer goes (close(), garbage
collection, interpreter exit), the parameters and gradients that view its arena become ordinary
tensors holding the latest values; the arena's mapping is never unmapped under a live view. A
forked child gets private copies at the fork, and its copy of the optimizer is closed.

Parameters without a gradient: as torch.optim, step() leaves a parameter that has no gradient
(torch's ``p.grad is None``) and its optimizer state untouched: no momentum or weight decay, and
AdamW's own step count stays where it was; the groups' step counters advance, as microsoft/dion's
``group["step"]``. In remote mode that is ``p.grad is None``. In shared-memory mode ``.grad`` is
always a view of the gradient arena, so the optimizer keeps the answer beside it: a parameter has
a gradient once backward reached it (a tensor hook on each parameter that requires grad, one
Python call per parameter per backward), a tensor was assigned to its ``.grad``, an in-place
write left its ``.grad`` non-zero (``p.grad.copy_(g)``), or it had a ``.grad`` when the optimizer
was built. ``zero_grad()`` (set_to_none=True) or a ``.grad`` set to None
(``model.zero_grad(set_to_none=True)``) takes it away; ``zero_grad(set_to_none=False)`` keeps it
(a zero gradient, stepped as torch steps it). One edge: on torch 2.x ``torch.autograd.grad``
with respect to a parameter runs its hooks without writing ``.grad``, which counts as a gradient
here. In a world session under REPLICATED every rank's trainer must have the same parameters
without a gradient (docs/ALGORITHMS.md §2.6).

Differences from a PyTorch optimizer, by design:
  * in shared-memory mode ``.grad`` is never None: ``zero_grad()`` zeroes in place, whatever
    ``set_to_none`` says, so the gradients stay views of the arena (see above for what marks a
    parameter as having no gradient);
  * optimizer state lives in the daemon: ``state_dict()`` fetches it (GetState) and
    ``load_state_dict()`` sends it (SetState); ``self.state`` stays empty;
  * only ``lr`` (sent with every step, so schedulers just work) and ``weight_decay`` (sent with
    SetHyperparameters when it changes) may change after construction.
"""
import math
import os
import warnings
import weakref

import grpc
import torch

from . import cuda_arena, fdchannel, host_arena, torch_overlap
from .client import Client, DiondError, pb
from .options import ALGORITHMS, MATRIX_ALGORITHMS, _GRADIENT_SYNC, _NONFINITE, same_option

__all__ = ["Optimizer", "ALGORITHMS"]

_DTYPES = {torch.float32: pb.DTYPE_F32, torch.bfloat16: pb.DTYPE_BF16,
           torch.float16: pb.DTYPE_F16}
_SEGMENT_ALIGN = 4096
_HOST_ARENAS = ("memfd", "shm")
_CUDA_ARENAS = ("cuda_vmm", "cuda_ipc")


def _align(n, a):
    return (n + a - 1) // a * a


def _describe(wheres, limit=4):
    more = len(wheres) - limit
    return ", ".join(wheres[:limit]) + (" and %d more" % more if more > 0 else "")


def _arena_device(params):
    """The one device of shared-memory mode's arenas. params: [(where, torch.device)], where
    names the parameter for messages. ValueError when the parameters span several devices (CPU
    and GPU, or several GPUs: one arena lives on one device) or a device that is neither the CPU
    nor a CUDA GPU."""
    by_device = {}
    for where, device in params:
        by_device.setdefault(device, []).append(where)
    for device, wheres in by_device.items():
        if device.type not in ("cpu", "cuda"):
            raise ValueError("shared-memory mode takes CPU or CUDA parameters; %s %s on %s: use "
                             "remote=True" % (_describe(wheres),
                                              "is" if len(wheres) == 1 else "are", device))
    if len(by_device) > 1:
        raise ValueError(
            "shared-memory mode keeps every parameter in one arena on one device, but these "
            "parameters are on %d devices: %s. Move them to one device (one optimizer per GPU), "
            "or use remote=True" % (len(by_device), "; ".join(
                "%s on %s" % (_describe(w), d) for d, w in by_device.items())))
    return next(iter(by_device)) if by_device else torch.device("cpu")


def _fill_views(p, pv, gv, from_daemon):
    """An arena's views of parameter p take its values (unless the weights come from the daemon)
    and its gradient (zeros when it has none, or when the weights come from the daemon). Returns
    whether p has a gradient."""
    if not from_daemon:
        pv.copy_(p.data)
    if p.grad is not None and not from_daemon:
        gv.copy_(p.grad)
        return True
    gv.zero_()
    return False


class _GradFlags:
    """Which parameters have a gradient (torch's ``p.grad is not None``) in shared-memory mode,
    where every .grad stays a view of the gradient arena. ``has`` is set by the parameters'
    hooks (_has_grad_hook) and by the optimizer (a tensor assigned to .grad, an in-place write);
    ``versions`` are the views' torch version counters when last looked at."""

    __slots__ = ("has", "versions", "__weakref__")

    def __init__(self, has):
        self.has = list(has)
        self.versions = []

    def note(self, gviews):
        self.versions = [gv._version for gv in gviews]

    def wrote(self, i, gv):
        """Whether an in-place write gave parameter i a gradient: its view was written since
        note() and is not all zeros. The zeros exception: nn.Module.zero_grad(set_to_none=False)
        zeroes every .grad in place, where torch leaves a None gradient None. Reads the view
        only when its version moved."""
        return gv._version != self.versions[i] and bool(gv.any())


def _has_grad_hook(flags, i):
    """A tensor hook: backward reached parameter i. It returns None (the gradient goes on
    unchanged) and holds the flags weakly, so the model's hooks never keep an optimizer's
    state alive."""
    ref = weakref.ref(flags)

    def hook(grad):
        f = ref()
        if f is not None:
            f.has[i] = True

    return hook


# Bindings of live optimizers with host arenas, for the fork handler.
_LIVE = weakref.WeakSet()


class _Binding:
    """What a model borrows from its optimizer's session: the arena its tensors view, the
    session, the connection. Shared by the optimizer and its finalizer, so that the model gets
    ordinary tensors back however the optimizer goes: close(), garbage collection (also in a
    reference cycle), interpreter exit, an exception unwinding the training loop. In a forked
    child the session is the parent's: the child only takes private copies (at the fork)."""

    def __init__(self):
        self.pid = os.getpid()
        self.params = []  # the parameters whose .data/.grad were made views
        self.pviews, self.gviews = [], []
        self.flags = None  # _GradFlags of shared-memory mode
        self.hooks = {}  # parameter index -> the handle of its _has_grad_hook
        self.grad_arena = None
        self.shm = None  # host_arena.ShmArena or fdchannel.MemfdArena
        self.cuda_arena = None
        self.session_id = None
        self.client = None
        self.owns_client = False
        self.closed = True
        self.on_release = None  # overlap=True: removes the model's hooks

    def give_back(self):
        """Parameters and gradients that still view the arena become copies of it (ordinary
        memory holding the latest values), then the arena is let go: its mapping goes with the
        last tensor still viewing it (a view the user kept stays valid). A parameter without a
        gradient gets None, as torch would have it."""
        for h in self.hooks.values():
            h.remove()
        self.hooks = {}
        flags, self.flags = self.flags, None
        with torch.no_grad():
            for i, (p, pv, gv) in enumerate(zip(self.params, self.pviews, self.gviews)):
                if p.data.data_ptr() == pv.data_ptr():
                    p.data = pv.clone()
                if p.grad is not None and p.grad.data_ptr() == gv.data_ptr():
                    if flags is not None and not (flags.has[i] or flags.wrote(i, gv)):
                        p.grad = None
                        continue
                    try:
                        p.grad = gv.clone()
                    except RuntimeError:  # .data was replaced by another dtype or shape
                        p.grad = None
        self.params, self.pviews, self.gviews, self.grad_arena = [], [], [], None
        _LIVE.discard(self)
        if self.cuda_arena is not None:
            # The copies above are queued on the current stream: the allocation is freed after a
            # cuCtxSynchronize, once no view of it is left (cuda_arena.CudaArena.close).
            arena, self.cuda_arena = self.cuda_arena, None
            arena.close()
        if self.shm is not None:
            shm, self.shm = self.shm, None
            shm.close()

    def release(self):
        """Ends the session (CloseSession waits for a queued step, so the arena holds its
        result), gives the model its tensors back and closes an owned connection. Never raises:
        it runs from finalizers and close(), also after the daemon died."""
        self.closed = True
        if self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            try:
                on_release()
            except Exception:
                pass
        if self.pid == os.getpid() and self.session_id is not None and self.client is not None:
            try:
                self.client.close_session(self.session_id, timeout=5.0)
            except Exception:
                pass
        try:
            self.give_back()
        finally:
            if self.owns_client and self.client is not None and self.pid == os.getpid():
                try:
                    self.client.close()
                except Exception:
                    pass
            self.client = None


def _after_fork_in_child():
    """A forked child gets private copies of the parameters and gradients that view a host
    arena (MAP_SHARED, so the child's writes would reach the parent's model and the daemon, and
    the parent's steps would change the child's model). Its copies of those optimizers are
    closed; the sessions stay the parent's."""
    for b in list(_LIVE):
        b.closed = True
        try:
            b.give_back()
        except Exception:  # pragma: no cover - a child must not die in an at-fork hook
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _NoSync:
    def __init__(self, ov):
        self._ov = ov

    def __enter__(self):
        if self._ov is not None and self._ov.active:
            self._ov.armed(False)
        return self

    def __exit__(self, *exc):
        if self._ov is not None and self._ov.active:
            self._ov.armed(True)


def _binding_attr(name, doc):
    return property(lambda self: getattr(self._bind, name),
                    lambda self, v: setattr(self._bind, name, v), doc=doc)


class Optimizer(torch.optim.Optimizer):
    """torch.optim.Optimizer backed by a diond session.

    Args:
      params: parameters or parameter groups (dicts), as for any torch optimizer. A group may
        set ``algorithm`` and any option below; ``name`` names the group in the daemon.
      target: the daemon ("unix:/path" or "host:port"; default $DIOND_TARGET or the daemon's
        default socket), or a connected ``diond.Client``.
      remote: True for remote mode (no shared memory), False for shared memory; default: shared
        memory on a Unix socket, remote over TCP.
      arena: the shared memory of shared-memory mode. For CPU parameters: "memfd" (a sealed
        memfd sent over the daemon's fd channel: it cannot shrink under the daemon), "shm" (a
        POSIX shm segment), or None (default): "memfd" when this is Linux and the daemon lists
        REGION_KIND_MEMFD with an fd channel, else "shm". For CUDA parameters (all on one GPU;
        the daemon must compute on that GPU): "cuda_vmm" (a VMM allocation exported as an fd),
        "cuda_ipc" (a legacy CUDA IPC handle), or None (default): the first of the two that the
        daemon lists in its region kinds and that works here, falling back from "cuda_vmm" to
        "cuda_ipc" with a RuntimeWarning that says why. An explicit kind the daemon does not
        offer, or one for the other device type, raises ValueError. ``self.arena`` tells which
        one is used. Parameters on several devices (CPU and GPU, or two GPUs) are refused with
        a ValueError naming them; remote=True takes any mix.
      fp32_master_weights: for bf16/f16 parameters, let the daemon keep float32 master weights.
        (state_dict() does not carry them: SetState takes parameters in their own dtype, so a
        resumed session restarts from the bf16/f16 weights; bit-identical resume needs
        fp32_master_weights=False or float32 parameters.)
      non_finite_policy: "skip" (a step with NaN/Inf gradients changes nothing) or "error".
      track_writes: where the daemon keeps its own copy of the weights (remote mode, fp32 master
        weights), send the parameters the trainer wrote since the last step (load_state_dict,
        copy_, nn.init: torch's version counter) before the next one. Writes through ``p.data``
        are not counted by torch: call sync_parameters() after those.
      timeout: deadline of every RPC, seconds. connect_timeout: for the connection.
      token, tls_ca, tls_cert, tls_key, tls_server_name: credentials, passed to ``diond.Client``
        (a bearer token for TCP targets; TLS and mutual TLS).
      client_name: shown by ListSessions and in the daemon's logs.
      world_key: make this a world session (docs/DISTRIBUTED.md): the trainer on every rank
        creates its optimizer with the same key, model and groups against its own daemon; the
        daemons shard the work and state and every trainer ends each step with the same weights.
        step() is then collective: every rank's trainer must call it. state_dict() returns the
        weights and this rank's share of the optimizer state; load_state_dict() takes the whole
        state (each daemon keeps its share).
      gradient_sync: with world_key, "replicated" (trainers already hold identical averaged
        gradients), "average" (the daemons average them) or "dion_compressed".
      session: a stable name for the session, e.g. "job-17/rank-0" (unique among the daemon's
        live sessions). resume: with session, continue the live session of that name if there is
        one (a restarted trainer; after a daemon restart with --recover too): the daemon's
        current weights are copied into the model, the step counter continues from the
        daemon's, and the optimizer state is the daemon's, so the run goes on as if the trainer
        had never stopped. If no live session has the name, a new one is created from the
        model's weights (``self.resumed`` tells which). The model must declare the same
        parameters (shapes, dtypes, order) as the session.
      overlap: True for the overlapped step (see the module's doc); "delayed" for one step of
        staleness: the model trains on its own copy of the weights, step() hands the gradients
        to the daemon and returns, and the daemon computes w_N from w_{N-1} while the next
        forward and backward run on w_{N-1} (DeepSpeed's delayed parameter update; synchronize()
        brings the newest weights into the model). Both work in world sessions (every trainer
        the same mode) and are refused with ValueError in remote mode. CUDA parameters: written,
        never run on a GPU (docs/DATA_PLANE.md "Overlapped step").
        delayed_warmup_steps: with overlap="delayed", the number of first steps that run
        synchronously (ZeRO-Offload's delayed parameter update also starts after a warm-up).
        max_grad_norm: clip the gradients in the daemon to this total L2 norm before every step,
        as torch.nn.utils.clip_grad_norm_(params, max_grad_norm) in the trainer would (None: no
        clip). The norm is summed in double over the parameters that have a gradient;
        ``self.last_grad_norm`` is the norm before clipping of the last step collected.
        It may change between steps, as lr. Under overlap=True this is the way to clip: a
        clip_grad_norm_ in the trainer makes every step synchronous (see the module's doc).
        Local and world sessions: a world under AVERAGE clips the averaged gradients, as
        clip_grad_norm_ after DDP's all-reduce would. On a device daemon each gradient's norm
        is computed on the device in f32 (never run on a GPU). The daemon refuses it under
        DION_COMPRESSED.
      overlap_bucket_bytes: the gradient bytes a bucket gathers; None (default): about 1/64 of
        all the parameters' bytes, from 256 KiB to 64 MiB. A smaller bucket starts the daemon's
        work earlier, at a doorbell per bucket (docs/BENCHMARKS.md measures three sizes).
      algorithm, lr, mu, betas, weight_decay, epsilon, nesterov, cautious_wd, adjust_lr, flatten,
      use_polar_express, muon_beta2, rank_fraction, rank_multiple_of, fraction, ef_decay,
      num_heads, split_sizes, precision ("fp32" | "bf16_reference"), bf16_matmul ("auto" |
      "float32_gemm" | "onednn": bf16_reference's matmul engine, Muon/NorMuon/Dion2/Dion3;
      auto = oneDNN's bf16 matmul on AVX-512 CPUs as PyTorch, else the float32 GEMM; the
      float32 GEMM reproduces the stored conformance trajectories bit for bit, docs/CONFORMANCE.md),
      seed (Dion's initial Q),
      qr_method ("rcqr" | "qr" | "cqr"), cqr_warmup_steps, oversample (= the reference's
      rcqr_oversample, either name is accepted): group defaults, with the reference's values.
        Dion's cqr warm-up counts the group's "step" (sent with every step, restored by
        load_state_dict() as the reference's).
    """

    _pviews = _binding_attr("pviews", "the parameters' views of the arena")
    _gviews = _binding_attr("gviews", "the gradients' views of the arena")
    _grad_arena = _binding_attr("grad_arena", "the gradient arena as one uint8 tensor")
    _shm = _binding_attr("shm", "the host arena (ShmArena or MemfdArena), or CUDA arenas' "
                               "doorbell page")
    _cuda_arena = _binding_attr("cuda_arena", "the CUDA arena")
    _closed = _binding_attr("closed", "no session (not yet, closed, or a forked child's copy)")

    def __init__(self, params, *, target=None, remote=None, fp32_master_weights=False,
                 non_finite_policy="skip", timeout=60.0, connect_timeout=10.0,
                 client_name="diond.torch", world_key="", gradient_sync="replicated",
                 token=None, tls_ca=None, tls_cert=None, tls_key=None, tls_server_name=None,
                 session="", resume=False, arena=None, track_writes=True, overlap=False,
                 overlap_bucket_bytes=None, delayed_warmup_steps=0, max_grad_norm=None,
                 **options):
        if non_finite_policy not in _NONFINITE:
            raise ValueError("non_finite_policy must be 'skip' or 'error', got %r"
                             % (non_finite_policy,))
        if gradient_sync not in _GRADIENT_SYNC:
            raise ValueError("gradient_sync must be one of %s, got %r"
                             % (", ".join(sorted(_GRADIENT_SYNC)), gradient_sync))
        if gradient_sync != "replicated" and not world_key:
            raise ValueError("gradient_sync=%r needs a world_key" % (gradient_sync,))
        self.world_key = str(world_key)
        self.gradient_sync = gradient_sync
        self.session_name = str(session or "")
        if resume and not self.session_name:
            raise ValueError("resume=True needs session=<name> (the name the trainer gave the "
                             "session it resumes)")
        if resume and self.world_key:
            raise ValueError("resume=True is for local sessions; world sessions restore from "
                             "checkpoints on every rank")
        if arena not in (None,) + _HOST_ARENAS + _CUDA_ARENAS:
            raise ValueError("arena must be 'memfd', 'shm', 'cuda_vmm', 'cuda_ipc' or None, got %r"
                             % (arena,))
        if arena == "memfd" and not fdchannel.supported():
            raise ValueError("arena='memfd' needs Linux and Python >= 3.9 (os.memfd_create, "
                             "socket.send_fds); use arena='shm'")
        if overlap not in (False, True, "delayed"):
            raise ValueError("overlap must be False, True or 'delayed', got %r" % (overlap,))
        self.overlap = overlap is not False
        self.delayed = overlap == "delayed"
        if not (isinstance(delayed_warmup_steps, int) and delayed_warmup_steps >= 0):
            raise ValueError("delayed_warmup_steps must be an int >= 0, got %r"
                             % (delayed_warmup_steps,))
        self.delayed_warmup_steps = delayed_warmup_steps
        self.max_grad_norm = max_grad_norm
        self._check_max_grad_norm()
        self.last_grad_norm = None  # the gradients' total norm before the clip, as the daemon saw
        if self.overlap and overlap_bucket_bytes is not None and not (
                isinstance(overlap_bucket_bytes, int) and overlap_bucket_bytes > 0):
            raise ValueError("overlap_bucket_bytes must be a positive int, got %r"
                             % (overlap_bucket_bytes,))
        self._ov = None  # torch_overlap.Overlap once the session is ready
        self._bind = _Binding()
        self.track_writes = bool(track_writes)
        self._versions = None  # each parameter's torch version counter when the daemon had it
        self._arena_choice = arena
        self.arena = None  # "memfd", "shm", "cuda_vmm" or "cuda_ipc" once the arenas exist
        self._queued = None  # the step index queued by step(asynchronous=True), not collected
        self._session_ready = False
        self._finalizer = None
        self._owns_client = not isinstance(target, Client)
        self.client = target if isinstance(target, Client) else Client(
            target, timeout=timeout, connect_timeout=connect_timeout, token=token,
            tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name)
        try:
            # The options' defaults, ranges and algorithms are the daemon's (DescribeOptions);
            # nothing reaches a session before they are checked.
            self.option_schema = self.client.option_schema()
            defaults, self._explicit_defaults = self.option_schema.check_options(options)
            super().__init__(params, defaults)
            self._check_constructor_options()
        except BaseException:
            if self._owns_client:
                self.client.close()
            raise
        self._bind.client, self._bind.owns_client = self.client, self._owns_client
        self.remote = (not self.client.is_unix) if remote is None else bool(remote)
        self.fp32_master_weights = bool(fp32_master_weights)
        self._device = None  # the arenas' device (shared-memory mode)
        self._events = None  # the interprocess events of CUDA arenas, created at the first step
        attached = None
        try:
            if not self.remote:
                self._device = self._check_arena_device(arena)
            if self.overlap:
                self._check_overlap()
            if resume:
                _, specs = self._declare()
                try:
                    attached = self.client.attach_session(self.session_name, parameters=specs)
                except DiondError as e:
                    if e.code == grpc.StatusCode.FAILED_PRECONDITION:
                        raise ValueError("cannot resume session %r: %s"
                                         % (self.session_name, e.message)) from None
                    if e.code != grpc.StatusCode.NOT_FOUND:
                        raise
            if attached is not None:
                self._adopt_session(attached)
            else:
                self._create_session(client_name, non_finite_policy)
            self._client_name, self._non_finite_policy = client_name, non_finite_policy
            if self.remote:
                if attached is not None:
                    self._download_parameters()
                else:
                    self._upload_parameters()
            else:
                self._attach_arenas(from_daemon=attached is not None)
        except BaseException:
            if attached is None:
                self._abort()
            else:  # never close a live session we only failed to take over
                self._detach()
                if self._owns_client:
                    self.client.close()
            raise
        self._closed = False
        self._session_ready = True
        # True when this optimizer continued a live session (resume=True found it).
        self.resumed = attached is not None
        self._step_index = attached.step_index if attached is not None else 0
        for g in self.param_groups:
            g["step"] = self._step_index
        self.last_step = None  # the last StepResponse
        self._bind.session_id = self.session_id
        self._note_versions()
        self._finalizer = weakref.finalize(self, _Binding.release, self._bind)
        self._ov_bucket_bytes = overlap_bucket_bytes
        self._start_overlap()

    def _start_overlap(self):
        if self.delayed:
            # The model trains on its own copy of the weights (the arena's are the daemon's
            # while a step runs), and its gradients are its own.
            has = self._bind.flags.has
            with torch.no_grad():
                for i, (p, pv, gv) in enumerate(zip(self._params(), self._pviews, self._gviews)):
                    p.data = pv.clone()
                    p.grad = gv.clone() if has[i] else None
        elif self.overlap:
            self._ov = torch_overlap.Overlap(self, self._ov_bucket_bytes)
            self._bind.on_release = self._ov.close  # also when the optimizer is collected

    # -- construction -------------------------------------------------------------------------
    def add_param_group(self, param_group):
        """Adds a parameter group, as torch.optim's. After construction (e.g. Lightning's
        BackboneFinetuning unfreezing layers) the daemon's session is rebuilt with the new
        group: the existing groups' state comes out (GetState), the session is closed, a new one
        is created with every group and the state goes back (SetState), so the existing groups
        continue bit for bit (with fp32_master_weights the master copies restart from the
        model's bf16/f16 weights: SetState takes parameters in their own dtype). The new group's
        parameters start with no state and its step counter at 0. Not for world sessions. If
        the new session cannot be made, the optimizer is closed (the model keeps its weights)
        and the error is raised."""
        if not getattr(self, "_session_ready", False):
            self._add_group(param_group)
            return
        self._check_open()
        if self.world_key:
            raise RuntimeError("diond.torch.Optimizer: add_param_group is not supported in a "
                               "world session (every rank would have to rebuild it at once); "
                               "build every group at construction")
        self.synchronize()
        self._add_group(param_group)
        try:
            self._rebuild_session()
        except BaseException:
            self.param_groups.pop()
            raise

    def _rebuild_session(self):
        saved = self.client.get_state(self.session_id)
        if self._ov is not None:  # the new session records backward's order again
            self._ov.close()
            self._ov = None
        # The old session goes first (its name becomes free); the model gets ordinary tensors
        # with the latest weights and gradients, which the new arena then takes.
        self._queued = None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._bind.owns_client = False  # the connection goes on to the new session
        self._bind.release()
        self._bind = _Binding()
        self._bind.client, self._bind.owns_client = self.client, self._owns_client
        try:
            self._create_session(self._client_name, self._non_finite_policy)
            if self.remote:
                self._upload_parameters()
            else:
                self._attach_arenas()
            self.client.set_state(self.session_id,
                                  {n: t.data for n, t in saved.items()})
        except BaseException:
            self._abort()
            raise
        self._bind.closed = False
        self._bind.session_id = self.session_id
        self._step_index = 0  # the new session's own Step index; the groups keep their "step"
        self._note_versions()
        self._finalizer = weakref.finalize(self, _Binding.release, self._bind)
        self._start_overlap()

    def _add_group(self, param_group):
        gi = len(self.param_groups)
        where = "param group %d: " % gi
        schema = self.option_schema
        algo, g = schema.check_group(param_group, gi, self.defaults["algorithm"])
        given = set(g)
        # Let torch's own checks run (params list, duplicates, defaults filled in).
        super().add_param_group(g)
        g = self.param_groups[-1]
        for k in list(g):  # keep only the options this group's algorithm has
            if k in schema.defaults and k not in schema.applies[algo] and k != "algorithm":
                del g[k]
        for k in schema.applies[algo]:  # the algorithm's own default, where nobody set one
            if k not in given and k not in self._explicit_defaults:
                g[k] = schema.algorithm_default(algo, k)
        g.setdefault("step", 0)
        try:
            schema.validate(g, algo, where)
            for j, p in enumerate(g["params"]):
                self._check_param(p, gi, j, algo)
        except BaseException:
            self.param_groups.pop()
            raise

    def _check_param(self, p, gi, j, algo):
        where = "param group %d, parameter %d (shape %s)" % (gi, j, list(p.shape))
        if p.dtype not in _DTYPES:
            raise TypeError("%s: dtype %s is not supported; diond takes float32, bfloat16 or "
                            "float16 parameters" % (where, p.dtype))
        if p.is_sparse:
            raise TypeError("%s: sparse parameters are not supported" % where)
        if not p.is_contiguous():
            raise ValueError("%s: the parameter is not contiguous (strides %s); diond places "
                             "parameters in a flat arena. Make it contiguous first "
                             "(p.data = p.data.contiguous())" % (where, list(p.stride())))
        if p.numel() == 0:
            raise ValueError("%s: empty parameters are not supported" % where)
        if algo in MATRIX_ALGORITHMS and p.dim() < 2:
            raise ValueError("%s: algorithm %r needs matrices (>= 2 dims); put biases, norms and "
                             "other vectors in an 'adamw' or 'lion' group" % (where, algo))

    def _check_constructor_options(self):
        self.option_schema.unused(self._explicit_defaults, self.defaults,
                       [g["algorithm"] for g in self.param_groups])

    def _check_overlap(self):
        where = None
        if self.remote:
            where = "remote mode"
        if where is not None:
            raise ValueError("overlap=True is built for local and world sessions (CPU parameters "
                             "over host shared memory, CUDA parameters over CUDA regions); %s "
                             "are not built yet (docs/DATA_PLANE.md \"Overlapped step\")" % where)

    def _check_arena_device(self, choice):
        """The arenas' device (every parameter's), checked against the arena choice."""
        device = _arena_device([
            ("param group %d, parameter %d (shape %s)" % (gi, j, list(p.shape)), p.device)
            for gi, g in enumerate(self.param_groups) for j, p in enumerate(g["params"])])
        if device.type == "cuda" and choice in _HOST_ARENAS:
            raise ValueError("arena=%r is host memory, but the parameters are on %s; use "
                             "'cuda_vmm', 'cuda_ipc' or None (or remote=True)" % (choice, device))
        if device.type == "cpu" and choice in _CUDA_ARENAS:
            raise ValueError("arena=%r is GPU memory, but the parameters are on the CPU; use "
                             "'memfd', 'shm' or None" % (choice,))
        return device

    def _params(self):
        for g in self.param_groups:
            for p in g["params"]:
                yield p

    def _declare(self):
        """Group protos and parameter specs (names p0, p1, ... in group order)."""
        self._group_names = []
        groups, specs = [], []
        self._names = []
        idx = 0
        for gi, g in enumerate(self.param_groups):
            name = g.get("name") or "group%d" % gi
            if name in self._group_names:
                raise ValueError("two parameter groups are named %r" % name)
            self._group_names.append(name)
            groups.append(self.option_schema.group_proto(name, g))
            for p in g["params"]:
                n = "p%d" % idx
                idx += 1
                self._names.append(n)
                specs.append(pb.ParameterSpec(name=n, shape=list(p.shape), dtype=_DTYPES[p.dtype],
                                              group=name))
        return groups, specs

    def _adopt_session(self, attached):
        """Takes over the live session resume=True found, after checking it is this model's."""
        _, specs = self._declare()
        resp = attached.session
        layout = {t.name: t for t in resp.layout}
        if len(layout) != len(specs):
            raise ValueError("session %r holds %d parameters; this model has %d"
                             % (self.session_name, len(layout), len(specs)))
        for spec in specs:
            t = layout.get(spec.name)
            if t is None or list(t.shape) != list(spec.shape) or t.dtype != spec.dtype:
                raise ValueError(
                    "session %r does not match this model: parameter %s is %s in the session, "
                    "shape %s dtype %s here" % (
                        self.session_name, spec.name,
                        "missing" if t is None else "shape %s dtype %s" % (
                            list(t.shape), pb.DType.Name(t.dtype)),
                        list(spec.shape), pb.DType.Name(spec.dtype)))
        self.session_id = resp.session_id
        self._layout = layout
        self._data_plane = (resp.fd_channel_socket, list(resp.region_kinds))
        self._param_arena_bytes = resp.param_arena_bytes
        self._grad_arena_bytes = resp.grad_arena_bytes
        self._pushed = False  # remote mode: gradients uploaded to this session at least once
        # weight_decay is sent again at the first step (the daemon's may be another trainer's).
        self._sent = [(float(g["lr"]), None) for g in self.param_groups]

    def _download_parameters(self):
        direct, staged = {}, {}
        for n, p in zip(self._names, self._params()):
            if p.device.type == "cpu" and p.data.is_contiguous():
                direct[n] = p.data
            else:
                staged[n] = p
        new = self.client.pull_parameters(self.session_id, into=direct)
        with torch.no_grad():
            for n, p in staged.items():
                p.data.copy_(new[n].torch().view(p.shape))

    def _create_session(self, client_name, non_finite_policy):
        groups, specs = self._declare()
        resp = self.client.create_session(
            parameters=specs, groups=groups, fp32_master_weights=self.fp32_master_weights,
            non_finite_policy=_NONFINITE[non_finite_policy], client_name=client_name,
            world_key=self.world_key, gradient_sync=_GRADIENT_SYNC[self.gradient_sync],
            session_name=self.session_name)
        self.session_id = resp.session_id
        self._layout = {t.name: t for t in resp.layout}
        self._data_plane = (resp.fd_channel_socket, list(resp.region_kinds))
        self._param_arena_bytes = resp.param_arena_bytes
        self._grad_arena_bytes = resp.grad_arena_bytes
        self._pushed = False  # remote mode: gradients uploaded to this session at least once
        # What the daemon has for each group, to notice changes made through param_groups.
        self._sent = [(float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups]

    def _attach_arenas(self, from_daemon=False):
        """from_daemon: the weights come from the daemon (a resumed session): registering the
        PARAMETERS region writes them into the arena, which the model's tensors then view."""
        if not self.client.is_unix:
            raise ValueError("shared memory needs a Unix-socket target (got %s); use remote=True"
                             % self.client.target)
        if self._device.type == "cuda":
            self._attach_cuda_arenas(from_daemon)
            return
        grad_base = _align(self._param_arena_bytes, _SEGMENT_ALIGN)
        size = grad_base + self._grad_arena_bytes
        # The overlapped step's doorbell page follows the gradients (a sealed memfd cannot grow).
        self._page_offset = _align(size, 256)
        if self.overlap and not self.delayed:
            size = self._page_offset + torch_overlap.page_bytes(len(self._names))
        fd_path, kinds = self._data_plane
        daemon_memfd = bool(fd_path) and pb.REGION_KIND_MEMFD in kinds
        kind = self._arena_choice
        if kind is None:
            # The channel socket must be writable to connect (it is 0600, as the gRPC socket).
            usable = daemon_memfd and fdchannel.supported() and os.access(fd_path, os.W_OK)
            kind = "memfd" if usable else "shm"
        if kind == "memfd" and not daemon_memfd:
            raise ValueError("arena='memfd': the daemon at %s offers no MEMFD regions (no fd "
                             "channel); use arena='shm' or None" % self.client.target)
        if kind == "memfd":
            self._shm = fdchannel.MemfdArena(size, name="diond-%d" % os.getpid())
        else:
            self._shm = host_arena.ShmArena(size)
        self.arena = kind
        self._bind.params = list(self._params())
        _LIVE.add(self._bind)
        buf = self._shm.buf
        self._pviews, self._gviews = [], []
        self._grad_arena = torch.frombuffer(buf, dtype=torch.uint8, count=self._grad_arena_bytes,
                                            offset=grad_base)
        has = []
        with torch.no_grad():
            for n, p in zip(self._names, self._params()):
                t = self._layout[n]
                count = p.numel()
                pv = torch.frombuffer(buf, dtype=p.dtype, count=count,
                                      offset=t.param_offset_bytes).view(p.shape)
                # Each gradient view has its own version counter (_GradFlags.wrote).
                gv = torch.frombuffer(buf, dtype=p.dtype, count=count,
                                      offset=grad_base + t.grad_offset_bytes).view(p.shape)
                has.append(_fill_views(p, pv, gv, from_daemon))
                p.data = pv
                p.grad = gv
                self._pviews.append(pv)
                self._gviews.append(gv)
        self._track_gradients(has)
        if kind == "memfd":
            # One token per region: each RegisterRegion takes (and the daemon keeps) its own fd.
            self._regions = [
                self.client.register_memfd_region(self.session_id, pb.REGION_ROLE_PARAMETERS,
                                                  self._shm.send(fd_path), 0,
                                                  self._param_arena_bytes),
                self.client.register_memfd_region(self.session_id, pb.REGION_ROLE_GRADIENTS,
                                                  self._shm.send(fd_path), grad_base,
                                                  self._grad_arena_bytes),
            ]
        else:
            self._regions = [
                self.client.register_region(self.session_id, pb.REGION_ROLE_PARAMETERS,
                                            self._shm.name, 0, self._param_arena_bytes),
                self.client.register_region(self.session_id, pb.REGION_ROLE_GRADIENTS,
                                            self._shm.name, grad_base, self._grad_arena_bytes),
            ]

    def _attach_cuda_arenas(self, from_daemon):
        """One allocation on the parameters' GPU (cuda_arena.CudaArena) holds both arenas; the
        first kind that allocates, exports and registers is kept (VMM, then legacy IPC, for
        arena=None). The model's tensors become views of it only once both regions are
        registered, so a kind that failed leaves the model as it was."""
        fd_path, kinds = self._data_plane
        usable = bool(fd_path) and fdchannel.supported() and os.access(fd_path, os.W_OK)
        order = cuda_arena.candidate_kinds(self._arena_choice, kinds, usable, self.client.target)
        for i, kind in enumerate(order):
            arena = None
            try:
                arena = cuda_arena.CudaArena(self._device, kind, self._param_arena_bytes,
                                             self._grad_arena_bytes)
                views = self._cuda_views(arena, from_daemon)
                arena.register(self.client, self.session_id, fd_path, self._param_arena_bytes,
                               self._grad_arena_bytes)
            except BaseException as e:
                views = None  # the last views of the allocation: it is freed with them
                if arena is not None:
                    arena.close()
                # The next kind may work where the driver, the fd channel or the daemon refused
                # this one; anything else (a bug, an interrupt) would fail it too.
                fallback = isinstance(e, (cuda_arena.CudaDriverError, DiondError, OSError))
                if i + 1 == len(order) or not fallback:
                    raise
                warnings.warn("diond: the %s arena failed on %s (%s); falling back to %s"
                              % (kind, self._device, e, order[i + 1]), RuntimeWarning,
                              stacklevel=4)
                continue
            break
        self._cuda_arena = arena
        self.arena = kind
        self._bind.params = list(self._params())
        plan = arena.plan
        self._grad_arena = arena.view(plan.grad_offset, self._grad_arena_bytes)
        self._pviews, self._gviews = [], []
        for p, (pv, gv, _) in zip(self._params(), views):
            # A narrow() of the allocation shares its version counter with every other view;
            # set_() aliases the same memory with a counter of its own (_GradFlags.wrote).
            gv = torch.empty(0, dtype=gv.dtype, device=gv.device).set_(gv)
            p.data = pv
            p.grad = gv
            self._pviews.append(pv)
            self._gviews.append(gv)
        self._track_gradients([h for _, _, h in views])

    def _cuda_views(self, arena, from_daemon):
        """[(parameter view, gradient view, whether the parameter has a gradient)] of `arena`,
        filled with the model's values (unless the weights come from the daemon) and
        synchronized: registration may read them."""
        out = []
        with torch.no_grad():
            for n, p in zip(self._names, self._params()):
                t = self._layout[n]
                nbytes = p.numel() * p.element_size()
                pv = arena.view(arena.plan.param_offset + t.param_offset_bytes, nbytes)
                gv = arena.view(arena.plan.grad_offset + t.grad_offset_bytes, nbytes)
                pv, gv = pv.view(p.dtype).view(p.shape), gv.view(p.dtype).view(p.shape)
                out.append((pv, gv, _fill_views(p, pv, gv, from_daemon)))
        torch.cuda.current_stream(self._device).synchronize()
        return out

    def _page_buffer(self, nbytes):
        """The doorbell page's memory (overlap=True): after the host arenas; for CUDA arenas,
        a host segment of its own (the doorbells are host words: only the events are the
        GPU's), a memfd where the daemon takes one, released with the binding."""
        if self._cuda_arena is None:
            return self._shm.buf[self._page_offset:]
        fd_path, kinds = self._data_plane
        if (fd_path and pb.REGION_KIND_MEMFD in kinds and fdchannel.supported()
                and os.access(fd_path, os.W_OK)):
            self._shm = fdchannel.MemfdArena(nbytes, name="diond-page-%d" % os.getpid())
            self._page_kind = "memfd"
        else:
            self._shm = host_arena.ShmArena(nbytes)
            self._page_kind = "shm"
        self._page_offset = 0
        return self._shm.buf

    def _register_doorbells(self, nbytes, buckets, events=None):
        fd_path, _ = self._data_plane
        kind = self.arena if self._cuda_arena is None else self._page_kind
        if kind == "memfd":
            region = self.client.register_memfd_region(
                self.session_id, pb.REGION_ROLE_DOORBELLS, self._shm.send(fd_path),
                self._page_offset, nbytes, buckets=buckets, bucket_events=events)
        else:
            region = self.client.register_region(
                self.session_id, pb.REGION_ROLE_DOORBELLS, self._shm.name, self._page_offset,
                nbytes, buckets=buckets, bucket_events=events)
        self._regions.append(region)

    def _track_gradients(self, has):
        """Shared-memory mode: which parameters have a gradient (_GradFlags), starting from
        `has`, and the hooks that tell."""
        self._bind.flags = _GradFlags(has)
        self._bind.flags.note(self._gviews)
        self._hook_parameters()

    def _hook_parameters(self):
        """A _has_grad_hook on every parameter that requires grad and has none yet; a parameter
        that starts requiring grad later gets its hook at the next step() or zero_grad()."""
        b = self._bind
        for i, p in enumerate(b.params):
            if p.requires_grad and i not in b.hooks:
                b.hooks[i] = p.register_hook(_has_grad_hook(b.flags, i))

    def _upload_parameters(self):
        self.client.set_state(self.session_id,
                              {n: p.data for n, p in zip(self._names, self._params())})

    def sync_parameters(self):
        """Send the model's current weights to the daemon. Where the daemon keeps its own copy
        (remote mode, fp32 master weights), step() already sends the parameters written since
        the last step (track_writes=True, the default), except writes through ``p.data``, which
        torch does not count: call this after those; load_state_dict() of this optimizer calls
        it."""
        self._check_open()
        self.synchronize()
        if self.delayed:
            with torch.no_grad():
                for p, pv in zip(self._params(), self._pviews):
                    pv.copy_(p.data)
        if self._own_copy():
            self._sync_views()
            self._upload_parameters()
            self._note_versions()

    def _abort(self):
        try:
            if getattr(self, "session_id", None):
                self.client.close_session(self.session_id, timeout=2.0)
        except Exception:
            pass
        self._detach()
        if self._owns_client:
            self.client.close()

    # -- stepping -----------------------------------------------------------------------------
    def _check_open(self):
        if self._bind.pid != os.getpid():
            raise RuntimeError(
                "diond.torch.Optimizer: this optimizer's session belongs to process %d, and this "
                "is a forked child (its model holds private copies of the weights); build a new "
                "Optimizer here to train in this process" % self._bind.pid)
        if self._closed:
            raise RuntimeError("diond.torch.Optimizer is closed")

    def _sync_views(self):
        """Keep .data/.grad as arena views: whatever replaced them is copied back in, and the
        gradient flags follow (a .grad set to None: no gradient; a tensor assigned: one).
        Returns the indices of the parameters whose .data was replaced."""
        if self.remote:
            return set()
        if self.delayed:
            return set()
        replaced = self._sync_data_views()
        if self._ov is not None and self._ov.active:
            return replaced  # the gradients are the trainer's own (torch_overlap)
        has = self._bind.flags.has
        with torch.no_grad():
            for i, (p, gv) in enumerate(zip(self._params(), self._gviews)):
                g = p.grad
                if g is None:
                    # Zeroed: the next backward accumulates into it.
                    gv.zero_()
                    p.grad = gv
                    has[i] = False
                elif g.data_ptr() != gv.data_ptr():
                    if g.shape != gv.shape:
                        raise ValueError("gradient of shape %s for a parameter of shape %s"
                                         % (list(g.shape), list(gv.shape)))
                    if g.is_sparse:
                        g = g.to_dense()
                    gv.copy_(g)
                    p.grad = gv
                    has[i] = True
                elif not has[i]:
                    has[i] = self._bind.flags.wrote(i, gv)
            self._bind.flags.note(self._gviews)
        return replaced

    def _sync_data_views(self):
        """Parameters whose .data was replaced get their arena view back, with the new values.
        Returns their indices."""
        replaced = set()
        with torch.no_grad():
            for i, (p, pv) in enumerate(zip(self._params(), self._pviews)):
                if p.data.data_ptr() != pv.data_ptr() or p.data.shape != pv.shape:
                    if p.data.shape != pv.shape or p.data.dtype != pv.dtype:
                        raise ValueError(
                            "a parameter's data was replaced by a tensor of shape %s dtype %s; "
                            "the session holds shape %s dtype %s"
                            % (list(p.data.shape), p.data.dtype, list(pv.shape), pv.dtype))
                    pv.copy_(p.data)
                    p.data = pv
                    replaced.add(i)
        return replaced

    @property
    def overlap_stats(self):
        """overlap=True: {"buckets": the bucket count (0 while backward's order is still being
        recorded), "overlapped": steps run overlapped, "synchronous": steps that fell back to a
        synchronous step after backward (each warned once per cause)}. None otherwise."""
        ov = self._ov
        if ov is None:
            return None
        return {"buckets": len(ov.buckets) if ov.active else 0, "overlapped": ov.overlapped,
                "synchronous": ov.fell_back}

    def no_sync(self):
        """``with opt.no_sync(): loss.backward()``: a micro-batch of gradient accumulation that
        is not the last. Under overlap=True its backward hands no bucket to the daemon (the
        last micro-batch's does); otherwise it changes nothing. As DDP's no_sync()."""
        return _NoSync(self._ov)

    def _own_copy(self):
        """True where the daemon keeps its own copy of the weights (remote mode, fp32 master
        weights), which a write by the trainer does not reach by itself."""
        return self.remote or self.fp32_master_weights

    def _note_versions(self):
        if self.track_writes and self._own_copy():
            self._versions = [p._version for p in self._params()]

    def _push_writes(self, replaced):
        """Sends the parameters the trainer wrote since the daemon last had them: a write to
        the parameter itself (load_state_dict, copy_, nn.init, any in-place op under no_grad)
        advances its torch version counter; a replaced .data is seen by _sync_views. One
        attribute read per parameter and step; a SetState of the written ones only."""
        if not (self.track_writes and self._own_copy()) or self._versions is None:
            return
        names = [n for i, (n, p, v) in enumerate(zip(self._names, self._params(), self._versions))
                 if p._version != v or i in replaced]
        if names:
            params = dict(zip(self._names, self._params()))
            self.client.set_state(self.session_id, {n: params[n].data for n in names})

    def _check_max_grad_norm(self):
        m = self.max_grad_norm
        if m is not None and not (isinstance(m, (int, float)) and math.isfinite(m) and m > 0):
            raise ValueError("max_grad_norm must be None or a finite number > 0, got %r" % (m,))
        return float(m or 0.0)

    def _lr_overrides(self):
        out = {}
        for i, (name, g) in enumerate(zip(self._group_names, self.param_groups)):
            lr = g["lr"]
            lr = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
            if not (math.isfinite(lr) and lr >= 0):
                raise ValueError("param group %d: lr = %r must be finite and >= 0" % (i, lr))
            out[name] = lr
            wd = g["weight_decay"]
            wd = float(wd.item() if isinstance(wd, torch.Tensor) else wd)
            if wd != self._sent[i][1]:
                self.client.set_hyperparameters(self.session_id, name, weight_decay=wd)
                self._sent[i] = (self._sent[i][0], wd)
        return out

    def step(self, closure=None, *, asynchronous=False):
        """One optimizer step in the daemon. Returns the closure's loss, like torch optimizers.

        On failure (DiondError) nothing was applied and the step counter did not advance, so
        calling step() again retries the same step (Step is idempotent on its index).

        asynchronous=True: returns as soon as the daemon has queued the step (the request was
        checked; self.last_step.queued is True). The model's parameters and gradients belong to
        the daemon until synchronize() returns: do not read or write them (no forward, backward
        or zero_grad) before it. step(), zero_grad(), state_dict(), load_state_dict(),
        sync_parameters() and close() synchronize first. A failure of the queued step is raised
        by synchronize() (or the call that synchronizes), and the step counter then stays where
        it was."""
        self._check_open()
        ov = self._ov
        if ov is None or not ov.active:
            self.synchronize()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if ov is not None and ov.active:
            ov.finish()
            return loss
        if self.delayed:
            self._delayed_step()
            if self._queued is not None and self._queued <= self.delayed_warmup_steps:
                self.synchronize()  # a warm-up step: no staleness yet
            return loss
        # overlap=True: the first steps are synchronous, while backward's order is recorded.
        self._send_step(asynchronous and ov is None)
        if ov is not None:
            ov.after_sync_step()
        return loss

    def _delayed_step(self):
        """overlap="delayed": step N's gradients go to the daemon, which computes w_N from
        w_{N-1} while the model's next forward and backward run on w_{N-1} (synchronize()
        brought it into the model)."""
        without = []
        with torch.no_grad():
            for i, (p, gv) in enumerate(zip(self._params(), self._gviews)):
                if p.grad is None:
                    without.append(i)
                else:
                    gv.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
        self._send_step(True, without=without, views=False)

    def _send_step(self, asynchronous, overlap=False, without=None, views=True):
        """Sends Step(N + 1) for the gradients as they are. without: the parameters without a
        gradient, given by the overlapped step (whose gradients are not the arena's views);
        None: found here."""
        lrs = self._lr_overrides()
        if self.remote:
            params = list(self._params())
            without = [i for i, p in enumerate(params) if p.grad is None]
            grads = {n: p.grad for n, p in zip(self._names, params) if p.grad is not None}
            if not grads and not self._pushed:
                # A Step needs gradients uploaded once; these zeros are not read (masked).
                grads = {self._names[0]: torch.zeros_like(params[0].data)}
            if grads:
                self.client.push_gradients(self.session_id, grads)
                self._pushed = True
            replaced = set()
        elif without is None:
            self._hook_parameters()
            replaced = self._sync_views()
            without = [i for i, h in enumerate(self._bind.flags.has) if not h]
        else:
            replaced = self._sync_data_views() if views else set()
        self._push_writes(replaced)
        # An overlapped step orders the streams per bucket, with the page's events instead.
        events = self._record_ready() if self._cuda_arena is not None and not overlap else {}
        # The groups' own step counters (restored by load_state_dict, as the reference's; a
        # group added later counts from its own start), which the update rules see (bias
        # correction, Dion's cqr warm-up) whatever the session's Step index.
        steps = {name: int(g.get("step", 0)) + 1
                 for name, g in zip(self._group_names, self.param_groups)}
        resp = self.client.step(self.session_id, self._step_index + 1, lr_override=lrs,
                                group_step=steps, asynchronous=asynchronous,
                                params_without_grad=without, overlap=overlap,
                                max_grad_norm=self._check_max_grad_norm(), **events)
        self.last_step = resp
        if resp.queued:
            self._queued = self._step_index + 1
            return
        self._finish_step()

    def _record_ready(self):
        """The event protocol (docs/DATA_PLANE.md), trainer side: two interprocess events on the
        arenas' GPU, created once (the daemon opens each handle once and keeps it); "gradients
        ready" is recorded on the current stream now, after backward, and the daemon's stream
        waits on it before it reads the gradients. Returns the Step fields."""
        stream = torch.cuda.current_stream(self._device)
        if self._events is None:
            with torch.cuda.device(self._device):
                ready = torch.cuda.Event(enable_timing=False, interprocess=True)
                done = torch.cuda.Event(enable_timing=False, interprocess=True)
                ready.record(stream)
                self._events = (ready, done, bytes(ready.ipc_handle()), bytes(done.ipc_handle()))
        else:
            self._events[0].record(stream)
        return {"ready_event": self._events[2], "done_event": self._events[3]}

    def _wait_done(self):
        """The current stream waits on "weights done", which the daemon recorded once the new
        weights were written (also for a skipped step): the next forward reads them, with no
        host synchronization. A step that failed recorded nothing; waiting then completes at
        once (CUDA's rule for an event's last record)."""
        if self._events is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[1])

    def synchronize(self):
        """Waits for the step queued by step(asynchronous=True) and returns its StepResponse
        (also in self.last_step); with none queued, returns self.last_step. Raises DiondError
        if the queued step failed: nothing was applied, the step counter did not advance, and
        step() retries it."""
        if self._queued is None:
            return self.last_step
        index, self._queued = self._queued, None
        try:
            resp = self.client.wait_step(self.session_id, index)
        finally:
            if self._ov is not None:
                self._ov.collected()
        self.last_step = resp
        self._finish_step()
        if self.delayed:
            with torch.no_grad():
                for p, pv in zip(self._params(), self._pviews):
                    p.data.copy_(pv)
            self._note_versions()  # the daemon's weights, not the trainer's writes
        return resp

    def _finish_step(self):
        """A step applied: the counters advance; remote mode fetches the new weights; CUDA
        arenas order the trainer's stream after the daemon's writes. An asynchronous step waits
        here, at its collection, not when it was queued: only then has the daemon recorded
        "weights done" for it (a wait enqueued earlier would see the previous step's record)."""
        if self.max_grad_norm:
            self.last_grad_norm = self.last_step.grad_norm
        self._wait_done()
        self._step_index += 1
        if self.remote:
            direct, staged = {}, {}
            for n, p in zip(self._names, self._params()):
                if p.device.type == "cpu" and p.data.is_contiguous():
                    direct[n] = p.data  # written in place, chunk by chunk
                else:
                    staged[n] = p
            new = self.client.pull_parameters(self.session_id, into=direct)
            with torch.no_grad():
                for n, p in staged.items():
                    p.data.copy_(new[n].torch().view(p.shape))
        for g in self.param_groups:
            g["step"] = g.get("step", 0) + 1
        self._note_versions()

    def zero_grad(self, set_to_none=True):
        """Zeroes every gradient in place (also for set_to_none=True: the gradients must stay
        views of the gradient arena). set_to_none=True also takes every parameter's gradient
        away, as torch's None, until backward (or an assignment to .grad) gives it one again;
        with False a parameter that had a gradient keeps it, zeroed, and is stepped."""
        overlapped = (self._ov is not None and self._ov.active) or self.delayed
        if not self._closed and not overlapped:
            self.synchronize()
        with torch.no_grad():
            if self.remote or self._closed or overlapped:
                # Overlapped: the gradients are the trainer's own (copied into the arena by
                # bucket), so zeroing them never races the daemon's reads.
                for p in self._params():
                    if p.grad is not None:
                        if set_to_none and (self.remote or overlapped):
                            p.grad = None
                        else:
                            p.grad.zero_()
                return
            self._hook_parameters()  # before the backward that follows
            flags = self._bind.flags
            for i, (p, gv) in enumerate(zip(self._params(), self._gviews)):
                g = p.grad
                if set_to_none or g is None:
                    flags.has[i] = False
                elif g.data_ptr() != gv.data_ptr():
                    flags.has[i] = True
                elif not flags.has[i]:
                    flags.has[i] = flags.wrote(i, gv)  # before the memset hides the write
            self._grad_arena.zero_()  # one memset for every gradient
            for p, gv in zip(self._params(), self._gviews):
                if p.grad is None or p.grad.data_ptr() != gv.data_ptr():
                    p.grad = gv
            flags.note(self._gviews)

    # -- state --------------------------------------------------------------------------------
    def _index_of(self):
        return {n: i for i, n in enumerate(self._names)}

    def state_dict(self):
        """{"state": {param index: {state name: float32 tensor}}, "param_groups": [...]}, the
        usual PyTorch structure, with the state fetched from the daemon (GetState)."""
        self._check_open()
        self.synchronize()
        raw = self.client.get_state(self.session_id)
        index = self._index_of()
        state = {}
        for name, t in raw.items():
            pname, _, sname = name.partition("/state.")
            state.setdefault(index[pname], {})[sname] = t.torch().clone()
        groups = []
        i = 0
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            if isinstance(d.get("betas"), list):
                d["betas"] = tuple(d["betas"])
            d["params"] = list(range(i, i + len(g["params"])))
            i += len(g["params"])
            groups.append(d)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Restores the state (SetState) and the groups' lr, weight_decay and step. The other
        options must equal this optimizer's (they are fixed in the daemon's session)."""
        self._check_open()
        self.synchronize()
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has %d parameter groups, this optimizer %d"
                             % (len(groups), len(self.param_groups)))
        for gi, (new, g) in enumerate(zip(groups, self.param_groups)):
            if len(new["params"]) != len(g["params"]):
                raise ValueError("param group %d: loaded state dict has %d parameters, this "
                                 "optimizer %d" % (gi, len(new["params"]), len(g["params"])))
            for k in self.option_schema.applies[g["algorithm"]] - {"lr", "weight_decay"}:
                if k in new and same_option(new[k]) != same_option(g[k]):
                    raise ValueError("param group %d: option %s = %r in the state dict, %r here; "
                                     "only lr and weight_decay can change in a session"
                                     % (gi, k, new[k], g[k]))
            if new.get("algorithm", g["algorithm"]) != g["algorithm"]:
                raise ValueError("param group %d: algorithm %r in the state dict, %r here"
                                 % (gi, new.get("algorithm"), g["algorithm"]))
        # Map saved indices onto this optimizer's parameter names, in group order.
        saved_ids = [i for grp in groups for i in grp["params"]]
        names = {}
        for sid, n in zip(saved_ids, self._names):
            names[sid] = n
        tensors = {}
        for sid, st in state_dict["state"].items():
            if sid not in names:
                raise ValueError("state for parameter %r, which no group holds" % (sid,))
            for sname, v in st.items():
                if not isinstance(v, torch.Tensor):
                    v = torch.tensor(v)
                tensors["%s/state.%s" % (names[sid], sname)] = v.detach().to(
                    "cpu", torch.float32).contiguous()
        self.client.set_state(self.session_id, tensors)
        for new, g in zip(groups, self.param_groups):
            for k in ("lr", "weight_decay", "step", "initial_lr"):
                if k in new:
                    g[k] = new[k]
        self.sync_parameters()

    # -- lifetime -----------------------------------------------------------------------------
    def _detach(self):
        """Give the model back ordinary tensors (copies of the arenas) and free the arenas."""
        self._bind.give_back()

    def close(self):
        """Ends the session (CloseSession) and frees the shared memory; the model keeps its
        current weights and gradients as ordinary tensors. Safe to call twice, and after the
        daemon died. Dropping the optimizer does the same (its finalizer); in a forked child,
        whose optimizer was closed at the fork, it does nothing."""
        if self._closed:
            return
        if self.delayed and self._bind.pid == os.getpid():
            try:  # the model keeps the newest weights, as in the other modes
                self.synchronize()
            except Exception:
                pass
        # CloseSession waits for a queued step in the daemon; its outcome is dropped with it.
        self._queued = None
        if self._ov is not None:
            self._ov.close()
        if self._finalizer is not None:
            self._finalizer.detach()
        self._bind.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        mode = "remote" if self.remote else (self.arena or "shm")
        return "diond.torch.Optimizer(session=%s, %s, %d groups, %d params)" % (
            getattr(self, "session_id", None), mode, len(self.param_groups),
            sum(len(g["params"]) for g in self.param_groups))

    # torch.optim.Optimizer pickles through __getstate__; a live session cannot be pickled.
    def __getstate__(self):
        raise TypeError("diond.torch.Optimizer holds a live session; use state_dict()")


