// The checkpoint codec writes and reads every row of the option table (kernels/optim/
// options.def) with nothing else to write, and manifests without the options added later load
// with their defaults; a value outside its range is damage.
#include <string>

#include "common/status_matchers.h"
#include "common/strict_json.h"
#include "gtest/gtest.h"
#include "kernels/optim/option_table.h"
#include "kernels/optim/testing/option_values.h"
#include "server/checkpoint/manifest.h"

namespace diond::checkpoint {
namespace {

using ::diond::testing::IsOk;

session::SessionSpec OneGroup(optim::AlgorithmKind k) {
  session::SessionSpec spec;
  session::GroupSpec g;
  g.name = "g";
  g.config.algorithm = k;
  g.config.hyperparams = optim::DefaultHyperparams(k);
  spec.groups.push_back(g);
  spec.params.push_back({"w", {4, 4}, session::DType::kF32, "g"});
  return spec;
}

using optim::testing::NonDefault;

TEST(SpecCodec, EveryOptionRoundTrips) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    for (optim::AlgorithmKind k : optim::kAllAlgorithmKinds) {
      session::SessionSpec spec = OneGroup(k);
      optim::Hyperparams& h = spec.groups[0].config.hyperparams;
      row.set(h, NonDefault(row));
      const std::string text = SpecToJson(spec);
      EXPECT_NE(text.find("\"" + std::string(row.member) + "\""), std::string::npos) << text;
      absl::StatusOr<session::SessionSpec> back = SpecFromJson(text);
      ASSERT_THAT(back.status(), IsOk()) << row.name << "\n" << text;
      for (const optim::OptionRow& other : optim::OptionTable()) {
        EXPECT_EQ(other.get(back->groups[0].config.hyperparams), other.get(h))
            << "setting " << row.name << ": " << other.name;
      }
    }
  }
}

TEST(SpecCodec, OptionsAddedLaterMayBeAbsent) {
  session::SessionSpec spec = OneGroup(optim::AlgorithmKind::kDion);
  for (const optim::OptionRow& row : optim::OptionTable()) {
    row.set(spec.groups[0].config.hyperparams, NonDefault(row));
  }
  for (const optim::OptionRow& row : optim::OptionTable()) {
    strict_json::Json j = strict_json::Json::parse(SpecToJson(spec));
    j["groups"][0].erase(std::string(row.member));
    absl::StatusOr<session::SessionSpec> back = SpecFromJson(j.dump());
    if (row.since == optim::OptionSince::kFirst) {
      EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss) << row.name;
      EXPECT_NE(back.status().message().find(std::string(row.member) + ": missing"),
                std::string::npos)
          << back.status();
      continue;
    }
    ASSERT_THAT(back.status(), IsOk()) << row.name;
    EXPECT_EQ(row.get(back->groups[0].config.hyperparams), row.Default(optim::AlgorithmKind::kDion))
        << row.name;
  }
}

// A manifest's value outside its row's range is damage (DATA_LOSS naming the key) for an algorithm
// that reads the option; an algorithm that ignores it loads it as written, as CreateSession
// accepted it.
TEST(SpecCodec, AnOutOfRangeOptionIsDataLossWhereItIsRead) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    if (row.type != optim::OptionType::kDouble) continue;
    const double below = row.range.lo - 1;
    for (optim::AlgorithmKind k : optim::kAllAlgorithmKinds) {
      strict_json::Json j = strict_json::Json::parse(SpecToJson(OneGroup(k)));
      j["groups"][0][std::string(row.member)] = below;
      absl::StatusOr<session::SessionSpec> back = SpecFromJson(j.dump());
      if (row.AppliesTo(k)) {
        EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss)
            << row.name << " " << optim::AlgorithmName(k);
        EXPECT_NE(back.status().message().find(std::string(row.member)), std::string::npos)
            << back.status();
      } else if (row.elsewhere == optim::OptionElsewhere::kIgnored) {
        EXPECT_THAT(back.status(), IsOk()) << row.name << " " << optim::AlgorithmName(k);
      }
    }
  }
}

}  // namespace
}  // namespace diond::checkpoint
