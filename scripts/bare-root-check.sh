#!/usr/bin/env bash
# Runs a diond bundle where nothing was installed (docs/GPU.md "The bare-root proof").
#   scripts/bare-root-check.sh BUNDLE.tar.xz
# Two Debian 13 roots made by `debootstrap --variant=minbase`, cached under
# $DIOND_BARE_ROOT_CACHE (default /var/cache/diond) so that only the first run fetches them:
#   trixie-minbase   nothing added: none of diond's build dependencies, no Python
#   trixie-python    minbase + python3, python3-numpy, python3-torch (the trainer's side), and
#                    trixie-python-site: grpcio and protobuf wheels from PyPI, a newer runtime than
#                    the protoc 3.21 that made the bundle's stubs (as on the GPU machine's venv)
# Steps, each a failure if it fails (all inside a private mount namespace, so nothing stays
# mounted and the cached roots are never written):
#   runpath      every ELF of the bundle has an $ORIGIN-relative RUNPATH and nothing else
#   libs         tools/check-libs.sh in the minbase root: every packed library resolves inside
#                the bundle, and only the NVIDIA libraries are allowed to be missing
#   health       diond --device=cpu in the minbase root serves health (the bundled diondctl)
#   conformance  diond-conformance --device cpu --mode both passes every vector of the manifest
#   example      examples/python/train_gpt.py, in the python root, trains against that daemon
#                (unix socket and /dev/shm shared between the roots) and its loss goes down
# Exit 77 when it cannot run here (not root, or no cache and no debootstrap); CI sets
# DIOND_REQUIRE_BARE_ROOT=1 to make that a failure.
set -euo pipefail
bundle_file=$(readlink -f "${1:?usage: scripts/bare-root-check.sh BUNDLE.tar.xz}")
cache=${DIOND_BARE_ROOT_CACHE:-/var/cache/diond}
mirror=${DIOND_BARE_ROOT_MIRROR:-}   # empty: debootstrap's default Debian mirror
suite=trixie
steps=${DIOND_BARE_ROOT_STEPS:-20}
# The Python runtime of the trainer's side; pinned so that every run tests the same one.
wheels="protobuf==6.33.6 grpcio==1.76.0 typing_extensions==4.15.0"
start=$(date +%s)

skip() {
  echo "bare-root-check: cannot run here: $*" >&2
  [ "${DIOND_REQUIRE_BARE_ROOT:-0}" = 1 ] && exit 1
  exit 77
}
[ "$(id -u)" = 0 ] || skip "needs root (chroot, mount namespaces)"
command -v unshare >/dev/null || skip "unshare (util-linux) is missing"
[ -f "$bundle_file" ] || { echo "bare-root-check: no bundle $bundle_file" >&2; exit 2; }

# ---- the cached roots (made once, under a lock; a root is used only once it is complete) ------
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9
make_root() {  # make_root DIR [PACKAGES]
  local dir=$1 include=${2:-}
  [ -f "$dir/.diond-root-ready" ] && return 0
  command -v debootstrap >/dev/null || skip "no cached root $dir and no debootstrap (apt-get install debootstrap)"
  echo "bare-root-check: making $dir (debootstrap --variant=minbase $suite${include:+, $include})"
  rm -rf "$dir.tmp"
  # shellcheck disable=SC2086
  debootstrap --variant=minbase ${include:+--include=$include} "$suite" "$dir.tmp" $mirror \
    >"$dir.log" 2>&1 || { tail -20 "$dir.log"; echo "bare-root-check: debootstrap failed" >&2; exit 1; }
  chroot "$dir.tmp" apt-get clean
  mkdir -p "$dir.tmp/opt/diond" "$dir.tmp/opt/site" "$dir.tmp/run/diond-bare"
  touch "$dir.tmp/.diond-root-ready"
  mv "$dir.tmp" "$dir"
}
make_root "$cache/$suite-minbase"
make_root "$cache/$suite-python" python3,python3-numpy,python3-torch
site=$cache/$suite-python-site
if [ ! -f "$site/.diond-site-ready" ] || [ "$(cat "$site/.diond-site-ready")" != "$wheels" ]; then
  pyver=$(chroot "$cache/$suite-python" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  echo "bare-root-check: installing $wheels for CPython $pyver into $site"
  rm -rf "$site.tmp"
  # shellcheck disable=SC2086
  /usr/bin/python3 -m pip install -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --target "$site.tmp" $wheels
  echo "$wheels" >"$site.tmp/.diond-site-ready"
  rm -rf "$site"
  mv "$site.tmp" "$site"
fi
flock -u 9
echo "bare-root-check: roots ready in $(( $(date +%s) - start )) s"

# ---- unpack and check RUNPATHs (here: readelf is not in the minimal root) ----------------------
work=$(mktemp -d "${TMPDIR:-/tmp}/diond-bare.XXXXXX")
trap 'rm -rf "$work"' EXIT
tar -xJf "$bundle_file" -C "$work"
top=$(ls "$work")
[ "$(echo "$top" | wc -l)" = 1 ] || { echo "bare-root-check: the bundle has more than one top folder" >&2; exit 1; }
b=$work/$top
bad=0 n=0
while IFS= read -r -d '' f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  n=$((n + 1))
  runpath=$(readelf -d "$f" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  rpath=$(readelf -d "$f" | sed -n 's/.*(RPATH).*\[\(.*\)\]/\1/p')
  if [ -z "$runpath" ] || [ -n "$rpath" ] || [ -n "$(tr ':' '\n' <<<"$runpath" | grep -v '^\$ORIGIN')" ]; then
    echo "runpath: ${f#"$b"/}: RUNPATH [$runpath] RPATH [$rpath]: want only \$ORIGIN entries"
    bad=$((bad + 1))
  fi
done < <(find "$b" -type f -print0)
[ $bad = 0 ] || { echo "bare-root-check: FAILED runpath ($bad of $n ELF files)"; exit 1; }
echo "== runpath: all $n ELF files have an \$ORIGIN-only RUNPATH"
# Every vector file must be run and pass: a count from the files, not from the runner.
vectors=$(find "$b/tests/conformance/vectors" -name '*.safetensors' | wc -l)
mkdir -p "$work/run"

# ---- the steps, in a private mount namespace ----------------------------------------------------
export B=$b MIN=$cache/$suite-minbase PY=$cache/$suite-python SITE=$site RUN=$work/run
export STEPS=$steps VECTORS=$vectors
unshare --mount --fork bash -euo pipefail -c '
mount --make-rprivate /
for r in "$MIN" "$PY"; do
  mount --bind "$B" "$r/opt/diond"; mount -o remount,bind,ro "$r/opt/diond"
  mount -t proc proc "$r/proc"
  mount --rbind /dev "$r/dev"          # one /dev/shm for both roots: the shared-memory arenas
  mount -t tmpfs tmpfs "$r/tmp"
  mount --bind "$RUN" "$r/run/diond-bare"
done
mount --bind "$SITE" "$PY/opt/site"; mount -o remount,bind,ro "$PY/opt/site"
in_min() { chroot "$MIN" env -i PATH=/usr/bin:/bin HOME=/tmp "$@"; }
in_py() { chroot "$PY" env -i PATH=/usr/bin:/bin HOME=/tmp PYTHONPATH=/opt/site "$@"; }
step() { echo "== $1"; }

step "libs: check-libs.sh in the minbase root"
in_min bash /opt/diond/tools/check-libs.sh /opt/diond --allow-missing-nvidia

step "health: diond --device=cpu in the minbase root"
sock=/run/diond-bare/diond.sock
chroot "$MIN" env -i PATH=/usr/bin:/bin HOME=/tmp /opt/diond/bin/diond --device=cpu \
  --listen=unix:$sock --metrics_address= --health_address= --compute_threads=2 \
  >"$RUN/daemon.log" 2>&1 &
daemon=$!
trap "kill $daemon 2>/dev/null || true" EXIT
for _ in $(seq 100); do [ -S "$RUN/diond.sock" ] && break; sleep 0.1; done
health=$(in_min /opt/diond/bin/diondctl --target=unix:$sock health) || {
  cat "$RUN/daemon.log"; exit 1; }
echo "$health"
[ "${health##* }" = SERVING ] || { echo "health is not SERVING"; exit 1; }

step "conformance: every vector on the CPU, both modes"
in_min /opt/diond/bin/diond-conformance --device cpu --mode both /opt/diond/tests/conformance/vectors \
  >"$RUN/conformance.log" 2>&1 || { tail -20 "$RUN/conformance.log"; exit 1; }
tail -1 "$RUN/conformance.log"
tail -1 "$RUN/conformance.log" | grep -qx "$VECTORS passed, 0 failed" || {
  echo "want $VECTORS passed, 0 failed"; exit 1; }

step "example: train_gpt.py in the python root, $STEPS steps against that daemon"
in_py python3 -c "import google.protobuf, grpc, torch; print(\"protobuf\", google.protobuf.__version__, \"grpcio\", grpc.__version__, \"torch\", torch.__version__)"
in_py python3 /opt/diond/examples/python/train_gpt.py --target unix:$sock --steps "$STEPS" \
  --log-every 10 --threads 2 --eval-batches 2 --summary-json /run/diond-bare/train.json
in_py python3 -c "
import json, math
s = json.load(open(\"/run/diond-bare/train.json\"))
assert s[\"steps\"] == $STEPS, s
assert math.isfinite(s[\"final_loss\"]) and s[\"final_loss\"] < s[\"initial_loss\"] - 0.5, s
print(\"example: loss %.3f -> %.3f in %d steps\" % (s[\"initial_loss\"], s[\"final_loss\"], s[\"steps\"]))"

kill -TERM $daemon; rc=0; wait $daemon || rc=$?
trap - EXIT
[ $rc = 0 ] || { echo "diond exited $rc after SIGTERM"; tail -20 "$RUN/daemon.log"; exit 1; }
echo "daemon: stopped cleanly"
' || { echo "bare-root-check: FAILED (bundle $bundle_file)"; exit 1; }
echo "bare-root-check: passed in $(( $(date +%s) - start )) s"
