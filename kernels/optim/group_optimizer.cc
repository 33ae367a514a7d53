#include "kernels/optim/group_optimizer.h"

#include <cassert>
#include <cmath>
#include <cstring>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/optim/internal/rule.h"
#include "kernels/optim/internal/util.h"
#include "kernels/optim/validation.h"

namespace diond::optim {

absl::Status GroupOptimizer::Step(const kernels::Context& ctx, absl::Span<float* const> params,
                                  absl::Span<const float* const> grads,
                                  const StepOptions& options) {
  // The three phases back to back: nothing can fail between them, so in-place rules may step
  // the caller's buffers directly.
  StepOptions in_place = options;
  in_place.in_place = true;
  DIOND_RETURN_IF_ERROR(Stage(ctx, params, grads, in_place));
  WriteStagedParams(params);
  CommitStagedState();
  return absl::OkStatus();
}

absl::Status GroupOptimizer::CheckStepArgs(absl::Span<float* const> params,
                                           absl::Span<const float* const> grads) const {
  if (params.size() != shapes_.size() || grads.size() != shapes_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(AlgorithmName(config_.algorithm), " step: got ", params.size(), " params and ",
                     grads.size(), " grads for a group of ", shapes_.size(), " parameters"));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (grads[i] != nullptr && params[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          AlgorithmName(config_.algorithm), " step: parameter ", i, " is null but has a grad"));
    }
    if (grads[i] != nullptr && grads[i] == params[i]) {
      return absl::InvalidArgumentError(absl::StrCat(AlgorithmName(config_.algorithm),
                                                     " step: grad ", i, " aliases its parameter"));
    }
    if (grads[i] != nullptr && StateReleased(i)) {
      return absl::FailedPreconditionError(
          absl::StrCat(AlgorithmName(config_.algorithm), " step: parameter ", i,
                       " has a gradient but its state was released (it is owned elsewhere)"));
    }
  }
  return absl::OkStatus();
}

absl::Status GroupOptimizer::CheckStepOptions(const kernels::Context& ctx,
                                              const StepOptions& options) const {
  DIOND_RETURN_IF_ERROR(ValidateStepOptions(options));
  if (ctx.device() != state_device_) {
    return absl::InvalidArgumentError(
        absl::StrCat(AlgorithmName(config_.algorithm), " step: the context's device (type ",
                     static_cast<int>(ctx.device().type), ", index ", ctx.device().index,
                     ") is not the device of the optimizer's state"));
  }
  return absl::OkStatus();
}

absl::Status GroupOptimizer::Stage(const kernels::Context& ctx, absl::Span<float* const> params,
                                   absl::Span<const float* const> grads,
                                   const StepOptions& options) {
  CloseParts();
  DIOND_RETURN_IF_ERROR(CheckStepArgs(params, grads));
  DIOND_RETURN_IF_ERROR(CheckStepOptions(ctx, options));
  const double lr = options.lr.value_or(config_.hyperparams.lr);
  const double wd = options.weight_decay.value_or(config_.hyperparams.weight_decay);
  capture_ = options.capture;
  replica_average_ = options.replica_average ? &options.replica_average : nullptr;
  replica_average_on_device_ = options.replica_average_on_device;
  step_number_ = options.step.value_or(steps_taken_ + 1);
  in_place_ = options.in_place;
  absl::Status s = StageStep(ctx, params, grads, static_cast<float>(lr), static_cast<float>(wd));
  capture_ = nullptr;
  replica_average_ = nullptr;
  replica_average_on_device_ = false;
  if (!s.ok()) {
    DiscardStaged();
    return s;
  }
  return absl::OkStatus();
}

absl::Status GroupOptimizer::BeginStagedStep(const kernels::Context& ctx,
                                             const StepOptions& options) {
  CloseParts();
  DIOND_RETURN_IF_ERROR(CheckStepOptions(ctx, options));
  // In place a part would write the caller's memory before a later part could still fail.
  if (options.in_place) {
    return absl::InvalidArgumentError(absl::StrCat(
        AlgorithmName(config_.algorithm), " step in parts: in_place needs a step in one Stage"));
  }
  parts_lr_ = static_cast<float>(options.lr.value_or(config_.hyperparams.lr));
  parts_weight_decay_ =
      static_cast<float>(options.weight_decay.value_or(config_.hyperparams.weight_decay));
  step_number_ = options.step.value_or(steps_taken_ + 1);
  in_place_ = false;
  in_part_.assign(shapes_.size(), false);
  BeginParts(ctx);
  // Each part averages its own sub-batches (the caller keeps the ranks' parts alike) and
  // captures its parameters' compact updates; the step's capture holds them all.
  parts_replica_average_ = options.replica_average;
  replica_average_ = parts_replica_average_ ? &parts_replica_average_ : nullptr;
  replica_average_on_device_ = options.replica_average_on_device;
  capture_ = options.capture;
  if (capture_ != nullptr) capture_->payload.assign(shapes_.size(), {});
  parts_open_ = true;
  return absl::OkStatus();
}

absl::Status GroupOptimizer::StagePart(absl::Span<float* const> params,
                                       absl::Span<const float* const> grads) {
  if (!parts_open_) {
    return absl::FailedPreconditionError(absl::StrCat(
        AlgorithmName(config_.algorithm), " StagePart: no step is open (BeginStagedStep first)"));
  }
  DIOND_RETURN_IF_ERROR(CheckStepArgs(params, grads));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i] != nullptr && in_part_[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat(AlgorithmName(config_.algorithm), " StagePart: parameter ", i,
                       " already has a gradient in an earlier part of this step"));
    }
  }
  DIOND_RETURN_IF_ERROR(StagePartImpl(params, grads, parts_lr_, parts_weight_decay_));
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i] != nullptr) in_part_[i] = true;
  }
  return absl::OkStatus();
}

absl::Status GroupOptimizer::CopyStagedParam(size_t p, float* dst) const {
  if (!parts_open_ || p >= in_part_.size() || !in_part_[p]) {
    return absl::FailedPreconditionError(
        absl::StrCat(AlgorithmName(config_.algorithm), " CopyStagedParam: parameter ", p,
                     " was not staged by a part of the open step"));
  }
  return CopyStagedParamImpl(p, dst);
}

void GroupOptimizer::CloseParts() {
  parts_open_ = false;
  capture_ = nullptr;
  replica_average_ = nullptr;
  replica_average_on_device_ = false;
  parts_replica_average_ = nullptr;
}

void GroupOptimizer::DiscardStagedStep() {
  CloseParts();
  DiscardStaged();
}

void GroupOptimizer::WriteStagedParams(absl::Span<float* const> params) {
  CloseParts();
  update_sq_ = 0;
  defer_norm_ = false;
  CommitStagedParams(params);
}

void GroupOptimizer::WriteStagedParamsDeferringNorm(absl::Span<float* const> params,
                                                    float* norm_host) {
  CloseParts();
  update_sq_ = 0;
  defer_norm_ = true;
  defer_norm_to_ = norm_host;
  CommitStagedParams(params);
  defer_norm_ = false;
}

void GroupOptimizer::FinishStagedNorm() {
  if (!norm_pending_) return;
  SumDeferredNorm();
  norm_pending_ = false;
}

double GroupOptimizer::staged_update_norm() const {
  assert(!norm_pending_ && "FinishStagedNorm after the wait, before the norm is read");
  return std::sqrt(update_sq_);
}

void GroupOptimizer::CommitStagedState() {
  assert(!norm_pending_ && "FinishStagedNorm after the wait, before the commit");
  CommitStagedStateImpl();
  last_update_norm_ = std::sqrt(update_sq_);
  ++steps_taken_;
}

std::vector<std::string> GroupOptimizer::StateNames() const {
  return optim::StateNames(config_.algorithm);
}

namespace internal {

int64_t StateSpec::NumElements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool UpdateRule::InitState(const GroupConfig&, const ParamShape&, size_t, int64_t, uint64_t,
                           float*) const {
  return false;
}

absl::Status UpdateRule::CommitParams(const kernels::Context&, const BucketArgs&) const {
  return absl::InternalError("CommitParams: this rule does not defer its parameter write");
}

namespace {

int64_t NumElements(const ParamShape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Parameters of one shape, with their persistent state stacked [N, ...]: one f32 Buffer per
// state spec, from the optimizer's allocator (kernels/context.h).
struct Bucket {
  ParamShape shape;
  int64_t numel = 0;
  std::vector<size_t> members;  // parameter indices, ascending
  std::vector<StateSpec> specs;
  std::vector<kernels::Buffer> state;  // per spec, [N·spec numel] f32
};

// One rule call of a step: the members of one bucket that one part (or Stage) gave a gradient,
// staged in rows [begin, begin + count) of the bucket's staging.
struct Chunk {
  size_t begin = 0;
  size_t count = 0;
  int64_t part = 0;  // which StagePart staged it (a failed part drops its own chunks)
  // A deferred parameter write (UpdateRule::DefersParamWrite): the chunk's rows of x hold the
  // rule's compact update, `keep` its host data, and the commit calls CommitParams.
  bool deferred = false;
  std::vector<int64_t> keep;
};

// Results of one bucket waiting for commit. The buffers are sized for every member of the
// bucket once (at its first step) and reused by every later step, whichever members have a
// gradient, so steps after the first allocate nothing. The parts of a step append their members
// in the order they come; a step staged in one Stage has one chunk, in member order.
struct Staged {
  std::vector<size_t> slots;  // per staged row, its position in Bucket::members
  kernels::Buffer x;          // the gradients are not staged: the rules read the caller's buffers
  std::vector<kernels::Buffer> state;
  bool allocated = false;     // x and state, at the bucket's first step
  std::vector<Chunk> chunks;  // the first num_chunks are this step's; the rest kept for reuse
  size_t num_chunks = 0;
};

// f32 vector views on the state's device (the device contract of group_optimizer.h).
kernels::TensorView F32View(float* p, int64_t n, kernels::Device dev) { return Vec(p, n, dev); }
kernels::ConstTensorView F32CView(const float* p, int64_t n, kernels::Device dev) {
  return CVec(p, n, dev);
}

absl::StatusOr<kernels::Buffer> F32Buffer(const kernels::Allocator& alloc, int64_t n) {
  return alloc.Allocate(kernels::DType::kF32, {n});
}

class BucketedOptimizer final : public GroupOptimizer {
 public:
  BucketedOptimizer(GroupConfig config, std::vector<ParamShape> shapes,
                    std::unique_ptr<UpdateRule> rule, kernels::Allocator alloc)
      : GroupOptimizer(std::move(config), std::move(shapes)),
        rule_(std::move(rule)),
        alloc_(std::move(alloc)) {
    state_device_ = alloc_.device();
    std::map<ParamShape, size_t> by_shape;
    for (size_t i = 0; i < this->shapes().size(); ++i) {
      const ParamShape& s = this->shapes()[i];
      auto [it, inserted] = by_shape.emplace(s, buckets_.size());
      if (inserted) {
        Bucket b;
        b.shape = s;
        b.numel = NumElements(s);
        b.specs = rule_->Specs(this->config(), s);
        buckets_.push_back(std::move(b));
      }
      buckets_[it->second].members.push_back(i);
      where_.push_back({it->second, buckets_[it->second].members.size() - 1});
    }
    step_dev_host_.assign(this->shapes().size(), 0.0f);
    step_dev_staged_ = step_dev_host_;
  }

  // Allocates and initializes the state on ctx's device: zeros (a Fill), or the rule's initial
  // values, drawn on the host and uploaded (one explicit copy per state stack, e.g. Dion's Q).
  absl::Status InitStates(const kernels::Context& ctx) {
    const kernels::Device dev = ctx.device();
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      Bucket& b = buckets_[bi];
      const int64_t n = static_cast<int64_t>(b.members.size());
      for (size_t k = 0; k < b.specs.size(); ++k) {
        const int64_t total = n * b.specs[k].NumElements();
        DIOND_ASSIGN_OR_RETURN(kernels::Buffer buf, F32Buffer(alloc_, total));
        // The stream makes every bucket's random draws independent and fixed by the first
        // parameter index of the bucket, so adding a parameter of another shape does not
        // change them.
        std::vector<float> host(static_cast<size_t>(total), 0.0f);
        if (rule_->InitState(this->config(), b.shape, k, n, b.members[0], host.data())) {
          DIOND_RETURN_IF_ERROR(Upload(ctx, host.data(), buf.As<float>(), total));
        } else if (total > 0) {
          DIOND_RETURN_IF_ERROR(kernels::Fill(ctx, 0.0f, F32View(buf.As<float>(), total, dev)));
        }
        b.state.push_back(std::move(buf));
      }
    }
    DIOND_ASSIGN_OR_RETURN(update_sq_buf_,
                           F32Buffer(alloc_, static_cast<int64_t>(this->shapes().size())));
    update_sq_host_.assign(this->shapes().size(), 0.0f);
    return absl::OkStatus();
  }

 protected:
  absl::Status StageStep(const kernels::Context& ctx, absl::Span<float* const> params,
                         absl::Span<const float* const> grads, float lr,
                         float weight_decay) override {
    BeginParts(ctx);
    if (capture_ != nullptr) capture_->payload.assign(shapes().size(), {});
    // In place (AdamW, Lion: one fused op, each byte read and written once) only when the
    // caller says nothing can fail between Stage and CommitStagedState (StepOptions::in_place);
    // otherwise the rule steps copies in the staging, and the commit phases write them back.
    if (rule_->InPlace() && in_place_) return StepInPlace(ctx, params, grads, lr, weight_decay);
    return StageBuckets(ctx, params, grads, lr, weight_decay);
  }

  void BeginParts(const kernels::Context& ctx) override {
    ResetStaging();
    in_place_step_ = false;
    commit_ctx_ = &ctx;
    step_dev_staged_ = step_dev_host_;  // same size: no allocation
  }

  absl::Status StagePartImpl(absl::Span<float* const> params, absl::Span<const float* const> grads,
                             float lr, float weight_decay) override {
    ++part_;
    absl::Status s = StageBuckets(*commit_ctx_, params, grads, lr, weight_decay);
    if (s.ok()) return s;
    // Drop this part's chunks (always the last of their bucket) and its step counts; what it
    // wrote into the staging is past the rows still staged.
    for (Staged& st : staging_) {
      if (st.num_chunks > 0 && st.chunks[st.num_chunks - 1].part == part_) {
        st.slots.resize(st.chunks[st.num_chunks - 1].begin);
        --st.num_chunks;
      }
    }
    for (size_t p = 0; p < grads.size(); ++p) {
      if (grads[p] != nullptr) step_dev_staged_[p] = step_dev_host_[p];
    }
    return s;
  }

  // Runs the rule on the members of every bucket that have a gradient in `grads`, one chunk per
  // bucket, appended to what earlier parts of the step staged.
  absl::Status StageBuckets(const kernels::Context& ctx, absl::Span<float* const> params,
                            absl::Span<const float* const> grads, float lr, float weight_decay) {
    const kernels::Device dev = ctx.device();
    staging_.resize(buckets_.size());
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const Bucket& b = buckets_[bi];
      Staged& st = staging_[bi];
      const size_t begin = st.slots.size();
      size_t np = 0;
      for (size_t slot = 0; slot < b.members.size(); ++slot) np += grads[b.members[slot]] ? 1 : 0;
      if (np == 0) continue;
      // The buffers of this bucket's previous step are reused: large fresh allocations would be
      // page-faulted in (and zeroed) again on every step.
      if (!st.allocated) DIOND_RETURN_IF_ERROR(AllocateStaging(b, &st));
      for (size_t slot = 0; slot < b.members.size(); ++slot) {
        if (grads[b.members[slot]] != nullptr) st.slots.push_back(slot);
      }
      if (st.num_chunks == st.chunks.size()) st.chunks.emplace_back();
      Chunk& c = st.chunks[st.num_chunks++];
      c.begin = begin;
      c.count = np;
      c.part = part_;
      // Nothing is copied in: the rule reads the caller's parameters and gradients and the
      // persistent state where they are, and writes its results into the staging (a later
      // fallible phase, e.g. an orthogonalization, may still fail).
      internal::BucketArgs args;
      args.config = &config();
      args.shape = &b.shape;
      args.count = static_cast<int64_t>(np);
      args.x = st.x.As<float>() + begin * b.numel;
      for (size_t j = begin; j < begin + np; ++j) {
        args.x_in.push_back(params[b.members[st.slots[j]]]);
        args.g.push_back(grads[b.members[st.slots[j]]]);
        args.step_count.push_back(&step_dev_staged_[b.members[st.slots[j]]]);
      }
      args.state_in.resize(b.specs.size());
      for (size_t k = 0; k < b.specs.size(); ++k) {
        const int64_t sn = b.specs[k].NumElements();
        args.state.push_back(st.state[k].As<float>() + begin * sn);
        for (size_t j = begin; j < begin + np; ++j) {
          args.state_in[k].push_back(b.state[k].As<float>() + st.slots[j] * sn);
        }
      }
      if (rule_->InPlace()) {
        // An in-place rule on the staged path: it steps copies of x and of the state, in the
        // staging, where it reads and writes them (it does not read x_in / state_in).
        for (size_t j = 0; j < np; ++j) {
          DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, F32CView(args.x_in[j], b.numel, dev),
                                              F32View(args.x + j * b.numel, b.numel, dev)));
          for (size_t k = 0; k < b.specs.size(); ++k) {
            const int64_t sn = b.specs[k].NumElements();
            DIOND_RETURN_IF_ERROR(kernels::Copy(ctx, F32CView(args.state_in[k][j], sn, dev),
                                                F32View(args.state[k] + j * sn, sn, dev)));
          }
        }
      }
      args.scalars = {lr, weight_decay};
      args.step = step_number_;
      args.replica_average = replica_average_;
      args.replica_average_on_device = replica_average_on_device_;
      if (capture_ != nullptr && CapturedUpdateSize(config(), b.shape) > 0) {
        for (size_t j = begin; j < begin + np; ++j) {
          args.capture.push_back(&capture_->payload[b.members[st.slots[j]]]);
        }
      }
      // A rule that can write the parameters at commit does so unless the step captures its
      // compact update (the owner's payload is read from the staged parameters).
      c.deferred = rule_->DefersParamWrite() && args.capture.empty();
      if (c.deferred) args.keep = &c.keep;
      scalars_ = args.scalars;
      DIOND_RETURN_IF_ERROR(rule_->Apply(ctx, args));
    }
    return absl::OkStatus();
  }

  // The staging of every member of `b`, kept in `st` only when all of it was allocated.
  absl::Status AllocateStaging(const Bucket& b, Staged* st) {
    const int64_t all = static_cast<int64_t>(b.members.size());
    DIOND_ASSIGN_OR_RETURN(kernels::Buffer x, F32Buffer(alloc_, all * b.numel));
    std::vector<kernels::Buffer> state;
    for (const StateSpec& spec : b.specs) {
      DIOND_ASSIGN_OR_RETURN(kernels::Buffer sb, F32Buffer(alloc_, all * spec.NumElements()));
      state.push_back(std::move(sb));
    }
    st->x = std::move(x);
    st->state = std::move(state);
    st->allocated = true;
    return absl::OkStatus();
  }

  void CommitStagedParams(absl::Span<float* const> params) override {
    const kernels::Context& ctx = *commit_ctx_;
    if (in_place_step_) {
      // The rule already wrote params and state; only its Σ(Δx)² are read back (one sync point
      // per step, docs/KERNELS.md §4.3).
      ReadBackUpdateSq(ctx, params.size());
      return;
    }
    // CopyWithChange and Fill on valid views cannot fail: the statuses are checked in debug
    // builds only (the commit has no way back).
    const kernels::Device dev = ctx.device();
    absl::Status s = kernels::Fill(ctx, 0.0f, update_sq_buf_.view());
    float* const sq = update_sq_buf_.As<float>();
    for (size_t bi = 0; bi < staging_.size(); ++bi) {
      const Bucket& b = buckets_[bi];
      Staged& st = staging_[bi];
      const int64_t numel = b.numel;
      for (size_t ci = 0; ci < st.num_chunks; ++ci) {
        Chunk& c = st.chunks[ci];
        if (c.deferred) {
          // The rule applies its compact update to the parameters in place (Σ(Δx)² with it).
          internal::BucketArgs args;
          args.config = &config();
          args.shape = &b.shape;
          args.count = static_cast<int64_t>(c.count);
          args.x = st.x.As<float>() + c.begin * numel;
          args.keep = &c.keep;
          args.scalars = scalars_;
          args.step = step_number_;
          for (size_t j = c.begin; j < c.begin + c.count; ++j) {
            const size_t p = b.members[st.slots[j]];
            args.commit_x.push_back(params[p]);
            args.commit_sq.push_back(sq + p);
          }
          s.Update(rule_->CommitParams(ctx, args));
          continue;
        }
        for (size_t j = c.begin; j < c.begin + c.count; ++j) {
          const size_t p = b.members[st.slots[j]];
          // One pass: the parameter takes the staged value, and Σ(Δx)² comes with it.
          s.Update(kernels::CopyWithChange(ctx, F32View(st.x.As<float>() + j * numel, numel, dev),
                                           F32View(params[p], numel, dev),
                                           F32View(sq + p, 1, dev)));
        }
      }
    }
    assert(s.ok());
    (void)s;
    // Σ(Δx)² per parameter read back once per step (a sync point, docs/KERNELS.md §4.3).
    ReadBackUpdateSq(ctx, params.size());
  }

  absl::Status CopyStagedParamImpl(size_t p, float* dst) const override {
    const Bucket& b = buckets_[where_[p].first];
    const Staged& st = staging_[where_[p].first];
    for (size_t ci = 0; ci < st.num_chunks; ++ci) {
      const Chunk& c = st.chunks[ci];
      for (size_t j = c.begin; j < c.begin + c.count; ++j) {
        if (st.slots[j] != where_[p].second) continue;
        if (c.deferred) {
          return absl::FailedPreconditionError(
              absl::StrCat(AlgorithmName(config().algorithm), " CopyStagedParam: parameter ", p,
                           " has a compact update staged, not its new value"));
        }
        const kernels::Device dev = commit_ctx_->device();
        return kernels::Copy(*commit_ctx_, F32CView(st.x.As<float>() + j * b.numel, b.numel, dev),
                             F32View(dst, b.numel, dev));
      }
    }
    return absl::InternalError(absl::StrCat("CopyStagedParam: parameter ", p, " not in staging"));
  }

  // update_sq_ += Σ_p update_sq_buf_[p], the buffer read back in one copy (a sync point), or,
  // deferring the norm, the copy queued and the sum left to SumDeferredNorm.
  void ReadBackUpdateSq(const kernels::Context& ctx, size_t n) {
    if (n == 0) return;
    if (defer_norm_) {
      const int64_t count = static_cast<int64_t>(n);
      deferred_to_ = defer_norm_to_ != nullptr ? defer_norm_to_ : update_sq_host_.data();
      absl::Status s = kernels::CopyToHostAsync(
          ctx,
          kernels::ConstTensorView(update_sq_buf_.data(),
                                   kernels::ContiguousLayout(kernels::DType::kF32, {count}),
                                   update_sq_buf_.device()),
          kernels::MakeView(deferred_to_, {count}));
      assert(s.ok());
      (void)s;
      deferred_count_ = n;
      norm_pending_ = true;
      return;
    }
    absl::Status s =
        Download(ctx, update_sq_buf_.As<float>(), update_sq_host_.data(), static_cast<int64_t>(n));
    assert(s.ok());
    (void)s;
    deferred_to_ = update_sq_host_.data();
    deferred_count_ = n;
    SumDeferredNorm();
  }
  void SumDeferredNorm() override {
    for (size_t p = 0; p < deferred_count_; ++p) {
      update_sq_ += static_cast<double>(deferred_to_[p]);
    }
    deferred_count_ = 0;
  }
  size_t deferred_count_ = 0;
  float* deferred_to_ = nullptr;  // where the queued read-back lands

  void CommitStagedStateImpl() override {
    step_dev_host_.swap(step_dev_staged_);  // the staged step counts become current
    if (in_place_step_) {
      in_place_step_ = false;
      return;
    }
    const kernels::Context& ctx = *commit_ctx_;
    const kernels::Device dev = ctx.device();
    absl::Status s;
    for (size_t bi = 0; bi < staging_.size(); ++bi) {
      Bucket& b = buckets_[bi];
      Staged& st = staging_[bi];
      if (st.num_chunks == 0) continue;
      // Every member took part, staged in member order (one Stage, or parts in that order): the
      // staged state becomes the state, and the old state buffers the next step's staging.
      bool in_order = st.slots.size() == b.members.size();
      for (size_t j = 0; in_order && j < st.slots.size(); ++j) in_order = st.slots[j] == j;
      if (in_order) {
        for (size_t k = 0; k < b.specs.size(); ++k) std::swap(b.state[k], st.state[k]);
        continue;
      }
      for (size_t j = 0; j < st.slots.size(); ++j) {
        for (size_t k = 0; k < b.specs.size(); ++k) {
          const int64_t sn = b.specs[k].NumElements();
          s.Update(kernels::Copy(ctx, F32View(st.state[k].As<float>() + j * sn, sn, dev),
                                 F32View(b.state[k].As<float>() + st.slots[j] * sn, sn, dev)));
        }
      }
    }
    assert(s.ok());
    (void)s;
    ResetStaging();
  }

  void DiscardStaged() override {
    in_place_step_ = false;
    norm_pending_ = false;  // (a queued read-back still lands where it was sent, never summed)
    deferred_count_ = 0;
    ResetStaging();
  }

  // The in-place path (UpdateRule::InPlace: AdamW, Lion): each parameter with a gradient is
  // stepped directly in the caller's buffer and its state slot, by one fused op that reads g, x
  // and the state and writes x and the state once, and reports Σ(Δx)² in the same pass. Nothing
  // is staged: after Step's validation these ops cannot fail (the promise that a failed step
  // changes nothing holds because nothing can fail once anything is written).
  absl::Status StepInPlace(const kernels::Context& ctx, absl::Span<float* const> params,
                           absl::Span<const float* const> grads, float lr, float weight_decay) {
    DIOND_RETURN_IF_ERROR(kernels::Fill(ctx, 0.0f, update_sq_buf_.view()));
    float* const sq = update_sq_buf_.As<float>();
    internal::BucketArgs args;
    args.config = &config();
    args.count = 1;
    args.scalars = {lr, weight_decay};
    args.step = step_number_;
    args.replica_average = replica_average_;
    for (Bucket& b : buckets_) {
      args.shape = &b.shape;
      args.state.resize(b.specs.size());
      args.state_in.resize(b.specs.size());
      for (size_t slot = 0; slot < b.members.size(); ++slot) {
        const size_t p = b.members[slot];
        if (grads[p] == nullptr) continue;
        args.x = params[p];
        args.x_in.assign(1, params[p]);
        args.g.assign(1, grads[p]);
        args.step_count.assign(1, &step_dev_staged_[p]);
        for (size_t k = 0; k < b.specs.size(); ++k) {
          args.state[k] = b.state[k].As<float>() + slot * b.specs[k].NumElements();
          args.state_in[k].assign(1, args.state[k]);
        }
        args.update_sq = sq + p;
        DIOND_RETURN_IF_ERROR(rule_->Apply(ctx, args));
      }
    }
    in_place_step_ = true;
    return absl::OkStatus();
  }

  absl::Status ReleaseStateImpl(const kernels::Context& ctx,
                                const std::vector<bool>& keep) override {
    const kernels::Device dev = ctx.device();
    // Allocate every smaller buffer first, so that a failure changes nothing.
    std::vector<std::vector<kernels::Buffer>> fresh(buckets_.size());
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      const Bucket& b = buckets_[bi];
      int64_t kept = 0;
      for (size_t p : b.members) kept += keep[p] ? 1 : 0;
      for (size_t k = 0; k < b.specs.size(); ++k) {
        DIOND_ASSIGN_OR_RETURN(kernels::Buffer nb,
                               F32Buffer(alloc_, kept * b.specs[k].NumElements()));
        fresh[bi].push_back(std::move(nb));
      }
    }
    staging_.clear();  // staging buffers were sized for the old buckets
    for (size_t bi = 0; bi < buckets_.size(); ++bi) {
      Bucket& b = buckets_[bi];
      std::vector<size_t> members;
      for (size_t slot = 0; slot < b.members.size(); ++slot) {
        const size_t p = b.members[slot];
        if (!keep[p]) {
          where_[p].second = kReleasedSlot;
          continue;
        }
        for (size_t k = 0; k < b.specs.size(); ++k) {
          const int64_t sn = b.specs[k].NumElements();
          if (sn > 0) {
            // A device copy of valid views: it cannot fail (checked in debug builds).
            absl::Status s = kernels::Copy(
                ctx, F32CView(b.state[k].As<float>() + slot * sn, sn, dev),
                F32View(fresh[bi][k].As<float>() + static_cast<int64_t>(members.size()) * sn, sn,
                        dev));
            assert(s.ok());
            (void)s;
          }
        }
        where_[p].second = members.size();
        members.push_back(p);
      }
      b.members = std::move(members);
      b.state = std::move(fresh[bi]);  // the released rows are freed here
    }
    return absl::OkStatus();
  }

  int64_t StateFloats() const override {
    int64_t n = 0;
    for (const Bucket& b : buckets_) {
      for (const auto& s : b.state) n += s.NumElements();
    }
    return n;
  }

  void StateWritten(size_t param_index, absl::string_view name,
                    absl::Span<const float> values) override {
    if (name == kStateStepDev && param_index < step_dev_host_.size() && values.size() == 1) {
      step_dev_host_[param_index] = values[0];
    }
  }

  float* MutableStatePtr(size_t param_index, absl::string_view name) override {
    if (param_index >= where_.size() || where_[param_index].second == kReleasedSlot) {
      return nullptr;
    }
    Bucket& b = buckets_[where_[param_index].first];
    for (size_t k = 0; k < b.specs.size(); ++k) {
      if (b.specs[k].name == name) {
        return b.state[k].As<float>() + where_[param_index].second * b.specs[k].NumElements();
      }
    }
    return nullptr;
  }

  absl::StatusOr<std::vector<int64_t>> StateShape(size_t param_index,
                                                  absl::string_view name) const override {
    if (param_index >= where_.size()) {
      return absl::OutOfRangeError(absl::StrCat("parameter index ", param_index,
                                                " out of range (group has ", where_.size(), ")"));
    }
    const Bucket& b = buckets_[where_[param_index].first];
    for (const StateSpec& s : b.specs) {
      if (s.name == name) return s.shape;
    }
    return absl::NotFoundError(
        absl::StrCat(AlgorithmName(config().algorithm), " has no state named '", name, "'"));
  }

 private:
  std::unique_ptr<UpdateRule> rule_;
  kernels::Allocator alloc_;
  std::vector<Bucket> buckets_;
  static constexpr size_t kReleasedSlot = static_cast<size_t>(-1);
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, slot or kReleasedSlot)
  // Empties the staging for the next step (its buffers and chunks are kept for reuse).
  void ResetStaging() {
    for (Staged& st : staging_) {
      st.slots.clear();
      st.num_chunks = 0;
    }
  }

  std::vector<Staged> staging_;    // per bucket
  int64_t part_ = 0;               // the StagePart being staged (numbers the chunks)
  internal::StepScalars scalars_;  // of the step being staged
  // In-place rules: Σ(Δx)² per parameter of the step (f32, one per parameter), and whether the
  // last StageStep ran in place.
  kernels::Buffer update_sq_buf_;
  std::vector<float> update_sq_host_;  // its host copy (sized once: steps allocate nothing)
  bool in_place_step_ = false;
  // AdamW's step_dev per parameter, mirrored on the host (the device copy is advanced by an op,
  // this one by the same f32 addition), so that a step reads no counter back: the current
  // values, and those of the step being staged (made current by CommitStagedState).
  std::vector<float> step_dev_host_, step_dev_staged_;
  // The context of the step being staged; CommitStaged runs its copies on it.
  const kernels::Context* commit_ctx_ = nullptr;
};

}  // namespace
}  // namespace internal

namespace {
// The process-wide CPU context of the context-less calls (never destroyed).
const kernels::Context& HostContext() {
  static const kernels::Context* const host = kernels::Context::CpuDefault(1).release();
  return *host;
}
}  // namespace

absl::Status GroupOptimizer::NeedsContext(absl::string_view what) const {
  if (state_device_.type == kernels::DeviceType::kCpu) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(what, ": the optimizer's state is in device memory (device type ",
                   static_cast<int>(state_device_.type), ", index ", state_device_.index,
                   "); pass a Context on that device"));
}

absl::Status GroupOptimizer::CheckContextDevice(const kernels::Context& ctx,
                                                absl::string_view what) const {
  if (ctx.device() == state_device_) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": the context's device (type ", static_cast<int>(ctx.device().type),
                   ", index ", ctx.device().index, ") is not the device of the optimizer's state"));
}

absl::Status GroupOptimizer::ReleaseState(const std::vector<bool>& keep) {
  DIOND_RETURN_IF_ERROR(NeedsContext("ReleaseState"));
  return ReleaseState(HostContext(), keep);
}

absl::Status GroupOptimizer::ReleaseState(const kernels::Context& ctx,
                                          const std::vector<bool>& keep) {
  if (keep.size() != shapes_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("ReleaseState: keep has ", keep.size(),
                                                   " entries for ", shapes_.size(), " parameters"));
  }
  DIOND_RETURN_IF_ERROR(CheckContextDevice(ctx, "ReleaseState"));
  std::vector<bool> now_released = released_;
  if (now_released.empty()) now_released.assign(shapes_.size(), false);
  std::vector<bool> still(keep.size());
  for (size_t i = 0; i < keep.size(); ++i) {
    still[i] = keep[i] && !now_released[i];
    now_released[i] = !still[i];
  }
  DIOND_RETURN_IF_ERROR(ReleaseStateImpl(ctx, still));
  released_ = std::move(now_released);
  return absl::OkStatus();
}

absl::Status GroupOptimizer::GetState(size_t param_index, absl::string_view name,
                                      absl::Span<float> out) const {
  DIOND_RETURN_IF_ERROR(NeedsContext("GetState"));
  return GetState(HostContext(), param_index, name, out);
}

absl::Status GroupOptimizer::GetState(const kernels::Context& ctx, size_t param_index,
                                      absl::string_view name, absl::Span<float> out) const {
  if (StateReleased(param_index)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state '", name, "' of parameter ", param_index, " was released (owned elsewhere)"));
  }
  DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape, StateShape(param_index, name));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (static_cast<int64_t>(out.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("GetState '", name, "' of parameter ",
                                                   param_index, ": buffer has ", out.size(),
                                                   " floats, state has ", n));
  }
  DIOND_RETURN_IF_ERROR(CheckContextDevice(ctx, "GetState"));
  const float* p = const_cast<GroupOptimizer*>(this)->MutableStatePtr(param_index, name);
  // An explicit copy from the state's device (a sync point; a plain copy on the CPU).
  return internal::Download(ctx, p, out.data(), n);
}

absl::Status GroupOptimizer::SetState(size_t param_index, absl::string_view name,
                                      absl::Span<const float> values) {
  DIOND_RETURN_IF_ERROR(NeedsContext("SetState"));
  return SetState(HostContext(), param_index, name, values);
}

absl::Status GroupOptimizer::SetState(const kernels::Context& ctx, size_t param_index,
                                      absl::string_view name, absl::Span<const float> values) {
  if (StateReleased(param_index)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "state '", name, "' of parameter ", param_index, " was released (owned elsewhere)"));
  }
  DIOND_ASSIGN_OR_RETURN(std::vector<int64_t> shape, StateShape(param_index, name));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (static_cast<int64_t>(values.size()) != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetState '", name, "' of parameter ", param_index, ": got ", values.size(),
                     " floats for shape [", absl::StrJoin(shape, ","), "]"));
  }
  DIOND_RETURN_IF_ERROR(CheckContextDevice(ctx, "SetState"));
  float* p = MutableStatePtr(param_index, name);
  // An explicit copy to the state's device (a sync point; a plain copy on the CPU).
  DIOND_RETURN_IF_ERROR(internal::Upload(ctx, values.data(), p, n));
  StateWritten(param_index, name, values);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<GroupOptimizer>> CreateGroupOptimizer(
    const GroupConfig& config, std::vector<ParamShape> shapes) {
  // One process-wide CPU context (never destroyed) lends its allocator to optimizers created
  // without one; its counters are shared by all of them.
  return CreateGroupOptimizer(HostContext(), config, std::move(shapes));
}

absl::StatusOr<std::unique_ptr<GroupOptimizer>> CreateGroupOptimizer(
    const kernels::Context& ctx, const GroupConfig& config, std::vector<ParamShape> shapes) {
  DIOND_RETURN_IF_ERROR(ValidateGroup(config, shapes));
  std::unique_ptr<internal::UpdateRule> rule;
  switch (config.algorithm) {
    case AlgorithmKind::kMuon:
    case AlgorithmKind::kNorMuon:
      rule = internal::MakeMuonRule();
      break;
    case AlgorithmKind::kDion2:
    case AlgorithmKind::kNorDion2:
      rule = internal::MakeDion2Rule();
      break;
    case AlgorithmKind::kDion:
      rule = internal::MakeDionRule();
      break;
    case AlgorithmKind::kAdamW:
    case AlgorithmKind::kLion:
      rule = internal::MakeScalarRule();
      break;
  }
  if (rule == nullptr) return absl::InvalidArgumentError("unknown algorithm");
  auto opt = std::make_unique<internal::BucketedOptimizer>(config, std::move(shapes),
                                                           std::move(rule), ctx.allocator());
  DIOND_RETURN_IF_ERROR(opt->InitStates(ctx));
  return std::unique_ptr<GroupOptimizer>(std::move(opt));
}

int64_t CapturedUpdateSize(const GroupConfig& config, const ParamShape& shape) {
  switch (config.algorithm) {
    case AlgorithmKind::kDion:
      return internal::DionCaptureSize(config, shape);
    case AlgorithmKind::kDion2:
    case AlgorithmKind::kNorDion2:
      return internal::Dion2CaptureSize(config, shape);
    default:
      return 0;
  }
}

absl::Status ApplyCapturedUpdate(const kernels::Context& ctx, const GroupConfig& config,
                                 const ParamShape& shape, const StepOptions& options,
                                 absl::Span<const float> payload, float* x) {
  const int64_t want = CapturedUpdateSize(config, shape);
  if (want == 0 || static_cast<int64_t>(payload.size()) != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        AlgorithmName(config.algorithm), " captured update of ", payload.size(),
        " values; expected ", want, want == 0 ? " (no compact form for this shape)" : ""));
  }
  DIOND_RETURN_IF_ERROR(ValidateStepOptions(options));
  const double lr = options.lr.value_or(config.hyperparams.lr);
  const double wd = options.weight_decay.value_or(config.hyperparams.weight_decay);
  const internal::StepScalars scalars{static_cast<float>(lr), static_cast<float>(wd)};
  if (config.algorithm == AlgorithmKind::kDion) {
    return internal::DionApplyCaptured(ctx, config, shape, scalars, payload.data(), x);
  }
  return internal::Dion2ApplyCaptured(ctx, config, shape, scalars, payload.data(), x);
}

}  // namespace diond::optim
