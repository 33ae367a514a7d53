#include "common/logging.h"

#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

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

TEST(Logging, JsonFormatIsOneObjectPerLineWithContext) {
  EXPECT_EQ(*ParseLogFormat("JSON"), LogFormat::kJson);
  EXPECT_EQ(*ParseLogFormat("text"), LogFormat::kText);
  EXPECT_THAT(ParseLogFormat("xml"),
              testing::StatusIs(absl::StatusCode::kInvalidArgument, ::testing::HasSubstr("xml")));
  std::vector<std::string> lines;
  g_lines = &lines;
  SetLogSinkForTest(&Capture);
  SetLogFormat(LogFormat::kJson);
  DIOND_LOG(WARNING) << "outside";
  {
    ScopedLogContext outer("s-outer");
    {
      ScopedLogContext inner("s-inner", 7);
      DIOND_LOG(INFO) << "two\nlines \"quoted\" \xff";
      ScopedLogContext same("s-inner");  // same session, no step: keeps step 7
      DIOND_LOG(INFO) << "nested";
    }
    DIOND_LOG(ERROR) << "back";
  }
  SetLogFormat(LogFormat::kText);
  SetLogSinkForTest(nullptr);
  ASSERT_EQ(lines.size(), 4u);
  std::vector<nlohmann::json> j;
  for (const std::string& l : lines) {
    EXPECT_EQ(l.find('\n'), std::string::npos) << l;
    j.push_back(nlohmann::json::parse(l));
  }
  EXPECT_EQ(j[0]["level"], "WARNING");
  EXPECT_TRUE(j[0]["session"].is_null());
  EXPECT_TRUE(j[0]["step"].is_null());
  EXPECT_EQ(j[0]["message"], "outside");
  EXPECT_EQ(j[1]["session"], "s-inner");
  EXPECT_EQ(j[1]["step"], 7);
  EXPECT_EQ(j[1]["message"], "two\nlines \"quoted\" \xef\xbf\xbd");  // invalid byte replaced
  EXPECT_EQ(j[2]["session"], "s-inner");
  EXPECT_EQ(j[2]["step"], 7);
  EXPECT_EQ(j[3]["session"], "s-outer");
  EXPECT_TRUE(j[3]["step"].is_null());
  EXPECT_EQ(j[3]["level"], "ERROR");
  // time is RFC 3339 UTC with milliseconds; source is file:line.
  absl::Time t;
  std::string err;
  EXPECT_TRUE(absl::ParseTime("%Y-%m-%dT%H:%M:%E3SZ", j[1]["time"].get<std::string>(), &t, &err))
      << j[1]["time"] << ": " << err;
  EXPECT_NE(j[1]["source"].get<std::string>().find("logging_test.cc:"), std::string::npos);
}

TEST(LoggingDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH({ DIOND_CHECK(1 + 1 == 3) << "math broke"; },
               "Check failed: 1 \\+ 1 == 3 math broke");
}

}  // namespace
}  // namespace diond
