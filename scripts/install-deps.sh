#!/usr/bin/env bash
# Installs every system dependency of diond from Debian 12 packages.
# Idempotent: packages already present are skipped, so a second run takes seconds.
# Used by README's commands, .ci/run and the Dockerfile.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git ca-certificates
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev libcivetweb-dev libcurl4-openssl-dev zlib1g-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libopenblas-dev liblapacke-dev libdnnl-dev libgloo-dev
  nlohmann-json3-dev
  python3-grpcio python3-protobuf python3-numpy python3-pytest python3-torch
  prometheus curl procps binutils
)

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
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
