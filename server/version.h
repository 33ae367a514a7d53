// The daemon's version, from the CMake project version.
#ifndef DIOND_SERVER_VERSION_H_
#define DIOND_SERVER_VERSION_H_

namespace diond::server {
inline constexpr char kVersion[] = DIOND_VERSION_STRING;
}  // namespace diond::server

#endif  // DIOND_SERVER_VERSION_H_
