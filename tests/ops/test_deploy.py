"""The deployment examples (`deploy/k8s/`, `deploy/slurm/`, `docs/multinode.md`) checked
against the real CLI: they parse, every `mainspring worker` command line in them names only
options and roles of the real `worker` subparser (`ops.cli.build_parser`), trainers get
their GPUs and a grace period longer than their drain, and credentials come from Secrets or
the environment, never from the files. No cluster, no Slurm: plain file reads, fast."""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
import shlex
import shutil
import subprocess

import pytest
import yaml

from common.redact import is_secret_name, redact
from ops.cli import build_parser

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S_DIR = os.path.join(ROOT, "deploy", "k8s")
SBATCH = os.path.join(ROOT, "deploy", "slurm", "mainspring-trainers.sbatch")
DOC = os.path.join(ROOT, "docs", "multinode.md")

WORKLOADS = ("Deployment", "StatefulSet")
# (apiVersion, kind) of the objects the examples may use: stable APIs only.
KNOWN_KINDS = {("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "Deployment"),
               ("apps/v1", "StatefulSet"), ("policy/v1", "PodDisruptionBudget")}
# Fields of core/v1 PodSpec and Container (Kubernetes 1.30 API reference): a misspelt
# field is otherwise only noticed when the manifest meets a cluster.
POD_SPEC_FIELDS = {
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "hostAliases",
    "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname", "imagePullSecrets",
    "initContainers", "nodeName", "nodeSelector", "os", "overhead", "preemptionPolicy",
    "priority", "priorityClassName", "readinessGates", "resourceClaims", "restartPolicy",
    "runtimeClassName", "schedulerName", "schedulingGates", "securityContext",
    "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
    "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints", "volumes"}
CONTAINER_FIELDS = {
    "args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
    "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy", "resources",
    "restartPolicy", "securityContext", "startupProbe", "stdin", "stdinOnce",
    "terminationMessagePath", "terminationMessagePolicy", "tty", "volumeDevices",
    "volumeMounts", "workingDir"}
SHELL_OPERATORS = {"&", "&&", "||", ";", "|", ";;", "(", ")"}


# ---- reading the examples ------------------------------------------------------------


def manifest_files() -> list[str]:
    return sorted(glob.glob(os.path.join(K8S_DIR, "*.yaml")) +
                  glob.glob(os.path.join(K8S_DIR, "*.yml")))


@functools.cache  # read-only below: the files are parsed once per session
def manifests() -> list[tuple[str, dict]]:
    """(file name, object) for every YAML document of deploy/k8s/."""
    out = []
    for path in manifest_files():
        with open(path) as f:
            out += [(os.path.basename(path), doc) for doc in yaml.safe_load_all(f) if doc]
    return out


def workloads() -> list[tuple[str, dict]]:
    """(file:name, object) of every Deployment and StatefulSet."""
    return [(f"{name}:{obj['metadata']['name']}", obj) for name, obj in manifests()
            if obj.get("kind") in WORKLOADS]


def pod_specs() -> list[tuple[str, dict]]:
    return [(where, obj["spec"]["template"]["spec"]) for where, obj in workloads()]


def containers() -> list[tuple[str, dict, dict]]:
    """(where, workload, container) for every container of every workload."""
    return [(f"{where}/{c['name']}", obj, c) for where, obj in workloads()
            for c in obj["spec"]["template"]["spec"].get("containers", [])
            + obj["spec"]["template"]["spec"].get("initContainers", [])]


def worker_argv(tokens: list[str]) -> list[str] | None:
    """What follows `mainspring worker` (or `python -m ops.cli worker`) in a command line,
    up to a shell operator; None when the tokens hold no such command."""
    for i, tok in enumerate(tokens[:-1]):
        name = os.path.basename(tok.strip("\"'").lstrip("$")).lower().strip("{}")
        is_cli = name == "mainspring" or (tok == "ops.cli" and i and tokens[i - 1] == "-m")
        if is_cli and tokens[i + 1] == "worker":
            rest = tokens[i + 2:]
            end = next((j for j, t in enumerate(rest) if t in SHELL_OPERATORS), len(rest))
            return rest[:end] or None  # `mainspring worker` named in prose: no command line
    return None


def shell_lines(text: str) -> list[str]:
    """Logical lines (backslash continuations joined) of shell text, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [ln for ln in joined.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def shell_invocations(text: str) -> list[list[str]]:
    found = []
    for line in shell_lines(text):
        if not re.search(r"(?i)mainspring\S*\s+worker\b", line):
            continue
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv = worker_argv(list(lexer))
        if argv is not None:
            found.append(argv)
    return found


def doc_invocations() -> list[list[str]]:
    """`mainspring worker …` in docs/multinode.md: its code blocks and inline code."""
    with open(DOC) as f:
        text = f.read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    inline = re.findall(r"`([^`\n]*mainspring worker[^`\n]*)`", text)
    return [argv for chunk in blocks + inline for argv in shell_invocations(chunk)]


def invocations() -> dict[str, list[list[str]]]:
    """source -> the argv after `mainspring worker` of each command line found there."""
    out: dict[str, list[list[str]]] = {}
    for where, _, c in containers():
        argv = worker_argv([str(t) for t in c.get("command", []) + c.get("args", [])])
        if argv is not None:
            out.setdefault(f"deploy/k8s/{where}", []).append(argv)
    with open(SBATCH) as f:
        out["deploy/slurm/mainspring-trainers.sbatch"] = shell_invocations(f.read())
    out["docs/multinode.md"] = doc_invocations()
    return out


def options(argv: list[str]) -> dict[str, str | None]:
    """--flag -> its value (None for a flag given no value) of one worker argv."""
    found: dict[str, str | None] = {}
    flag = None
    for tok in argv:
        if tok.startswith("--"):
            flag, _, value = tok.partition("=")
            found[flag] = value or None
            if value:
                flag = None
        elif flag is not None:
            found[flag], flag = tok, None
    return found


def worker_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["worker"]


def placeholder(action: argparse.Action | None, value: str) -> str:
    """A value of the flag's type for a value that is a variable ($(X), "$X")."""
    if "$" not in value or action is None:
        return value
    if action.choices:
        return str(next(iter(action.choices)))
    if action.type in (int, float) or getattr(action.type, "__name__", "") == "seconds":
        return "1"
    flag = max(action.option_strings, key=len)
    if flag.endswith("-address"):
        return "10.0.0.1"
    if flag == "--address":
        return "10.0.0.1:7233"
    return "/tmp/placeholder" if flag.endswith(("-root", "-dir")) else "placeholder"


def trainer_containers() -> list[tuple[str, dict, dict, dict[str, str | None]]]:
    """(where, workload, container, its worker options) of every trainer worker."""
    out = []
    for where, obj, c in containers():
        argv = worker_argv([str(t) for t in c.get("command", []) + c.get("args", [])])
        if argv is not None and options(argv).get("--role") == "trainer":
            out.append((where, obj, c, options(argv)))
    return out


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def field_of(env: dict[str, dict], value: str | None) -> str | None:
    """The downward-API field a `$(VAR)` value comes from, if it is one."""
    ref = re.fullmatch(r"\$\((\w+)\)", value or "")
    source = env.get(ref.group(1), {}) if ref else {}
    return source.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")


def sbatch_text() -> str:
    with open(SBATCH) as f:
        return f.read()


# ---- Kubernetes ----------------------------------------------------------------------


def test_every_kubernetes_manifest_parses_as_yaml():
    assert manifest_files(), "no manifests under deploy/k8s/"
    for path in manifest_files():
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        assert docs, f"{path} holds no YAML document"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: a document is not a mapping"
            assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"]["name"], path


def test_each_kubernetes_file_opens_with_a_comment_saying_what_it_deploys():
    for path in manifest_files():
        with open(path) as f:
            head = [next(f) for _ in range(3)]
        assert all(line.startswith("#") for line in head), f"{path} has no header comment"


def test_the_kubernetes_examples_deploy_every_role_with_stable_api_kinds():
    kinds = {(obj["apiVersion"], obj["kind"]) for _, obj in manifests()}
    assert kinds <= KNOWN_KINDS, f"unexpected kinds: {kinds - KNOWN_KINDS}"
    roles = {options(argv).get("--role") for where, argvs in invocations().items()
             if where.startswith("deploy/k8s/") for argv in argvs}
    assert roles == {"orchestrator", "data", "trainer"}


def test_pod_specs_and_containers_use_only_kubernetes_api_fields():
    for where, spec in pod_specs():
        assert set(spec) <= POD_SPEC_FIELDS, f"{where}: {set(spec) - POD_SPEC_FIELDS}"
    for where, _, c in containers():
        assert set(c) <= CONTAINER_FIELDS, f"{where}: {set(c) - CONTAINER_FIELDS}"


def test_kubernetes_trainers_request_and_limit_nvidia_gpus_and_run_one_rank_per_gpu():
    trainers = trainer_containers()
    assert trainers, "no trainer worker in deploy/k8s/"
    for where, _, c, opts in trainers:
        resources = c.get("resources", {})
        requested = resources.get("requests", {}).get("nvidia.com/gpu")
        limited = resources.get("limits", {}).get("nvidia.com/gpu")
        assert limited, f"{where}: no nvidia.com/gpu limit"
        assert requested in (None, limited), f"{where}: GPU requests and limits differ"
        assert opts.get("--procs") == str(limited), f"{where}: --procs is not its GPU count"
        assert opts.get("--gpus") in (None, str(limited)), f"{where}: --gpus is not its GPUs"


def test_kubernetes_trainers_run_one_per_node_named_by_pod_and_addressed_by_pod_ip():
    objects = {(obj["kind"], obj["metadata"]["name"]): obj for _, obj in manifests()}
    for kind, name in objects:
        if kind != "StatefulSet":
            continue
        sts = objects[(kind, name)]
        service = objects.get(("Service", sts["spec"]["serviceName"]))
        assert service and service["spec"].get("clusterIP") == "None", \
            f"StatefulSet {name}: its serviceName is not a headless Service here"
    for where, obj, c, opts in trainer_containers():
        spec, env = obj["spec"]["template"]["spec"], env_of(c)
        assert field_of(env, opts.get("--node")) == "metadata.name", where
        assert field_of(env, opts.get("--node-address")) == "status.podIP", where
        anti = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname" for t in anti), where
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        volume = mounts.get(opts.get("--fast-root") or "")
        sources = {v["name"]: set(v) - {"name"} for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        assert volume in claims or sources.get(volume, set()) & {"hostPath", "ephemeral"}, \
            f"{where}: --fast-root is not on a node-local volume"


def test_kubernetes_trainers_get_a_grace_period_longer_than_their_drain_timeout():
    for where, obj, _, opts in trainer_containers():
        drain = float(opts.get("--drain-timeout-s") or 300)  # the worker's default
        grace = obj["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        assert grace > drain, f"{where}: SIGKILL after {grace} s cuts a {drain} s drain short"


def test_credentials_and_the_temporal_address_come_from_secrets_not_literals():
    assert not [n for n, obj in manifests() if obj["kind"] == "Secret"], \
        "a Secret with its values belongs in the cluster, not in deploy/k8s/"
    for name, obj in manifests():
        if obj["kind"] == "ConfigMap":
            bad = [k for k in obj.get("data", {})
                   if is_secret_name(k) or k.startswith(("AWS_", "TEMPORAL_"))]
            assert not bad, f"{name}: {bad} belong in a Secret"
    for where, _, c in containers():
        env = env_of(c)
        literal = [n for n, e in env.items() if "value" in e
                   and (is_secret_name(n) or n.startswith(("AWS_", "TEMPORAL_")))]
        assert not literal, f"{where}: literal {literal}"
        assert "secretKeyRef" in env["TEMPORAL_ADDRESS"]["valueFrom"], where
        s3_secret = any("secretRef" in src for src in c.get("envFrom", [])) or all(
            "secretKeyRef" in env.get(n, {}).get("valueFrom", {})
            for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
        assert s3_secret, f"{where}: no S3 credentials from a Secret"


def test_pods_turn_off_service_links_so_no_service_sets_a_mainspring_variable():
    # A Service named mainspring-metrics would inject MAINSPRING_METRICS_PORT=tcp://…
    for where, spec in pod_specs():
        assert spec.get("enableServiceLinks") is False, where


# ---- Slurm ---------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
@pytest.mark.process
def test_the_slurm_script_passes_bash_n():
    proc = subprocess.run(["bash", "-n", SBATCH], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr


def test_the_slurm_script_runs_one_trainer_worker_per_node_named_by_slurm():
    text = sbatch_text()
    assert re.search(r"^#SBATCH --ntasks-per-node=1$", text, re.M)
    launch = [ln for ln in shell_lines(text) if ln.lstrip().startswith("srun ")
              and "node_worker" in ln]
    assert launch and "--ntasks-per-node=1" in launch[0]
    (argv,) = shell_invocations(text)
    opts = options(argv)
    assert opts["--role"] == "trainer"
    assert opts["--node"] == "$SLURMD_NODENAME"
    assert "hostname -I" in text and opts["--node-address"]
    assert opts["--fast-root"] == "$FAST_ROOT"


def test_the_slurm_signal_reaches_the_batch_shell_early_enough_for_the_drain():
    text = sbatch_text()
    signal = re.search(r"^#SBATCH --signal=B:TERM@(\d+)$", text, re.M)
    drain = re.search(r'DRAIN_TIMEOUT_S="\$\{DRAIN_TIMEOUT_S:-(\d+)\}"', text)
    assert signal and drain
    assert int(signal.group(1)) >= int(drain.group(1)) + 60  # Slurm's 60 s resolution
    assert re.search(r"^trap drain TERM$", text, re.M)
    # the batch shell signals the worker's own pid on each node, not the whole step
    assert re.search(r"srun --overlap .*kill -TERM \"\$\(cat \"\$STATE_DIR/worker.pid\"\)\"",
                     " ".join(shell_lines(text)))


def test_the_slurm_script_holds_no_credentials():
    text = sbatch_text()
    assert redact(text).replace("***", "...") == text  # only `...` placeholders look secret


# ---- all examples against the real CLI -------------------------------------------------


def test_the_manifests_and_the_slurm_script_name_only_real_mainspring_worker_flags():
    known = worker_parser()._option_string_actions
    found = invocations()
    for source in ("deploy/k8s/", "deploy/slurm/", "docs/multinode.md"):
        assert any(where.startswith(source) and argvs for where, argvs in found.items()), \
            f"no `mainspring worker` command line in {source}"
    unknown = sorted({f"{where}: {flag}" for where, argvs in found.items() for argv in argvs
                      for flag in options(argv) if flag not in known})
    with open(DOC) as f:  # the doc's flag table
        table = re.findall(r"^\| `(--[\w-]+)`(?:, `(--[\w-]+)`)?", f.read(), re.M)
    unknown += sorted({f"docs/multinode.md table: {flag}" for row in table for flag in row
                       if flag and flag not in known})
    assert not unknown, "not options of `mainspring worker` (ops/cli.py):\n" + "\n".join(unknown)


def test_every_role_in_the_examples_is_a_real_choice():
    choices = worker_parser()._option_string_actions["--role"].choices
    for where, argvs in invocations().items():
        for argv in argvs:
            role = options(argv).get("--role")
            assert role in choices, f"{where}: --role {role!r} is not one of {choices}"


def test_the_example_worker_command_lines_parse_with_the_real_cli(capsys):
    parser, known = build_parser(), worker_parser()._option_string_actions
    for where, argvs in invocations().items():
        for argv in argvs:
            concrete, flag = [], None
            for tok in argv:
                if tok.startswith("--"):
                    flag, eq, value = tok.partition("=")
                    concrete.append(f"{flag}={placeholder(known.get(flag), value)}" if eq else tok)
                else:
                    concrete.append(placeholder(known.get(flag or ""), tok))
            try:
                args = parser.parse_args(["worker", *concrete])
            except SystemExit:
                pytest.fail(f"{where}: `mainspring worker {shlex.join(argv)}` does not parse: "
                            f"{capsys.readouterr().err.strip().splitlines()[-1]}")
            assert args.role == options(argv)["--role"]


def test_the_multinode_doc_names_every_example_file_and_only_files_that_exist():
    with open(DOC) as f:
        text = f.read()
    named = set(re.findall(r"deploy/[\w./-]*\w", text))
    missing = [p for p in named if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"docs/multinode.md names {missing}"
    unnamed = [p for p in [*manifest_files(), SBATCH] if os.path.basename(p) not in text]
    assert not unnamed, f"docs/multinode.md does not describe {unnamed}"
