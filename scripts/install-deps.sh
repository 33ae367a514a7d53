#!/usr/bin/env bash
# Installs diond's system dependencies from the distribution's packages (Debian 12; the
# Dockerfile runs it on Ubuntu 24.04, which has the same package names).
#   scripts/install-deps.sh [--all|--build|--runtime|--rust]
#     --all      (default) build + test tools + the Rust client's crates: what CI and developers need
#     --rust     only the Rust client's crates (client/rust), and cargo if none is on PATH
#     --build    compilers and the C++ libraries (the Dockerfile's build stage)
#     --runtime  the libraries the binaries load, no compilers (the Dockerfile's runtime stage)
# Idempotent: installed packages are skipped, so a second run takes about a second.
set -euo pipefail

# The C++ libraries. Their -dev packages pull the matching runtime libraries, whose names
# differ between distributions (t64 suffixes, soname versions), so the runtime stage installs
# the -dev packages too.
LIBS=(
  libgrpc++-dev libgrpc-dev libprotobuf-dev libabsl-dev prometheus-cpp-dev libcivetweb-dev
  libcurl4-openssl-dev zlib1g-dev libopenblas-dev liblapacke-dev libdnnl-dev libgloo-dev
  nlohmann-json3-dev
)
BUILD=(
  build-essential cmake pkg-config git ca-certificates protobuf-compiler protobuf-compiler-grpc
  libgtest-dev libgmock-dev libbenchmark-dev ccache
  patchelf binutils xz-utils python3  # scripts/bundle.sh
)
TEST=(
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch
  prometheus curl procps binutils
  debootstrap  # scripts/bare-root-check.sh
  universal-ctags  # tests/size_limits_test.py: function extents
  clang-format-14  # scripts/check-format.sh (format_test)
  clang-tidy-14  # scripts/tidy.sh (CI)
)
# The Rust client (client/rust) builds offline from these crates: they fill the local registry
# /usr/share/cargo/registry that client/rust/.cargo/config.toml points cargo at. Debian's cargo
# (with rustc 1.63) is added only where no cargo is on PATH (e.g. a rustup toolchain).
RUST=(
  librust-prost-dev librust-prost-build-dev librust-tokio-dev librust-hyper-dev librust-h2-dev
  librust-bytes-dev librust-http-dev librust-tower-service-dev librust-libc-dev
  librust-tokio-rustls-dev librust-rustls-pemfile-dev librust-serde-json-dev protobuf-compiler
  openssl  # tests/tls.rs makes its certificates with it at test time
)
if ! command -v cargo >/dev/null 2>&1; then RUST+=(cargo); fi

# kubectl renders the Kustomize overlays (scripts/check-deploy.sh). Debian's kubernetes-client
# provides it; a kubectl installed otherwise (another package owning /usr/bin/kubectl) is kept.
if ! command -v kubectl >/dev/null 2>&1; then TEST+=(kubernetes-client); fi

mode=${1:---all}
case "$mode" in
  --all) PKGS=("${LIBS[@]}" "${BUILD[@]}" "${TEST[@]}" "${RUST[@]}") ;;
  --rust) PKGS=("${RUST[@]}") ;;
  --build) PKGS=("${LIBS[@]}" "${BUILD[@]}") ;;
  --runtime) PKGS=("${LIBS[@]}" ca-certificates) ;;
  *) echo "usage: $0 [--all|--build|--runtime|--rust]" >&2; exit 2 ;;
esac

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages already installed"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${#missing[@]} packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# --no-install-recommends: recommends would add node-exporter, smartmontools, ipmitool, ...
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
