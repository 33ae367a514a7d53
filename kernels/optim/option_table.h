// The option table: one row per option of a parameter group (kernels/optim/options.def), with
// its proto name, type, default, range and the algorithms that read it. Validation
// (ValidateGroup), the daemon's proto conversion (server/rpc/convert.cc), the checkpoint codec
// (server/checkpoint/spec_codec.cc) and the DescribeOptions RPC all walk these rows, so none of
// them names an option. No proto here (STYLE.md R2): the server maps `name` to the field of
// diond.v1.Hyperparameters by reflection.
//
// Thread-safety: immutable data.
#ifndef DIOND_KERNELS_OPTIM_OPTION_TABLE_H_
#define DIOND_KERNELS_OPTIM_OPTION_TABLE_H_

#include <cstdint>
#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/optim/optimizer_types.h"

namespace diond::optim {

// One bit per algorithm: the algorithm sets of the rows.
constexpr uint32_t AlgorithmBit(AlgorithmKind k) { return 1u << static_cast<unsigned>(k); }
inline constexpr uint32_t kMuonBit = AlgorithmBit(AlgorithmKind::kMuon);
inline constexpr uint32_t kNorMuonBit = AlgorithmBit(AlgorithmKind::kNorMuon);
inline constexpr uint32_t kDionBit = AlgorithmBit(AlgorithmKind::kDion);
inline constexpr uint32_t kDion2Bit = AlgorithmBit(AlgorithmKind::kDion2);
inline constexpr uint32_t kNorDion2Bit = AlgorithmBit(AlgorithmKind::kNorDion2);
inline constexpr uint32_t kAdamWBit = AlgorithmBit(AlgorithmKind::kAdamW);
inline constexpr uint32_t kLionBit = AlgorithmBit(AlgorithmKind::kLion);
inline constexpr uint32_t kAllAlgorithms =
    kMuonBit | kNorMuonBit | kDionBit | kDion2Bit | kNorDion2Bit | kAdamWBit | kLionBit;
// Muon, NorMuon, Dion2, NorDion2 (HasBf16Path).
inline constexpr uint32_t kMegabatchBits = kMuonBit | kNorMuonBit | kDion2Bit | kNorDion2Bit;
// Every AlgorithmKind, in enum order.
inline constexpr AlgorithmKind kAllAlgorithmKinds[] = {
    AlgorithmKind::kMuon,     AlgorithmKind::kNorMuon, AlgorithmKind::kDion, AlgorithmKind::kDion2,
    AlgorithmKind::kNorDion2, AlgorithmKind::kAdamW,   AlgorithmKind::kLion};

enum class OptionType : uint8_t { kDouble, kInt, kBool, kEnum };
// What an algorithm outside the row's set does with the option.
enum class OptionElsewhere : uint8_t {
  kIgnored,  // ignores it, and does not check its range
  kRefused,  // INVALID_ARGUMENT for a value other than the default
};
// Whether every checkpoint has the option, or only those written after it was added.
enum class OptionSince : uint8_t { kFirst, kLater };

// lo < v < hi with each end open or closed; hi = +inf for none. Doubles must also be finite.
struct OptionRange {
  double lo = 0;
  bool lo_open = false;
  double hi = std::numeric_limits<double>::infinity();
  bool hi_open = false;
  bool any = false;  // kNoRange: bools and enums
};
constexpr OptionRange Closed(double lo, double hi) { return {lo, false, hi, false, false}; }
constexpr OptionRange ClosedOpen(double lo, double hi) { return {lo, false, hi, true, false}; }
constexpr OptionRange OpenClosed(double lo, double hi) { return {lo, true, hi, false, false}; }
inline constexpr OptionRange kNoRange = {0, false, 0, false, true};

// One option's value: `number` for kDouble, `integer` for kInt, kBool (0/1) and kEnum (the
// domain enum's value, 0-based).
struct OptionValue {
  double number = 0;
  int64_t integer = 0;
  bool operator==(const OptionValue& o) const { return number == o.number && integer == o.integer; }
  bool operator!=(const OptionValue& o) const { return !(*this == o); }
};

struct OptionRow {
  absl::string_view name;    // the field of diond.v1.Hyperparameters
  absl::string_view member;  // the Hyperparams member, and the option's key in checkpoints
  OptionType type;
  OptionRange range;
  uint32_t algorithms;  // AlgorithmBit set
  OptionElsewhere elsewhere;
  OptionSince since;
  // kEnum: the values' names, as checkpoints and clients spell them; value i is proto enum
  // number i + 1 (0 is the proto's UNSPECIFIED: "keep the default").
  absl::Span<const absl::string_view> enum_names;
  OptionValue (*get)(const Hyperparams& h);
  void (*set)(Hyperparams& h, const OptionValue& v);

  bool AppliesTo(AlgorithmKind k) const { return (algorithms & AlgorithmBit(k)) != 0; }
  // "oversample (rcqr_oversample)" where the names differ: messages name both.
  std::string Label() const;
  // The value as messages and checkpoints show it: 0.5, 3, true, "rms_norm".
  std::string Format(const OptionValue& v) const;
  // The row's default for `kind` (DefaultHyperparams(kind)).
  OptionValue Default(AlgorithmKind kind) const;
  // OK when `v` lies in the range (doubles also finite); INVALID_ARGUMENT
  // "<label> = <v> is outside [lo, hi)" (integers: "must be >= lo" / "must be <= hi") otherwise.
  absl::Status CheckRange(const OptionValue& v) const;
};

// Every row, in the order of options.def (the proto's field order).
absl::Span<const OptionRow> OptionTable();
// The row named `name` (proto name), or null.
const OptionRow* FindOption(absl::string_view name);
// The row whose member (checkpoint key) is `member`, or null.
const OptionRow* FindOptionByMember(absl::string_view member);
// "Muon, NorMuon, AdamW and Lion": the algorithms of a row's set, for messages.
std::string AlgorithmList(uint32_t algorithms);

}  // namespace diond::optim

#endif  // DIOND_KERNELS_OPTIM_OPTION_TABLE_H_
