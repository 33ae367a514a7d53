#!/usr/bin/python3
"""Packs a CUDA build of diond into one relocatable tar.xz (docs/GPU.md "The bundle").

    pack.py --build DIR --src REPO --flavour check|release --out FILE.tar.xz

Layout of the archive (one top folder, diond-<flavour>/):
  bin/           diond, diondctl, diond-conformance, diond-gpu-bench, diond-ipc-bench,
                 libdiond_cuda.so (next to diond: its default plugin lookup)
  lib/           every shared library those load that is not in ALLOWED below
  tests/gpu/     the executables of every `gpu`-labelled ctest case, tests.json (the cases, with
                 their commands rewritten to bundle paths) and paths.json (absolute build paths
                 compiled into the executables, and the bundle file each stands for)
  client/python/ the Python client with its generated stubs, and its test suite
  examples/python/, tests/conformance/ (the vectors), tools/ (check-libs.sh, run_gpu_tests.py),
                 docs/ and README.md (also the example's corpus where a machine has no
                 /usr/share/common-licenses)
  MANIFEST.json  flavour, CUDA architectures, commit, files, packed libraries and their origin
Every ELF is stripped and gets an $ORIGIN-relative RUNPATH (patchelf), so nothing needs
LD_LIBRARY_PATH to find the packed libraries.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

# Found on the target, never packed: glibc, the GCC runtime every C++ program's host has (the
# manylinux policy's set), and the NVIDIA driver and CUDA libraries, which must match the
# target's driver. tools/check-libs.sh holds the same list.
ALLOWED = re.compile(
    r"^(linux-vdso\.so\.1|ld-linux-x86-64\.so\.2|lib(c|m|dl|pthread|rt|resolv|util|anl|mvec)\.so\.\d+"
    r"|libstdc\+\+\.so\.6|libgcc_s\.so\.1"
    r"|libcuda\.so\.1|libnvidia-[\w-]+\.so\.\d+|libcudart\.so\.\d+|libcublas(Lt)?\.so\.\d+"
    r"|libcusolver\.so\.\d+|libcusparse\.so\.\d+|libnvJitLink\.so\.\d+|libnccl\.so\.\d+)$")
NVIDIA = re.compile(r"^(libcuda|libnvidia-|libcudart|libcublas|libcusolver|libcusparse|libnvJitLink|libnccl)")

PROGRAMS = ["diond", "diondctl", "diond-conformance", "diond-gpu-bench", "diond-ipc-bench",
            "libdiond_cuda.so"]
# CUDA architectures of each flavour; "cpu" is a build without the CUDA plugin (no gpu tests).
FLAVOURS = {"check": "90-real;90-virtual", "release": "80-real;90-real;100-real;100-virtual",
            "cpu": None}
CPU_PROGRAMS = ["diond", "diondctl", "diond-conformance"]


def die(msg):
    sys.exit("bundle: " + msg)


def cmake_cache(build):
    cache = {}
    with open(os.path.join(build, "CMakeCache.txt")) as f:
        for line in f:
            m = re.match(r"^([A-Za-z_0-9]+):[A-Z]+=(.*)$", line.rstrip("\n"))
            if m:
                cache[m.group(1)] = m.group(2)
    return cache


def plugin_architectures(build):
    """The plugin's CUDA architectures as CMake spells them ("90-real;90-virtual"), read off
    the nvcc flags it was compiled with (CMake keeps a default in no cache entry)."""
    codes = set()
    for dirpath, _, filenames in os.walk(build):
        if dirpath.endswith("diond_cuda.dir") and "flags.make" in filenames:
            with open(os.path.join(dirpath, "flags.make")) as f:
                for m in re.finditer(r"--generate-code=arch=compute_(\d+),code=\[([^\]]*)\]", f.read()):
                    for code in m.group(2).split(","):
                        kind, num = code.split("_")
                        codes.add((int(num), "real" if kind == "sm" else "virtual"))
    return ";".join("%d-%s" % c for c in sorted(codes))


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def ldd(path):
    """{soname: resolved path or None} of every library `path` loads, transitively."""
    r = subprocess.run(["ldd", path], capture_output=True, text=True)
    deps = {}
    for line in r.stdout.splitlines():
        m = re.match(r"^\s*(\S+)\s+=>\s+(\S+|not found)", line)
        if m:
            deps[m.group(1)] = None if m.group(2) == "not found" else m.group(2)
        else:
            m = re.match(r"^\s*(/\S+)\s+\(0x", line)
            if m:
                deps[os.path.basename(m.group(1))] = m.group(1)
    return deps


def dynamic_names(path):
    """The dynamic symbols (name@version, defined or not) and the DT_NEEDED entries of `path`."""
    syms = subprocess.run(["nm", "-D", "-P", path], capture_output=True, text=True, check=True)
    dyn = subprocess.run(["readelf", "-d", "-W", path], capture_output=True, text=True, check=True)
    return ({line.split()[0] for line in syms.stdout.splitlines() if line.strip()},
            re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn.stdout))


def set_runpath(path, rpath):
    """Gives `path` the RUNPATH `rpath`, keeping every dynamic name as it was.

    The linker tail-merges .dynstr, so a symbol such as `read` can live at the end of an old
    RUNPATH ".../openblas-pthread"; `patchelf --set-rpath` overwrites the old string with X's
    in place, renaming the symbol (NixOS/patchelf#162). Removing the RUNPATH first makes
    patchelf add the new one as a fresh string and leave the old bytes alone.
    """
    before = dynamic_names(path)
    subprocess.run(["patchelf", "--remove-rpath", path], check=True)
    subprocess.run(["patchelf", "--set-rpath", rpath, path], check=True)
    after = dynamic_names(path)
    if after != before:
        die("%s: setting its RUNPATH changed its dynamic names (lost %s, gained %s)"
            % (path, sorted(before[0] - after[0]) + [n for n in before[1] if n not in after[1]],
               sorted(after[0] - before[0]) + [n for n in after[1] if n not in before[1]]))


def compiled_paths(path, prefixes):
    """Absolute paths under `prefixes` that appear as C strings in the file."""
    with open(path, "rb") as f:
        data = f.read()
    found = set()
    for p in prefixes:
        for m in re.finditer(re.escape(p.encode()) + rb"/[\x21-\x7e]*", data):
            found.add(m.group(0).decode())
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True)
    ap.add_argument("--src", required=True)
    ap.add_argument("--flavour", choices=sorted(FLAVOURS), required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    build, src = os.path.realpath(a.build), os.path.realpath(a.src)
    cache = cmake_cache(build)
    want_cuda = "OFF" if FLAVOURS[a.flavour] is None else "ON"
    if cache.get("DIOND_WITH_CUDA") != want_cuda:
        die("%s has DIOND_WITH_CUDA=%s; the %s flavour needs %s"
            % (build, cache.get("DIOND_WITH_CUDA"), a.flavour, want_cuda))
    archs = plugin_architectures(build) if want_cuda == "ON" else None
    if archs != FLAVOURS[a.flavour]:
        die("%s builds CUDA architectures %r; the %s flavour needs %r"
            % (build, archs, a.flavour, FLAVOURS[a.flavour]))
    for tool in ("ldd", "strip", "patchelf", "ctest", "nm", "readelf"):
        if shutil.which(tool) is None:
            die("%s not found (apt-get install patchelf binutils)" % tool)

    top = "diond-" + a.flavour
    stage_parent = tempfile.mkdtemp(prefix="diond-bundle.")
    stage = os.path.join(stage_parent, top)
    try:
        manifest = pack(build, src, a.flavour, archs, stage)
        write_tar(stage_parent, top, a.out, manifest)
    finally:
        shutil.rmtree(stage_parent)


def pack(build, src, flavour, archs, stage):
    files = {}  # bundle-relative path -> source path
    for name in (PROGRAMS if archs else CPU_PROGRAMS):
        p = os.path.join(build, "bin", name)
        if not os.path.isfile(p):
            die("%s is missing: build the targets diond diondctl diond_conformance diond_cuda "
                "diond_gpu_bench diond_ipc_bench first" % p)
        files["bin/" + name] = p

    # The gpu-labelled cases, as ctest would run them; whatever test carries the label is taken.
    r = subprocess.run(["ctest", "--test-dir", build, "--show-only=json-v1", "-L", "gpu"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        die("ctest --show-only failed: " + r.stderr.strip())
    cases = []
    for t in json.loads(r.stdout).get("tests", []):
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        cmd = []
        for arg in t.get("command", []):
            real = os.path.realpath(arg) if os.path.isabs(arg) else arg
            if os.path.isabs(arg) and real.startswith(build + "/") and os.path.isfile(real):
                rel = "tests/gpu/bin/" + os.path.basename(real)
                if rel in files and files[rel] != real:
                    die("two gpu test executables are named %s" % os.path.basename(real))
                files[rel] = real
                cmd.append("@BUNDLE@/" + rel)
            elif os.path.isabs(arg) and real.startswith(src + "/") and os.path.isfile(real):
                rel = "src/" + os.path.relpath(real, src)
                files[rel] = real
                cmd.append("@BUNDLE@/" + rel)
            elif os.path.isabs(arg) and re.match(r"^/usr(/local)?/bin/python3(\.\d+)?$", arg):
                cmd.append("python3")  # the target's interpreter, from its PATH
            else:
                cmd.append(arg)
        cases.append({"name": t["name"], "command": cmd,
                      "timeout": float(props.get("TIMEOUT", 1500)),
                      "skip_regex": props.get("SKIP_REGULAR_EXPRESSION", []),
                      "skip_code": props.get("SKIP_RETURN_CODE"),
                      "environment": props.get("ENVIRONMENT", []),
                      "labels": props.get("LABELS", [])})
    if not cases and archs:
        die("ctest lists no test with label gpu in %s: build the tests first" % build)

    # Python client + stubs, example, conformance vectors, the tools that run on the target.
    def add_tree(src_dir, dest, pattern=None):
        for dirpath, dirnames, filenames in os.walk(src_dir):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for fn in filenames:
                if pattern and not re.search(pattern, fn):
                    continue
                p = os.path.join(dirpath, fn)
                files[os.path.join(dest, os.path.relpath(p, src_dir))] = p
    add_tree(os.path.join(src, "client/python/diond"), "client/python/diond", r"\.py$")
    add_tree(os.path.join(build, "python/diond/v1"), "client/python/diond/v1", r"\.py$")
    if "client/python/diond/v1/optimizer_pb2.py" not in files:
        die("%s/python/diond/v1 has no stubs: build the target diond_proto_python" % build)
    add_tree(os.path.join(src, "client/python/tests"), "client/python/tests", r"\.py$")
    add_tree(os.path.join(src, "examples/python"), "examples/python", r"\.py$")
    add_tree(os.path.join(src, "tests/conformance"), "tests/conformance",
             r"\.(json|safetensors|md)$")
    add_tree(os.path.join(src, "docs"), "docs", r"\.md$")
    readme = "README" + ".md"
    files[readme] = os.path.join(src, readme)
    for tool in ("check-libs.sh", "run_gpu_tests.py"):
        files["tools/" + tool] = os.path.join(src, "scripts/bundle", tool)

    # The shared-library closure of every ELF, minus ALLOWED.
    libs, missing = {}, []
    for rel, p in sorted(files.items()):
        if not is_elf(p):
            continue
        for soname, resolved in ldd(p).items():
            if ALLOWED.match(soname):
                continue
            if resolved is None:
                missing.append("%s (needed by %s)" % (soname, rel))
            else:
                libs[soname] = os.path.realpath(resolved)
    if missing:
        die("libraries that do not resolve on this machine: " + ", ".join(sorted(missing)))
    for soname, p in libs.items():
        files["lib/" + soname] = p

    # Absolute build and source paths compiled into the executables (e.g. a test's default
    # plugin path): the runner links each to the bundle file it stands for.
    by_base = {}
    for rel in files:
        by_base.setdefault(os.path.basename(rel), []).append(rel)
    paths = {}
    for rel, p in files.items():
        if rel.startswith("lib/") or not is_elf(p):
            continue
        for cp in compiled_paths(p, [build, src]):
            if cp.startswith(src + "/") and not cp.startswith(build + "/"):
                rel_src = os.path.relpath(cp, src)
                mapped = next((r for r in (rel_src, "src/" + rel_src) if r in files), None)
            else:
                cands = by_base.get(os.path.basename(cp), [])
                mapped = cands[0] if len(cands) == 1 else None
            if mapped:
                paths[cp] = mapped

    for rel, p in sorted(files.items()):
        dest = os.path.join(stage, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(p, dest)
        if not is_elf(dest):
            continue
        os.chmod(dest, 0o755)
        subprocess.run(["strip", "--strip-unneeded", dest], check=True)
        depth = rel.count("/")
        up = "/".join([".."] * depth)
        set_runpath(dest, "$ORIGIN" if rel.startswith("lib/") else "$ORIGIN/%s/lib" % up)

    with open(os.path.join(stage, "tests/gpu/tests.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
    with open(os.path.join(stage, "tests/gpu/paths.json"), "w") as f:
        json.dump(paths, f, indent=1, sort_keys=True)
    commit = subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", src, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip() != ""
    manifest = {"flavour": flavour, "cuda_architectures": archs, "commit": commit,
                "dirty": dirty, "gpu_cases": len(cases),
                "packed_libraries": {s: libs[s] for s in sorted(libs)},
                "nvidia_libraries_needed": sorted(
                    {s for rel, p in files.items() if is_elf(p) for s in ldd(p) if NVIDIA.match(s)}),
                "files": sorted(files) + ["tests/gpu/tests.json", "tests/gpu/paths.json"]}
    with open(os.path.join(stage, "MANIFEST.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def write_tar(parent, top, out, manifest):
    out = os.path.abspath(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + ".tmp"
    mtime = int(subprocess.run(["git", "log", "-1", "--format=%ct"], capture_output=True,
                               text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
                or 0)

    def norm(ti):
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        ti.mtime = mtime
        return ti
    # xz through the xz tool (multi-threaded); the tar stream itself is sorted and normalised.
    raw = tmp + ".tar"
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as t:
        for dirpath, dirnames, filenames in os.walk(os.path.join(parent, top)):
            dirnames.sort()
            t.add(dirpath, arcname=os.path.relpath(dirpath, parent), recursive=False, filter=norm)
            for fn in sorted(filenames):
                p = os.path.join(dirpath, fn)
                t.add(p, arcname=os.path.relpath(p, parent), filter=norm)
    subprocess.run(["xz", "-f", "-6", "-T2", raw], check=True)
    os.replace(raw + ".xz", out)
    print("bundle: %s (%s flavour, CUDA %s, %d gpu cases, %d packed libraries): %.1f MiB"
          % (out, manifest["flavour"], manifest["cuda_architectures"], manifest["gpu_cases"],
             len(manifest["packed_libraries"]), os.path.getsize(out) / 2**20))


if __name__ == "__main__":
    main()
