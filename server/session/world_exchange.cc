#include "server/session/world_exchange.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/session/device_comm.h"
#include "server/session/step_memory.h"

namespace diond::session {

namespace {

class HostWire final : public ExchangeWire {
 public:
  HostWire(comm::Communicator* comm, const kernels::Context* ctx, ComputeThread* compute,
           int64_t mine, int64_t total)
      : comm_(comm), ctx_(ctx), compute_(compute) {
    mine_host_.resize(static_cast<size_t>(mine));
    all_host_.resize(static_cast<size_t>(total));
    mine_ = mine_host_.data();
    all_ = all_host_.data();
  }
  comm::Communicator& comm() override { return *comm_; }
  const kernels::Context& step_context() const override { return *ctx_; }
  absl::Status PutStep(const float* src, int64_t at, int64_t n) override {
    return CallOnCompute(compute_, [&] { return internal::CopyF32(src, mine_ + at, n); });
  }
  absl::Status PutHost(const float* src, int64_t at, int64_t n) override {
    std::copy(src, src + n, mine_ + at);
    return absl::OkStatus();
  }
  absl::Status GetStep(int64_t at, float* dst, int64_t n) override {
    return CallOnCompute(compute_, [&] { return internal::CopyF32(all_ + at, dst, n); });
  }
  absl::StatusOr<absl::Span<const float>> GetHost(int64_t at, int64_t n) override {
    return absl::MakeConstSpan(all_ + at, static_cast<size_t>(n));
  }
  absl::Status Settled() override { return absl::OkStatus(); }

 private:
  comm::Communicator* comm_;
  const kernels::Context* ctx_;
  ComputeThread* compute_;
  std::vector<float> mine_host_, all_host_;
};

kernels::TensorView DevView(const kernels::Context& ctx, float* p, int64_t n) {
  return kernels::TensorView(p, kernels::ContiguousLayout(DType::kF32, {n}), ctx.device());
}
kernels::ConstTensorView DevCView(const kernels::Context& ctx, const float* p, int64_t n) {
  return kernels::ConstTensorView(p, kernels::ContiguousLayout(DType::kF32, {n}), ctx.device());
}

class DeviceWire final : public ExchangeWire {
 public:
  DeviceWire(const kernels::Context* dctx, StepDeviceComm* dcomm, ComputeThread* compute,
             float* mine, float* all)
      : dctx_(*dctx), dcomm_(dcomm), compute_(compute) {
    mine_ = mine;
    all_ = all;
  }
  comm::Communicator& comm() override { return *dcomm_; }
  const kernels::Context& step_context() const override { return dctx_; }
  absl::Status PutStep(const float* src, int64_t at, int64_t n) override {
    return CallOnCompute(compute_, [&] {
      return kernels::Copy(dctx_, DevCView(dctx_, src, n), DevView(dctx_, mine_ + at, n));
    });
  }
  absl::Status PutHost(const float* src, int64_t at, int64_t n) override {
    return CallOnCompute(compute_,
                         [&] { return internal::CopyF32ToDevice(dctx_, src, mine_ + at, n); });
  }
  absl::Status GetStep(int64_t at, float* dst, int64_t n) override {
    return CallOnCompute(compute_, [&] {
      return kernels::Copy(dctx_, DevCView(dctx_, all_ + at, n), DevView(dctx_, dst, n));
    });
  }
  absl::StatusOr<absl::Span<const float>> GetHost(int64_t at, int64_t n) override {
    host_copy_.resize(static_cast<size_t>(n));
    DIOND_RETURN_IF_ERROR(dcomm_->ReadBackQueued(
        [&] { return internal::CopyF32ToHost(dctx_, all_ + at, host_copy_.data(), n); }));
    return absl::MakeConstSpan(host_copy_);
  }
  // Queued collectives (NCCL on the session's stream) fail asynchronously: once every rank's
  // tail was read back, the stream got past the exchange, ended by the world's abort if a peer
  // was lost; nothing read from the wire is trusted until the device communicator is healthy.
  absl::Status Settled() override { return dcomm_->DeviceStatus(); }

 private:
  const kernels::Context& dctx_;
  StepDeviceComm* dcomm_;
  ComputeThread* compute_;
  std::vector<float> host_copy_;
};

}  // namespace

std::unique_ptr<ExchangeWire> MakeHostExchangeWire(comm::Communicator* comm,
                                                   const kernels::Context* ctx,
                                                   ComputeThread* compute, int64_t mine,
                                                   int64_t total) {
  return std::make_unique<HostWire>(comm, ctx, compute, mine, total);
}

std::unique_ptr<ExchangeWire> MakeDeviceExchangeWire(const kernels::Context* dctx,
                                                     StepDeviceComm* dcomm, ComputeThread* compute,
                                                     float* mine, float* all) {
  return std::make_unique<DeviceWire>(dctx, dcomm, compute, mine, all);
}

WorldExchange::WorldExchange(Session& s, Session::StepRun& run, const kernels::Context& ctx)
    : s_(s),
      run_(run),
      ctx_(ctx),
      w_(*s.world_),
      where_(absl::StrCat(run.when, ": ")),
      extra_(2 * static_cast<int64_t>(s.groups_.size()) + 1) {
  counts_.resize(static_cast<size_t>(w_.plan.world_size));
  for (int j = 0; j < w_.plan.world_size; ++j) {
    counts_[j] = (run.updates_exchanged ? 0 : w_.owned_payload[j]) + extra_;
    total_ += counts_[j];
  }
}

absl::Status WorldExchange::Run() {
  DIOND_RETURN_IF_ERROR(MakeWire());
  if (!run_.updates_exchanged) PackOwned();
  DIOND_RETURN_IF_ERROR(Gather());
  DIOND_RETURN_IF_ERROR(ReadTails());
  if (absl::Status d = wire_->Settled(); !d.ok()) {
    return Broken("exchange of the updated parameters failed: ", d);
  }
  if (run_.compute_status.ok() && !ok_here_) {
    run_.compute_status = s_.arenas_.CheckRegions(run_.when);
  }
  // Always, so that every replica holds the owners' values.
  ApplyWholeParameters();
  if (failed_.empty() && run_.compute_status.ok()) ApplyCompactUpdates();
  if (run_.compute_status.ok() && !failed_.empty()) {
    run_.compute_status =
        absl::InternalError(absl::StrCat("step ", run_.request->step_index, " failed on rank(s) ",
                                         absl::StrJoin(failed_, ", "), " (see their logs)"));
  }
  DIOND_RETURN_IF_ERROR(CompareChecksums());
  run_.result.world_bytes_sent = s_.TakeWorldBytes(run_);
  return absl::OkStatus();
}

absl::Status WorldExchange::Broken(absl::string_view what, const absl::Status& why) {
  return s_.BreakWorld(
      run_, absl::UnavailableError(absl::StrCat(where_, what, s_.DescribeWorldFailure(why),
                                                "; create the session again and resume from "
                                                "the last checkpoint")));
}

void WorldExchange::Fail(absl::Status why) {
  if (run_.compute_status.ok()) run_.compute_status = std::move(why);
}

absl::Status WorldExchange::MakeWire() {
  absl::StatusOr<std::unique_ptr<ExchangeWire>> wire =
      s_.memory_->MakeExchangeWire(s_, run_, counts_[w_.rank], total_);
  if (!wire.ok()) {
    return s_.BreakWorld(
        run_, absl::Status(wire.status().code(), absl::StrCat(where_, wire.status().message(),
                                                              "; the world session must be created "
                                                              "again")));
  }
  wire_ = *std::move(wire);
  return absl::OkStatus();
}

void WorldExchange::PackOwned() {
  const Layout& layout = s_.layout_;
  for (size_t i : w_.owned[w_.rank]) {
    absl::Status put;
    if (run_.no_grad[i]) {
      // Not stepped on any rank (AgreeGradientsPhase): its slot is sent but never read.
      at_ += w_.compact[i] > 0 ? w_.compact[i] : layout.tensors[i].numel;
      continue;
    }
    if (w_.compact[i] > 0) {
      const auto& payloads = run_.captures[s_.group_of_param_[i]].payload;
      const size_t slot = s_.slot_in_group_[i];
      const std::vector<float>* p = payloads.size() > slot ? &payloads[slot] : nullptr;
      if (p != nullptr && static_cast<int64_t>(p->size()) == w_.compact[i]) {
        put = wire_->PutHost(p->data(), at_, w_.compact[i]);
      } else {
        // Only after a failed compute (reported through the status value); the block's bytes
        // are then never read.
        Fail(absl::InternalError(absl::StrCat("no compact update captured for '",
                                              Bounded(layout.tensors[i].name), "'")));
      }
      at_ += w_.compact[i];
    } else {
      // The whole parameter.
      const int64_t numel = layout.tensors[i].numel;
      put = wire_->PutStep(run_.params[i], at_, numel);
      at_ += numel;
    }
    if (!put.ok()) {
      // Reported to every rank through the status value.
      Fail(absl::Status(put.code(), absl::StrCat("copying '", Bounded(layout.tensors[i].name),
                                                 "' for the exchange failed: ", put.message())));
    }
  }
}

absl::Status WorldExchange::Gather() {
  std::vector<float> tail;
  tail.reserve(static_cast<size_t>(extra_));
  for (double sq : run_.update_sq) {
    const float hi = static_cast<float>(sq);
    tail.push_back(hi);
    tail.push_back(static_cast<float>(sq - static_cast<double>(hi)));
  }
  // This rank's failure, or its trainer's memory gone while it was read: the step fails on
  // every rank.
  ok_here_ = run_.compute_status.ok() && s_.arenas_.CheckRegions(run_.when).ok();
  tail.push_back(ok_here_ ? 0.0f : 1.0f);
  absl::Status st = wire_->PutHost(tail.data(), at_, extra_);
  if (st.ok()) {
    st = wire_->comm().AllGatherV(
        absl::MakeConstSpan(wire_->mine(), static_cast<size_t>(counts_[w_.rank])), counts_,
        absl::MakeSpan(wire_->all(), static_cast<size_t>(total_)));
  }
  if (!st.ok()) return Broken("exchange of the updated parameters failed: ", st);
  return absl::OkStatus();
}

absl::Status WorldExchange::ReadTails() {
  const Layout& layout = s_.layout_;
  std::vector<double>& update_sq = run_.update_sq;
  int64_t at = 0;
  const std::vector<size_t> none;  // the payloads went bucket by bucket (an overlapped step)
  for (int j = 0; j < w_.plan.world_size; ++j) {
    for (size_t i : run_.updates_exchanged ? none : w_.owned[j]) {
      const int64_t numel = layout.tensors[i].numel;
      // A parameter nobody stepped keeps its value on every rank.
      const bool apply = j != w_.rank && !run_.no_grad[i];
      if (w_.compact[i] > 0) {
        if (apply) compact_.emplace_back(i, at);
        at += w_.compact[i];
      } else {
        if (apply) whole_.emplace_back(i, at);
        at += numel;
      }
    }
    absl::StatusOr<absl::Span<const float>> t = wire_->GetHost(at, extra_);
    if (!t.ok()) {
      return s_.BreakWorld(
          run_,
          absl::Status(t.status().code(),
                       absl::StrCat(where_, "reading rank ", j, "'s norms: ", t.status().message(),
                                    "; the world session must be created again")));
    }
    for (size_t gi = 0; gi < s_.groups_.size(); ++gi) {
      if (j == 0) update_sq[gi] = 0;  // from here on: the world's sum
      update_sq[gi] += static_cast<double>((*t)[2 * gi]) + static_cast<double>((*t)[2 * gi + 1]);
    }
    if ((*t)[static_cast<size_t>(extra_) - 1] != 0.0f && j != w_.rank) failed_.push_back(j);
    at += extra_;
  }
  return absl::OkStatus();
}

void WorldExchange::ApplyWholeParameters() {
  const Layout& layout = s_.layout_;
  for (const auto& [i, offset] : whole_) {
    absl::Status s = wire_->GetStep(offset, run_.params[i], layout.tensors[i].numel);
    if (!s.ok()) {
      Fail(absl::Status(s.code(),
                        absl::StrCat("writing '", Bounded(layout.tensors[i].name), "' from rank ",
                                     w_.plan.owner[i], " failed: ", s.message())));
    }
  }
}

void WorldExchange::ApplyCompactUpdates() {
  const Layout& layout = s_.layout_;
  // Through the rules' own code: bit-identical to what their owners computed.
  for (const auto& entry : compact_) {
    // Plain names: a lambda below uses them (C++17 lambdas cannot capture a structured binding).
    const size_t i = entry.first;
    const int64_t offset = entry.second;
    const size_t gi = s_.group_of_param_[i];
    absl::StatusOr<absl::Span<const float>> payload = wire_->GetHost(offset, w_.compact[i]);
    absl::Status s = payload.status();
    if (s.ok()) {
      s = CallOnCompute(s_.compute_, [&] {
        return optim::ApplyCapturedUpdate(ctx_, s_.groups_[gi].optimizer->config(),
                                          layout.tensors[i].shape, run_.opts[gi], *payload,
                                          run_.params[i]);
      });
    }
    if (!s.ok()) {
      run_.compute_status = absl::InternalError(
          absl::StrCat("applying the compact update of '", Bounded(layout.tensors[i].name),
                       "' from rank ", w_.plan.owner[i], ": ", s.message()));
      return;
    }
  }
}

absl::Status WorldExchange::CompareChecksums() {
  const int64_t step = run_.request->step_index;
  if (!run_.compute_status.ok() || w_.checksum_every <= 0 || step % w_.checksum_every != 0) {
    return absl::OkStatus();
  }
  absl::StatusOr<int64_t> healed =
      s_.CheckReplicas(wire_->step_context(), run_.comm.get(), run_.dcomm.get(), step, run_.params);
  if (!healed.ok()) return Broken("checksum comparison failed: ", healed.status());
  run_.result.checksum_mismatches = *healed;
  return absl::OkStatus();
}

}  // namespace diond::session
