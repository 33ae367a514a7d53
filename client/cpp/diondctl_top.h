// diondctl (diondctl.cc) and its `top` command (diondctl_top.cc).
#ifndef DIOND_CLIENT_CPP_DIONDCTL_TOP_H_
#define DIOND_CLIENT_CPP_DIONDCTL_TOP_H_

#include <cstdint>
#include <string>

namespace diondctl {

// "512 B", "1.5 MiB": byte counts as the tables print them.
std::string Bytes(int64_t b);
// The `top` command: refreshes every --interval, --iterations times (0: until interrupted), from
// --metrics_url; --json prints one object per refresh. Returns the exit status.
int Top();

}  // namespace diondctl

#endif  // DIOND_CLIENT_CPP_DIONDCTL_TOP_H_
