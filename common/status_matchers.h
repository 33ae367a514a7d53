// GoogleMock matchers for absl::Status and absl::StatusOr (STYLE.md E4):
//   EXPECT_THAT(s, IsOk());  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument));
//   EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("lr")));
#ifndef DIOND_COMMON_STATUS_MATCHERS_H_
#define DIOND_COMMON_STATUS_MATCHERS_H_

#include <ostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gmock/gmock.h"

namespace diond::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const absl::Status& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s;
  return s.ok();
}

MATCHER_P(StatusIs, code, "has code " + ::testing::PrintToString(code)) {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher, "has code and message") {
  const absl::Status& s = GetStatus(arg);
  *result_listener << "status is " << s;
  return s.code() == code && ::testing::Matches(message_matcher)(std::string(s.message()));
}

}  // namespace diond::testing

#endif  // DIOND_COMMON_STATUS_MATCHERS_H_
