"""A real Prometheus on loopback for the tests of deploy/ (the dashboard and the rules), its
HTTP API, and the expressions those files hold.

The binary is Debian's `prometheus` package (with `promtool`), which `make system-tools`
installs; `make test` depends on it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml  # PyYAML, a dependency of gguf

import loopback
from child_process import terminate, wait_answering
from server_fixtures import free_port

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "deploy/grafana/prefixcache.json"
PROMETHEUS_DIR = REPO / "deploy/prometheus"
RULES = PROMETHEUS_DIR / "rules.yml"
START_TIMEOUT_S = 30.0

# The live test's copy of rules.yml: each production window and `for:` shortened so that a
# run of seconds can fill the windows and fire the alerts (rules_test.yml checks the
# production values with promtool). A window not listed here fails the test: add it.
WINDOWS = {"5m": "8s", "1h": "45s"}
FOR = "1s"
# The tiny model's requests take milliseconds: its queue cannot reach the production 5 s
# in a short run, so the live copy compares the same p90 with 1 s.
THRESHOLDS = {
    "prefixcache:request_queue_time_seconds:p90_5m > 5": (
        "prefixcache:request_queue_time_seconds:p90_5m > 1"
    ),
}
# Grafana's values of the dashboard's variables: its "All" (allValue) for the multi-value
# ones, and a rate window of a few scrapes.
VARIABLES = {"job": "prefixcache", "instance": ".+", "router": ".+", "__rate_interval": "15s"}


def binary(name: str) -> str:
    """``prometheus`` or ``promtool`` on PATH; AssertionError saying how to install it."""
    found = shutil.which(name)
    assert found, f"{name} not found: `make system-tools` installs Debian's prometheus package"
    return found


def promtool(*args: str | Path) -> str:
    """Run ``promtool`` with ``args``; its output (AssertionError with it on a failure)."""
    done = subprocess.run(
        [binary("promtool"), *map(str, args)], capture_output=True, text=True, timeout=60
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(map(str, args))} failed:\n{output}"
    return output


def rules_for_a_short_run(text: str) -> str:
    """rules.yml with WINDOWS, FOR and THRESHOLDS applied (each threshold found once)."""

    def window(match: re.Match[str]) -> str:
        assert match[1] in WINDOWS, f"rules.yml window [{match[1]}] not in WINDOWS"
        return f"[{WINDOWS[match[1]]}]"

    text = re.sub(r"\[(\w+)\]", window, text)
    text = re.sub(r"^(\s+for:) \S+$", rf"\1 {FOR}", text, flags=re.MULTILINE)
    for production, short in THRESHOLDS.items():
        assert text.count(production) == 1, f"{production!r} not once in rules.yml"
        text = text.replace(production, short)
    return text


def rule_groups(text: str) -> list[dict]:
    """Every rule of a rules file: dicts with ``record`` or ``alert``, and ``expr``."""
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


@dataclass(frozen=True)
class Target:
    """One query of a dashboard panel: where it is, and its PromQL with variables filled."""

    panel: str
    expr: str


def dashboard_targets(dashboard: dict) -> list[Target]:
    """Every panel target's expression (rows' nested panels included), variables filled."""
    panels = list(dashboard["panels"])
    for panel in dashboard["panels"]:
        panels += panel.get("panels", [])
    return [
        Target(panel["title"], fill(target["expr"]))
        for panel in panels
        for target in panel.get("targets", [])
    ]


def fill(expr: str) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` replaced from VARIABLES."""

    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        assert name in VARIABLES, f"dashboard variable ${name} has no test value"
        return VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, expr)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@dataclass
class PrometheusProcess:
    """``prometheus`` on a free loopback port, its data and log in ``workdir``."""

    workdir: Path
    config: dict
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "prometheus.log"

    def start(self) -> PrometheusProcess:
        """Write the config, launch, and wait until ``/-/ready`` answers 200."""
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(self.config))
        command = [
            binary("prometheus"), f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
        ]  # fmt: skip
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, cwd=self.workdir
            )
        ready = f"{self.url}/-/ready"
        wait_answering(self.process, ready, "prometheus", self.log_tail, START_TIMEOUT_S)
        return self

    def stop(self) -> None:
        terminate(self.process)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def api(self, path: str, **params: str) -> dict:
        """``/api/v1/<path>``'s ``data``; AssertionError with Prometheus' error otherwise."""
        reply = loopback.get(f"{self.url}/api/v1/{path}", params=params, timeout=10).json()
        assert reply["status"] == "success", f"{path} {params}: {reply.get('error')}"
        return reply["data"]

    def query(self, expr: str) -> list[dict]:
        """An instant query's series (a vector, or a scalar as one series)."""
        reply = loopback.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        if reply["status"] != "success":
            raise ValueError(reply.get("error", reply))
        data = reply["data"]
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data]

    def empty(self, exprs: list[str]) -> dict[str, str]:
        """Those of ``exprs`` that return no series now: expr -> why (empty or the error)."""
        found = {}
        for expr in exprs:
            try:
                if not self.query(expr):
                    found[expr] = "no series"
            except ValueError as error:
                found[expr] = str(error)
        return found

    def rules(self) -> list[dict]:
        """Every loaded rule as ``/api/v1/rules`` reports it (health, lastError, state)."""
        groups = self.api("rules")["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def alerts(self) -> list[dict]:
        """Active alerts: labels, annotations, state (pending or firing)."""
        return self.api("alerts")["alerts"]
