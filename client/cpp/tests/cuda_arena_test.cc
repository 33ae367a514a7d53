// GPU-only (ctest label `gpu`; scripts/gpu-check.sh runs it): the C++ client's CudaArena against
// a real daemon on the GPU (--device=cuda:0 with the CUDA plugin). For each export kind (legacy
// IPC handle, VMM fd over the fd channel) one session steps through a CudaArena and a twin
// session through a ShmArena, with the same weights and the same gradients at every step; the
// weights the daemon writes into the device arena must equal those it writes into shm, bit for
// bit, and so must the update norms. Both sessions run on the same GPU with the same rules, so
// the only difference is the data plane: device memory mapped from the trainer against host
// memory copied to and from the device.
// Skips cleanly (GTEST_SKIP) where the CUDA runtime sees no GPU, as on the CI machines.
#include "diond/cuda_arena.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/cpp/tests/test_daemon.h"
#include "diond/client.h"
#include "diond/shm_arena.h"
#include "gtest/gtest.h"

namespace diond::client {
namespace {

std::vector<ParamSpec> Params() {
  return {{"w", {96, 64}, DType::kF32, "matrices"},
          {"v", {64, 160}, DType::kF32, "matrices"},
          {"b", {96}, DType::kF32, "vectors"}};
}

std::vector<GroupSpec> Groups(Algorithm matrices) {
  GroupSpec m{"matrices", matrices, {}};
  m.hyperparams.lr = 0.02;
  m.hyperparams.weight_decay = 0.01;
  GroupSpec a{"vectors", Algorithm::kAdamW, {}};
  a.hyperparams.lr = 0.01;
  return {m, a};
}

// Deterministic values that differ per tensor, step and element (no RNG to keep in sync).
std::vector<float> Values(size_t n, uint32_t seed, float scale) {
  std::vector<float> v(n);
  uint32_t s = seed * 2654435761u + 12345u;
  for (size_t i = 0; i < n; ++i) {
    s = s * 1664525u + 1013904223u;
    v[i] = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
  }
  return v;
}

bool GpuPresent(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);
    return false;
  }
  if (n == 0) *why = "the CUDA runtime sees no device";
  return n > 0;
}

class CudaArenaTest : public ::testing::TestWithParam<std::tuple<CudaArena::Export, Algorithm>> {
 protected:
  void SetUp() override {
    std::string why;
    if (!GpuPresent(&why)) GTEST_SKIP() << "no GPU here: " << why;
    auto d = testing::StartTestDaemon(
        DIOND_BINARY, {"--device=cuda:0", absl::StrCat("--cuda_plugin=", DIOND_CUDA_PLUGIN)});
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = std::move(*d);
    auto c = Client::Connect(daemon_->target);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }
  void TearDown() override {
    client_.reset();
    if (daemon_ != nullptr) {
      EXPECT_EQ(daemon_->Stop(), 0) << daemon_->proc->Log();
    }
  }

  std::unique_ptr<testing::TestDaemon> daemon_;
  std::unique_ptr<Client> client_;
};

TEST_P(CudaArenaTest, StepsEqualAShmSessionBitForBit) {
  const auto [kind, algorithm] = GetParam();
  auto shm_layout = client_->CreateSession(Params(), Groups(algorithm));
  ASSERT_TRUE(shm_layout.ok()) << shm_layout.status();
  auto gpu_layout = client_->CreateSession(Params(), Groups(algorithm));
  ASSERT_TRUE(gpu_layout.ok()) << gpu_layout.status();
  auto shm = ShmArena::Create(client_.get(), *shm_layout);
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto gpu = CudaArena::Create(client_.get(), *gpu_layout, /*device=*/0, kind);
  ASSERT_TRUE(gpu.ok()) << gpu.status() << "\n" << daemon_->proc->Log();

  // The same initial weights in both sessions (uploaded, as the shm test of client_daemon_test
  // does), and in both arenas.
  std::vector<ConstTensorRef> init;
  std::vector<std::vector<float>> w0;
  for (const ParamSpec& p : Params()) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    w0.push_back(Values(static_cast<size_t>(n), static_cast<uint32_t>(w0.size() + 1), 0.2f));
  }
  for (size_t i = 0; i < w0.size(); ++i) {
    init.push_back(ConstTensorRef::F32(Params()[i].name, w0[i]));
  }
  ASSERT_TRUE(client_->SetState(shm_layout->session_id, init).ok());
  ASSERT_TRUE(client_->SetState(gpu_layout->session_id, init).ok());
  for (size_t i = 0; i < w0.size(); ++i) {
    const std::string& name = Params()[i].name;
    auto hp = shm->Param(name);
    auto dp = gpu->Param(name);
    ASSERT_TRUE(hp.ok() && dp.ok());
    std::memcpy(hp->data(), w0[i].data(), w0[i].size() * 4);
    ASSERT_EQ(cudaMemcpy(*dp, w0[i].data(), w0[i].size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  }

  for (int64_t step = 1; step <= 4; ++step) {
    for (size_t i = 0; i < w0.size(); ++i) {
      const std::string& name = Params()[i].name;
      const std::vector<float> g =
          Values(w0[i].size(), static_cast<uint32_t>(100 * step + i), 1.0f);
      auto hg = shm->Grad(name);
      auto dg = gpu->Grad(name);
      ASSERT_TRUE(hg.ok() && dg.ok());
      std::memcpy(hg->data(), g.data(), g.size() * 4);
      ASSERT_EQ(cudaMemcpy(*dg, g.data(), g.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    }
    auto a = client_->Step(shm_layout->session_id, step);
    ASSERT_TRUE(a.ok()) << a.status();
    auto b = client_->Step(gpu_layout->session_id, step);
    ASSERT_TRUE(b.ok()) << b.status() << "\n" << daemon_->proc->Log();
    EXPECT_FALSE(b->skipped);
    EXPECT_EQ(a->update_norms, b->update_norms) << "step " << step;
    for (size_t i = 0; i < w0.size(); ++i) {
      const std::string& name = Params()[i].name;
      auto hp = shm->Param(name);
      auto dp = gpu->Param(name);
      ASSERT_TRUE(hp.ok() && dp.ok());
      std::vector<float> got(w0[i].size());
      ASSERT_EQ(cudaMemcpy(got.data(), *dp, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(std::memcmp(got.data(), hp->data(), got.size() * 4), 0)
          << "'" << name << "' differs after step " << step;
      // And the step moved it (the comparison is not between two untouched copies).
      if (step == 1) {
        EXPECT_NE(std::memcmp(got.data(), w0[i].data(), got.size() * 4), 0) << name;
      }
    }
  }
  gpu->Reset();
  EXPECT_TRUE(client_->CloseSession(gpu_layout->session_id).ok());
  EXPECT_TRUE(client_->CloseSession(shm_layout->session_id).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Kinds, CudaArenaTest,
    ::testing::Combine(::testing::Values(CudaArena::Export::kLegacyIpc, CudaArena::Export::kVmmFd),
                       ::testing::Values(Algorithm::kMuon, Algorithm::kDion)),
    [](const auto& info) {
      return absl::StrCat(std::get<0>(info.param) == CudaArena::Export::kLegacyIpc ? "Ipc" : "Vmm",
                          std::get<1>(info.param) == Algorithm::kMuon ? "_Muon" : "_Dion");
    });

}  // namespace
}  // namespace diond::client
