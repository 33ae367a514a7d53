#include "common/logging.h"

#include <string>
#include <vector>

#include "common/status_matchers.h"
#include "gtest/gtest.h"

namespace diond {
namespace {

std::vector<std::string>* g_lines = nullptr;
void Capture(LogLevel, const std::string& line) { g_lines->push_back(line); }

TEST(Logging, ParsesLevels) {
  EXPECT_EQ(*ParseLogLevel("INFO"), LogLevel::kInfo);
  EXPECT_EQ(*ParseLogLevel("debug"), LogLevel::kDebug);
  EXPECT_EQ(*ParseLogLevel("warning"), LogLevel::kWarning);
  EXPECT_THAT(ParseLogLevel("loud"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("loud")));
}

TEST(Logging, ThresholdFiltersAndLineCarriesLevelAndLocation) {
  std::vector<std::string> lines;
  g_lines = &lines;
  SetLogSinkForTest(&Capture);
  SetMinLogLevel(LogLevel::kWarning);
  int evaluated = 0;
  DIOND_LOG(INFO) << "hidden " << ++evaluated;
  DIOND_LOG(ERROR) << "shown " << 42;
  SetMinLogLevel(LogLevel::kInfo);
  SetLogSinkForTest(nullptr);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(evaluated, 0) << "disabled log statements must not evaluate their operands";
  EXPECT_NE(lines[0].find("ERROR logging_test.cc:"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("shown 42"), std::string::npos);
}

TEST(LoggingDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH({ DIOND_CHECK(1 + 1 == 3) << "math broke"; }, "Check failed: 1 \\+ 1 == 3 math broke");
}

}  // namespace
}  // namespace diond
