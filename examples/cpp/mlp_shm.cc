// Example: a trainer that uses diond over shared memory.
//
// A 2-layer MLP (16 -> 64 tanh -> 4) learns to imitate a fixed random "teacher" MLP on 256
// synthetic samples, with a hand-written forward and backward pass. The weights and gradients
// live in POSIX shm arenas shared with the daemon (diond::client::ShmArena): backward writes the
// gradients in place, Step makes the daemon update the weights in place. Muon updates the two
// weight matrices, AdamW the two biases (two parameter groups).
//
//   diond --listen=unix:/tmp/d.sock --device=cpu &
//   diond_example_mlp --target=unix:/tmp/d.sock --steps=200
//
// Prints "step N loss L" every --print_every steps and, last, "initial_loss A final_loss B".
// Exit status: 0 on success, 1 when a call fails (the daemon's message is printed).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "diond/client.h"
#include "diond/shm_arena.h"

ABSL_FLAG(std::string, target, "", "Daemon address: unix:PATH or HOST:PORT (required).");
ABSL_FLAG(int, steps, 200, "Training steps.");
ABSL_FLAG(int, print_every, 10, "Print the loss every N steps.");
ABSL_FLAG(double, muon_lr, 0.05, "Learning rate of the Muon group (weight matrices).");
ABSL_FLAG(double, adamw_lr, 0.01, "Learning rate of the AdamW group (biases).");
ABSL_FLAG(bool, two_segments, false, "One shm segment per arena instead of one for both.");

namespace {

namespace dc = diond::client;

constexpr int64_t kIn = 16, kHidden = 64, kOut = 4, kSamples = 256;

// Views of the four tensors of an MLP (the student's live in shm, the teacher's on the heap).
struct Mlp {
  absl::Span<float> w1, b1, w2, b2;  // w1: [kHidden, kIn], w2: [kOut, kHidden], row-major
};

struct Data {
  std::vector<float> x;  // [kSamples, kIn]
  std::vector<float> y;  // [kSamples, kOut]
};

void Fill(absl::Span<float> v, std::mt19937* rng, float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  for (float& e : v) e = dist(*rng);
}

// Hidden activations and outputs of one sample.
void Forward(const Mlp& m, const float* x, float* h, float* out) {
  for (int j = 0; j < kHidden; ++j) {
    float s = m.b1[j];
    for (int i = 0; i < kIn; ++i) s += m.w1[j * kIn + i] * x[i];
    h[j] = std::tanh(s);
  }
  for (int k = 0; k < kOut; ++k) {
    float s = m.b2[k];
    for (int j = 0; j < kHidden; ++j) s += m.w2[k * kHidden + j] * h[j];
    out[k] = s;
  }
}

// Mean squared error over all samples and outputs. With `grads` set, also writes its gradient
// (overwriting, not accumulating: the arena still holds the previous step's).
float LossAndGrad(const Mlp& m, const Data& d, const Mlp* grads) {
  if (grads != nullptr) {
    for (absl::Span<float> g : {grads->w1, grads->b1, grads->w2, grads->b2}) {
      std::fill(g.begin(), g.end(), 0.0f);
    }
  }
  const float scale = 1.0f / (kSamples * kOut);
  double loss = 0;
  float h[kHidden], out[kOut], dout[kOut], dh[kHidden];
  for (int n = 0; n < kSamples; ++n) {
    const float* x = &d.x[n * kIn];
    Forward(m, x, h, out);
    for (int k = 0; k < kOut; ++k) {
      const float err = out[k] - d.y[n * kOut + k];
      loss += static_cast<double>(err) * err;
      dout[k] = 2.0f * err * scale;
    }
    if (grads == nullptr) continue;
    for (int j = 0; j < kHidden; ++j) dh[j] = 0.0f;
    for (int k = 0; k < kOut; ++k) {
      grads->b2[k] += dout[k];
      for (int j = 0; j < kHidden; ++j) {
        grads->w2[k * kHidden + j] += dout[k] * h[j];
        dh[j] += m.w2[k * kHidden + j] * dout[k];
      }
    }
    for (int j = 0; j < kHidden; ++j) {
      const float dpre = dh[j] * (1.0f - h[j] * h[j]);  // tanh' = 1 - tanh^2
      grads->b1[j] += dpre;
      for (int i = 0; i < kIn; ++i) grads->w1[j * kIn + i] += dpre * x[i];
    }
  }
  return static_cast<float>(loss * scale);
}

absl::Status Train() {
  const std::string target = absl::GetFlag(FLAGS_target);
  if (target.empty()) return absl::InvalidArgumentError("--target is required");
  auto client = dc::Client::Connect(target);
  if (!client.ok()) return client.status();

  dc::GroupSpec muon{"matrices", dc::Algorithm::kMuon, {}};
  muon.hyperparams.lr = absl::GetFlag(FLAGS_muon_lr);
  muon.hyperparams.weight_decay = 0.0;
  muon.hyperparams.nesterov = true;
  dc::GroupSpec adamw{"biases", dc::Algorithm::kAdamW, {}};
  adamw.hyperparams.lr = absl::GetFlag(FLAGS_adamw_lr);
  adamw.hyperparams.weight_decay = 0.0;
  std::vector<dc::ParamSpec> params = {
      {"w1", {kHidden, kIn}, dc::DType::kF32, "matrices"},
      {"b1", {kHidden}, dc::DType::kF32, "biases"},
      {"w2", {kOut, kHidden}, dc::DType::kF32, "matrices"},
      {"b2", {kOut}, dc::DType::kF32, "biases"},
  };
  auto layout = (*client)->CreateSession(params, {muon, adamw}, {"example-mlp-shm"});
  if (!layout.ok()) return layout.status();
  std::printf("session %s: %zu parameters, arenas %lld + %lld bytes\n", layout->session_id.c_str(),
              layout->tensors.size(), static_cast<long long>(layout->param_arena_bytes),
              static_cast<long long>(layout->grad_arena_bytes));

  absl::Status status = [&]() -> absl::Status {
    auto arena = dc::ShmArena::Create(client->get(), *layout, {!absl::GetFlag(FLAGS_two_segments)});
    if (!arena.ok()) return arena.status();
    Mlp student, grads;
    for (auto [name, dst, gdst] : {std::make_tuple("w1", &student.w1, &grads.w1),
                                   std::make_tuple("b1", &student.b1, &grads.b1),
                                   std::make_tuple("w2", &student.w2, &grads.w2),
                                   std::make_tuple("b2", &student.b2, &grads.b2)}) {
      auto p = arena->Param(name);
      auto g = arena->Grad(name);
      if (!p.ok()) return p.status();
      if (!g.ok()) return g.status();
      *dst = *p;
      *gdst = *g;
    }

    // Teacher and data from a fixed seed; the student starts from another.
    std::mt19937 rng(1234);
    std::vector<float> tw1(kHidden * kIn), tb1(kHidden), tw2(kOut * kHidden), tb2(kOut);
    Mlp teacher{absl::MakeSpan(tw1), absl::MakeSpan(tb1), absl::MakeSpan(tw2), absl::MakeSpan(tb2)};
    Fill(teacher.w1, &rng, 2.0f / std::sqrt(static_cast<float>(kIn)));
    Fill(teacher.b1, &rng, 0.5f);
    Fill(teacher.w2, &rng, 2.0f / std::sqrt(static_cast<float>(kHidden)));
    Fill(teacher.b2, &rng, 0.5f);
    Data data;
    data.x.resize(kSamples * kIn);
    data.y.resize(kSamples * kOut);
    Fill(absl::MakeSpan(data.x), &rng, 1.0f);
    float h[kHidden];
    for (int n = 0; n < kSamples; ++n) Forward(teacher, &data.x[n * kIn], h, &data.y[n * kOut]);
    Fill(student.w1, &rng, 0.5f / std::sqrt(static_cast<float>(kIn)));
    Fill(student.w2, &rng, 0.5f / std::sqrt(static_cast<float>(kHidden)));
    std::fill(student.b1.begin(), student.b1.end(), 0.0f);
    std::fill(student.b2.begin(), student.b2.end(), 0.0f);

    const int steps = absl::GetFlag(FLAGS_steps);
    const int print_every = std::max(1, absl::GetFlag(FLAGS_print_every));
    float initial = 0, loss = 0;
    for (int step = 1; step <= steps; ++step) {
      loss = LossAndGrad(student, data, &grads);  // gradients straight into shm
      if (step == 1) initial = loss;
      if (step == 1 || step % print_every == 0) std::printf("step %d loss %.6f\n", step, loss);
      auto r = (*client)->Step(layout->session_id, step);  // weights updated in shm
      if (!r.ok()) return r.status();
      if (r->skipped) std::printf("step %d skipped (non-finite gradients)\n", step);
    }
    const float final_loss = LossAndGrad(student, data, nullptr);
    std::printf("initial_loss %.6f final_loss %.6f\n", initial, final_loss);
    std::fflush(stdout);
    return absl::OkStatus();
  }();
  // The arena is gone (unregistered, unmapped, unlinked); close the session either way.
  absl::Status closed = (*client)->CloseSession(layout->session_id);
  if (!status.ok()) return status;
  return closed;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::Status s = Train();
  if (!s.ok()) {
    std::fprintf(stderr, "diond_example_mlp: %s\n", s.ToString().c_str());
    return 1;
  }
  return 0;
}
