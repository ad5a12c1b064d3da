"""`dynrubric monitor`: a local Prometheus (Debian's binary) on loopback, scraping the local services
with the project's recording and alerting rules from `monitoring/rules/`.

The scrape config is rendered from the settings, never hand-written: each local service whose port
the config names (LOCAL_SERVICES) is a job, plus any extra jobs in `monitoring.targets`.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from dynrubric.console import make_console
from dynrubric.context import settings_of
from dynrubric.errors import DynrubricError
from dynrubric.process import http_ok, log_tail, spawn, stop_signals_interrupt, terminate, wait_until

if TYPE_CHECKING:
    from dynrubric.config import Settings

MONITORING_DIR = Path(__file__).resolve().parents[2] / "monitoring"
INSTALL_FIX = "run `make setup`, or `apt-get install prometheus` (Debian), then try again"


def find_prometheus() -> Path:
    """The `prometheus` binary on PATH, or a DynrubricError saying how to install it."""
    found = shutil.which("prometheus")
    if found is None:
        raise DynrubricError("Prometheus is not installed (no `prometheus` on PATH)", INSTALL_FIX)
    return Path(found)


def rule_files(monitoring_dir: Path = MONITORING_DIR) -> list[Path]:
    files = sorted((monitoring_dir / "rules").glob("*.yml"))
    if not files:
        raise DynrubricError(
            f"no rule files in {monitoring_dir / 'rules'}",
            "run from a checkout of dynrubric (pip install -e .), which ships monitoring/rules/",
        )
    return files


# job -> (config section, port field). Fields a section does not have (yet) are skipped, so a service
# is scraped as soon as its config names a port. Job names match the k8s Services and the rules.
LOCAL_SERVICES = {
    "dynrubric-reward-server": ("reward_server", "port"),
    "dynrubric-router": ("serving", "port"),
    "dynrubric-fleet": ("serving", "fleet_port"),
    "dynrubric-rollout": ("rollout", "port"),
    "dynrubric-ingest": ("ingest", "metrics_port"),
    "dynrubric-trainer": ("train", "metrics_port"),
    "dynrubric-up": ("loop", "metrics_port"),  # the main job: restarts, cycles, the fleet's engines
}


def local_targets(settings) -> dict[str, list[str]]:
    """Scrape jobs of the local services: job name -> ["host:port", ...]."""
    jobs: dict[str, list[str]] = {}
    for job, (section_name, field) in LOCAL_SERVICES.items():
        section = getattr(settings, section_name, None)
        port = getattr(section, field, None)
        if not isinstance(port, int) or isinstance(port, bool) or port == 0:
            continue
        host = (
            (getattr(section, "metrics_host", None) if field == "metrics_port" else None)
            or getattr(section, "host", None)
            or getattr(getattr(settings, "serving", None), "host", None)
        )
        jobs[job] = [f"{host if isinstance(host, str) else '127.0.0.1'}:{port}"]
    for job, addresses in settings.monitoring.targets.items():
        jobs.setdefault(job, [])
        jobs[job] += [a for a in addresses if a not in jobs[job]]
    return jobs


def render_config(
    targets: dict[str, list[str]], rules: list[Path], scrape_interval_s: int, evaluation_interval_s: int
) -> dict:
    """A Prometheus config (as data) scraping `targets` with `rules` loaded."""
    return {
        "global": {
            "scrape_interval": f"{scrape_interval_s}s",
            "scrape_timeout": f"{min(scrape_interval_s, 10)}s",
            "evaluation_interval": f"{evaluation_interval_s}s",
        },
        "rule_files": [str(p.resolve()) for p in rules],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": addresses}]} for job, addresses in sorted(targets.items())
        ],
    }


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class RunningPrometheus:
    process: subprocess.Popen
    url: str
    log_path: Path

    def stop(self, timeout_s: float = 15.0) -> None:
        terminate(self.process, timeout_s)


def start_prometheus(
    config: dict, work_dir: Path, host: str, port: int, retention: str = "2d", ready_timeout_s: float = 60.0
) -> RunningPrometheus:
    """Write `config` under `work_dir`, check it with promtool when available, start Prometheus on
    host:port with its TSDB in `work_dir/data`, and wait until /-/ready answers."""
    import yaml

    from dynrubric import atomic

    binary = find_prometheus()
    if not port_is_free(host, port):
        raise DynrubricError(
            f"{host}:{port} is already in use",
            "stop what listens there or pick another port (--port or DYNRUBRIC_MONITORING__PROMETHEUS_PORT)",
        )
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "prometheus.yml"
    atomic.write_text(config_path, yaml.safe_dump(config, sort_keys=False))
    promtool = shutil.which("promtool")
    if promtool:
        check = subprocess.run([promtool, "check", "config", str(config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise DynrubricError(
                f"promtool rejects the generated config {config_path}: {(check.stdout + check.stderr).strip()}",
                "fix monitoring.targets or the rule files it names",
            )
    log_path = work_dir / "prometheus.log"
    process = spawn(  # in its own session: Ctrl-C reaches us, and we stop it cleanly
        [
            str(binary),
            f"--config.file={config_path}",
            f"--storage.tsdb.path={work_dir / 'data'}",
            f"--storage.tsdb.retention.time={retention}",
            f"--web.listen-address={host}:{port}",
        ],
        log_path,
    )
    running = RunningPrometheus(process, f"http://{host}:{port}", log_path)
    if wait_until(process, lambda: http_ok(f"{running.url}/-/ready", 1.0), ready_timeout_s, 0.2):
        return running
    if process.poll() is not None:
        raise DynrubricError(
            f"Prometheus exited with code {process.returncode} at start: {log_tail(log_path)}", f"read {log_path}"
        )
    running.stop()
    raise DynrubricError(f"Prometheus did not become ready in {ready_timeout_s:.0f}s", f"read {log_path}")


# ---------------------------------------------------------------- commands
app = typer.Typer(help="Local Prometheus with the project's rules.", no_args_is_help=True)


def _config_of(ctx: typer.Context) -> tuple[Settings, dict]:
    settings = settings_of(ctx)
    m = settings.monitoring
    return settings, render_config(local_targets(settings), rule_files(), m.scrape_interval_s, m.evaluation_interval_s)


@app.command("config")
def config_command(ctx: typer.Context) -> None:
    """Print the local scrape config that `monitor up` runs Prometheus with."""
    import yaml

    _, config = _config_of(ctx)
    typer.echo(yaml.safe_dump(config, sort_keys=False), nl=False)


@app.command("up")
def up_command(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option(help="listen port (default: monitoring.prometheus_port)")] = None,
) -> None:
    """Start Prometheus on loopback scraping the local services; runs until Ctrl-C."""
    console = make_console()
    find_prometheus()  # the clear message first, before anything is written
    settings, config = _config_of(ctx)
    m = settings.monitoring
    work_dir = settings.paths.resolved_state() / "monitoring"
    running = start_prometheus(config, work_dir, m.prometheus_host, port or m.prometheus_port, m.retention)
    console.print(
        f"[green]Prometheus ready[/] at {running.url} (alerts: {running.url}/alerts, log: {running.log_path})"
    )
    for job in config["scrape_configs"]:
        console.print(f"  scraping {job['job_name']}: {', '.join(job['static_configs'][0]['targets'])}")
    console.print("Ctrl-C stops it.")
    stop_signals_interrupt()
    try:
        running.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        running.stop()
    if running.process.returncode not in (0, -15):
        raise DynrubricError(f"Prometheus exited with code {running.process.returncode}", f"read {running.log_path}")
