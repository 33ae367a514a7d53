// The option table (kernels/optim/options.def), the proto's Hyperparameters message and the
// rows DescribeOptions serves agree, and every row converts both ways with nothing else to
// write: a field added to the proto without its row fails here.
#include "server/rpc/option_schema.h"

#include <set>
#include <string>

#include "common/status_matchers.h"
#include "gtest/gtest.h"
#include "kernels/optim/option_table.h"
#include "kernels/optim/testing/option_values.h"
#include "server/rpc/convert.h"

namespace diond::rpc {
namespace {

using ::diond::testing::IsOk;
using ::diond::testing::StatusIs;
using google::protobuf::FieldDescriptor;

FieldDescriptor::CppType WantCppType(optim::OptionType t) {
  switch (t) {
    case optim::OptionType::kDouble:
      return FieldDescriptor::CPPTYPE_DOUBLE;
    case optim::OptionType::kInt:
      return FieldDescriptor::CPPTYPE_INT64;
    case optim::OptionType::kBool:
      return FieldDescriptor::CPPTYPE_BOOL;
    case optim::OptionType::kEnum:
      return FieldDescriptor::CPPTYPE_ENUM;
  }
  return FieldDescriptor::CPPTYPE_STRING;
}

TEST(OptionTable, EveryFieldHasItsRowInFieldOrder) {
  const google::protobuf::Descriptor* d = v1::Hyperparameters::descriptor();
  const auto rows = optim::OptionTable();
  ASSERT_EQ(static_cast<size_t>(d->field_count()), rows.size())
      << "every field of diond.v1.Hyperparameters needs one row in kernels/optim/options.def";
  std::set<std::string> members;
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    const optim::OptionRow& row = rows[i];
    EXPECT_EQ(f->name(), row.name) << "row " << i << " is not the field in that place";
    EXPECT_EQ(f->cpp_type(), WantCppType(row.type)) << f->name();
    EXPECT_TRUE(members.insert(std::string(row.member)).second) << row.member;
    if (row.type == optim::OptionType::kEnum) {
      // Value i of the domain enum is proto number i + 1; 0 is UNSPECIFIED.
      ASSERT_EQ(f->enum_type()->value_count(), static_cast<int>(row.enum_names.size()) + 1)
          << f->name();
      for (int v = 0; v <= static_cast<int>(row.enum_names.size()); ++v) {
        EXPECT_NE(f->enum_type()->FindValueByNumber(v), nullptr) << f->name() << " " << v;
      }
    } else {
      EXPECT_TRUE(f->has_presence()) << f->name() << " must be optional: unset = the default";
    }
    EXPECT_NE(row.algorithms, 0u) << row.name;
    EXPECT_EQ(row.range.any,
              row.type == optim::OptionType::kBool || row.type == optim::OptionType::kEnum)
        << row.name;
    EXPECT_EQ(optim::FindOption(row.name), &row);
  }
}

using optim::testing::NonDefault;

TEST(OptionTable, EveryRowRoundTripsThroughTheProto) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    const optim::OptionValue want = NonDefault(row);
    ASSERT_NE(want, row.Default(optim::AlgorithmKind::kMuon)) << row.name;
    ASSERT_THAT(row.CheckRange(want), IsOk()) << row.name << " = " << row.Format(want);
    optim::Hyperparams h = optim::DefaultHyperparams(optim::AlgorithmKind::kMuon);
    row.set(h, want);
    v1::Hyperparameters m;
    HyperparametersToProto(h, &m);
    optim::Hyperparams back = optim::DefaultHyperparams(optim::AlgorithmKind::kAdamW);
    ASSERT_THAT(ApplyHyperparameters(m, &back), IsOk()) << row.name;
    for (const optim::OptionRow& other : optim::OptionTable()) {
      EXPECT_EQ(other.get(back), other.get(h)) << "setting " << row.name << ": " << other.name;
    }
  }
}

TEST(OptionTable, AnUnsetMessageChangesNothing) {
  optim::Hyperparams h = optim::DefaultHyperparams(optim::AlgorithmKind::kDion);
  for (const optim::OptionRow& row : optim::OptionTable()) row.set(h, NonDefault(row));
  const optim::Hyperparams before = h;
  ASSERT_THAT(ApplyHyperparameters(v1::Hyperparameters(), &h), IsOk());
  for (const optim::OptionRow& row : optim::OptionTable()) {
    EXPECT_EQ(row.get(h), row.get(before)) << row.name;
  }
}

TEST(OptionTable, UnknownEnumNumbersAreRefusedByName) {
  for (const optim::OptionRow& row : optim::OptionTable()) {
    if (row.type != optim::OptionType::kEnum) continue;
    v1::Hyperparameters m;
    const FieldDescriptor* f = m.GetDescriptor()->FindFieldByName(std::string(row.name));
    m.GetReflection()->SetEnumValue(&m, f, 99);
    optim::Hyperparams h;
    EXPECT_THAT(ApplyHyperparameters(m, &h),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         ::testing::HasSubstr(std::string(row.name) + " 99 is unknown")));
  }
}

TEST(DescribeOptions, ServesTheTable) {
  v1::DescribeOptionsResponse r;
  DescribeOptionsToProto(&r);
  const auto rows = optim::OptionTable();
  ASSERT_EQ(static_cast<size_t>(r.options_size()), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const v1::OptionDescription& d = r.options(static_cast<int>(i));
    EXPECT_EQ(d.name(), rows[i].name);
    EXPECT_EQ(d.checkpoint_key(), rows[i].member);
    EXPECT_EQ(d.refused_elsewhere(), rows[i].elsewhere == optim::OptionElsewhere::kRefused);
    EXPECT_EQ(static_cast<size_t>(d.enum_values_size()), rows[i].enum_names.size());
    std::set<int> algorithms(d.algorithms().begin(), d.algorithms().end());
    for (optim::AlgorithmKind k : optim::kAllAlgorithmKinds) {
      EXPECT_EQ(algorithms.count(AlgorithmToProto(k)) == 1, rows[i].AppliesTo(k)) << d.name();
    }
    if (!rows[i].range.any) {
      EXPECT_EQ(d.min(), rows[i].range.lo);
      EXPECT_EQ(d.max(), rows[i].range.hi);
      EXPECT_EQ(d.min_exclusive(), rows[i].range.lo_open);
      EXPECT_EQ(d.max_exclusive(), rows[i].range.hi_open);
    }
  }
  // Every algorithm's defaults, every field set, and each the row's default.
  ASSERT_EQ(r.defaults_size(), 7);
  for (const v1::AlgorithmDefaults& a : r.defaults()) {
    std::vector<const FieldDescriptor*> set;
    a.hyperparameters().GetReflection()->ListFields(a.hyperparameters(), &set);
    EXPECT_EQ(set.size(), rows.size()) << a.algorithm();
    optim::Hyperparams h;
    for (const optim::OptionRow& row : rows) row.set(h, NonDefault(row));
    ASSERT_THAT(ApplyHyperparameters(a.hyperparameters(), &h), IsOk());
    for (const optim::OptionRow& row : rows) {
      EXPECT_EQ(row.get(h), row.Default(optim::AlgorithmKind::kMuon)) << row.name;
    }
  }
}

}  // namespace
}  // namespace diond::rpc
