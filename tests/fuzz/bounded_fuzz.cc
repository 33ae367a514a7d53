// libFuzzer target: common/bounded.cc. Any input: the echo is at most 200 bytes plus its suffix,
// holds no control character, and is a prefix of the input when it needed no cut.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/bounded.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string in(reinterpret_cast<const char*>(data), size);
  const std::string out = diond::Bounded(in);
  bool ok = out.size() <= diond::kMaxEchoBytes + 32;
  for (char c : out) ok = ok && !(static_cast<unsigned char>(c) < 0x20 || c == 0x7f);
  if (size <= diond::kMaxEchoBytes) ok = ok && out.size() == size;
  ok = ok && diond::BoundedMessage(in).size() <= diond::kMaxStatusMessageBytes + 64;
  if (!ok) {
    std::fprintf(stderr, "property violated: unbounded or unsanitized echo\n");
    std::abort();
  }
  return 0;
}
