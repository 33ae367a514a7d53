#include "common/status_macros.h"

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using ::testing::HasSubstr;

absl::Status FailIf(bool fail) {
  return fail ? absl::InvalidArgumentError("bad value 7") : absl::OkStatus();
}

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::Status Chain(bool fail, int* reached) {
  DIOND_RETURN_IF_ERROR(FailIf(fail));
  *reached = 1;
  return absl::OkStatus();
}

absl::StatusOr<int> Quarter(int x) {
  DIOND_ASSIGN_OR_RETURN(int h, Half(x));
  DIOND_ASSIGN_OR_RETURN(h, Half(h));
  return h;
}

TEST(StatusMacros, ReturnIfErrorStopsAtFirstError) {
  int reached = 0;
  EXPECT_THAT(Chain(true, &reached), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("7")));
  EXPECT_EQ(reached, 0);
  EXPECT_THAT(Chain(false, &reached), IsOk());
  EXPECT_EQ(reached, 1);
}

TEST(StatusMacros, AssignOrReturnPropagatesAndAssigns) {
  EXPECT_EQ(*Quarter(12), 3);
  EXPECT_THAT(Quarter(6), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(Quarter(7), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("odd")));
}

}  // namespace
}  // namespace diond
