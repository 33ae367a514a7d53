#!/usr/bin/env python3
"""Runs a bundle's `gpu`-labelled test cases without ctest or a build tree.

    run_gpu_tests.py BUNDLE_DIR LOG_DIR [--junit FILE] [--deadline UNIX_SECONDS]

tests/gpu/tests.json lists the cases as ctest would run them (command, timeout, skip rules,
environment), each command with @BUNDLE@ for the bundle's folder. Absolute build paths compiled
into the executables (tests/gpu/paths.json, e.g. a test's default plugin path) are made to exist
first, each as a symbolic link to the bundle file it stands for, and removed afterwards; an
existing path is never touched (the case may then fail, and the log says why).
Each case: LOG_DIR/<executable>.<case>.log, and for GoogleTest cases
LOG_DIR/gtest/<executable>.<case>.json. A case is
skipped like ctest skips it (SKIP_REGULAR_EXPRESSION, SKIP_RETURN_CODE). Cases not started
before --deadline are recorded as not run. Exit status: 0 when no case failed or was left out.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from xml.sax.saxutils import escape, quoteattr


def link_compiled_paths(bundle, log):
    made = []
    with open(os.path.join(bundle, "tests/gpu/paths.json")) as f:
        paths = json.load(f)
    for absolute, rel in sorted(paths.items()):
        target = os.path.join(bundle, rel)
        if os.path.lexists(absolute):
            if os.path.realpath(absolute) != os.path.realpath(target):
                log("path %s already exists here; it is left alone, not linked to %s"
                    % (absolute, rel))
            continue
        parent = os.path.dirname(absolute)
        created = []
        d = parent
        while not os.path.exists(d):
            created.append(d)
            d = os.path.dirname(d)
        try:
            os.makedirs(parent, exist_ok=True)
            os.symlink(target, absolute)
        except OSError as e:
            log("cannot link %s -> %s (%s): cases that load it will fail" % (absolute, rel, e))
            continue
        made.append((absolute, created))
        log("linked %s -> %s" % (absolute, rel))
    return made


def unlink_compiled_paths(made):
    dirs = set()
    for absolute, created in made:
        try:
            os.unlink(absolute)
        except OSError:
            pass
        dirs.update(created)
    for d in sorted(dirs, key=len, reverse=True):  # innermost first
        try:
            os.rmdir(d)
        except OSError:
            pass


def safe(name):
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("logs")
    ap.add_argument("--junit")
    ap.add_argument("--deadline", type=float, default=0)
    a = ap.parse_args()
    bundle = os.path.abspath(a.bundle)
    os.makedirs(os.path.join(a.logs, "gtest"), exist_ok=True)
    with open(os.path.join(bundle, "tests/gpu/tests.json")) as f:
        cases = json.load(f)["cases"]

    def log(msg):
        print("run_gpu_tests: " + msg, flush=True)

    made = link_compiled_paths(bundle, log)
    results = []
    try:
        for c in cases:
            name = c["name"]
            if a.deadline and time.time() >= a.deadline:
                results.append({"name": name, "status": "notrun", "seconds": 0.0,
                                "detail": "the check's time budget ran out before this case"})
                continue
            cmd = [arg.replace("@BUNDLE@", bundle) for arg in c["command"]]
            # Two executables may have cases of one name (ctest keeps both): the file names of a
            # case's log and JSON start with its executable's.
            stem = safe(os.path.basename(cmd[0])) + "." + safe(name)
            gtest = any(arg.startswith("--gtest_filter=") for arg in cmd)
            if gtest:
                cmd.append("--gtest_output=json:" + os.path.join(a.logs, "gtest", stem + ".json"))
            env = dict(os.environ)
            for kv in c.get("environment", []):
                k, _, v = kv.partition("=")
                env[k] = v.replace("@BUNDLE@", bundle)
            limit = c.get("timeout") or 1500
            if a.deadline:
                limit = max(1.0, min(limit, a.deadline - time.time()))
            t0 = time.time()
            try:
                p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   timeout=limit)
                out, rc = p.stdout.decode(errors="replace"), p.returncode
            except subprocess.TimeoutExpired as e:
                out = (e.stdout or b"").decode(errors="replace") + "\n[timed out after %.0f s]" % limit
                rc = None
            except OSError as e:
                out, rc = "cannot start %s: %s" % (cmd[0], e), None
            secs = time.time() - t0
            with open(os.path.join(a.logs, stem + ".log"), "w") as f:
                f.write("$ %s\n%s" % (" ".join(cmd), out))
            skip_re = c.get("skip_regex") or []
            if isinstance(skip_re, str):
                skip_re = [skip_re]
            if rc is not None and (any(re.search(r, out) for r in skip_re)
                                   or (c.get("skip_code") is not None and rc == int(c["skip_code"]))):
                status = "skipped"
            elif rc == 0:
                status = "passed"
            else:
                status = "failed"
            detail = "" if status == "passed" else (out[-2000:] if rc is not None else out[-500:])
            results.append({"name": stem.split(".")[0] + ": " + name, "status": status,
                            "seconds": round(secs, 2),
                            "exit": rc, "detail": detail})
            log("%-8s %6.1f s  %s" % (status, secs, results[-1]["name"]))
    finally:
        unlink_compiled_paths(made)

    counts = {s: sum(r["status"] == s for r in results)
              for s in ("passed", "failed", "skipped", "notrun")}
    log("%d cases: %s" % (len(results), ", ".join("%d %s" % (n, s) for s, n in counts.items())))
    if a.junit:
        with open(a.junit, "w") as f:
            f.write('<?xml version="1.0" encoding="UTF-8"?>\n<testsuite name="gpu" tests="%d" '
                    'failures="%d" skipped="%d">\n' % (len(results), counts["failed"],
                                                        counts["skipped"] + counts["notrun"]))
            for r in results:
                f.write('  <testcase name=%s time="%.2f">' % (quoteattr(r["name"]), r["seconds"]))
                if r["status"] == "failed":
                    f.write('<failure message="exit %s">%s</failure>' % (r["exit"], escape(r["detail"])))
                elif r["status"] in ("skipped", "notrun"):
                    f.write('<skipped message=%s/>' % quoteattr(r["status"]))
                f.write("</testcase>\n")
            f.write("</testsuite>\n")
    # A GPU run where every case skipped tested nothing: that is a failure, not a pass.
    if results and counts["skipped"] == len(results):
        log("every case skipped: the GPU was not usable by the tests")
        return 1
    return 0 if counts["failed"] == 0 and counts["notrun"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
