// A device session's passes of the step (step_memory.h, session_device.h), on its staging.
//
// The step stays transactional (ARCHITECTURE.md §2): the trainer's memory is written only after
// every group staged its update and the regions were found intact, and the optimizer state is
// committed last, exactly where the host session writes and commits.
//
// The host <-> device copies are stream-ordered (docs/GPU.md "Sync points"): every gradient and
// parameter copy host -> device is queued on the session stream, the finiteness of every
// gradient is OR-ed into one device flag, and the flag's read-back into the pinned host words is
// queued last and waited for once (which completes the copies) before the rules run; the new
// weights device -> host are queued too and waited for once before the answer.
#include <cassert>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/device_comm.h"
#include "server/session/grad_clip.h"
#include "server/session/session_device.h"

namespace diond::session {
namespace {

using internal::DeviceView;

// Queued on the context's stream: `host` stays valid and untouched by the host until the
// stream is synchronized (or a synchronous copy of the same context).
absl::Status CopyToDeviceAsync(const kernels::Context& ctx, const void* host, void* device,
                               size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesFromHostAsync(ctx, host, device, bytes);
}
absl::Status CopyToHostAsync(const kernels::Context& ctx, const void* device, void* host,
                             size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return kernels::CopyBytesToHostAsync(ctx, device, host, bytes);
}
absl::Status SyncStream(const kernels::Context& ctx) { return kernels::Synchronize(ctx); }

}  // namespace

absl::Status Session::DeviceSide::ReadGradients(Session& s, StepRun& run) {
  params_queued = false;
  // The trainer's gradients are ready once its ready_event completes: everything this step
  // runs on the session stream is ordered after it.
  if (!run.request->ready_event.empty()) {
    DIOND_RETURN_IF_ERROR(
        kernels::DeviceRuntimeFor(device.type).stream_wait_event(device, stream, ready.event));
  }
  DIOND_RETURN_IF_ERROR(RunPhaseGraph(
      s, run, GraphPhase::kRead, [&] { return QueueStepReads(s, run); }, nullptr));
  params_queued = true;
  // The step's one host wait before the update: the flag is back, after every copy and scan
  // queued before it.
  DIOND_RETURN_IF_ERROR(SyncStream(*ctx));
  run.finite = words[0] == 0.0f;
  // Before the check, as a host session's: the clip reads them (eagerly, outside the graphs).
  if (run.clip) DIOND_RETURN_IF_ERROR(Clip::Apply(s, run));
  return s.arenas_.CheckRegions(run.when, Role::kGradients);
}

absl::Status Session::DeviceSide::QueueStepReads(Session& s, StepRun& run) {
  const kernels::Context& dc = *ctx;
  const size_t n = s.layout_.tensors.size();
  run.grads.assign(n, nullptr);
  // A CUDA GRADIENTS region lies on this device: its f32 gradients are read in place (as a host
  // session reads a shm arena), the others widened / scaled straight from it into the staging,
  // all on the session stream: device to device, no host copy. From host memory: one queued
  // copy per gradient (into the staging, or into the conversion buffer that the widening reads
  // next: the stream orders the next tensor's copy after it). Every scan ORs into one device
  // flag, whose read-back is queued last.
  const kernels::TensorView flag = DeviceView(device, DType::kF32, nonfinite.data(), 1);
  DIOND_RETURN_IF_ERROR(kernels::Fill(dc, 0.0f, flag));
  for (size_t i = 0; i < n; ++i) {
    // No gradient in this step: never read (a step with another mask is another graph).
    if (!run.no_grad[i]) DIOND_RETURN_IF_ERROR(QueueGradientRead(s, run, i, flag));
  }
  // The parameters' reads are queued behind the gradients' (a skipped step only wrote the
  // staging), so that the one wait that follows completes every host -> device copy of the step.
  DIOND_RETURN_IF_ERROR(QueueParameterReads(s, run));
  return CopyToHostAsync(dc, nonfinite.data(), words, sizeof(float));
}

absl::Status Session::DeviceSide::QueueGradientRead(Session& s, StepRun& run, size_t i,
                                                    const kernels::TensorView& flag) {
  const kernels::Context& dc = *ctx;
  const Arenas::Binding& g = s.arenas_.grads();
  const memory::CudaRegion* cuda = g.cuda.get();
  const TensorPlacement& t = s.layout_.tensors[i];
  float* dst = grad(i);
  if (cuda != nullptr) {
    const uint8_t* src = cuda->data() + t.grad_offset;
    if (t.dtype == DType::kF32 && !run.scaled) {
      DIOND_RETURN_IF_ERROR(
          kernels::AllFiniteFlag(dc, DeviceView(device, DType::kF32, src, t.numel), flag));
      run.grads[i] = reinterpret_cast<const float*>(src);
      return absl::OkStatus();
    }
    DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFiniteFlag(
        dc, DeviceView(device, t.dtype, static_cast<const void*>(src), t.numel), run.scale,
        DeviceView(device, DType::kF32, dst, t.numel), flag));
    run.grads[i] = dst;
    return absl::OkStatus();
  }
  const uint8_t* src = g.data + t.grad_offset;
  const size_t bytes = static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype);
  if (t.dtype == DType::kF32 && !run.scaled) {
    DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, src, dst, bytes));
    DIOND_RETURN_IF_ERROR(
        kernels::AllFiniteFlag(dc, DeviceView(device, DType::kF32, dst, t.numel), flag));
  } else {
    DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, src, raw.data(), bytes));
    DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFiniteFlag(
        dc, DeviceView(device, t.dtype, static_cast<const void*>(raw.data()), t.numel), run.scale,
        DeviceView(device, DType::kF32, dst, t.numel), flag));
  }
  run.grads[i] = dst;
  return absl::OkStatus();
}

absl::Status Session::DeviceSide::QueueParameterReads(Session& s, StepRun& run) {
  const kernels::Context& dc = *ctx;
  Arenas& a = s.arenas_;
  const size_t n = s.layout_.tensors.size();
  run.params.assign(n, nullptr);
  run.via_scratch.assign(n, true);  // every parameter comes back from the device staging
  a.param_scratch().resize(n);
  // A CUDA PARAMETERS region: copied (and widened) device to device into the staging, which
  // the update writes; the region itself is written only by WriteWeights.
  const memory::CudaRegion* cuda = a.params().cuda.get();
  for (size_t i = 0; i < n; ++i) {
    const TensorPlacement& t = s.layout_.tensors[i];
    float* dst = param(i);
    if (a.HasMaster(i) && a.master_valid()) {
      // The master weights, on the device: copied into the staging the update writes (they
      // take its result at the commit).
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc, DeviceView(device, DType::kF32, static_cast<const void*>(a.DeviceMaster(i)), t.numel),
          DeviceView(device, DType::kF32, dst, t.numel)));
      run.params[i] = dst;
      continue;
    }
    if (cuda != nullptr) {
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc,
          DeviceView(device, t.dtype, static_cast<const void*>(cuda->data() + t.param_offset),
                     t.numel),
          DeviceView(device, DType::kF32, dst, t.numel)));
      run.params[i] = dst;
      continue;
    }
    const uint8_t* arena = a.params().data + t.param_offset;
    if (t.dtype == DType::kF32) {
      DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(dc, arena, dst, 4 * t.numel));
    } else {
      DIOND_RETURN_IF_ERROR(CopyToDeviceAsync(
          dc, arena, raw.data(), static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype)));
      DIOND_RETURN_IF_ERROR(kernels::Copy(
          dc, DeviceView(device, t.dtype, static_cast<const void*>(raw.data()), t.numel),
          DeviceView(device, DType::kF32, dst, t.numel)));
    }
    run.params[i] = dst;
  }
  return absl::OkStatus();
}

absl::Status Session::DeviceSide::ReadParameters(Session& s, StepRun& run) {
  if (params_queued) {
    // Queued and completed with the gradients' reads (ReadGradients).
    params_queued = false;
    return absl::OkStatus();
  }
  DIOND_RETURN_IF_ERROR(QueueParameterReads(s, run));
  // The host memory was read once the stream got there: wait, so that the regions' check that
  // follows covers these reads.
  return SyncStream(*ctx);
}

absl::Status Session::DeviceSide::Stage(Session& s, StepRun& run, const kernels::Context& c) {
  const bool local = s.world_ == nullptr;
  auto body = [&]() -> absl::Status {
    DIOND_RETURN_IF_ERROR(s.StageGroups(run, c));
    if (local) QueueStagedWeights(s, run);
    return absl::OkStatus();
  };
  return RunPhaseGraph(s, run, GraphPhase::kUpdate, body, [&] { s.DiscardStep(run); });
}

void Session::DeviceSide::QueueStagedWeights(Session& s, StepRun& run) {
  // The norms' read-back is queued with the new weights' copies and summed after the step's
  // final wait (WriteWeights), one host wait less per group (docs/GPU.md "Sync points"), into
  // the pinned host words (group after group).
  size_t word = 1;
  for (size_t gi = 0; gi < s.groups_.size(); ++gi) {
    if (!run.staged[gi]) continue;
    const size_t n = run.group_params[gi].size();
    assert(word + n <= words_bytes / sizeof(float));
    s.groups_[gi].optimizer->WriteStagedParamsDeferringNorm(run.group_params[gi], words + word);
    word += n;
  }
}

absl::Status Session::DeviceSide::WriteWeights(Session& s, StepRun& run) {
  DIOND_RETURN_IF_ERROR(RunPhaseGraph(
      s, run, GraphPhase::kWrite, [&] { return QueueWeightCopies(s); }, nullptr));
  // The step's one host wait after the update: the trainer's arena (and the next master
  // weights) hold the new bytes when the answer leaves. Over a CUDA PARAMETERS region too: a
  // trainer without a done_event takes the answer as "the weights are written". The groups'
  // Σ(Δx)² read-backs (queued by QueueStagedWeights) are complete with it.
  DIOND_RETURN_IF_ERROR(SyncStream(*ctx));
  for (size_t gi = 0; gi < s.groups_.size(); ++gi) {
    if (run.staged[gi]) s.groups_[gi].optimizer->FinishStagedNorm();
  }
  return absl::OkStatus();
}

absl::Status Session::DeviceSide::QueueWeightCopies(Session& s) {
  // Every copy device -> host is queued (narrowed first on the device where the trainer's dtype
  // is not f32: the conversion buffer is reused tensor after tensor in stream order); the
  // caller waits once.
  for (size_t i = 0; i < s.layout_.tensors.size(); ++i) {
    DIOND_RETURN_IF_ERROR(QueueWeightCopy(s, i));
  }
  return absl::OkStatus();
}

absl::Status Session::DeviceSide::QueueWeightCopy(Session& s, size_t i) {
  const kernels::Context& dc = *ctx;
  const Arenas::Binding& p = s.arenas_.params();
  memory::CudaRegion* cuda = p.cuda.get();
  const TensorPlacement& t = s.layout_.tensors[i];
  const float* src = param(i);
  // (The next master weights stay in the staging: the commit copies them on the device.)
  if (cuda != nullptr) {
    // Device to device into the trainer's GPU memory, narrowed on the way.
    return kernels::Copy(
        dc, DeviceView(device, DType::kF32, src, t.numel),
        DeviceView(device, t.dtype, static_cast<void*>(cuda->data() + t.param_offset), t.numel));
  }
  uint8_t* arena = p.data + t.param_offset;
  if (t.dtype == DType::kF32) return CopyToHostAsync(dc, src, arena, 4 * t.numel);
  DIOND_RETURN_IF_ERROR(kernels::Copy(dc, DeviceView(device, DType::kF32, src, t.numel),
                                      DeviceView(device, t.dtype, raw.data(), t.numel)));
  return CopyToHostAsync(dc, raw.data(), arena,
                         static_cast<size_t>(t.numel) * kernels::DTypeSize(t.dtype));
}

void Session::DeviceSide::CommitMaster(Session& s, size_t i) {
  const int64_t n = s.layout_.tensors[i].numel;
  // Valid views of the session's own buffers: a failure would be a bug, and is logged.
  absl::Status st =
      kernels::Copy(*ctx, DeviceView(device, DType::kF32, static_cast<const void*>(param(i)), n),
                    DeviceView(device, DType::kF32, s.arenas_.DeviceMaster(i), n));
  if (!st.ok()) {
    DIOND_LOG(ERROR) << "session " << s.id_
                     << ": queuing the master weights' update failed: " << st.message();
  }
}

void Session::DeviceSide::JoinWorld(Session& s, StepRun& run,
                                    std::shared_ptr<comm::Communicator> device_comm) {
  run.device_world_comm = std::move(device_comm);
  if (run.device_world_comm != nullptr) run.device_world_comm->TakeBytesSent();
  run.dcomm =
      std::make_unique<StepDeviceComm>(ctx.get(), s.compute_, run.comm, run.device_world_comm);
}

absl::StatusOr<std::unique_ptr<ExchangeWire>> Session::DeviceSide::MakeExchangeWire(Session& s,
                                                                                    StepRun& run,
                                                                                    int64_t mine,
                                                                                    int64_t total) {
  absl::StatusOr<float*> m = WorldBufferOf(s, WorldBuffer::kExchangeMine, mine);
  absl::StatusOr<float*> a = m.ok() ? WorldBufferOf(s, WorldBuffer::kWire, total) : m;
  if (!a.ok()) return a.status();
  return MakeDeviceExchangeWire(ctx.get(), run.dcomm.get(), s.compute_, *m, *a);
}

// The reduce-scatter of a world AVERAGE step (or bucket) in device memory: the same blocks as
// the host's, packed on the device (a device copy per gradient and a Fill per flag slot; the
// padding between a block's gradients and its flags holds whatever the wire held before, the
// last exchange's bytes: summed, never read), reduce-scattered by the step's device collectives,
// divided on the device straight into the gradient staging. One sync point of its own: the
// summed flags read back.
absl::Status Session::DeviceSide::ReduceGradients(Session& s, StepRun& run,
                                                  const std::vector<std::vector<size_t>>& of,
                                                  int64_t block, const std::vector<float>& flags,
                                                  std::vector<float>* summed) {
  const WorldPart& w = *s.world_;
  const int world_size = w.plan.world_size;
  const int64_t nflags = static_cast<int64_t>(flags.size());
  const kernels::Context& dctx = *ctx;
  auto fail = [&](const absl::Status& st, absl::string_view what) {
    return s.BreakWorld(run, absl::Status(st.code(), absl::StrCat(run.when, ": ", what,
                                                                  " failed: ", st.message())));
  };
  float *in = nullptr, *out = nullptr, *div = nullptr;
  {
    absl::StatusOr<float*> a = WorldBufferOf(s, WorldBuffer::kWire, block * world_size);
    absl::StatusOr<float*> b = a.ok() ? WorldBufferOf(s, WorldBuffer::kReduceOut, block) : a;
    absl::StatusOr<float*> c = b.ok() ? WorldBufferOf(s, WorldBuffer::kDivisor, 1) : b;
    if (!c.ok()) return fail(c.status(), "the reduce-scatter's device buffers");
    in = *a;
    out = *b;
    div = *c;
  }
  absl::Status packed = CallOnCompute(run.compute, [&]() -> absl::Status {
    for (int j = 0; j < world_size; ++j) {
      float* dst = in + static_cast<int64_t>(j) * block;
      for (size_t i : of[static_cast<size_t>(j)]) {
        const int64_t numel = s.layout_.tensors[i].numel;
        // A gradient this rank's trainer does not have counts as zeros.
        DIOND_RETURN_IF_ERROR(
            run.grads[i] != nullptr
                ? kernels::Copy(dctx, internal::StepView(dctx, run.grads[i], numel),
                                internal::StepView(dctx, dst, numel))
                : kernels::Fill(dctx, 0.0f, internal::StepView(dctx, dst, numel)));
        dst += numel;
      }
      for (int64_t f = 0; f < nflags; ++f) {
        DIOND_RETURN_IF_ERROR(
            kernels::Fill(dctx, flags[static_cast<size_t>(f)],
                          internal::StepView(dctx, in + (j + 1) * block - nflags + f, 1)));
      }
    }
    return kernels::Fill(dctx, static_cast<float>(world_size), internal::StepView(dctx, div, 1));
  });
  if (!packed.ok()) return fail(packed, "packing the gradients for the reduce-scatter");
  absl::Status st =
      run.dcomm->ReduceScatterSum(absl::MakeConstSpan(in, static_cast<size_t>(block * world_size)),
                                  absl::MakeSpan(out, static_cast<size_t>(block)));
  if (!st.ok()) return s.ReduceFailed(run, st);
  summed->assign(static_cast<size_t>(nflags), 0.0f);
  absl::Status read = run.dcomm->ReadBackQueued(
      [&] { return internal::CopyF32ToHost(dctx, out + block - nflags, summed->data(), nflags); });
  if (!read.ok()) return fail(read, "reading the world's flags");
  // A queued reduce-scatter fails asynchronously (the read-back returned because the world's
  // abort ended it): its output is then garbage.
  if (absl::Status d = run.dcomm->DeviceStatus(); !d.ok()) return s.ReduceFailed(run, d);
  // The average, as on the host: a division by the world size, into the gradient staging.
  absl::Status divided = CallOnCompute(run.compute, [&]() -> absl::Status {
    const float* a = out;
    for (size_t i : of[static_cast<size_t>(w.rank)]) {
      const int64_t numel = s.layout_.tensors[i].numel;
      run.grads[i] = nullptr;
      if (!run.no_grad[i]) {  // else no rank has it: not stepped
        float* staging = grad(i);
        DIOND_RETURN_IF_ERROR(kernels::Binary(
            dctx, kernels::BinaryOp::kDiv, internal::StepView(dctx, a, numel),
            internal::StepView(dctx, div, 1), internal::StepView(dctx, staging, numel)));
        run.grads[i] = staging;
      }
      a += numel;
    }
    return absl::OkStatus();
  });
  if (!divided.ok()) return fail(divided, "averaging the gradients on the device");
  return absl::OkStatus();
}

}  // namespace diond::session
