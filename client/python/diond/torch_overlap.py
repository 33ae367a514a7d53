"""diond.torch's overlapped step, ``Optimizer(..., overlap=True)`` (docs/DATA_PLANE.md
"Overlapped step"): the daemon updates a bucket of parameters as soon as backward has finished
its gradients, and the next forward waits for each layer's weights just before the layer runs.

The first step is an ordinary synchronous one, during which backward's order is recorded and
cut into buckets. From then on:
- the gradients are the trainer's own tensors again (as plain torch's), and each bucket's are
  copied into the gradient arena when its last one is accumulated; the first such bucket sends
  the asynchronous ``Step(N, overlap=True)``, and every bucket but the last rings its doorbell;
- ``step()`` checks that nothing changed what was handed over (gradients written again after
  their bucket went: clip_grad_norm_, accumulation outside ``no_sync()``; another set of
  parameters without a gradient than announced), rings the last bucket, and returns;
- a forward pre-hook on every module waits for the buckets of the parameters it owns.
CUDA parameters: the doorbells stay host words (a page of their own), and each bucket has two
interprocess events: "gradients ready", recorded on the trainer's stream after its copy and
before its doorbell rings (the daemon's stream waits on it), and "weights done", which the
daemon records after the bucket's write-back and before its weights word says N (the trainer's
stream waits on it once the word does). No host synchronization on the common path.
If something changed, the last bucket's doorbell abandons the step (-N: the daemon commits
nothing), and step N runs again synchronously from the gradients as they are now, with a
warning: the numbers are always the synchronous step's.
"""
import logging
import threading
import warnings
import weakref

import torch

from . import doorbell
from .client import DiondError
from .overlap import BucketSignals, plan_buckets, record_backward_order

_log = logging.getLogger("diond")

# How long a forward waits on a doorbell before it asks the daemon instead (a Step wait RPC,
# which also notices a daemon that died).
_DOORBELL_PATIENCE_S = 2.0


def _synchronize_on_save(ref):
    def hook(module, state_dict, prefix, local_metadata):
        ov = ref()
        if ov is not None and ov.inflight is not None:
            ov._opt().synchronize()
    return hook


def page_bytes(nparams):
    """Bytes to reserve for the doorbell page of a session of `nparams` parameters: at most
    one bucket per parameter."""
    return doorbell.bytes_for(max(1, nparams))


class Overlap:
    """The overlapped steps of one diond.torch.Optimizer (which owns it and calls it)."""

    def __init__(self, opt, bucket_bytes):
        self._opt = weakref.ref(opt)
        if bucket_bytes is None:
            total = sum(p.numel() * p.element_size() for p in opt._params())
            bucket_bytes = min(max(total // 64, 256 << 10), 64 << 20)
        self.bucket_bytes = int(bucket_bytes)
        self.active = False  # False while the backward order is being recorded
        self.inflight = None  # the step whose weights the next forward waits for
        self._lock = threading.RLock()
        self._recorder = record_backward_order(list(opt._params()))
        self._order = self._recorder.__enter__()
        self._signals = None
        self.events = None  # CUDA: (gradients ready, weights done) per bucket
        self._hook = None
        self._warned = set()
        self._waited = set()  # buckets the forward after the step in flight waited for
        self._waited_last = set()
        self.inflight_seen = None
        self.overlapped = 0  # steps run overlapped
        self.fell_back = 0  # steps that ran synchronously after backward (see the module doc)

    # -- setup ------------------------------------------------------------------------------
    def after_sync_step(self):
        """After a synchronous step while recording: the buckets, the doorbells and the hooks,
        once a backward was seen."""
        opt = self._opt()
        if self.active or not self._order:
            return
        self._recorder.__exit__(None, None, None)
        self._recorder = None
        params = list(opt._params())
        nbytes = [p.numel() * p.element_size() for p in params]
        self.buckets = plan_buckets(list(self._order), nbytes, self.bucket_bytes)
        self.held = len(self.buckets) - 1  # rung by step(), which can still abandon the step
        nbytes_page = doorbell.bytes_for(len(self.buckets))
        self.doorbells = doorbell.Doorbells(opt._page_buffer(nbytes_page), len(self.buckets))
        if opt._cuda_arena is not None:
            self.events = self._make_events(opt, len(self.buckets))
        opt._register_doorbells(nbytes_page, self.buckets, events=self.events and [
            (bytes(r.ipc_handle()), bytes(d.ipc_handle())) for r, d in self.events])
        self._bucket_of = {i: k for k, b in enumerate(self.buckets) for i in b}
        self._by_id = {id(p): self._bucket_of[i] for i, p in enumerate(params)}
        self._modules = weakref.WeakKeyDictionary()
        # The gradients leave the arena: from now on they are copied into it bucket by bucket.
        has = opt._bind.flags.has
        with torch.no_grad():
            for i, (p, gv) in enumerate(zip(params, opt._gviews)):
                p.grad = gv.clone() if has[i] else None
        self._without = {i for i, h in enumerate(has) if not h}
        self._signals = BucketSignals(params, self.buckets, self._ready)
        me = weakref.ref(self)

        def before_forward(module, _inputs):
            ov = me()
            if ov is not None:
                ov._before_forward(module)

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(before_forward)
        self._new_step()
        self.active = True
        _log.info("diond overlap: session %s, %d buckets of %s bytes in backward's order, from "
                  "step %d", opt.session_id, len(self.buckets),
                  "/".join(str(sum(nbytes[i] for i in b)) for b in self.buckets),
                  opt._step_index + 1)

    @staticmethod
    def _make_events(opt, count):
        """(gradients ready, weights done) per bucket: interprocess events on the arenas' GPU,
        recorded once so that they exist before their handles are taken."""
        stream = torch.cuda.current_stream(opt._device)
        out = []
        with torch.cuda.device(opt._device):
            for _ in range(count):
                pair = (torch.cuda.Event(enable_timing=False, interprocess=True),
                        torch.cuda.Event(enable_timing=False, interprocess=True))
                for e in pair:
                    e.record(stream)
                out.append(pair)
        return out

    def _stream_waits(self, ks):
        """CUDA: the trainer's stream waits on the "weights done" events of buckets `ks`."""
        if self.events is not None:
            stream = torch.cuda.current_stream(self._opt()._device)
            for k in ks:
                stream.wait_event(self.events[k][1])

    def _new_step(self):
        self.started = False
        self.step = None
        self.copied = set()
        self.rung = set()
        self.handed = {}  # parameter index -> (its .grad, its version) when copied
        self._signals.reset()

    def armed(self, on):
        self._signals.armed = on

    def close(self):
        self.active = False
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None
        if self._signals is not None:
            self._signals.remove()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.inflight = None

    # -- backward ---------------------------------------------------------------------------
    def _ready(self, k):
        """Bucket k's gradients are all accumulated (on the autograd thread)."""
        if not self.active:
            return
        with self._lock:
            if not self.started:
                self._start()
            if self.inflight_seen is not None and k not in self._waited_last:
                self._warn_unwaited(k)
            self._copy(k)
            if k != self.held:
                self.doorbells.ring_gradients(k, self.step)
                self.rung.add(k)

    def collected(self):
        """The optimizer collected the step in flight: every weight of it is written (CUDA:
        once the stream waited on every bucket's "weights done"; a forward that gave up on a
        doorbell waited on none)."""
        if self.inflight is not None:
            self._stream_waits(range(len(self.buckets)))
            self._waited = set(range(len(self.buckets)))
        self.inflight = None

    def _start(self):
        """Collects the previous step (its weights are written: the forward waited for them)
        and sends Step(N) asynchronous and overlapped."""
        opt = self._opt()
        self.inflight_seen = self.inflight
        self._waited_last = set(self._waited)
        opt.synchronize()
        self.step = opt._step_index + 1
        opt._send_step(asynchronous=True, overlap=True, without=sorted(self._without))
        self.started = True

    def _copy(self, k):
        opt = self._opt()
        params = opt._bind.params
        with torch.no_grad():
            for i in self.buckets[k]:
                g = params[i].grad
                if g is None:
                    continue
                gv = opt._gviews[i]
                if g.shape != gv.shape:
                    raise ValueError("gradient of shape %s for a parameter of shape %s"
                                     % (list(g.shape), list(gv.shape)))
                gv.copy_(g.to_dense() if g.is_sparse else g)
                self.handed[i] = (g, g._version)
            if self.events is not None:  # after the copies, before the doorbell rings
                self.events[k][0].record(torch.cuda.current_stream(opt._device))
        self.copied.add(k)

    def _warn_unwaited(self, k):
        if ("unwaited", k) in self._warned:
            return
        self._warned.add(("unwaited", k))
        opt = self._opt()
        names = [opt._names[i] for i in self.buckets[k]]
        warnings.warn(
            "diond overlap: parameters %s got gradients, but no module that owns them ran "
            "forward after step %d was sent, so forward may have read them while the daemon "
            "wrote them. Use parameters inside the module that owns them, or call "
            "opt.synchronize() before such use" % (", ".join(names[:4]), self.inflight_seen),
            RuntimeWarning, stacklevel=2)

    # -- step() -----------------------------------------------------------------------------
    def finish(self):
        """step() under overlap. Returns True when the step stays overlapped (its weights come
        during the next forward), False when it ran synchronously here."""
        opt = self._opt()
        with self._lock:
            params = opt._bind.params
            without = {i for i, p in enumerate(params) if p.grad is None}
            if not self.started:  # no bucket was finished by backward: announce the truth
                self._without = without
                self._start()
            changed = [i for i, (g, v) in self.handed.items()
                       if params[i].grad is not g or g._version != v]
            if changed or without != self._without:
                self._fall_back(without, changed)
                return False
            for k in range(len(self.buckets)):
                if k not in self.copied:
                    self._copy(k)
            for k in range(len(self.buckets)):
                if k not in self.rung and k != self.held:
                    self.doorbells.ring_gradients(k, self.step)
            self.doorbells.ring_gradients(self.held, self.step)
            self.inflight = self.step
            self.overlapped += 1
            self._waited = set()
            self._new_step()
            return True

    def _fall_back(self, without, changed):
        opt = self._opt()
        n = self.step
        self.doorbells.ring_gradients(self.held, -n)  # abandon: the daemon commits nothing
        try:
            opt.synchronize()
        except DiondError as e:
            if "abandon" not in e.message:
                self._new_step()
                raise
        if changed:
            why = ("the gradients of %s were written after backward handed them over "
                   "(clip_grad_norm_, gradient accumulation outside opt.no_sync(), or another "
                   "write); to clip, pass max_grad_norm= to the optimizer (the daemon clips)"
                   % ", ".join(opt._names[i] for i in changed[:4]))
        else:
            why = ("the parameters without a gradient changed (%d announced, %d now)"
                   % (len(self._without), len(without)))
        if why[:20] not in self._warned:
            self._warned.add(why[:20])
            warnings.warn("diond overlap: step %d ran synchronously: %s" % (n, why),
                          RuntimeWarning, stacklevel=3)
        for k in range(len(self.buckets)):
            self._copy(k)
        self.fell_back += 1
        self._without = without
        self._new_step()
        opt._send_step(asynchronous=False, overlap=False, without=sorted(without))

    # -- forward ----------------------------------------------------------------------------
    def _before_forward(self, module):
        if not self.active:
            return
        ks = self._modules.get(module)
        if ks is None:
            ks = tuple(sorted({self._by_id[id(p)] for p in module.parameters(recurse=False)
                               if id(p) in self._by_id}))
            self._modules[module] = ks
            if ks:
                # model.state_dict() (a checkpoint right after step()) then holds the step's
                # weights: its tensors view the parameters, which are final once this returns.
                module._register_state_dict_hook(_synchronize_on_save(weakref.ref(self)))
        n = self.inflight
        if n is None:
            return
        for k in ks:
            if k in self._waited:
                continue
            self._waited.add(k)
            try:
                self.doorbells.wait_weights(k, n, timeout=_DOORBELL_PATIENCE_S)
                self._stream_waits((k,))
            except (TimeoutError, doorbell.DoorbellError):
                # The daemon's word on it: the step's result or its error (also when the daemon
                # is gone); afterwards every weight is written, or the error was raised.
                self._opt().synchronize()
                return
