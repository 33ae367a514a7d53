#!/usr/bin/env python3
"""The bundle's target-side tools on small synthetic bundles (docs/GPU.md "The bundle").

check-libs.sh: a binary whose libraries are not packed fails, naming each library and that it
resolve outside the bundle; packed with an $ORIGIN RUNPATH it passes; a missing library is named;
an NVIDIA library is tolerated only with --allow-missing-nvidia.
run_gpu_tests.py: pass / fail / skip (regex and return code) / timeout / deadline as ctest would
classify them, a run where every case skipped fails, and compiled-in paths are linked for the
run and removed afterwards.

usage: bundle_tools_test.py REPO_ROOT
"""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

REPO = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), ".."))
CHECK_LIBS = os.path.join(REPO, "scripts/bundle/check-libs.sh")
RUNNER = os.path.join(REPO, "scripts/bundle/run_gpu_tests.py")
PACK = os.path.join(REPO, "scripts/bundle/pack.py")


def load_pack():
    spec = importlib.util.spec_from_file_location("diond_pack", PACK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ldd_deps(path):
    out = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
    deps = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>" and parts[2].startswith("/"):
            deps[parts[0]] = parts[2]
    return deps


class CheckLibsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.bundle = os.path.join(self.tmp, "b")
        os.makedirs(os.path.join(self.bundle, "bin"))
        os.makedirs(os.path.join(self.bundle, "lib"))
        self.exe = os.path.join(self.bundle, "bin", "ls")
        shutil.copy(shutil.which("ls"), self.exe)
        allowed = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")
        self.packable = {s: p for s, p in ldd_deps(self.exe).items() if s not in allowed}
        if not self.packable:
            self.skipTest("ls loads only glibc here: nothing to pack")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def check(self, *args):
        return subprocess.run(["bash", CHECK_LIBS, self.bundle, *args], capture_output=True,
                              text=True)

    def pack(self):
        for soname, path in self.packable.items():
            dest = os.path.join(self.bundle, "lib", soname)
            shutil.copy(os.path.realpath(path), dest)
            subprocess.run(["patchelf", "--set-rpath", "$ORIGIN", dest], check=True)
        subprocess.run(["patchelf", "--set-rpath", "$ORIGIN/../lib", self.exe], check=True)

    def test_unpacked_libraries_resolve_outside_and_fail(self):
        r = self.check()
        self.assertEqual(r.returncode, 1, r.stdout)
        for soname in self.packable:
            self.assertIn("bin/ls: %s resolves to" % soname, r.stdout)
            self.assertIn("outside the bundle's lib/", r.stdout)

    def test_packed_with_origin_runpath_passes(self):
        self.pack()
        r = self.check()
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("resolve every library they load", r.stdout)

    def test_a_missing_packed_library_is_named(self):
        self.pack()
        gone = sorted(self.packable)[0]
        os.unlink(os.path.join(self.bundle, "lib", gone))
        r = self.check()
        self.assertEqual(r.returncode, 1, r.stdout)
        # not found, or found on this machine outside the bundle: both are named
        self.assertRegex(r.stdout, r"bin/ls: %s (not found|resolves to \S+, outside)" % gone)

    def test_missing_nvidia_library_only_with_the_flag(self):
        self.pack()
        # A packed library that needs libnccl.so.2, which this machine may or may not have: take
        # it out of the search by renaming the dependency to a name nothing provides.
        lib = os.path.join(self.bundle, "lib", sorted(self.packable)[0])
        subprocess.run(["patchelf", "--add-needed", "libnvidia-diondtest.so.1", lib], check=True)
        r = self.check()
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("libnvidia-diondtest.so.1 not found", r.stdout)
        r = self.check("--allow-missing-nvidia")
        self.assertEqual(r.returncode, 0, r.stdout)
        self.assertIn("(allowed): libnvidia-diondtest.so.1", r.stdout)


class RunnerTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.bundle = os.path.join(self.tmp, "b")
        os.makedirs(os.path.join(self.bundle, "tests/gpu/bin"))
        self.compiled = os.path.join(self.tmp, "gone/build/bin/plugin.so")
        with open(os.path.join(self.bundle, "tests/gpu/bin/plugin.so"), "w") as f:
            f.write("plugin")

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def run_cases(self, cases, *args):
        with open(os.path.join(self.bundle, "tests/gpu/tests.json"), "w") as f:
            json.dump({"cases": cases}, f)
        with open(os.path.join(self.bundle, "tests/gpu/paths.json"), "w") as f:
            json.dump({self.compiled: "tests/gpu/bin/plugin.so"}, f)
        logs = os.path.join(self.tmp, "logs")
        junit = os.path.join(self.tmp, "junit.xml")
        r = subprocess.run([sys.executable, RUNNER, self.bundle, logs, "--junit", junit, *args],
                           capture_output=True, text=True)
        with open(junit) as f:
            return r, f.read()

    @staticmethod
    def case(name, script, **kw):
        c = {"name": name, "command": ["bash", "-c", script], "timeout": 10, "skip_regex": [],
             "skip_code": None, "environment": [], "labels": ["gpu"]}
        c.update(kw)
        return c

    def test_classifies_like_ctest_and_links_compiled_paths(self):
        compiled = self.compiled
        cases = [
            # reads the compiled-in path: it must exist, as a link to the bundle's file
            self.case("passes", 'test "$(cat %s)" = plugin && test "$DIOND_X" = y' % compiled,
                      environment=["DIOND_X=y"]),
            self.case("fails", "echo broken; exit 3"),
            self.case("skips_by_regex", "echo '[  SKIPPED ] no GPU'; exit 0",
                      skip_regex=["\\[  SKIPPED \\]"]),
            self.case("skips_by_code", "exit 77", skip_code="77"),
            self.case("times_out", "sleep 30", timeout=1),
        ]
        r, junit = self.run_cases(cases)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("1 passed, 2 failed, 2 skipped, 0 notrun", r.stdout)
        self.assertIn('failures="2" skipped="2"', junit)
        self.assertIn("linked %s" % compiled, r.stdout)
        self.assertFalse(os.path.lexists(compiled), "the link outlived the run")
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "gone")),
                         "folders made for the link outlived the run")
        with open(os.path.join(self.tmp, "logs", "bash.fails.log")) as f:
            self.assertIn("broken", f.read())

    def test_every_case_skipped_is_a_failure(self):
        r, _ = self.run_cases([self.case("a", "exit 77", skip_code="77"),
                               self.case("b", "exit 77", skip_code="77")])
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("every case skipped", r.stdout)

    def test_all_passing_exits_zero(self):
        r, _ = self.run_cases([self.case("a", "true"), self.case("b", "true")])
        self.assertEqual(r.returncode, 0, r.stdout)

    def test_cases_past_the_deadline_are_not_run(self):
        r, junit = self.run_cases([self.case("a", "true")], "--deadline", "1")
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("0 passed, 0 failed, 0 skipped, 1 notrun", r.stdout)

    def test_an_existing_path_is_left_alone(self):
        os.makedirs(os.path.dirname(self.compiled))
        with open(self.compiled, "w") as f:
            f.write("someone else's")
        r, _ = self.run_cases([self.case("a", "true")])
        self.assertIn("already exists here; it is left alone", r.stdout)
        with open(self.compiled) as f:
            self.assertEqual(f.read(), "someone else's")


class RunpathTest(unittest.TestCase):
    """The build links OpenBLAS from .../openblas-pthread, whose tail "read" the linker shares
    with the symbol read(); the bundle's RUNPATH rewrite must not rename it."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        src = os.path.join(self.tmp, "t.c")
        with open(src, "w") as f:
            f.write("#include <unistd.h>\n"
                    "int main(void) { char b[1]; return (int)read(0, b, 0); }\n")
        self.exe = os.path.join(self.tmp, "t")
        subprocess.run(["cc", src, "-o", self.exe, "-Wl,--enable-new-dtags",
                        "-Wl,-rpath,/usr/lib/x86_64-linux-gnu/openblas-pthread"], check=True)
        self.pack = load_pack()

    def tearDown(self):
        shutil.rmtree(self.tmp)

    def names(self):
        return self.pack.dynamic_names(self.exe)[0]

    def test_a_symbol_sharing_the_old_runpath_keeps_its_name(self):
        self.assertIn("read@GLIBC_2.2.5", self.names())
        self.pack.set_runpath(self.exe, "$ORIGIN/../lib")
        self.assertIn("read@GLIBC_2.2.5", self.names())
        self.assertFalse([n for n in self.names() if n.startswith("XX")])
        dyn = subprocess.run(["readelf", "-d", self.exe], capture_output=True, text=True).stdout
        self.assertIn("Library runpath: [$ORIGIN/../lib]", dyn)
        r = subprocess.run([self.exe], stdin=subprocess.DEVNULL)
        self.assertEqual(r.returncode, 0)

    def test_a_rewrite_that_changes_a_name_is_refused(self):
        # A patchelf that also adds a library stands for any rewrite that changes a name.
        fake = os.path.join(self.tmp, "fakebin")
        os.makedirs(fake)
        with open(os.path.join(fake, "patchelf"), "w") as f:
            f.write("#!/bin/sh\nfor a; do last=$a; done\n"
                    "%s \"$@\" && exec %s --add-needed libextra.so.1 \"$last\"\n"
                    % (shutil.which("patchelf"), shutil.which("patchelf")))
        os.chmod(os.path.join(fake, "patchelf"), 0o755)
        env = dict(os.environ, PATH=fake + os.pathsep + os.environ["PATH"])
        r = subprocess.run([sys.executable, "-c",
                            "import importlib.util as u, sys;"
                            "s = u.spec_from_file_location('p', sys.argv[1]);"
                            "m = u.module_from_spec(s); s.loader.exec_module(m);"
                            "m.set_runpath(sys.argv[2], '$ORIGIN')", PACK, self.exe],
                           capture_output=True, text=True, env=env)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("changed its dynamic names", r.stderr)
        self.assertIn("libextra.so.1", r.stderr)


if __name__ == "__main__":
    unittest.main()
