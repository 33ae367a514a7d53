// libFuzzer target: the safetensors reader (common/safetensors.cc, owned by the checkpoint code)
// on arbitrary bytes: Parse, then every tensor read back as float. No crash, no sanitizer report,
// and every tensor it accepts lies inside the data it was given.
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file =
      diond::SafetensorsFile::Parse(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
  if (!file.ok()) return 0;
  for (const diond::SafetensorsTensorInfo& t : file->tensors()) {
    if (t.end < t.begin || t.end > size) {
      std::fprintf(stderr, "property violated: tensor outside the input\n");
      std::abort();
    }
    auto v = file->ReadFloat(t.name);
    if (v.ok() && static_cast<int64_t>(v->size()) != t.NumElements()) {
      std::fprintf(stderr, "property violated: element count\n");
      std::abort();
    }
  }
  return 0;
}
