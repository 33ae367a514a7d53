#!/usr/bin/env python3
"""Checks of deploy/ that need more than kubectl and promtool (run by scripts/check-deploy.sh,
with the interpreter of its venv, which has PyYAML and jsonschema).

  deploy_checks.py prometheusrule DEPLOY_DIR [--update]
      overlays/monitoring/prometheusrule.yaml must carry exactly the groups of
      prometheus/rules.yml; --update rewrites it from rules.yml.
  deploy_checks.py crs RENDERED.yaml...
      The Prometheus Operator resources (no schema ships with kubernetes-validate) against the
      fields diond uses, written from the operator's API reference: unknown fields fail.
  deploy_checks.py dashboard DASHBOARD.json
      Grafana dashboard structure: unique panel ids, a datasource and at least one PromQL
      target per graph panel, the panels the issue asks for.
"""
import json
import sys

import jsonschema
import yaml

RULE_HEADER = """\
# Generated from deploy/prometheus/rules.yml by `scripts/check-deploy.sh --update`; do not edit.
# scripts/check-deploy.sh fails when the two differ.
"""


def prometheusrule(deploy, update):
    with open(deploy + "/prometheus/rules.yml") as f:
        rules = yaml.safe_load(f)
    path = deploy + "/kubernetes/overlays/monitoring/prometheusrule.yaml"
    want = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "diond", "labels": {"release": "prometheus"}},
        "spec": {"groups": rules["groups"]},
    }
    if update:
        with open(path, "w") as f:
            f.write(RULE_HEADER)
            yaml.safe_dump(want, f, sort_keys=False, width=100)
        print("wrote " + path)
        return 0
    try:
        with open(path) as f:
            have = yaml.safe_load(f)
    except FileNotFoundError:
        have = None
    if have != want:
        print("FAIL: %s differs from prometheus/rules.yml; run scripts/check-deploy.sh --update"
              % path)
        return 1
    print("ok: PrometheusRule carries the %d groups of rules.yml" % len(rules["groups"]))
    return 0


_STR = {"type": "string"}
_LABELS = {"type": "object", "additionalProperties": _STR}
_META = {"type": "object", "required": ["name"],
         "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS,
                        "annotations": _LABELS}, "additionalProperties": False}
_SELECTOR = {"type": "object", "additionalProperties": False,
             "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}}}
_RELABEL = {"type": "object", "additionalProperties": False,
            "properties": {"sourceLabels": {"type": "array", "items": _STR}, "separator": _STR,
                           "targetLabel": _STR, "regex": _STR, "modulus": {"type": "integer"},
                           "replacement": _STR,
                           "action": {"enum": ["replace", "keep", "drop", "hashmod", "labelmap",
                                               "labeldrop", "labelkeep", "lowercase",
                                               "uppercase", "keepequal", "dropequal"]}}}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                          r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SCHEMAS = {
    "PodMonitor": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"},
            "metadata": _META,
            "spec": {"type": "object", "required": ["selector", "podMetricsEndpoints"],
                     "additionalProperties": False,
                     "properties": {
                         "selector": _SELECTOR, "jobLabel": _STR,
                         "namespaceSelector": {"type": "object"},
                         "podMetricsEndpoints": {
                             "type": "array", "minItems": 1,
                             "items": {"type": "object", "additionalProperties": False,
                                       "properties": {
                                           "port": _STR, "path": _STR, "scheme": _STR,
                                           "interval": _DURATION, "scrapeTimeout": _DURATION,
                                           "relabelings": {"type": "array", "items": _RELABEL},
                                           "metricRelabelings": {"type": "array",
                                                                 "items": _RELABEL}}}}}}}},
    "PrometheusRule": {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PrometheusRule"}, "metadata": _META,
            "spec": {"type": "object", "required": ["groups"], "additionalProperties": False,
                     "properties": {"groups": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "required": ["name", "rules"],
                         "additionalProperties": False,
                         "properties": {"name": _STR, "interval": _DURATION, "rules": {
                             "type": "array", "minItems": 1, "items": {
                                 "type": "object", "required": ["expr"],
                                 "additionalProperties": False,
                                 "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                 "properties": {"alert": _STR, "record": _STR, "expr": _STR,
                                                "for": _DURATION, "labels": _LABELS,
                                                "annotations": _LABELS}}}}}}}}}},
}


def crs(paths):
    seen = 0
    bad = 0
    for path in paths:
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if not doc or not str(doc.get("apiVersion", "")).startswith(
                        "monitoring.coreos.com/"):
                    continue
                kind = doc.get("kind")
                schema = SCHEMAS.get(kind)
                name = "%s %s/%s" % (path, kind, doc.get("metadata", {}).get("name"))
                if schema is None:
                    print("FAIL: %s: no schema for kind %s" % (name, kind))
                    bad += 1
                    continue
                errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc),
                                key=lambda e: list(e.path))
                for e in errors:
                    print("FAIL: %s: %s: %s" % (name, "/".join(map(str, e.path)), e.message))
                bad += bool(errors)
                seen += 1
    if seen == 0:
        print("FAIL: no Prometheus Operator resource found in %s" % " ".join(paths))
        return 1
    print("ok: %d Prometheus Operator resource(s) valid" % seen)
    return 1 if bad else 0


# The rows the dashboard must have (docs/OPERATIONS.md "Dashboard"), each matched by a word in a
# panel title.
REQUIRED_PANELS = ["steps per second", "step outcomes", "step latency", "service time",
                   "bytes per step", "sessions", "memory", "checkpoint age",
                   "checkpoint failures", "world membership", "checksum mismatches",
                   "rpc errors"]


def dashboard(path):
    with open(path) as f:
        d = json.load(f)
    panels = []

    def walk(ps):
        for p in ps:
            panels.append(p)
            walk(p.get("panels", []))
    walk(d.get("panels", []))
    problems = []
    ids = [p.get("id") for p in panels]
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique: %s" % ids)
    for p in panels:
        if p.get("type") == "row":
            continue
        targets = [t for t in p.get("targets", []) if t.get("expr")]
        if not targets:
            problems.append("panel %r has no PromQL target" % p.get("title"))
        if "datasource" not in p:
            problems.append("panel %r has no datasource" % p.get("title"))
    titles = " | ".join(p.get("title", "").lower() for p in panels)
    for want in REQUIRED_PANELS:
        if want not in titles:
            problems.append("no panel titled with %r" % want)
    for p in problems:
        print("FAIL: %s: %s" % (path, p))
    if not problems:
        print("ok: %s: %d panels" % (path, len(panels)))
    return 1 if problems else 0


def main(argv):
    if len(argv) >= 3 and argv[1] == "prometheusrule":
        return prometheusrule(argv[2], "--update" in argv[3:])
    if len(argv) >= 3 and argv[1] == "crs":
        return crs(argv[2:])
    if len(argv) == 3 and argv[1] == "dashboard":
        return dashboard(argv[2])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
