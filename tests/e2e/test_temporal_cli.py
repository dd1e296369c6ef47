"""A run driven only by the real `temporal` CLI, as the README shows: an operator without
our CLI can start, watch and operate a run.

The commands are README's own ("From the Temporal CLI / UI"): the test reads that block and
runs each line in order against the session's dev server and real workers, with the run id
in place of `my-run` and the input file written from docs/runspec.md's JSON example (run id,
steps and faults changed, nothing else). The example's storage paths are relative: the
orchestrator anchors them at its `--spec-root`, so data prep, the sweep's trials and the
training segments all use one store (when they were resolved apart, the first trial failed
with `dataset manifest not found`). What the Web UI shows is read back through
`temporal workflow describe` and `metadata`: the memo, the current details, the static
summary of a run `mainspring run start` started, and each activity's summary.
"""

from __future__ import annotations

import base64
import json
import pathlib
import shlex
import subprocess

import pytest

from ops.cli import main
from ops.client import localize
from ops.services import find_binary
from spec import RunSpec
from storage.events import read_events
from tests.e2e.runs import wait_for

pytestmark = pytest.mark.e2e

REPO = pathlib.Path(__file__).resolve().parents[2]
RUN_ID = "cli-run"


def doc_example() -> dict:
    """docs/runspec.md's JSON example, as a reader copies it."""
    text = (REPO / "docs" / "runspec.md").read_text()
    block = text.split("## Example: the `demo` preset", 1)[1].split("```json", 1)[1]
    return json.loads(block.split("```", 1)[0])


def readme_commands() -> list[list[str]]:
    """The `temporal` command lines of README's "From the Temporal CLI / UI" block."""
    text = (REPO / "README.md").read_text()
    block = text.split("**From the Temporal CLI / UI**", 1)[1].split("```sh", 1)[1]
    lines = block.split("```", 1)[0].replace("\\\n", " ").splitlines()
    return [argv for argv in (shlex.split(ln, comments=True) for ln in lines) if argv]


def shown(out: subprocess.CompletedProcess) -> dict:
    """The JSON object a query printed in its text output (`QueryResult  {...}`)."""
    assert out.returncode == 0, out
    return json.JSONDecoder().raw_decode(out.stdout[out.stdout.index("{"):])[0]


def accepted(out: subprocess.CompletedProcess) -> str:
    """An update's text output: `Result    map[accepted:pause applies:... id:op1 ...]`."""
    assert out.returncode == 0 and "Result" in out.stdout, out
    return out.stdout


def test_the_docs_example_is_a_valid_spec_whose_storage_paths_are_relative():
    spec = RunSpec.from_dict(doc_example())
    assert (spec.storage.durable, spec.storage.fast) == (".mainspring/store", ".mainspring/fast")
    assert spec.sweep.enabled and spec.faults  # the test turns only the faults off


def test_a_run_started_and_operated_with_the_temporal_cli_as_the_readme_shows(
        temporal_server, fleet_factory, tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    root.mkdir()
    raw = doc_example()
    raw["run_id"], raw["faults"] = RUN_ID, []
    # long segments: the pause reaches a segment that is still running
    raw["train"].update(total_steps=2000, segment_steps=1000)
    raw["sweep"]["trial_steps"] = 5
    (root / "my-run.json").write_text(json.dumps(raw, indent=2))
    fleet_factory(args=("--spec-root", str(root)))
    address = temporal_server.address

    def temporal(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([find_binary("temporal"), *argv, "--address", address],
                              capture_output=True, text=True, timeout=60)

    def readme(argv: list[str]) -> subprocess.CompletedProcess:
        argv = [(root / "my-run.json").read_text() if a == "$(cat my-run.json)"
                else RUN_ID if a == "my-run" else a for a in argv]
        assert argv[0] == "temporal", argv
        return temporal(*argv[1:])

    def status() -> dict:
        """The status query's answer; {} while no worker answers (a continue-as-new)."""
        out = temporal("workflow", "query", "--workflow-id", RUN_ID, "--type", "status",
                       "--output", "json")
        return json.loads(out.stdout)["queryResult"][0] if out.returncode == 0 else {}

    def described() -> dict:
        out = temporal("workflow", "describe", "--workflow-id", RUN_ID, "--output", "json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    commands = readme_commands()
    kinds = [(c[2], c[c.index("--name") + 1] if "--name" in c else "") for c in commands]
    assert kinds == [("start", ""), ("query", ""), ("update", "pause"), ("list", ""),
                     ("update", "set_lr_scale"), ("update", "rollback"), ("update", "resume"),
                     ("describe", ""), ("metadata", ""), ("signal", "abort")], kinds
    start, query, pause, listing, set_lr, rollback, resume, describe, metadata, abort = commands

    out = readme(start)
    assert out.returncode == 0, out.stderr
    assert shown(readme(query))["run_id"] == RUN_ID
    store = f"file://{root}/.mainspring/store"  # anchored at the orchestrator's --spec-root
    wait_for(lambda: status().get("durable") == store, 30, "the spec's paths anchored")

    # the sweep ran on the data prep's dataset (with paths resolved apart, its first trial failed)
    wait_for(lambda: status().get("segment_running"), 240, "the first training segment")
    events = read_events(store, RUN_ID)
    assert [e["payload"]["trial_run_id"] for e in events if e["kind"] == "sweep_trial"] == \
        [f"{RUN_ID}-trial-0", f"{RUN_ID}-trial-1"]
    [manifest] = (root / ".mainspring" / "store" / "datasets").glob("*/MANIFEST.json")
    claim = json.loads((root / ".mainspring/store/runs" / RUN_ID / "RUN.json").read_text())
    # the same spec `mainspring run start` would have sent from the same directory
    monkeypatch.chdir(root)
    assert claim["spec_hash"] == localize(RunSpec.from_dict(raw)).spec_hash()

    assert "applies:at the running segment's next step" in accepted(readme(pause))
    paused = wait_for(lambda: (s := status()).get("stage") == "paused" and s, 120, "the pause")
    assert paused["needs_attention"] == "node maintenance" and 0 < paused["step"] < 1000
    listed = wait_for(lambda: RUN_ID in (r := readme(listing)).stdout and r, 30,
                      "the paused run in the MainspringStage listing")
    assert listed.returncode == 0
    assert "applies:now" in accepted(readme(set_lr))
    out = readme(rollback)  # to step 12000, which the run has not reached
    assert out.returncode == 1, out
    assert (f"rollback to step 12000 is not before the run's step {paused['step']}; "
            f"pick a step < {paused['step']}") in out.stderr, out.stderr
    assert status()["lr_windows"] == [[paused["step"], 2000, 0.5]]

    memo = described()["workflowExecutionInfo"]["memo"]["fields"]
    assert {k: memo[k] for k in ("stage", "step", "total_steps", "faults_recovered",
                                 "durable")} == {
        "stage": "paused", "step": paused["step"], "total_steps": 2000, "faults_recovered": 0,
        "durable": store}
    assert memo["headline"] == (f"paused · step {paused['step']}/2000 · loss "
                                f"{memo['loss']:.4f} · 0 faults recovered")

    assert "reason_was:node maintenance" in accepted(readme(resume))
    running = wait_for(lambda: (s := status()).get("segment_running") and s, 120,
                       "training again")
    assert running["stage"] == "train" and running["workflow_runs"] == 2  # continued as new
    out = readme(describe)
    assert out.returncode == 0 and "Memo" in out.stdout and "headline" in out.stdout, out
    out = readme(metadata)
    assert out.returncode == 0, out.stderr
    assert f"**{RUN_ID}** · train · step {paused['step']}/2000" in out.stdout
    assert f"training steps {paused['step']}–{paused['step'] + 1000}" in out.stdout

    out = readme(abort)
    assert out.returncode == 0, out.stderr
    done = wait_for(lambda: (d := described())["workflowExecutionInfo"]["status"]
                    != "WORKFLOW_EXECUTION_STATUS_RUNNING" and d, 180, "the abort")
    info = done["workflowExecutionInfo"]
    assert info["status"] == "WORKFLOW_EXECUTION_STATUS_FAILED"
    assert info["memo"]["fields"]["stage"] == "aborted"
    wait_for(lambda: RUN_ID in temporal("workflow", "list", "--query",
                                        'MainspringStage="aborted"').stdout, 30,
             "the aborted run in the MainspringStage listing")
    events = read_events(store, RUN_ID)
    ops = [(e["payload"]["command"], e["payload"]["who"]) for e in events
           if e["kind"] == "operator"]
    assert ops == [("pause", "alice"), ("set_lr_scale", ""), ("abort", "")]  # no rollback
    [finished] = [e["payload"] for e in events if e["kind"] == "run_finished"]
    assert (finished["status"], finished["reason"]) == ("aborted", "budget")

    # the timeline: each activity says what it is (the chain's first run: prep, sweep, train)
    first = temporal("workflow", "show", "--workflow-id", RUN_ID, "--run-id",
                     info["firstRunId"], "--output", "json")
    told = [json.loads(base64.b64decode(e["userMetadata"]["summary"]["data"]))
            for e in json.loads(first.stdout)["events"] if "summary" in e.get("userMetadata", {})]
    assert told[0] == "anchor the spec's relative paths at the orchestrator's --spec-root"
    assert "data prep: stdlib:*.py → clean, exact+near dedup, tokenize (BPE 1024), shards" in told
    assert "segment 0–1000 of 2000" in told
    child = temporal("workflow", "describe", "--workflow-id", f"{RUN_ID}-sweep", "--output",
                     "json")
    assert json.loads(child.stdout)["executionConfig"]["userMetadata"]["summary"] == \
        f"warm-up sweep of {RUN_ID}: 2 trials × 5 steps over lr"
    sweep = temporal("workflow", "show", "--workflow-id", f"{RUN_ID}-sweep", "--output", "json")
    trials = [json.loads(base64.b64decode(e["userMetadata"]["summary"]["data"]))
              for e in json.loads(sweep.stdout)["events"]
              if "summary" in e.get("userMetadata", {})]
    assert sum(t.startswith("sweep trial ") and t.endswith(": train 5 steps") for t in trials) == 2
    assert manifest.exists()

    # `mainspring run start` names the run for the UI: the static summary and details
    capsys.readouterr()
    second = "cli-run-started"
    assert main(["run", "start", "--spec", "my-run.json", "--set", f"run_id={second}",
                 "--address", address]) == 0
    started = temporal("workflow", "describe", "--workflow-id", second, "--output", "json")
    meta = json.loads(started.stdout)["executionConfig"]["userMetadata"]
    assert meta["summary"] == \
        f"{second}: 2000 steps of a 2×128 GPT on stdlib:*.py, sweep 2×5 steps"
    assert f"store `{store}`" in meta["details"]
    text = temporal("workflow", "describe", "--workflow-id", second).stdout
    assert f'StaticSummary  "{meta["summary"]}"' in text
    assert temporal("workflow", "terminate", "--workflow-id", second,
                    "--reason", "test over").returncode == 0
