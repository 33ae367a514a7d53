#include "server/rpc/status_conversion.h"

#include "gtest/gtest.h"

namespace diond::rpc {
namespace {

TEST(StatusConversion, EveryCodeMapsOneToOneBothWays) {
  for (int c = 0; c <= 16; ++c) {
    absl::Status s(static_cast<absl::StatusCode>(c), c == 0 ? "" : "msg " + std::to_string(c));
    grpc::Status g = ToGrpcStatus(s);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    if (c != 0) {
      EXPECT_EQ(g.error_message(), "msg " + std::to_string(c));
    }
    EXPECT_EQ(FromGrpcStatus(g), s);
  }
}

}  // namespace
}  // namespace diond::rpc
