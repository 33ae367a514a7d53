"""Every panel of deploy/grafana/diond.json shows data from a real Prometheus scraping real daemons.

Two daemons form a world on loopback; trainers step a local and a world session (with skipped,
replayed and refused steps, and automatic checkpoints). A real Prometheus (the `prometheus`
package) scrapes both daemons every second and loads deploy/prometheus/rules.yml. Then every
PromQL target of every panel, with the dashboard's variables bound as Grafana would bind "All"
($job, $instance -> .*, $__rate_interval -> 15s), is run through the HTTP API (/api/v1/query).
A target that returns no series, or only NaN, fails the test: a panel that shows nothing is a
failing test. The alert rules, loaded into the same Prometheus, must all evaluate without error.
"""
import json
import math
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ops_harness as h  # noqa: E402

DASHBOARD = os.path.join(h.REPO, "deploy", "grafana", "diond.json")
RULES = os.path.join(h.REPO, "deploy", "prometheus", "rules.yml")
BINDINGS = {"$__rate_interval": "15s", "${job}": ".*", "$job": ".*", "${instance}": ".*",
            "$instance": ".*"}


def targets(dashboard):
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p["title"], t["refId"], t["expr"]))
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    return out


def bind(expr):
    for k in sorted(BINDINGS, key=len, reverse=True):
        expr = expr.replace(k, BINDINGS[k])
    return expr


def query(port, expr):
    url = "http://127.0.0.1:%d/api/v1/query?%s" % (port, urllib.parse.urlencode({"query": expr}))
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise AssertionError("query failed: %s: %s" % (expr, body))
    data = body["data"]
    if data["resultType"] == "scalar":
        return [float(data["result"][1])]
    return [float(s["value"][1]) for s in data["result"]]


def main():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    todo = targets(dashboard)
    assert todo, "no PromQL targets in " + DASHBOARD
    world = h.OpsWorld(checkpoint_every=5).start()
    prom = None
    failures = []
    try:
        world.wait_steps(5)
        pport = h.free_port()
        cfg = os.path.join(world.dir, "prometheus.yml")
        with open(cfg, "w") as f:
            f.write("global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
                    "rule_files: ['%s']\n"
                    "scrape_configs:\n"
                    "  - job_name: diond\n"
                    "    static_configs: [{targets: ['127.0.0.1:%d', '127.0.0.1:%d']}]\n"
                    % (RULES, world.metrics_port(0), world.metrics_port(1)))
        log = open(os.path.join(world.dir, "prometheus.log"), "wb")
        prom = subprocess.Popen(["prometheus", "--config.file=" + cfg,
                                 "--web.listen-address=127.0.0.1:%d" % pport,
                                 "--storage.tsdb.path=" + os.path.join(world.dir, "tsdb")],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        # Both targets up, then enough samples for the 15 s rate windows.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if query(pport, 'sum(up{job="diond"})') == [2.0]:
                    break
            except OSError:
                pass
            if prom.poll() is not None:
                raise RuntimeError("prometheus exited: %s" % open(log.name).read()[-2000:])
            time.sleep(0.5)
        else:
            raise RuntimeError("prometheus never saw both daemons up")
        time.sleep(16)
        pending = list(todo)
        # Rate and quantile panels need an event inside their 15 s window at query time; on a
        # loaded machine the trainers step (and checkpoint) slowly, so keep asking for a while
        # (the test's ctest TIMEOUT is 300 s: 90 + 16 + 150 stays under it).
        deadline = time.monotonic() + 150
        last = {}
        while pending and time.monotonic() < deadline:
            still = []
            for title, ref, expr in pending:
                values = query(pport, bind(expr))
                last[(title, ref)] = values
                if not any(not math.isnan(v) for v in values):
                    still.append((title, ref, expr))
            pending = still
            if pending:
                time.sleep(2)
        for title, ref, expr in pending:
            failures.append("panel %r target %s shows nothing: %s -> %s"
                            % (title, ref, bind(expr), last.get((title, ref))))
        for title, ref, expr in todo:
            if (title, ref, expr) not in pending:
                print("ok: %s [%s]: %d series, e.g. %g" % (title, ref, len(last[(title, ref)]),
                                                          next(v for v in last[(title, ref)]
                                                               if not math.isnan(v))))
        # The alert rules loaded into the same Prometheus evaluate without errors on real series.
        with urllib.request.urlopen("http://127.0.0.1:%d/api/v1/rules" % pport, timeout=10) as r:
            groups = json.load(r)["data"]["groups"]
        rules = [rule for g in groups for rule in g["rules"]]
        if not rules:
            failures.append("prometheus loaded no rules from " + RULES)
        for rule in rules:
            if rule.get("health") != "ok":
                failures.append("rule %s: health %s: %s" % (rule["name"], rule.get("health"),
                                                            rule.get("lastError")))
        print("rules: %d loaded, %d healthy" % (len(rules),
                                                sum(r.get("health") == "ok" for r in rules)))
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        rcs = world.close()
    if rcs != [0, 0]:
        failures.append("daemons did not exit cleanly: %s" % rcs)
    for f in failures:
        print("FAIL: " + f)
    print("dashboard: %d targets, %d without data" % (len(todo), len(failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
