"""A worker process never imports torch (DESIGN §5: it restarts in about a second after a
SIGKILL, and a trainer's crash cannot take its heartbeats with it). On e3369a3 every worker
imported torch through activities/training.py -> trainer/faults.py.

The import contracts in pyproject.toml (`lint-imports`) name packages, not their modules; the
tests below add modules nobody has written yet to the real import graph and check that the
contracts hold them to their package's rules."""

from __future__ import annotations

import copy
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp
import pytest
from importlinter.api import read_configuration
from importlinter.contracts.forbidden import ForbiddenContract
from importlinter.contracts.layers import LayersContract
from importlinter.contracts.protected import ProtectedContract

REPO = Path(__file__).resolve().parents[1]

PROBE = """
import sys
import activities.data, activities.events, activities.runs, activities.suggest
import activities.evaluate, activities.training, ops.worker
import workflows.training_run, workflows.sweep
heavy = sorted(m for m in ("torch", "deepspeed", "numpy.linalg") if m in sys.modules)
print(",".join(heavy))
"""


@pytest.mark.process
def test_every_module_a_worker_loads_leaves_torch_and_deepspeed_unimported():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert "torch" not in out.stdout and "deepspeed" not in out.stdout, out.stdout


CONTRACT_TYPES = {"layers": LayersContract, "forbidden": ForbiddenContract,
                  "protected": ProtectedContract}


@pytest.fixture(scope="module")
def config():
    return read_configuration(str(REPO / "pyproject.toml"))


@pytest.fixture(scope="module")
def graph(config):
    return grimp.build_graph(*config["session_options"]["root_packages"],
                             include_external_packages=True, cache_dir=None)


def broken_contracts(config, graph) -> list[str]:
    broken = []
    for options in config["contracts_options"]:
        contract = CONTRACT_TYPES[options["type"]](
            name=options["name"], session_options=config["session_options"],
            contract_options=options)
        if not contract.check(copy.deepcopy(graph), verbose=False).kept:
            broken.append(contract.name)
    return broken


def with_import(graph, importer: str, imported: str):
    changed = copy.deepcopy(graph)
    for module in (importer, imported):
        if module not in changed.modules:
            changed.add_module(module)
    changed.add_import(importer=importer, imported=imported, line_number=1,
                       line_contents=f"import {imported}")
    return changed


def test_every_shipped_package_is_a_root_package_on_a_floor(config):
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert shipped == set(config["session_options"]["root_packages"])
    (layers,) = [c for c in config["contracts_options"] if c["type"] == "layers"]
    on_a_floor = {m.strip() for floor in layers["layers"] for m in floor.split("|")}
    assert on_a_floor == shipped


def test_the_tree_as_it_is_keeps_every_contract(config, graph):
    assert broken_contracts(config, graph) == []


# "new" names a module no contract lists; each import breaks a rule of the importer's package.
@pytest.mark.parametrize("importer,imported", [
    ("ops.new", "workflows.sweep"),               # only ops/worker.py registers workflows
    ("activities.new", "workflows.nodes"),
    ("workflows.new", "torch"),                   # the workflow sandbox stays deterministic
    ("workflows.new", "numpy"),
    ("workflows.new", "activities.hang"),         # activity code other than the contracts
    ("workflows.new", "activities.new"),
    ("workflows.new", "storage.new"),
    ("workflows.new", "ops.new"),
    ("activities.contracts", "activities.new"),   # workflows would load it through contracts
    ("activities.contracts", "trainer.new"),
    ("activities.new", "ops.new"),                # a floor above
    ("trainer.new", "dataprep.new"),              # one floor, kept apart
    ("dataprep.new", "trainer.new"),
    ("dataprep.new", "torch"),
    ("storage.new", "trainer.new"),
    ("storage.new", "activities.new"),
    ("sweep.new", "storage.new"),
    ("spec.new", "sweep.new"),
    ("common.new", "spec.new"),
    ("ops.report_render", "ops.new"),             # the renderer imports no project code
])
def test_a_new_module_that_breaks_its_packages_rule_breaks_a_contract(config, graph, importer,
                                                                      imported):
    assert broken_contracts(config, with_import(graph, importer, imported))


@pytest.mark.parametrize("importer,imported", [
    ("workflows.new", "activities.contracts"),
    ("workflows.new", "spec.new"),
    ("ops.new", "activities.new"),
    ("activities.new", "trainer.new"),
    ("trainer.new", "storage.new"),
])
def test_a_new_module_importing_what_its_package_may_breaks_nothing(config, graph, importer,
                                                                    imported):
    assert broken_contracts(config, with_import(graph, importer, imported)) == []
