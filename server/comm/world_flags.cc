#include "server/comm/world_flags.h"

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace diond::comm {
namespace {

// Splits "name-12" into ("name", 12); false without a numeric suffix.
bool SplitOrdinal(absl::string_view hostname, absl::string_view* base, int* ordinal) {
  // A FQDN's first label is the pod name.
  hostname = hostname.substr(0, hostname.find('.'));
  size_t dash = hostname.rfind('-');
  if (dash == absl::string_view::npos || dash + 1 >= hostname.size()) return false;
  absl::string_view digits = hostname.substr(dash + 1);
  for (char c : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
  }
  if (!absl::SimpleAtoi(digits, ordinal)) return false;
  *base = hostname.substr(0, dash);
  return true;
}

}  // namespace

absl::StatusOr<int> DeriveRank(int flag_rank, int world_size, absl::string_view hostname,
                               const char* job_index) {
  int rank = flag_rank;
  std::string source = "--rank";
  if (rank < 0 && job_index != nullptr && *job_index != '\0') {
    if (!absl::SimpleAtoi(job_index, &rank) || rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("JOB_COMPLETION_INDEX='", job_index, "' is not a rank"));
    }
    source = "JOB_COMPLETION_INDEX";
  }
  absl::string_view base;
  if (rank < 0 && SplitOrdinal(hostname, &base, &rank)) {
    source = absl::StrCat("the StatefulSet ordinal of hostname '", hostname, "'");
  }
  if (rank < 0) {
    if (world_size == 1) return 0;
    return absl::InvalidArgumentError(
        absl::StrCat("--world_size=", world_size,
                     " needs a rank: pass --rank, or run as a StatefulSet pod "
                     "(hostname '",
                     hostname, "' has no -<N> suffix) or an indexed Job (JOB_COMPLETION_INDEX)"));
  }
  if (rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " (from ", source, ") is not below --world_size=", world_size));
  }
  return rank;
}

absl::StatusOr<std::string> CoordinatorFromService(absl::string_view hostname,
                                                   absl::string_view service, int port) {
  absl::string_view base;
  int ordinal = 0;
  if (!SplitOrdinal(hostname, &base, &ordinal)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peer_service needs a StatefulSet pod name '<name>-<N>'; hostname is '", hostname, "'"));
  }
  return absl::StrCat(base, "-0.", service, ":", port);
}

}  // namespace diond::comm
