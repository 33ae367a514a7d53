"""The metric catalogue of docs/OPERATIONS.md against a live /metrics.

Two daemons form a world; a local and a world session step (applied, skipped, replayed and a
refused step), checkpoints are written, so every series the daemon can export exists. Then the
union of both daemons' metric families must equal the catalogue's rows: same names, same type,
same label names (histogram `le` and summary `quantile` aside). The failure message names each
metric and the side it is missing from.
"""
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops_harness as h  # noqa: E402

DOC = os.path.join(h.REPO, "docs", "OPERATIONS.md")
SECTION = "## Metric catalogue"


def catalogue():
    """{name: (type, {labels})} from the table under SECTION."""
    with open(DOC) as f:
        text = f.read()
    if SECTION not in text:
        raise AssertionError("%s has no '%s' section" % (DOC, SECTION))
    body = text.split(SECTION, 1)[1]
    body = re.split(r"\n## ", body, maxsplit=1)[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        kind = cells[1].lower()
        labels = set(re.findall(r"`([a-zA-Z_][a-zA-Z0-9_]*)`", cells[2]))
        if name in rows:
            raise AssertionError("%s lists %s twice" % (DOC, name))
        rows[name] = (kind, labels)
    if not rows:
        raise AssertionError("no metric rows under '%s' in %s" % (SECTION, DOC))
    return rows


def live(world):
    """{name: (type, {labels})}, union over both daemons."""
    out = {}
    for i in range(2):
        for name, fam in h.scrape(world.metrics_port(i)).items():
            labels = set()
            for _, l, _ in fam["samples"]:
                labels |= set(l) - {"le", "quantile"}
            kind, have = out.get(name, (fam["type"], set()))
            out[name] = (kind, have | labels)
    return out


def main():
    documented = catalogue()
    world = h.OpsWorld(checkpoint_every=3).start()
    try:
        world.wait_steps(15)
        # A requested checkpoint too (SaveCheckpoint RPC), and a refused one (unknown session).
        with h.diond.Client(world.daemons[0].target) as c:
            c.save_checkpoint(world.local_session)
            try:
                c.save_checkpoint("s-none")
            except h.diond.DiondError:
                pass
        exported = live(world)
    finally:
        rcs = world.close()
    problems = []
    for name in sorted(set(exported) - set(documented)):
        problems.append("undocumented: %s (%s, labels %s) is on /metrics but not in %s"
                        % (name, exported[name][0], sorted(exported[name][1]) or "none", DOC))
    for name in sorted(set(documented) - set(exported)):
        problems.append("missing: %s is documented in %s but not on /metrics" % (name, DOC))
    for name in sorted(set(documented) & set(exported)):
        (dk, dl), (ek, el) = documented[name], exported[name]
        if dk != ek:
            problems.append("type: %s is documented as %s, /metrics says %s" % (name, dk, ek))
        if dl != el:
            problems.append("labels: %s is documented with %s, /metrics has %s"
                            % (name, sorted(dl) or "none", sorted(el) or "none"))
    if rcs != [0, 0]:
        problems.append("daemons did not exit cleanly: %s" % rcs)
    for p in problems:
        print("FAIL: " + p)
    print("catalogue: %d documented, %d exported, %d problem(s)"
          % (len(documented), len(exported), len(problems)))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
