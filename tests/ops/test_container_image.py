"""deploy/Containerfile, the image deploy/k8s names: parsed (no registry and no image build
here), held to the Makefile's install (torch first, the same pin), to the manifests' image
and command (tini as PID 1), and its cpu variant's install steps run: the venv made and
its tooling installed for real, torch and the project resolved with `pip --dry-run`
against this machine's package index (the variant's torch index stands behind no network
here)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTAINERFILE = os.path.join(ROOT, "deploy", "Containerfile")
K8S_DIR = os.path.join(ROOT, "deploy", "k8s")
VENV = "/opt/venv"  # where the image puts its venv; a temporary one stands in for it here


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) of a Containerfile: continuations joined, comments out."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        word, _, rest = (buf + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def parsed() -> list[tuple[str, str]]:
    with open(CONTAINERFILE) as f:
        return instructions(f.read())


def global_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults."""
    out = {}
    for word, rest in instrs:
        if word == "FROM":
            break
        if word == "ARG":
            name, _, default = rest.partition("=")
            out[name] = default
    return out


def stages(instrs: list[tuple[str, str]]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """(base image, stage name or "", its instructions) for every FROM."""
    out: list[tuple[str, str, list[tuple[str, str]]]] = []
    for word, rest in instrs:
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            out.append((image.strip(), name.strip(), []))
        elif out:
            out[-1][2].append((word, rest))
    return out


def variant(name: str) -> list[tuple[str, str]]:
    """The instructions an image of `name` (cpu, cuda) is built with: its base stage's,
    then the final stage's."""
    *bases, (final_from, _, final) = stages(parsed())
    base = final_from.replace("${VARIANT}", name)
    (own,) = [instrs for _, stage, instrs in bases if stage == base]
    return own + final


def expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], m[0]), value)


def assignments(rest: str, env: dict[str, str]) -> dict[str, str]:
    """An ENV or ARG line's name=value pairs, values expanded as the builder does."""
    out = {}
    for pair in shlex.split(rest):
        name, _, value = pair.partition("=")
        out[name] = expand(value, {**env, **out})
    return out


def build_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """ARG defaults and ENV values in force after `instrs` (PATH from this machine)."""
    env = {"PATH": os.environ["PATH"]}
    for word, rest in instrs:
        if word in ("ARG", "ENV"):
            env.update(assignments(rest, env))
    return env


def runs(instrs: list[tuple[str, str]]) -> list[str]:
    return [rest for word, rest in instrs if word == "RUN"]


def makefile_torch() -> str:
    with open(os.path.join(ROOT, "Makefile")) as f:
        return re.search(r"^TORCH\s*\?=\s*(\S+)$", f.read(), re.M).group(1)


def pyproject() -> dict:
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def k8s_containers() -> list[tuple[str, dict]]:
    out = []
    for name in sorted(os.listdir(K8S_DIR)):
        with open(os.path.join(K8S_DIR, name)) as f:
            for doc in yaml.safe_load_all(f):
                if doc and doc.get("kind") in ("Deployment", "StatefulSet"):
                    for c in doc["spec"]["template"]["spec"]["containers"]:
                        out.append((f"{name}:{doc['metadata']['name']}/{c['name']}", c))
    return out


# ---- the file, read ------------------------------------------------------------------


def test_the_containerfile_builds_a_cpu_and_a_cuda_variant_chosen_by_one_build_arg():
    assert global_args(parsed()).get("VARIANT") in ("cpu", "cuda")
    *bases, (final_from, final_name, _) = stages(parsed())
    assert final_from == "base-${VARIANT}" and not final_name
    assert {name for _, name, _ in bases} == {"base-cpu", "base-cuda"}
    cuda_image = next(image for image, name, _ in bases if name == "base-cuda")
    # DeepSpeed JIT-builds its CUDA ops with nvcc at first use: a runtime image has none
    assert cuda_image.startswith("nvidia/cuda:") and "-devel-" in cuda_image


def test_each_variant_installs_tini_and_a_compiler_and_runs_the_worker_under_tini():
    entry = json.loads(next(rest for word, rest in parsed() if word == "ENTRYPOINT"))
    assert entry[:2] == ["/usr/bin/tini", "--"] and entry[2] == "mainspring", entry
    for name in ("cpu", "cuda"):
        apt = " ".join(r for r in runs(variant(name)) if "apt-get install" in r).split()
        assert "tini" in apt and "g++" in apt, f"{name}: {apt}"


def test_torch_is_installed_first_with_the_makefiles_pin_from_the_variants_index():
    pin = makefile_torch()
    assert pin in pyproject()["project"]["dependencies"]  # the project names the same one
    for name, index in (("cpu", "/whl/cpu"), ("cuda", "/whl/cu")):
        instrs = variant(name)
        env = build_env(instrs)
        steps = [expand(r, env) for r in runs(instrs)]
        torch_at = next(i for i, r in enumerate(steps) if pin in r)
        project_at = next(i for i, r in enumerate(steps) if "pip install" in r
                          and env["INSTALL_TARGET"] in shlex.split(r))
        assert torch_at < project_at, f"{name}: the project is installed before torch"
        assert f"--index-url {env['TORCH_INDEX']}" in steps[torch_at].replace('"', "")
        assert index in env["TORCH_INDEX"], f"{name}: torch from {env['TORCH_INDEX']}"


def test_the_cuda_variant_installs_the_gpu_extra_and_the_cpu_variant_no_gpu_package():
    extras = pyproject()["project"]["optional-dependencies"]
    assert build_env(variant("cuda"))["INSTALL_TARGET"] == ".[gpu]" and "gpu" in extras
    assert build_env(variant("cpu"))["INSTALL_TARGET"] == "."


def test_the_manifests_name_this_image_at_the_projects_version_and_start_it_under_tini():
    entry = json.loads(next(rest for word, rest in parsed() if word == "ENTRYPOINT"))
    image = f"mainspring:{pyproject()['project']['version']}"
    with open(CONTAINERFILE) as f:
        assert f"-t {image} ." in f.read(), "the build command does not tag the named image"
    found = k8s_containers()
    assert found, "no workload in deploy/k8s/"
    for where, c in found:
        assert c["image"] == image, f"{where}: {c['image']}"
        # `command` replaces the image's ENTRYPOINT: it must start with the same init
        assert c["command"][:2] == entry[:2], f"{where}: {c['command']} bypasses tini"


# ---- the cpu variant's install steps, run --------------------------------------------


def dry_run_prelude(report: str) -> str:
    """bash: `pip` becomes a dry run that writes `report`, and drops `--index-url` (this
    machine's configured index stands in for PyPI's and PyTorch's)."""
    return ("pip() {\n  local a=()\n  while (($#)); do\n"
            "    if [[ $1 == --index-url ]]; then shift 2; else a+=(\"$1\"); shift; fi\n"
            f"  done\n  command pip \"${{a[@]}}\" --dry-run --quiet --report {report}\n"
            "}\n")


@pytest.mark.timeout(900)
@pytest.mark.process
def test_the_cpu_variants_install_steps_resolve_to_the_pinned_torch_and_the_project(tmp_path):
    instrs = variant("cpu")
    venv = str(tmp_path / "venv")
    env = {k: v.replace(VENV, venv) for k, v in build_env(instrs).items()}
    pip_steps = [r.replace(VENV, venv) for r in runs(instrs) if "apt-get" not in r]
    assert any(r.startswith("python3 -m venv") for r in pip_steps)
    env = {**os.environ, **env, "PATH": f"{venv}/bin:{os.environ['PATH']}"}
    for n, step in enumerate(pip_steps):
        if "pip install --upgrade" in step or "-m venv" in step:  # for real: light tools
            script = step.replace("python3 -m venv", f"{sys.executable} -m venv")
        else:
            script = dry_run_prelude(str(tmp_path / f"{n}.json")) + step
        out = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, f"{step}\n{out.stderr[-3000:]}"
    reports = sorted(tmp_path.glob("*.json"), key=lambda p: int(p.stem))
    assert len(reports) == 2, "expected the torch and the project steps to run"
    installed = [{i["metadata"]["name"]: i["metadata"]["version"] for i in
                  json.loads(p.read_text())["install"]} for p in reports]
    pin = makefile_torch().split("==")[1]
    assert installed[0]["torch"].split("+")[0] == pin
    assert installed[1]["mainspring"] == pyproject()["project"]["version"]
    assert installed[1]["torch"].split("+")[0] == pin and "deepspeed" in installed[1]
