#!/usr/bin/env python3
"""Keeps files and functions small enough to read (STYLE.md S4).

Two limits over every C++ source git tracks (plus new files git does not ignore):

1. A `.cc` or `.cu` file has at most 600 lines.
2. A function (in a .cc, .h, .cu or .cuh) has at most 150 lines, from the line of its name to
   its closing brace. A GoogleTest body (TEST, TEST_F, TEST_P) counts as a function.

Function extents come from Universal Ctags (`--fields=+ne`: start and end line of every
function definition; Debian package universal-ctags, installed by scripts/install-deps.sh), not
from a home-made parser: ctags' C++ parser knows templates, macros, raw strings and lambdas.

Known offenders are listed, each with its reason, in tests/size_limits_exceptions.txt. The test
fails on an offender the list does not name, on an entry without a reason, and on an entry that
is no longer needed (the file or function shrank, moved or was renamed), so that the list stays
exactly today's offenders and only shrinks.

usage: size_limits_test.py REPO_ROOT [EXCEPTIONS_FILE]   (exit 0: clean; 1: findings)
       size_limits_test.py --mutations REPO_ROOT [EXCEPTIONS_FILE]
           checks the check: removing any one exception, or adding a stale one, must fail it
"""
import json
import os
import re
import subprocess
import sys

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 150
FILE_SUFFIXES = (".cc", ".cu")
FUNCTION_SUFFIXES = (".cc", ".h", ".cu", ".cuh")
EXCEPTIONS = "tests/size_limits_exceptions.txt"
# GoogleTest's macros look like functions named TEST; their arguments name them.
MACRO_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")


def source_files(root):
    """C++ files git tracks or would track (untracked but not ignored)."""
    out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                          "--exclude-standard"], check=True, capture_output=True).stdout
    names = sorted({n for n in out.decode("utf-8", "replace").split("\0") if n})
    return [n for n in names
            if n.endswith(FUNCTION_SUFFIXES) and os.path.isfile(os.path.join(root, n))]


def line_count(path):
    with open(path, "rb") as f:
        return f.read().count(b"\n")


def function_key(tag):
    """How a function is named in the exceptions list: `Class::Name`, `Name`, or
    `TEST_F(Suite,Case)` for a test body. Overloads in one file share a key."""
    name = tag["name"]
    if MACRO_NAME.match(name):
        return name + re.sub(r"\s+", "", tag.get("signature", ""))
    if tag.get("scopeKind") in ("class", "struct", "union"):
        return tag["scope"].split("::")[-1] + "::" + name
    return name


def functions(root, files):
    """(path, key, start, end) of every function definition, from ctags."""
    try:
        version = subprocess.run(["ctags", "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = ""
    if "Universal Ctags" not in version:
        sys.exit("size limits: needs Universal Ctags on PATH as `ctags` (Debian package "
                 "universal-ctags; bash scripts/install-deps.sh)")
    todo = [f for f in files if f.endswith(FUNCTION_SUFFIXES)]
    out = subprocess.run(
        ["ctags", "--output-format=json", "--fields=+neS", "--kinds-C++=f", "--kinds-CUDA=f",
         "--extras=-F", "-L", "-", "-o", "-"],
        cwd=root, input="\n".join(todo) + "\n", capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        tag = json.loads(line)
        if tag.get("_type") != "tag" or tag.get("kind") != "function":
            continue
        if "end" not in tag:
            sys.exit(f"size limits: ctags gave no end line for {tag['path']}:{tag['line']}")
        found.append((tag["path"], function_key(tag), tag["line"], tag["end"]))
    return found


def read_exceptions(path, findings):
    """{(path, function key or None): reason}. A line is `file PATH -- REASON` or
    `function PATH KEY -- REASON`; # starts a comment."""
    allowed = {}
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"{os.path.basename(path)}:{lineno}"
            head, sep, reason = line.partition(" -- ")
            words = head.split()
            if not sep or not reason.strip():
                findings.append(f"{where}: an exception needs ' -- ' and a reason: {line}")
                continue
            if words[:1] == ["file"] and len(words) == 2:
                key = (words[1], None)
            elif words[:1] == ["function"] and len(words) == 3:
                key = (words[1], words[2])
            else:
                findings.append(f"{where}: expected `file PATH -- REASON` or "
                                f"`function PATH NAME -- REASON`: {line}")
                continue
            if key in allowed:
                findings.append(f"{where}: listed twice: {' '.join(words)}")
            allowed[key] = reason.strip()
    return allowed


def offenders(root, files):
    """{(path, function key or None): finding} of everything over a limit."""
    found = {}
    for rel in files:
        if not rel.endswith(FILE_SUFFIXES):
            continue
        n = line_count(os.path.join(root, rel))
        if n > MAX_FILE_LINES:
            found[(rel, None)] = (f"{rel}: {n} lines, over {MAX_FILE_LINES}: split it by "
                                  f"responsibility (STYLE.md S2-S4)")
    for rel, key, start, end in sorted(functions(root, files)):
        n = end - start + 1
        if n > MAX_FUNCTION_LINES and (rel, key) not in found:
            found[(rel, key)] = (f"{rel}:{start}: function {key} is {n} lines, over "
                                 f"{MAX_FUNCTION_LINES}: split it (STYLE.md S4)")
    return found


def check(found, allowed):
    """Findings: offenders not in `allowed`, then entries of `allowed` no longer needed."""
    findings = [msg for k, msg in found.items() if k not in allowed]
    for (rel, key) in sorted(set(allowed) - set(found), key=lambda k: (k[0], k[1] or "")):
        what = f"function {key} in" if key else "file"
        findings.append(f"{EXCEPTIONS}: {what} {rel} is within the limits now (or gone): "
                        f"remove its exception")
    return findings


def mutations(found, allowed):
    """The check must fail when any one exception is removed, and when a stale one is added.
    Returns what it did not catch."""
    missed = []
    for k in allowed:
        if not check(found, {x: r for x, r in allowed.items() if x != k}):
            missed.append(f"removing the exception {k} went unnoticed")
    if not check(found, {**allowed, ("no/such/file.cc", None): "stale"}):
        missed.append("a stale exception went unnoticed")
    return missed


def main(argv):
    args = argv[1:]
    mutate = bool(args) and args[0] == "--mutations"
    if mutate:
        args = args[1:]
    if len(args) not in (1, 2):
        print(__doc__)
        return 2
    root = os.path.abspath(args[0])
    exceptions_path = args[1] if len(args) == 2 else os.path.join(root, EXCEPTIONS)
    findings = []
    allowed = read_exceptions(exceptions_path, findings)
    files = source_files(root)
    found = offenders(root, files)
    if mutate:
        missed = mutations(found, allowed)
        for m in missed:
            print(m)
        print(f"size limits mutations: {len(allowed) + 1 - len(missed)} of {len(allowed) + 1} "
              f"caught")
        return 1 if missed or not allowed else 0
    findings += check(found, allowed)
    for f in findings:
        print(f)
    if findings:
        print(f"size limits: {len(findings)} finding(s) in {len(files)} files")
        return 1
    print(f"size limits: OK ({len(files)} files, {len(allowed)} listed exceptions)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
