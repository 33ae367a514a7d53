// A host session's side of the step (step_memory.h): the trainer's memory read and written where
// it lies, the conversions and the master weights through the session's fp32 buffers, every pass
// an op of kernels/ops.h on the step's CPU context.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/grad_clip.h"
#include "server/session/step_memory.h"

namespace diond::session {

const kernels::Context& Session::HostMemory::UpdateContext(Session& s,
                                                           const kernels::Context& ctx) {
  // A host session stepped with a device context (none is made so) would step on the CPU.
  return ctx.device().type != kernels::DeviceType::kCpu ? s.arenas_.HostContext() : ctx;
}

absl::Status Session::HostMemory::PrepareEvents(Session& s, const StepRequest& request) {
  if (request.ready_event.empty() && request.done_event.empty()) return absl::OkStatus();
  DIOND_RETURN_IF_ERROR(internal::CheckEventHandles(request));
  return internal::RefuseEvents(request, "steps on the host");
}

absl::Status Session::HostMemory::ReadGradients(Session& s, StepRun& run) {
  BeginBuckets(s, run);  // (the whole step as one bucket)
  const size_t n = s.layout_.tensors.size();
  for (size_t i = 0; i < n; ++i) DIOND_RETURN_IF_ERROR(ReadGradient(s, run, i));
  if (run.clip) DIOND_RETURN_IF_ERROR(Clip::Apply(s, run));  // before the check: it reads them
  // A region found broken here fails the step before anything (a world: before any collective;
  // the other ranks' steps then fail on their collectives' timeout).
  return s.arenas_.CheckRegions(run.when, Role::kGradients);
}

void Session::HostMemory::BeginBuckets(Session& s, StepRun& run) {
  const size_t n = s.layout_.tensors.size();
  run.grads.assign(n, nullptr);
  s.arenas_.grad_scratch().resize(n);  // each buffer keeps its capacity between steps
  run.finite = true;
}

absl::Status Session::HostMemory::ReadGradientsOf(Session& s, StepRun& run, size_t k,
                                                  const std::vector<size_t>& params) {
  for (size_t i : params) DIOND_RETURN_IF_ERROR(ReadGradient(s, run, i));
  return s.arenas_.CheckRegions(run.when, Role::kGradients);
}

absl::Status Session::HostMemory::ReadGradient(Session& s, StepRun& run, size_t i) {
  if (run.no_grad[i]) return absl::OkStatus();  // never read: its bytes need not be finite
  const TensorPlacement& t = s.layout_.tensors[i];
  const uint8_t* src = s.arenas_.grads().data + t.grad_offset;
  bool ok = true;
  if (t.dtype == DType::kF32 && !run.scaled) {
    // In place, wherever the arena lies. The scan reads exactly what the update reads later;
    // a trainer writing its gradients meanwhile only changes its own session's step.
    run.grads[i] = reinterpret_cast<const float*>(src);
    if (run.finite) {
      DIOND_RETURN_IF_ERROR(
          kernels::AllFinite(*run.ctx, internal::HostView(t.dtype, src, t.numel), &ok));
    }
  } else {
    // Widened and scaled in the pass that scans them (a world's non-finite rank still
    // contributes every gradient to the reduce-scatter, so all are converted).
    std::vector<float>& c = s.arenas_.grad_scratch()[i];
    c.resize(static_cast<size_t>(t.numel));
    DIOND_RETURN_IF_ERROR(kernels::WidenScaleCheckFinite(
        *run.ctx, internal::HostView(t.dtype, src, t.numel), run.scale,
        internal::HostView(DType::kF32, c.data(), t.numel), &ok));
    run.grads[i] = c.data();
  }
  run.finite = run.finite && ok;
  if (run.clip) Clip::Accumulate(s, run, i);
  return absl::OkStatus();
}

absl::Status Session::HostMemory::ReadParameters(Session& s, StepRun& run) {
  const size_t n = s.layout_.tensors.size();
  run.params.assign(n, nullptr);
  run.via_scratch.assign(n, false);
  Arenas& a = s.arenas_;
  a.param_scratch().resize(n);
  for (size_t i = 0; i < n; ++i) {
    const TensorPlacement& t = s.layout_.tensors[i];
    uint8_t* arena = a.params().data + t.param_offset;
    const bool master = a.HasMaster(i);  // (a host session: host vectors)
    if (!master && t.dtype == DType::kF32 && !run.params_via_scratch) {
      run.params[i] = reinterpret_cast<float*>(arena);  // in place
      continue;
    }
    // The master weights are daemon state: the step updates a copy, swapped in at the commit.
    std::vector<float>& c = a.param_scratch()[i];
    c.resize(static_cast<size_t>(t.numel));
    const bool from_master = master && a.master_valid();
    DIOND_RETURN_IF_ERROR(kernels::Copy(
        *run.ctx,
        from_master ? internal::HostView(DType::kF32, a.host_master(i).data(), t.numel)
                    : internal::HostView(t.dtype, arena, t.numel),
        internal::HostView(DType::kF32, c.data(), t.numel)));
    run.params[i] = c.data();
    run.via_scratch[i] = true;
  }
  return absl::OkStatus();
}

absl::Status Session::HostMemory::Stage(Session& s, StepRun& run, const kernels::Context& ctx) {
  return s.StageGroups(run, ctx);
}

absl::Status Session::HostMemory::WriteWeights(Session& s, StepRun& run) {
  std::vector<size_t> all(s.layout_.tensors.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return WriteWeightsOf(s, run, 0, all);
}

absl::Status Session::HostMemory::WriteWeightsOf(Session& s, StepRun& run, size_t k,
                                                 const std::vector<size_t>& params) {
  for (size_t i : params) {
    if (!run.via_scratch[i]) continue;
    const TensorPlacement& t = s.layout_.tensors[i];
    DIOND_RETURN_IF_ERROR(kernels::Copy(
        *run.ctx, internal::HostView(DType::kF32, run.params[i], t.numel),
        internal::HostView(t.dtype, s.arenas_.params().data + t.param_offset, t.numel)));
  }
  return absl::OkStatus();
}

void Session::HostMemory::CommitMaster(Session& s, size_t i) {
  s.arenas_.SwapInHostMaster(i);  // the updated copy becomes the master weights
}

// The reduce-scatter of a world AVERAGE step (or bucket) in host memory: block j of the input
// holds the gradients of rank j's parameters, padded to the largest block, then this rank's
// flags, so every rank learns the same sums (e.g. of non-finite trainers).
absl::Status Session::HostMemory::ReduceGradients(Session& s, StepRun& run,
                                                  const std::vector<std::vector<size_t>>& of,
                                                  int64_t block, const std::vector<float>& flags,
                                                  std::vector<float>* summed) {
  const WorldPart& w = *s.world_;
  const int world_size = w.plan.world_size;
  const int64_t nflags = static_cast<int64_t>(flags.size());
  std::vector<float> input(static_cast<size_t>(block) * world_size, 0.0f);
  DIOND_RETURN_IF_ERROR(CallOnCompute(run.compute, [&]() -> absl::Status {
    for (int j = 0; j < world_size; ++j) {
      float* dst = input.data() + static_cast<size_t>(j) * block;
      for (size_t i : of[static_cast<size_t>(j)]) {
        const int64_t numel = s.layout_.tensors[i].numel;
        // A gradient this rank's trainer does not have counts as zeros (`input` is zeroed).
        if (run.grads[i] != nullptr) {
          DIOND_RETURN_IF_ERROR(kernels::Copy(*run.ctx,
                                              internal::HostView(DType::kF32, run.grads[i], numel),
                                              internal::HostView(DType::kF32, dst, numel)));
        }
        dst += numel;
      }
      std::copy(flags.begin(), flags.end(), input.data() + (j + 1) * block - nflags);
    }
    return absl::OkStatus();
  }));
  std::vector<float>& out = run.averaged.emplace_back(static_cast<size_t>(block));
  absl::Status st = run.comm->ReduceScatterSum(input, absl::MakeSpan(out));
  if (!st.ok()) return s.ReduceFailed(run, st);
  summed->assign(out.end() - nflags, out.end());
  // The average: the sum divided by the world size (a division, not a multiplication by its
  // inverse, so that the bits match the reference's mean).
  const float divisor = static_cast<float>(world_size);
  return CallOnCompute(run.compute, [&]() -> absl::Status {
    float* a = out.data();
    for (size_t i : of[static_cast<size_t>(w.rank)]) {
      const int64_t numel = s.layout_.tensors[i].numel;
      run.grads[i] = nullptr;
      if (!run.no_grad[i]) {  // else no rank has it: not stepped
        DIOND_RETURN_IF_ERROR(kernels::Binary(*run.ctx, kernels::BinaryOp::kDiv,
                                              internal::HostView(DType::kF32, a, numel),
                                              internal::HostView(DType::kF32, &divisor, 1),
                                              internal::HostView(DType::kF32, a, numel)));
        run.grads[i] = a;
      }
      a += numel;
    }
    return absl::OkStatus();
  });
}

absl::StatusOr<std::unique_ptr<ExchangeWire>> Session::HostMemory::MakeExchangeWire(Session& s,
                                                                                    StepRun& run,
                                                                                    int64_t mine,
                                                                                    int64_t total) {
  return MakeHostExchangeWire(run.comm.get(), run.ctx, s.compute_, mine, total);
}

namespace internal {

absl::Status CheckEventHandles(const StepRequest& request) {
  constexpr size_t kHandleBytes = 64;  // cudaIpcEventHandle_t
  const std::pair<const char*, const std::string*> events[] = {
      {"ready_event", &request.ready_event}, {"done_event", &request.done_event}};
  for (const auto& [name, handle] : events) {
    if (!handle->empty() && handle->size() != kHandleBytes) {
      return absl::InvalidArgumentError(absl::StrCat("step ", request.step_index, ": ", name,
                                                     " must be the 64 bytes of a "
                                                     "cudaIpcEventHandle_t; got ",
                                                     handle->size(), " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status RefuseEvents(const StepRequest& request, absl::string_view how) {
  return absl::FailedPreconditionError(
      absl::StrCat("step ", request.step_index,
                   ": ready_event / done_event order a device session's "
                   "stream, and this session ",
                   how, "; send them only with CUDA regions on a GPU daemon"));
}

}  // namespace internal

}  // namespace diond::session
