#!/usr/bin/env bash
# Checks the dependency rule of ARCHITECTURE.md §3 on every source file. System headers of
# gRPC and prometheus-cpp sit in /usr/include, so the compiler alone cannot stop a stray include;
# the generated proto headers are only reachable through diond::proto. This test covers both.
#   layering_test.sh REPO_ROOT
set -uo pipefail
root=$1
cd "$root"
fail=0
check() {  # check <description> <grep -E pattern> <paths...>
  local what=$1 pattern=$2; shift 2
  [ $# -gt 0 ] || return 0
  local hits
  hits=$(grep -rEn --include='*.h' --include='*.cc' --include='*.cu' --include='*.cuh' \
           "$pattern" "$@" 2>/dev/null || true)
  if [ -n "$hits" ]; then
    echo "LAYERING VIOLATION: $what"; echo "$hits"; fail=1
  fi
}
grpc='#include *[<"](grpcpp/|grpc/|.*\.pb\.h)'
prom='#include *[<"]prometheus/'
cuda='#include *[<"](cuda_runtime|cuda\.h|cublas|cusolver|nccl|cuda_bf16|cuda_fp16)'

check "common/ uses gRPC or proto" "$grpc" common
check "common/ uses prometheus-cpp" "$prom" common
check "common/ includes a higher layer" '#include *"(kernels|server|client)/' common
check "kernels/ uses gRPC or proto" "$grpc" kernels
check "kernels/ uses prometheus-cpp" "$prom" kernels
check "kernels/ includes server or client" '#include *"(server|client)/' kernels
# One exception: the C++ client's CudaArena (client/cpp/diond/cuda_arena.cc), the trainer-side
# allocator of the GPU data plane, built only where the CUDA toolkit is found (its own target,
# diond::client_cuda; diond_client itself stays CUDA-free), and its GPU test, which plays the
# trainer (client/cpp/tests/cuda_arena_test.cc, built with it).
# A second: kernels/testing/fake_cuda, the strict host stand-in for the CUDA runtime that the
# plugin's host code is compiled against in cuda_runtime_rules_test; its headers carry CUDA's
# names and no CUDA.
check "CUDA headers outside kernels/cuda" "$cuda" common server tests \
  $(find client -type f ! -path client/cpp/diond/cuda_arena.cc \
      ! -path client/cpp/tests/cuda_arena_test.cc) \
  $(find kernels \( -path kernels/cuda -o -path kernels/testing/fake_cuda \) -prune -o -type f -print)
# The ops API (ARCHITECTURE.md §3, docs/KERNELS.md): only the backends themselves and their tests
# see a backend's headers; kernels/optim, server/ and the API (kernels/*.h, kernels/api/) call the
# dispatcher in kernels/ops.h. kernels_api_alone_test proves the API also links without them.
backend_inc='#include *[<"]kernels/(cpu|cuda/[a-z_]+_backend|testing)/'
# (their *_test.cc files may use the test-only backend of kernels/testing, and so may the
# tests' own helpers in kernels/optim/testing and the composition root of diond-conformance,
# whose --device test registers it for CI)
check "kernels/optim includes a backend header" "$backend_inc" \
  $(find kernels/optim -path kernels/optim/testing -prune -o -type f ! -name '*_test.cc' \
      ! -path kernels/optim/conformance/main.cc -print)
check "server/ includes a backend header" "$backend_inc" $(find server -type f ! -name '*_test.cc')
check "the ops API includes a backend header" "$backend_inc" kernels/api \
  kernels/tensor.h kernels/context.h kernels/ops.h kernels/backend.h
api_srcs=$(sed -n '/NAME kernels_api$/,/^)/p' kernels/CMakeLists.txt)
if echo "$api_srcs" | grep -q 'cpu/'; then
  echo "LAYERING VIOLATION: the kernels_api target lists a kernels/cpu source"; fail=1
fi
# The device runtime (kernels/device_runtime.h) is the one door to a device besides the ops: the
# server (outside its composition root, which registers the CUDA plugin) sees no plugin adapter
# and no backend table, and production code never names the test device.
check "server/ (outside exe/) includes the plugin adapter or the backend table" \
  '#include *"kernels/(plugin/|backend\.h)' \
  $(find server -path server/exe -prune -o -type f ! -name '*_test.cc' -print)
check "production code names the test device" 'DeviceType::kTest' kernels/api \
  $(find server -type f ! -name '*_test.cc')
server_outside_rpc=$(find server -path server/rpc -prune -o -type f \( -name '*.h' -o -name '*.cc' \) -print)
check "server/ (outside rpc/) uses gRPC or proto" "$grpc" $server_outside_rpc
# The server's rooms (ARCHITECTURE.md §3): the arrows run one way,
#   exe/ -> rpc/ -> session/ -> memory/ and comm/,  exe/ -> checkpoint/ -> session/,
#   exe/ -> the core (server/*.h: metrics, version).
# Each room may include its own headers and those of the rooms below it, nothing else.
server_core=$(find server -maxdepth 1 -type f \( -name '*.h' -o -name '*.cc' \))
# Trainer memory (shm, memfd, CUDA regions, GPU UUIDs) knows no session, and only the fd
# channel's descriptor type of the other rooms.
check "server/memory includes a room above it" \
  '#include *"server/([a-z_]+\.h|session/|checkpoint/|comm/|rpc/|exe/|fdchannel/fd_channel)' \
  server/memory
check "server/comm includes a room above it" \
  '#include *"server/([a-z_]+\.h|memory/|session/|checkpoint/|rpc/|exe/)' server/comm
# The session room decides when to checkpoint and reaches the store only through its own
# interface (session/checkpoint_store.h); its tests wire the checkpoint room's store in, as the
# composition root does.
check "server/session includes a room above it" \
  '#include *"server/([a-z_]+\.h|rpc/|exe/)' server/session
check "server/session (outside its tests) includes server/checkpoint" '#include *"server/checkpoint/' \
  $(find server/session -type f ! -name '*_test.cc')
# The checkpoint room sees of the session room only the types it stores and the interface it
# implements, and no other room.
check "server/checkpoint includes a room other than session's" \
  '#include *"server/([a-z_]+\.h|memory/|comm/|rpc/|exe/|fdchannel/)' server/checkpoint
hits=$(grep -rEn --include='*.h' --include='*.cc' '#include *"server/session/' server/checkpoint |
         grep -Ev '"server/session/(types|session|checkpoint_store)\.h"' || true)
if [ -n "$hits" ]; then
  echo "LAYERING VIOLATION: server/checkpoint includes a session header other than its types"
  echo "$hits"; fail=1
fi
check "server/rpc includes exe/, checkpoint/ or the daemon core (metrics, version)" \
  '#include *"server/([a-z_]+\.h|exe/|checkpoint/)' server/rpc
check "the server core (server/*.h) includes a room" \
  '#include *"server/(comm|memory|session|checkpoint|rpc|exe)/' $server_core
# (tests/service/test_device_daemon.cc is the test-only diond_testdevice's part of the
# composition root: it fills DaemonOptions with the TEST backend, docs/GPU.md. So do
# tests/service/cuda_harness.h and cuda_region_service_test.cc, which run the daemon in the
# test's process because the TEST backend's CUDA hand-off emulation works within one process
# only.)
check "server/exe (the composition root) is included from outside it" '#include *"server/exe/' \
  common kernels client bench examples \
  $(find tests -type f ! -path tests/service/test_device_daemon.cc \
      ! -path tests/service/cuda_region_service_test.cc ! -path tests/service/cuda_harness.h) \
  $(find server -path server/exe -prune -o -type f -print)
check "client/ uses prometheus-cpp" "$prom" client
check "client/ includes server" '#include *"server/' client
if [ $fail -eq 0 ]; then echo "layering: OK"; fi
exit $fail
