"""The Grafana dashboard proven on a real Prometheus: no panel of it may be empty or
show an impossible value on a real run.

A real `prometheus` server (Debian's package) scrapes a real trainer worker's endpoint
every second while a real two-rank segment trains through the real Temporal dev server,
with a rank SIGKILLed mid-segment (a real fault, recovered in place). Then every PromQL
expression in ops/dashboards/mainspring.json, with `$run` substituted, goes through
Prometheus's HTTP API: each must return data, and every value must be finite and inside
the range its panel declares (min 0 everywhere: no negative time; goodput and overlap in
[0, 1]). The NVML panels — exactly those tagged "[nvml]", exactly the `mainspring_gpu_*`
series — are empty where no NVIDIA GPU is, and only there are they let off."""

from __future__ import annotations

import glob
import json
import math
import pathlib
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from common.metrics import PORT_ENV
from ops.services import free_port
from tests.e2e.runs import chaos_for, first_fault, run_in_background, strike, tiny_spec, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="the `prometheus` binary is not installed: install Debian's package with "
           "`apt-get install -y prometheus` (.ci/run does it when run as root)")]

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "ops" / "dashboards" / "mainspring.json"
NVML_TAG = "[nvml]"
STEPS = 40
SPEC = {"train.procs_per_node": 2, "train.total_steps": STEPS, "train.segment_steps": STEPS,
        "train.segments_per_run": 1, "train.checkpoint_every": 10, "train.eval_every": 10,
        "train.micro_batch_tokens": 4096, "sweep.enabled": False,
        "ops.profile_every": 5, "ops.metrics_every": 10}
FRACTIONS = {"mainspring_goodput", "mainspring_comm_exposed_fraction",
             "mainspring_gpu_utilization", "mainspring_gpu_memory_bandwidth_utilization"}
STRIKE = ((0, STEPS), (12, 28))  # kill a rank while the segment is between these steps


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


def test_every_dashboard_query_returns_sane_data_from_a_real_prometheus_scraping_a_real_segment(  # noqa: E501
        temporal_server, fleet_factory, tmp_path):
    t0 = time.monotonic()
    dashboard = json.loads(DASHBOARD.read_text())
    port = free_port()
    # One worker per role process: only the trainer worker serves the endpoint here.
    fleet_factory(roles=("orchestrator", "data"))
    trainer = fleet_factory(roles=("trainer",), env={PORT_ENV: str(port)}, log_dir="trainer")
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        spec = tiny_spec("e2e-prometheus", str(tmp_path / "store"), str(tmp_path / "fast"),
                         **SPEC)
        runner, box = run_in_background(temporal_server.address, spec, 300)
        strike(chaos_for(trainer, spec), spec, "kill_rank", *STRIKE)
        first_fault(spec, "rank_lost")
        runner.join(300)
        assert box["result"]["status"] == "completed", box
        run = spec.run_id
        # the last state scraped: the final step, and the in-place restart's recovery
        wait_for(lambda: [s for s in prom.query(f'mainspring_train_step{{run_id="{run}"}}')
                          if float(s["value"][1]) == STEPS], 30, "the final step scraped")
        wait_for(lambda: prom.query(f'mainspring_recoveries_total{{run_id="{run}"}} > 0'), 30,
                 "the recovery scraped")

        # the `run` variable: Grafana's label_values(mainspring_train_step, run_id)
        variable = next(v for v in dashboard["templating"]["list"] if v["name"] == "run")
        metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]
                                     ).groups()
        assert run in prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})

        gpu = nvidia_gpu_present()
        seen, let_off = check_panels(prom, panels(dashboard), run, gpu)
        assert len(seen) >= 20, seen
        assert bool(let_off) == (not gpu), let_off
        # the run's own figures: a real fault recovered, gradients and overlap measured
        assert seen['sum by (kind) (mainspring_faults_total{run_id="$run"})'] == [1.0]
        assert seen['mainspring_recoveries_total{run_id="$run"}'] == [1.0]
        assert seen['mainspring_grad_norm{run_id="$run"}'][0] > 0
        assert len(seen['mainspring_memory_peak_allocated_bytes{run_id="$run"}']) == 2  # ranks
        assert 0 < seen['mainspring_comm_exposed_fraction{run_id="$run"}'][0] <= 1
        print(f"\nprometheus dashboard e2e: {len(seen)} queries with data, NVML let off "
              f"{sorted(let_off)}; {time.monotonic() - t0:.1f}s")
        for expr, values in seen.items():
            print(f"  {expr}: {[round(v, 4) for v in values]}")
    finally:
        prom.stop()


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
