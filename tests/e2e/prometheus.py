"""A real Prometheus server for the dashboard's test (tests/e2e/test_rank_faults.py), and the
check of every panel's queries against it."""

from __future__ import annotations

import glob
import json
import math
import pathlib
import re
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import pytest

from ops.services import free_port
from tests.e2e.runs import wait_for

PROMETHEUS = shutil.which("prometheus")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the `prometheus` binary is not installed: install Debian's package with "
           "`apt-get install -y prometheus` (.ci/run does it when run as root)")

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "ops" / "dashboards" / "mainspring.json"
NVML_TAG = "[nvml]"
FRACTIONS = {"mainspring_goodput", "mainspring_comm_exposed_fraction",
             "mainspring_gpu_utilization", "mainspring_gpu_memory_bandwidth_utilization"}


def nvidia_gpu_present() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/proc/driver/nvidia/gpus/*"))


def panels(dashboard: dict) -> list[dict]:
    """Every panel with queries, those inside collapsed rows too."""
    out = []
    for p in dashboard["panels"]:
        out += [p] if p.get("targets") else []
        out += [q for q in p.get("panels", []) if q.get("targets")]
    return out


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(mainspring_[a-z0-9_]+)", expr))


class Prometheus:
    """A real Prometheus server scraping one target every second."""

    def __init__(self, workdir: pathlib.Path, target: str) -> None:
        self.port = free_port()
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: mainspring-trainer\n    scrape_interval: 1s\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        self.log = open(workdir / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(self.ready, 60, "prometheus to be ready")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError):
            assert self.proc.poll() is None, "prometheus exited; see prometheus.log"
            return False

    def get(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.get("/api/v1/query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return data["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def check_panels(prom: Prometheus, all_panels: list[dict], run: str, gpu: bool
                 ) -> tuple[dict[str, list[float]], set[str]]:
    """Every query of every panel through the HTTP API; returns ({expression as the
    dashboard has it: the values it returned}, titles of the NVML panels let off for want
    of a GPU)."""
    seen, let_off = {}, set()
    for panel in all_panels:
        nvml = panel.get("description", "").startswith(NVML_TAG)
        bounds = panel["fieldConfig"]["defaults"]
        lo, hi = bounds["min"], bounds.get("max", math.inf)  # every panel declares its floor
        for target in panel["targets"]:
            expr = target["expr"].replace("${run}", run).replace("$run", run)
            names = metric_names(expr)
            assert names, expr
            # the NVML panels are exactly those on the NVML series
            assert {n.startswith("mainspring_gpu_") for n in names} == {nvml}, (panel, names)
            if names & FRACTIONS:  # goodput, overlap, utilisations: declared 0..1
                assert (lo, hi) == (0, 1), panel["title"]
            result = prom.query(expr)
            if nvml and not gpu:
                assert result == [], (expr, result)  # nothing can sample NVML here
                let_off.add(panel["title"])
                continue
            assert result, f"{panel['title']!r}: {expr} returned no data"
            values = [float(sample["value"][1]) for sample in result]
            for value, sample in zip(values, result):
                assert math.isfinite(value) and lo <= value <= hi, (panel["title"], expr, sample)
            seen[target["expr"]] = values
    return seen, let_off
