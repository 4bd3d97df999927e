"""The Kubernetes manifests in docs/k8s: valid against the Kubernetes schema
(kubernetes-validate --strict), every specd flag they pass is one `specd serve` accepts,
and the shutdown timing adds up (the kubelet's grace period covers drain grace + drain
timeout, probes point at /ready and /health)."""
import os
import subprocess

import yaml

from conftest import BIN, REPO

MANIFEST = os.path.join(REPO, "docs", "k8s", "specd.yaml")


def deployment():
    docs = list(yaml.safe_load_all(open(MANIFEST)))
    return next(d for d in docs if d["kind"] == "Deployment"), docs


def test_manifest_passes_the_schema_check():
    r = subprocess.run(["python3", "-m", "kubernetes_validate", "--strict", MANIFEST], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") == 2, r.stdout


def test_manifest_flags_and_timing(tmp_path):
    dep, docs = deployment()
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    args = list(c["args"])
    assert args[0] == "serve"
    keys = tmp_path / "keys"
    keys.write_text("k\n")
    args = [str(keys) if a == "/etc/specd/keys/keys" else a for a in args]
    r = subprocess.run([BIN, *args, "--print-config"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr          # every flag exists and its value is valid
    cfg = yaml.safe_load(r.stdout)
    assert cfg["device"] == "cuda" and cfg["port"] == 8000
    grace = pod["terminationGracePeriodSeconds"]
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert grace > pre + cfg["drain_grace"] + cfg["drain_timeout"], (grace, pre, cfg["drain_grace"], cfg["drain_timeout"])
    rp = c["readinessProbe"]
    assert rp["httpGet"]["path"] == "/ready" and c["livenessProbe"]["httpGet"]["path"] == "/health"
    # the probe notices within the drain grace
    assert rp["periodSeconds"] * rp["failureThreshold"] < cfg["drain_grace"]
    svc = next(d for d in docs if d["kind"] == "Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
