"""The processes test's kubelet (tests/k8s_cluster.py) on a container that never answers its startupProbe.

A vLLM pod's start hung in tests/e2e/test_k8s_processes.py twice: in CI of stop 41 (vllm-stable onto v1) and in a
run of stop 43 (vllm-canary onto v2: its server logged `Enabled custom fusions` and then nothing for 600 s, its
engine process never a line). The manifests' startupProbe is what recovers from that on a cluster, and the
harness did not run it: the rollout waited out `rollout.restart_wait_s` and failed. Here it is run, on a plain
process that hangs, so the test that relies on it can be trusted to kill, to say where it hung, and to restart.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.k8s_cluster import VENV, Cluster

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="each pod's mount and UTS namespace needs root")

NAMESPACE = "kubelet-test"


def hanging_deployment(period_s: int, failures: int) -> dict:
    container = {
        "name": "hangs",
        "image": "dynrubric:test",
        "command": [str(VENV / "bin" / "python"), "-c", "import time\nwhile True:\n    time.sleep(0.2)"],
        "env": [{"name": "PYTHONFAULTHANDLER", "value": "1"}],
        "startupProbe": {
            "httpGet": {"path": "/health", "port": 8080},
            "periodSeconds": period_s,
            "failureThreshold": failures,
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "hangs", "namespace": NAMESPACE},
        "spec": {
            "replicas": 1,
            "template": {"metadata": {"labels": {"app": "hangs"}}, "spec": {"containers": [container]}},
        },
    }


def test_a_container_that_never_answers_its_startup_probe_is_killed_with_its_stacks_and_restarted(tmp_path):
    cluster = Cluster(tmp_path / "cluster", [hanging_deployment(1, 3)], {}, NAMESPACE)
    try:
        [pod] = cluster.start_deployment("hangs")
        assert pod.startup_budget_s() == 3.0
        deadline = time.monotonic() + 90  # killed after 3 s, restarted after the kubelet's 10 s back-off
        while time.monotonic() < deadline and not (pod.restarts >= 1 and pod.alive()):
            time.sleep(0.5)
        kills, restarts, alive = cluster.probe_kills(), cluster.restarts(), pod.alive()
    finally:
        cluster.stop()
    log = pod.log.read_text(errors="replace")
    assert kills[pod.name][0].startswith("startupProbe failed for") and "its budget: 3 s" in kills[pod.name][0]
    assert "--- kubelet: startupProbe failed for" in log, log[-2000:]
    # where it hung, from the faulthandler: the line of the `-c` program that was running
    assert "Fatal Python error: Aborted" in log and 'File "<string>", line 3' in log, log[-2000:]
    assert restarts[pod.name][0] == -6 and pod.restarts >= 1 and alive, (restarts, pod.restarts, alive)


def test_a_container_that_answers_its_startup_probe_is_left_alone(tmp_path):
    """The other side: started within its budget (the probe answers), the container is never killed."""
    deployment = hanging_deployment(1, 3)
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    container["command"] = [
        str(VENV / "bin" / "python"),
        "-c",
        "import http.server, sys\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200)\n"
        "        self.end_headers()\n"
        "http.server.HTTPServer((sys.argv[1], 8080), Health).serve_forever()",
    ]
    container["args"] = ["0.0.0.0"]  # the pod's address
    cluster = Cluster(tmp_path / "cluster", [deployment], {}, NAMESPACE)
    try:
        [pod] = cluster.start_deployment("hangs")
        time.sleep(8)  # more than twice its budget
        kills, started, alive = cluster.probe_kills(), pod.started, pod.alive()
    finally:
        cluster.stop()
    assert not kills and started and alive and not cluster.restarts(), (kills, started, alive, pod.log_tail())
