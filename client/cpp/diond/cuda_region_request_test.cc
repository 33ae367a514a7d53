// CudaArena's non-CUDA logic (cuda_region_request.h): the arena plan and the RegisterRegion
// requests, checked field by field; the requests are then validated by the daemon's own rules
// (server/rpc RegisterRegion), so they must carry exactly what the proto says.
#include "diond/cuda_region_request.h"

#include <vector>

#include "gtest/gtest.h"

namespace diond::client {
namespace {

Layout L(int64_t params, int64_t grads) {
  Layout l;
  l.session_id = "s-1";
  l.param_arena_bytes = params;
  l.grad_arena_bytes = grads;
  l.alignment_bytes = 256;
  return l;
}

TEST(CudaArenaPlan, GradientsFollowAt256AndTheWholeRoundsToTheGranularity) {
  auto p = PlanCudaArena(L(1000, 500), 1);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->param_offset, 0);
  EXPECT_EQ(p->grad_offset, 1024);
  EXPECT_EQ(p->bytes, 1524);
  p = PlanCudaArena(L(1000, 500), 2 << 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->bytes, 2 << 20);
  p = PlanCudaArena(L(3 << 20, 1 << 20), 2 << 20);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->grad_offset, 3 << 20);
  EXPECT_EQ(p->bytes, 4 << 20);
  EXPECT_FALSE(PlanCudaArena(L(1000, 500), 3).ok());
  EXPECT_FALSE(PlanCudaArena(L(1000, 500), 0).ok());
  EXPECT_FALSE(PlanCudaArena(L(0, 500), 1).ok());
}

TEST(CudaRegionRequest, IpcRequestCarriesTheHandleUuidAndRange) {
  std::vector<uint8_t> handle(64), uuid(16);
  for (size_t i = 0; i < handle.size(); ++i) handle[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < uuid.size(); ++i) uuid[i] = static_cast<uint8_t>(255 - i);
  auto r = CudaIpcRegionRequest("s-1", v1::REGION_ROLE_GRADIENTS, handle, uuid, 1024, 500);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->session_id(), "s-1");
  EXPECT_EQ(r->role(), v1::REGION_ROLE_GRADIENTS);
  EXPECT_EQ(r->kind(), v1::REGION_KIND_CUDA_IPC);
  ASSERT_TRUE(r->has_cuda_ipc());
  EXPECT_EQ(r->cuda_ipc().mem_handle(), std::string(handle.begin(), handle.end()));
  EXPECT_EQ(r->cuda_ipc().gpu_uuid(), std::string(uuid.begin(), uuid.end()));
  EXPECT_EQ(r->cuda_ipc().offset_bytes(), 1024);
  EXPECT_EQ(r->cuda_ipc().size_bytes(), 500);
  // Round trip through the wire format.
  v1::RegisterRegionRequest back;
  ASSERT_TRUE(back.ParseFromString(r->SerializeAsString()));
  EXPECT_EQ(back.cuda_ipc().mem_handle(), r->cuda_ipc().mem_handle());
  // Bad sizes and ranges.
  EXPECT_FALSE(
      CudaIpcRegionRequest("s", v1::REGION_ROLE_PARAMETERS, std::vector<uint8_t>(63), uuid, 0, 1)
          .ok());
  EXPECT_FALSE(
      CudaIpcRegionRequest("s", v1::REGION_ROLE_PARAMETERS, handle, std::vector<uint8_t>(15), 0, 1)
          .ok());
  EXPECT_FALSE(CudaIpcRegionRequest("s", v1::REGION_ROLE_PARAMETERS, handle, uuid, 100, 1).ok());
  EXPECT_FALSE(CudaIpcRegionRequest("s", v1::REGION_ROLE_PARAMETERS, handle, uuid, 0, 0).ok());
}

TEST(CudaRegionRequest, VmmRequestCarriesTheTokenAndGranularity) {
  std::vector<uint8_t> uuid(16, 9);
  auto r = CudaVmmRegionRequest("s-2", v1::REGION_ROLE_PARAMETERS, "tok", uuid, 0, 4096, 2 << 20);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->kind(), v1::REGION_KIND_CUDA_VMM_FD);
  EXPECT_EQ(r->cuda_vmm_fd().fd_token(), "tok");
  EXPECT_EQ(r->cuda_vmm_fd().granularity_bytes(), 2 << 20);
  EXPECT_EQ(r->cuda_vmm_fd().size_bytes(), 4096);
  EXPECT_EQ(r->cuda_vmm_fd().gpu_uuid(), std::string(16, '\x09'));
  EXPECT_FALSE(CudaVmmRegionRequest("s", v1::REGION_ROLE_PARAMETERS, "", uuid, 0, 1, 1).ok());
  EXPECT_FALSE(CudaVmmRegionRequest("s", v1::REGION_ROLE_PARAMETERS, "t", uuid, 0, 1, 6).ok());
}

}  // namespace
}  // namespace diond::client
