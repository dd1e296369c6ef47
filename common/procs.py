"""Worker processes as a local process manager would run them (demo, tests).

`WorkerFleet` starts one `mainspring worker` process per role and, like systemd or a
Kubernetes Deployment, starts a replacement when one dies — the run itself never waits
for a human. It also holds what every child of a worker shares: the parent-death signal,
the stop file, and the environment allow-list (`allowed_env`) trainers and writers get.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from common.redact import is_secret_name

log = structlog.get_logger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The trainer worker's pid, set by the supervisor for its children (the kill_worker fault).
WORKER_PID_ENV = "MAINSPRING_WORKER_PID"
# The process name of a rank a warm standby forked (trainer/standby.py; its command line is
# the standby's): how a rank is found among a worker's processes (ops/chaos.py).
RANK_NAME = "ms-rank-{}"
# The node a trainer worker is (`mainspring worker --node`), for its children.
NODE_ENV = "MAINSPRING_NODE"
# How many jobs the trainer worker runs at once (`mainspring worker --trainer-slots`), for
# its children: they share the machine's cores (`torch_threads`).
SLOTS_ENV = "MAINSPRING_TRAINER_SLOTS"


def torch_threads(environ: Mapping[str, str], cores: int, ranks: int) -> int:
    """Pure: a child's torch threads: OMP_NUM_THREADS where the operator set it, else its
    share of the cores among its `ranks` and the trainer worker's concurrent jobs (each a
    core at least). More threads than cores make OpenMP's workers spin against each other:
    two 2-thread trials on 2 cores ran their steps ~10x slower than one thread each."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    slots = environ.get(SLOTS_ENV, "").strip()
    jobs = int(slots) if slots.isdigit() and int(slots) > 0 else 1
    return max(1, cores // (max(1, ranks) * jobs))


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when the thread that started it dies.

    Used as `preexec_fn` for every child we start (services, workers, trainers), so a
    killed parent — a worker, a test run — never leaves an orphan holding ports or a GPU.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))


# Graceful stop of a supervised child: the supervisor writes this file in the child's workdir
# (reason inside); the trainer checks it after every step, commits a checkpoint at that step
# and exits 0. A file, not a signal: torchrun treats SIGTERM as a failure of the job.
STOP_FILE = "STOP"


def request_stop(workdir: str, reason: str) -> None:
    with open(os.path.join(workdir, STOP_FILE), "w") as f:
        f.write(reason)


def stop_requested(workdir: str) -> str:
    """The stop reason written by request_stop, or '' when none was requested."""
    try:
        with open(os.path.join(workdir, STOP_FILE)) as f:
            return f.read() or "stop requested"
    except FileNotFoundError:
        return ""


# What a trainer / evaluator / checkpoint-writer child may inherit from its worker: the
# interpreter, compilers for DeepSpeed's JIT build, the accelerator and collective libraries,
# tracing, and the storage credentials it needs to reach the durable tier. Never the Temporal
# credentials (TEMPORAL_API_KEY, TEMPORAL_TLS_*): a child does not talk to Temporal, and a
# crash dump of its environment must not hand them out.
CHILD_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "HOSTNAME",
    "TMPDIR", "TMP", "TEMP", "VIRTUAL_ENV", "XDG_CACHE_HOME", "LOGLEVEL",
    "LD_LIBRARY_PATH", "LD_PRELOAD",  # CUDA libraries, allocators (tcmalloc/jemalloc)
    # torch.utils.cpp_extension (DeepSpeed's JIT-built ops): compiler, flags, include paths
    "CC", "CXX", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CPATH", "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "MAX_JOBS",
    "TOKENIZERS_PARALLELISM", "TRACEPARENT", "TRACESTATE",
    # TLS trust and proxies on the way to S3
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
    # the durable tier (storage/fs.py, botocore): endpoint, credentials, their sources
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_CA_BUNDLE",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_EC2_METADATA_DISABLED", "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE", "AWS_STS_REGIONAL_ENDPOINTS",
})
# Families passed whole, except a secret-looking name among them (MAINSPRING_*_API_KEY).
CHILD_ENV_PREFIXES = (
    "LC_", "PYTHON", "TORCH_", "TORCHELASTIC_", "TORCHINDUCTOR_", "PYTORCH_", "TRITON_",
    "DS_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "CUDA_", "CUDNN_", "CUBLAS_",
    "NCCL_", "GLOO_", "NVIDIA_", "MASTER_", "HIP_", "ROCM_", "HSA_", "OTEL_", "MAINSPRING_",
    # NCCL's network plugins: libfabric (AWS EFA: FI_PROVIDER, FI_EFA_USE_DEVICE_RDMA) and UCX
    "FI_", "UCX_",
)
# OTLP exporter headers carry the collector's API key; children export no spans themselves.
_CHILD_ENV_DENY = ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
                   "OTEL_EXPORTER_OTLP_METRICS_HEADERS", "OTEL_EXPORTER_OTLP_LOGS_HEADERS",
                   # it would undo FORCED_CHILD_ENV (below)
                   "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


# What every child runs with, whatever its worker has. The bucket is data, not code (DESIGN
# §3): torch reads this on every torch.load and then loads weights-only even where the caller
# passes weights_only=False (torch/serialization.py, 2.4+) — DeepSpeed's own tools do, e.g.
# ds_to_universal and zero_to_fp32. Its opposite is never passed on: with both set torch
# refuses every load.
FORCED_CHILD_ENV = {"TORCH_FORCE_WEIGHTS_ONLY_LOAD": "1"}


def child_env_allowed(name: str) -> bool:
    """True when a child process may inherit environment variable `name`."""
    if name in CHILD_ENV_NAMES:
        return True
    if name in _CHILD_ENV_DENY or not name.startswith(CHILD_ENV_PREFIXES):
        return False
    return not is_secret_name(name)


def allowed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A child's environment: the allow-listed part of `environ` (default: this process's
    environment) and FORCED_CHILD_ENV."""
    env = os.environ if environ is None else environ
    return {**{k: v for k, v in env.items() if child_env_allowed(k)}, **FORCED_CHILD_ENV}


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with this checkout first on PYTHONPATH, so `python -m trainer…` imports it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return {**env, "PYTHONPATH": os.pathsep.join([root, *paths])}


def worker_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment: all of `environ` (a worker holds the credentials), with
    weights-only loading forced like every child's (FORCED_CHILD_ENV)."""
    return {k: v for k, v in environ.items()
            if k != "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"} | FORCED_CHILD_ENV


def worker_command(role: str, address: str, namespace: str = "default",
                   args: tuple[str, ...] = (), wrap: tuple[str, ...] = ()) -> list[str]:
    """`mainspring worker --role …` with `args` appended, behind the prefix `wrap` (e.g.
    `ip netns exec <ns>`, which execs the worker: it keeps the pid Popen returns)."""
    return [*wrap, sys.executable, "-m", "ops.cli", "worker", "--role", role,
            "--address", address, "--namespace", namespace, *args]


@dataclass
class WorkerFleet:
    address: str
    roles: tuple[str, ...] = ("orchestrator", "data", "trainer")
    log_dir: str = ".mainspring/logs"
    restart: bool = True
    env: dict[str, str] = field(default_factory=dict)
    # A command prefix for every worker (("ip", "netns", "exec", ns): a host of a multi-host
    # test) and extra worker flags appended to its command line; both empty by default.
    wrap: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    # The checkout the workers run (its code first on their and their children's path):
    # this one when empty; another release's, for an upgrade in the middle of a run.
    root: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def spawn(self, role: str) -> subprocess.Popen:
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(os.path.join(self.log_dir, f"worker-{role}.log"), "ab")
        root = self.root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = worker_env({**os.environ, **self.env})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        cmd = worker_command(role, self.address, args=self.args, wrap=self.wrap)
        proc = subprocess.Popen(cmd, stdout=out, cwd=self.root or None,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=set_parent_death_signal)
        self.procs[role] = proc
        log.info("worker_spawned", role=role, pid=proc.pid)
        return proc

    def start(self) -> "WorkerFleet":
        for role in self.roles:
            self.spawn(role)
        if self.restart:
            self._thread = threading.Thread(target=self._watch, daemon=True)
            self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.5):
            for role, proc in list(self.procs.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self.restarts[role] = self.restarts.get(role, 0) + 1
                    log.warning("worker_died_restarting", role=role, pid=proc.pid,
                                code=proc.returncode, restarts=self.restarts[role])
                    self.spawn(role)

    def kill(self, role: str, sig: int = signal.SIGKILL) -> int:
        proc = self.procs[role]
        os.kill(proc.pid, sig)
        return proc.pid

    def stop(self) -> None:
        self._stop.set()
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
