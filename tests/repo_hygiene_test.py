#!/usr/bin/env python3
"""Keeps the repository self-contained: a clone with nothing beside it must build, test and read.

Two checks over every file git tracks (plus new files git does not ignore):

1. No file refers to a path outside the repository: a sibling checkout (a `shared` folder next
   to the clone), a developer's home or the machine the project was written on. System paths
   that users really have (/usr, /dev/shm, /proc, /tmp, /etc, ...) are allowed; this is a deny
   list of places a user never has. Home directories are allowed in a Dockerfile and under
   deploy/, which describe a container's own filesystem. Markdown links must not climb out of
   the repository either.
   Binary files are skipped, except the JSON header of .safetensors files, which is scanned.
2. Every citation of a project document resolves. A citation is a document name followed by
   section numbers, rule IDs or a quoted heading, e.g. ALGORITHMS.md followed by a section sign
   and 9.7, or TOOLCHAIN.md followed by P1. The document must exist (docs/NAME, a path from the
   repository root, or `conformance README` = tests/conformance/README.md) and have a heading
   with that number, a list item that starts with that rule ID, or a heading with that text.
   A bare mention of one of the docs/ documents must name a file that exists.

usage: repo_hygiene_test.py REPO_ROOT      (exit 0: clean; 1: findings, one per line)
"""
import json
import os
import re
import struct
import subprocess
import sys

# ---- 1. paths outside the repository -------------------------------------------------------------
# Written so that this file does not match its own patterns.
_NOT_PATH_CHAR = r"(?<![A-Za-z0-9_.~/$-])"
# (pattern, what it is, whether container definitions may use it: a Dockerfile or a deploy/
# manifest describes the image's own filesystem, where a home directory is legitimate)
OUTSIDE_PATTERNS = [
    (re.compile(r"\.\./+(?:\.\./+)*shared\b"), "a sibling 'shared' folder", False),
    (re.compile(r"(?<![\w-])shared/(?:docs|conformance)\b"), "the team's shared notes", False),
    (re.compile(_NOT_PATH_CHAR + r"/wor[k]/"), "a machine path under /work", False),
    (re.compile(_NOT_PATH_CHAR + r"/roo[t](?:/|\b(?![-.]))"), "root's home directory", True),
    (re.compile(_NOT_PATH_CHAR + r"/hom[e]/[A-Za-z0-9_][\w.-]*"), "a user's home directory", True),
    (re.compile(_NOT_PATH_CHAR + r"/User[s]/[A-Za-z0-9_][\w.-]*"), "a user's home directory", True),
]
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")

# ---- 2. citations -------------------------------------------------------------------------------
DOCS = ("ALGORITHMS", "ARCHITECTURE", "STYLE", "TOOLCHAIN", "DEVELOPMENT", "OPERATIONS",
        "DISTRIBUTED", "BENCHMARKS")
# A document: a path ending in an upper-case .md name, or the conformance README by its nickname.
DOC_MENTION = re.compile(
    r"(?P<path>(?<![\w/.$}-])(?:[\w.-]+/)*[A-Z][A-Z0-9_]*\.md\b|\bconformance README\b)")
# What may follow the name: section numbers, rule IDs, ranges, "steps 3-6", "pitfall", commas.
SPAN_END = re.compile(r"[()\[\];:\n`*]|\.md\b|\.(?:\s|$)")
SECTION = re.compile(r"§\s?(\d+(?:\.\d+)*)(?:\s?(?:-|–|\.\.)\s?§?\s?(\d+(?:\.\d+)*))?")
RULE_ID = re.compile(r"\b([A-Z]{1,5}-?)(\d+)\b(?:\s?(?:-|–|\.\.)\s?(?:[A-Z]{1,5}-?)?(\d+)\b)?")
QUOTED = re.compile(r'^[,]?\s?"([^"\n]{2,80})"')
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
HEADING_NUMBER = re.compile(r"^(?:§\s*)?(\d+(?:\.\d+)*)\.?(?=\s|$)")
ID_LINE = re.compile(r"^\s*(?:[-*]\s+)?(?:\*\*)?([A-Z]{1,5}-?\d+)(?=[.:)\s*–-])")


def tracked_files(root):
    """Files git tracks or would track (untracked but not ignored); a tree walk without git."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], check=True, capture_output=True).stdout
        names = sorted({n for n in out.decode("utf-8", "replace").split("\0") if n})
        return [n for n in names if os.path.isfile(os.path.join(root, n))]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for d, dirs, files in os.walk(root):
            dirs[:] = [x for x in dirs if not (x.startswith(".git") or x.startswith("build")
                                               or x in ("__pycache__", ".venv"))]
            names += [os.path.relpath(os.path.join(d, f), root) for f in files]
        return sorted(names)


def read_text(path):
    """The file's text, or the JSON header of a safetensors file; None for other binaries."""
    with open(path, "rb") as f:
        data = f.read()
    if path.endswith(".safetensors") and len(data) >= 8:
        (n,) = struct.unpack("<Q", data[:8])
        return data[8:8 + n].decode("utf-8", "replace")
    if b"\0" in data:
        return None
    return data.decode("utf-8", "replace")


class Doc:
    """Sections, rule IDs and heading texts of one markdown document."""

    def __init__(self, text):
        self.sections, self.ids, self.headings = set(), set(), []
        in_code = False
        for line in text.splitlines():
            if line.lstrip().startswith("```"):
                in_code = not in_code
                continue
            if in_code:
                continue
            h = HEADING.match(line)
            if h:
                self.headings.append(h.group(1).lower())
                n = HEADING_NUMBER.match(h.group(1))
                if n:
                    self.sections.add(n.group(1))
                continue
            i = ID_LINE.match(line)
            if i:
                self.ids.add(i.group(1))


def resolve(root, name, citing_file):
    """Repository path of a cited document, or None if no such file exists."""
    if name == "conformance README":
        candidates = ["tests/conformance/README.md"]
    elif "/" in name:
        # relative to the root or to the citing file; "$root/docs/X.md" style prefixes dropped
        parts = name.split("/")
        while len(parts) > 1 and not os.path.isdir(os.path.join(root, parts[0])):
            parts = parts[1:]
        candidates = ["/".join(parts),
                      os.path.normpath(os.path.join(os.path.dirname(citing_file), name))]
    elif name == "README.md":
        candidates = [name, "docs/" + name]  # a bare README.md is the top-level one
    else:
        candidates = ["docs/" + name, name]
    for c in candidates:
        if os.path.isfile(os.path.join(root, c)):
            return c
    return None


def expand_ids(prefix, first, last):
    if last is None:
        return [prefix + first]
    a, b = int(first), int(last)
    if b < a or b - a > 50:
        return [prefix + first, prefix + last]
    return [prefix + str(k) for k in range(a, b + 1)]


def check_citations(root, rel, text, docs, findings):
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in DOC_MENTION.finditer(line):
            name = m.group("path")
            base = os.path.basename(name)[:-3] if name.endswith(".md") else None
            rest = line[m.end():]
            end = SPAN_END.search(rest)
            span = rest[:end.start()] if end else rest
            sections = [s for g in SECTION.findall(span) for s in g if s]
            ids = [i for p, a, b in RULE_ID.findall(span) for i in expand_ids(p, a, b or None)]
            quoted = QUOTED.match(rest.lstrip(" "))
            quoted = quoted.group(1) if quoted else None
            cited = bool(sections or ids or quoted)
            path_like = "/" in name and os.path.isdir(os.path.join(root, name.split("/")[0]))
            if not cited and base not in DOCS and not path_like:
                continue  # e.g. an upstream project's CHANGELOG.md mentioned in prose
            target = resolve(root, name, rel)
            where = f"{rel}:{lineno}"
            if target is None:
                if cited or base in DOCS or path_like:
                    findings.append(f"{where}: cites {name}, which is not in the repository")
                continue
            if target not in docs:
                docs[target] = Doc(read_text(os.path.join(root, target)) or "")
            doc = docs[target]
            for s in sections:
                if s not in doc.sections:
                    findings.append(f"{where}: cites {name} §{s}, which {target} has no heading for")
            for i in ids:
                if i not in doc.ids:
                    findings.append(f"{where}: cites {name} {i}, which {target} does not define")
            if quoted and not any(quoted.lower() in h for h in doc.headings):
                findings.append(f'{where}: cites {name} "{quoted}", which {target} has no heading for')


def check_outside_paths(root, rel, text, findings):
    container = os.path.basename(rel).startswith("Dockerfile") or rel.startswith("deploy/")
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern, what, container_ok in OUTSIDE_PATTERNS:
            if container and container_ok:
                continue
            m = pattern.search(line)
            if m:
                findings.append(f"{rel}:{lineno}: refers to {what} ({m.group(0)!r})")
        if rel.endswith(".md"):
            for link in MD_LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
                    continue
                target = os.path.normpath(os.path.join(os.path.dirname(rel), link.split("#")[0]))
                if target == ".." or target.startswith("../") or os.path.isabs(link):
                    findings.append(f"{rel}:{lineno}: links outside the repository ({link})")


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    root = os.path.abspath(argv[1])
    findings, docs = [], {}
    files = tracked_files(root)
    for rel in files:
        text = read_text(os.path.join(root, rel))
        if text is None:
            continue
        check_outside_paths(root, rel, text, findings)
        check_citations(root, rel, text, docs, findings)
    for f in findings:
        print(f)
    if findings:
        print(f"repo hygiene: {len(findings)} finding(s) in {len(files)} files")
        return 1
    print(f"repo hygiene: OK ({len(files)} files, {len(docs)} cited documents)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
