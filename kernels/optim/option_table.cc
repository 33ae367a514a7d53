#include "kernels/optim/option_table.h"

#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "kernels/optim/validation.h"

namespace diond::optim {
namespace {

constexpr OptionElsewhere kIgnored = OptionElsewhere::kIgnored;
constexpr OptionElsewhere kRefused = OptionElsewhere::kRefused;
constexpr OptionSince kFirst = OptionSince::kFirst;
constexpr OptionSince kLater = OptionSince::kLater;

// The names of each enum option's values (value i = proto enum number i + 1). The checkpoint
// spellings: "ns5" predates the proto's NEWTON_SCHULZ and stays, so old checkpoints load.
template <typename E>
struct EnumNames;
template <>
struct EnumNames<AdjustLr> {
  static constexpr absl::string_view kNames[] = {"spectral_norm", "rms_norm", "none"};
};
template <>
struct EnumNames<Orthogonalizer> {
  static constexpr absl::string_view kNames[] = {"polar_express", "ns5"};
};
template <>
struct EnumNames<QrMethod> {
  static constexpr absl::string_view kNames[] = {"rcqr", "qr", "cqr"};
};

// How a member of type T is held in an OptionValue.
template <typename T>
struct Codec {
  static constexpr OptionType kType = std::is_enum_v<T> ? OptionType::kEnum : OptionType::kInt;
  static absl::Span<const absl::string_view> Names() {
    if constexpr (std::is_enum_v<T>) {
      return EnumNames<T>::kNames;
    } else {
      return {};
    }
  }
  static OptionValue Get(T v) { return {0, static_cast<int64_t>(v)}; }
  static T Set(const OptionValue& v) { return static_cast<T>(v.integer); }
};
template <>
struct Codec<double> {
  static constexpr OptionType kType = OptionType::kDouble;
  static absl::Span<const absl::string_view> Names() { return {}; }
  static OptionValue Get(double v) { return {v, 0}; }
  static double Set(const OptionValue& v) { return v.number; }
};
template <>
struct Codec<bool> {
  static constexpr OptionType kType = OptionType::kBool;
  static absl::Span<const absl::string_view> Names() { return {}; }
  static OptionValue Get(bool v) { return {0, v ? 1 : 0}; }
  static bool Set(const OptionValue& v) { return v.integer != 0; }
};

const OptionRow kRows[] = {
#define DIOND_OPTION(name, member, type, default_value, range, algorithms, elsewhere, since) \
  {#name,                                                                                    \
   #member,                                                                                  \
   Codec<type>::kType,                                                                       \
   range,                                                                                    \
   algorithms,                                                                               \
   elsewhere,                                                                                \
   since,                                                                                    \
   Codec<type>::Names(),                                                                     \
   [](const Hyperparams& h) { return Codec<type>::Get(h.member); },                          \
   [](Hyperparams& h, const OptionValue& v) { h.member = Codec<type>::Set(v); }},
#include "kernels/optim/options.def"
#undef DIOND_OPTION
};

absl::string_view DisplayName(AlgorithmKind k) {
  switch (k) {
    case AlgorithmKind::kMuon:
      return "Muon";
    case AlgorithmKind::kNorMuon:
      return "NorMuon";
    case AlgorithmKind::kDion:
      return "Dion";
    case AlgorithmKind::kDion2:
      return "Dion2";
    case AlgorithmKind::kNorDion2:
      return "NorDion2";
    case AlgorithmKind::kAdamW:
      return "AdamW";
    case AlgorithmKind::kLion:
      return "Lion";
  }
  return "?";
}

}  // namespace

absl::Span<const OptionRow> OptionTable() { return kRows; }

const OptionRow* FindOption(absl::string_view name) {
  for (const OptionRow& r : kRows) {
    if (r.name == name) return &r;
  }
  return nullptr;
}

const OptionRow* FindOptionByMember(absl::string_view member) {
  for (const OptionRow& r : kRows) {
    if (r.member == member) return &r;
  }
  return nullptr;
}

std::string AlgorithmList(uint32_t algorithms) {
  std::vector<absl::string_view> names;
  for (AlgorithmKind k : kAllAlgorithmKinds) {
    if (algorithms & AlgorithmBit(k)) names.push_back(DisplayName(k));
  }
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) absl::StrAppend(&out, i + 1 == names.size() ? " and " : ", ");
    absl::StrAppend(&out, names[i]);
  }
  return out;
}

std::string OptionRow::Label() const {
  return name == member ? std::string(name) : absl::StrCat(name, " (", member, ")");
}

std::string OptionRow::Format(const OptionValue& v) const {
  switch (type) {
    case OptionType::kDouble:
      return absl::StrCat(v.number);
    case OptionType::kInt:
      return absl::StrCat(v.integer);
    case OptionType::kBool:
      return v.integer != 0 ? "true" : "false";
    case OptionType::kEnum:
      if (v.integer >= 0 && v.integer < static_cast<int64_t>(enum_names.size())) {
        return std::string(enum_names[v.integer]);
      }
      return absl::StrCat(v.integer);
  }
  return "?";
}

OptionValue OptionRow::Default(AlgorithmKind kind) const { return get(DefaultHyperparams(kind)); }

absl::Status OptionRow::CheckRange(const OptionValue& v) const {
  const OptionRange& r = range;
  if (r.any) return absl::OkStatus();
  if (type == OptionType::kInt) {
    const double x = static_cast<double>(v.integer);
    if (x < r.lo) {
      return absl::InvalidArgumentError(
          absl::StrCat(Label(), " = ", v.integer, " must be >= ", r.lo));
    }
    if (x > r.hi) {
      return absl::InvalidArgumentError(
          absl::StrCat(Label(), " = ", v.integer, " must be <= ", r.hi));
    }
    return absl::OkStatus();
  }
  const double x = v.number;
  const bool ok =
      std::isfinite(x) && (r.lo_open ? x > r.lo : x >= r.lo) && (r.hi_open ? x < r.hi : x <= r.hi);
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(Label(), " = ", x, " is outside ",
                                                 r.lo_open ? "(" : "[", r.lo, ", ", r.hi,
                                                 r.hi_open ? ")" : "]"));
}

}  // namespace diond::optim
