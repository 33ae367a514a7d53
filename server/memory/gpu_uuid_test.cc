// MapGpuUuid against fake device lists: a daemon whose CUDA_VISIBLE_DEVICES renumbered the GPUs
// (the trainer's UUID is found at another index), a daemon that cannot see the trainer's GPU,
// and one with no GPU at all.
#include "server/memory/gpu_uuid.h"

#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond::memory {
namespace {

using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

GpuUuid Uuid(uint8_t seed) {
  GpuUuid u{};
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(seed * 16 + i);
  return u;
}

TEST(GpuUuid, FormatsAsNvidiaSmiDoes) {
  GpuUuid u{};
  for (size_t i = 0; i < u.size(); ++i) u[i] = static_cast<uint8_t>(0xa0 + i);
  EXPECT_EQ(FormatGpuUuid(u), "GPU-a0a1a2a3-a4a5-a6a7-a8a9-aaabacadaeaf");
}

TEST(GpuUuid, ParseNeedsSixteenBytes) {
  EXPECT_THAT(ParseGpuUuid(std::string(15, 'x'), "cuda_ipc.gpu_uuid").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("cuda_ipc.gpu_uuid must be the 16 bytes")));
  auto u = ParseGpuUuid(std::string(16, '\x01'), "f");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ((*u)[15], 1);
}

TEST(GpuUuid, MapsByUuidNotByIndex) {
  // The trainer sees GPU 3 of the host as its cuda:0; the daemon, with other visible devices,
  // sees the same GPU as its cuda:1.
  const std::vector<GpuDevice> daemon = {{0, Uuid(2)}, {1, Uuid(3)}};
  auto index = MapGpuUuid(Uuid(3), daemon);
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(*index, 1);
  EXPECT_EQ(*MapGpuUuid(Uuid(2), daemon), 0);
}

TEST(GpuUuid, UnknownUuidNamesBothSides) {
  const std::vector<GpuDevice> daemon = {{0, Uuid(2)}, {1, Uuid(3)}};
  auto r = MapGpuUuid(Uuid(5), daemon);
  EXPECT_THAT(r.status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(FormatGpuUuid(Uuid(5)))));
  EXPECT_THAT(r.status().message(), HasSubstr("cuda:0 " + FormatGpuUuid(Uuid(2))));
  EXPECT_THAT(r.status().message(), HasSubstr("cuda:1 " + FormatGpuUuid(Uuid(3))));
  EXPECT_THAT(MapGpuUuid(Uuid(5), {}).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("sees no GPU")));
}

}  // namespace
}  // namespace diond::memory
