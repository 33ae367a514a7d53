#!/usr/bin/env bash
# Checks, with ldd, that every ELF of an unpacked diond bundle finds every library it loads.
#   check-libs.sh BUNDLE_DIR [--allow-missing-nvidia]
# A library the bundle packs must resolve inside BUNDLE_DIR/lib (so nothing on this machine
# shadows it); the ones left to the machine (glibc, libstdc++, libgcc_s, the NVIDIA driver and
# CUDA libraries: the same list as scripts/bundle/pack.py) must resolve somewhere. With
# --allow-missing-nvidia an NVIDIA library that is not found is listed but not an error (a
# machine without CUDA). Prints every problem with the file that has it; exit 1 if any.
# Needs only bash, ldd and coreutils: it runs in a bare Debian root too.
set -uo pipefail
bundle=$(cd "${1:?usage: check-libs.sh BUNDLE_DIR [--allow-missing-nvidia]}" && pwd -P)
allow_nvidia=0
[ "${2:-}" = --allow-missing-nvidia ] && allow_nvidia=1

left_to_machine() {
  case $1 in
    linux-vdso.so.1 | ld-linux-x86-64.so.2 | libstdc++.so.6 | libgcc_s.so.1) return 0 ;;
    lib[cm].so.[0-9]* | libdl.so.* | libpthread.so.* | librt.so.* | libresolv.so.* | libutil.so.* | \
      libanl.so.* | libmvec.so.*) return 0 ;;
  esac
  nvidia "$1"
}
nvidia() {
  case $1 in
    libcuda.so.1 | libnvidia-*.so.* | libcudart.so.* | libcublas.so.* | libcublasLt.so.* | \
      libcusolver.so.* | libcusparse.so.* | libnvJitLink.so.* | libnccl.so.*) return 0 ;;
  esac
  return 1
}

problems=0 files=0 nv_missing=""
declare -A from_machine=()
while IFS= read -r -d '' f; do
  [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ] || continue
  files=$((files + 1))
  rel=${f#"$bundle"/}
  out=$(ldd "$f" 2>&1)
  rc=$?
  if [ $rc -ne 0 ] && ! grep -q '=>' <<<"$out"; then
    echo "check-libs: $rel: ldd failed: $out"
    problems=$((problems + 1))
    continue
  fi
  while IFS= read -r line; do
    if [[ $line =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+not\ found ]]; then
      lib=${BASH_REMATCH[1]}
      if [ $allow_nvidia = 1 ] && nvidia "$lib"; then
        case " $nv_missing " in *" $lib "*) ;; *) nv_missing="$nv_missing $lib" ;; esac
      else
        echo "check-libs: $rel: $lib not found"
        problems=$((problems + 1))
      fi
    elif [[ $line =~ ^[[:space:]]*([^[:space:]]+)[[:space:]]+=\>[[:space:]]+(/[^[:space:]]+) ]]; then
      lib=${BASH_REMATCH[1]} path=${BASH_REMATCH[2]}
      if left_to_machine "$lib"; then
        from_machine[$lib]=$path
      else
        real=$(readlink -f "$path")
        if [ "${real#"$bundle"/lib/}" = "$real" ]; then
          echo "check-libs: $rel: $lib resolves to $path, outside the bundle's lib/"
          problems=$((problems + 1))
        fi
      fi
    elif [[ $line == *"not found"* ]]; then  # e.g. version `GLIBCXX_3.4.30' not found
      echo "check-libs: $rel: $line"
      problems=$((problems + 1))
    fi
  done <<<"$out"
done < <(find "$bundle/bin" "$bundle/lib" "$bundle/tests" -type f -print0 2>/dev/null | sort -z)

for lib in $(printf '%s\n' "${!from_machine[@]}" | sort); do
  echo "check-libs: from this machine: $lib => ${from_machine[$lib]}"
done
[ -n "$nv_missing" ] && echo "check-libs: NVIDIA libraries not on this machine (allowed):$nv_missing"
if [ "$files" -eq 0 ]; then
  echo "check-libs: no ELF file under $bundle"
  exit 1
fi
if [ $problems -ne 0 ]; then
  echo "check-libs: $problems problem(s) in $files ELF files"
  exit 1
fi
echo "check-libs: all $files ELF files resolve every library they load"
