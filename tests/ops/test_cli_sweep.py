"""`mainspring sweep RUN`: a run's sweep table from its durable event log, written here by
the project's own event log writer as the Sweep workflow writes it (`sweep_trial` events,
one per scored trial)."""

from __future__ import annotations

import json
import math

from ops.cli import main as cli
from ops.cli_sweep import sweep_rows, table
from ops.report_map import trials_of
from spec import preset
from storage.events import EventLog, read_events
from storage.runs import claim_run

RUN = "swept"


def trial(log: EventLog, i: int, params: dict, loss: float, source: str, **more) -> None:
    """A `sweep_trial` event as workflows/sweep.py records it."""
    log.emit("sweep_trial", {"params": params, "result": loss,
                             "trial_run_id": f"{RUN}-trial-{i}", "round": i // 2,
                             "source": source, **more}, step=0, event_id=f"sweep_trial/{i}")


def swept_store(tmp_path) -> str:
    store = str(tmp_path / "store")
    with EventLog(store, RUN, "workflow") as log:
        log.emit("run_started", event_id="run_started", spec_hash="x")
        # written out of order, and trial 1 twice (a retried record_event): one row each
        trial(log, 2, {"lr": 8e-3, "beta2": 0.99}, 3.1, "tpe", steps=15, status="complete")
        trial(log, 0, {"lr": 2.2e-3, "beta2": 0.95}, 3.3, "prior", steps=15, status="complete")
        trial(log, 1, {"lr": 1e-2, "beta2": 0.9}, math.nan, "tpe", steps=15, status="diverged")
        trial(log, 1, {"lr": 1e-2, "beta2": 0.9}, math.nan, "tpe", steps=15, status="diverged")
        trial(log, 3, {"lr": 5e-3, "beta2": 0.999}, 3.1, "tpe", steps=15, status="complete")
    return store


def test_the_table_lists_each_trial_in_order_and_stars_the_lowest_loss(tmp_path, capsys):
    store = swept_store(tmp_path)
    capsys.readouterr()  # the event log's own log lines
    assert cli(["sweep", RUN, "--durable", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run {RUN}: 4 sweep trials"
    assert lines[1].split() == ["trial", "source", "beta2", "lr", "status", "loss", "steps"]
    rows = [line.split() for line in lines[2:6]]
    assert rows[0] == ["0", "prior", "0.95", "0.0022", "complete", "3.3000", "15"]
    assert rows[1] == ["1", "tpe", "0.9", "0.01", "diverged", "-", "15"]
    # trials 2 and 3 tie at 3.1: the earlier wins, as the Sweep workflow picks it
    assert rows[2] == ["*", "2", "tpe", "0.99", "0.008", "complete", "3.1000", "15"]
    assert rows[3][0] == "3" and "*" not in lines[5]
    assert lines[6] == "winner: trial 2 (beta2 0.99, lr 0.008)"


def test_json_is_one_document_with_every_trial_and_the_winner(tmp_path, capsys):
    store = swept_store(tmp_path)
    capsys.readouterr()
    assert cli(["sweep", RUN, "--durable", store, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run_id"] == RUN and doc["swept"] is True and doc["winner"] == 2
    assert doc["parameters"] == ["beta2", "lr"]
    assert [t["trial"] for t in doc["trials"]] == [0, 1, 2, 3]
    t0, t1 = doc["trials"][:2]
    assert t0 == {"trial": 0, "run_id": f"{RUN}-trial-0", "source": "prior", "round": 0,
                  "params": {"lr": 2.2e-3, "beta2": 0.95}, "status": "complete",
                  "val_loss": 3.3, "steps": 15, "winner": False, "rungs": []}
    assert t1["status"] == "diverged" and t1["val_loss"] is None
    assert [t["winner"] for t in doc["trials"]] == [False, False, True, False]


def test_events_from_before_status_and_steps_get_them_from_the_loss_and_stored_spec(
        tmp_path, capsys):
    store = str(tmp_path / "store")
    spec = preset("demo", run_id=RUN)
    claim_run(store, RUN, spec.spec_hash(), spec.to_dict())
    with EventLog(store, RUN, "workflow") as log:
        trial(log, 0, {"lr": 3e-3}, 4.0, "initial")
        trial(log, 1, {"lr": 9e-3}, math.inf, "gp")
    capsys.readouterr()
    assert cli(["sweep", RUN, "--durable", store, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(t["status"], t["steps"]) for t in doc["trials"]] == [("complete", 15),
                                                                 ("diverged", 15)]
    assert doc["winner"] == 0


def test_a_run_without_a_sweep_says_so_and_exits_0(tmp_path, capsys):
    store = str(tmp_path / "store")
    with EventLog(store, RUN, "workflow") as log:
        log.emit("run_started", event_id="run_started", spec_hash="x")
    capsys.readouterr()
    assert cli(["sweep", RUN, "--durable", store]) == 0
    assert capsys.readouterr().out.startswith(f"run {RUN}: no sweep")
    assert cli(["sweep", RUN, "--durable", store, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == {"run_id": RUN, "swept": False, "parameters": [], "winner": None,
                   "trials": []}


def test_an_unknown_run_is_one_line_naming_the_store_and_exits_1(tmp_path, capsys):
    store = swept_store(tmp_path)
    capsys.readouterr()
    assert cli(["sweep", "nosuch", "--durable", store]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("mainspring sweep: ") and "nosuch" in line and RUN in line


def test_whole_number_parameters_show_whole_and_the_rest_to_four_digits():
    events = [{"kind": "sweep_trial", "event_id": "sweep_trial/0", "payload": {
        "params": {"batch_tokens": 16384.0, "grad_clip": 1.0, "lr": 0.0123456},
        "result": 3.0, "trial_run_id": f"{RUN}-trial-0", "source": "prior", "steps": 15}}]
    text = table(RUN, sweep_rows(events))
    assert text.splitlines()[2].split() == ["*", "0", "prior", "16384", "1", "0.01235",
                                            "complete", "3.0000", "15"]


def pruned_store(tmp_path) -> str:
    """A pruned sweep (sweep.pruning 3 rungs of a 9-step trial: boundaries at 1 and 3) as
    workflows/sweep.py records it."""
    store = str(tmp_path / "store")
    with EventLog(store, RUN, "workflow") as log:
        trial(log, 0, {"lr": 5e-3}, 4.4, "prior", steps=9, status="complete",
              rungs=[[1, 5.0], [3, 4.6]])
        trial(log, 1, {"lr": 2e-2}, 3.1, "tpe", steps=1, status="pruned", rungs=[[1, 5.3]],
              pruned_at={"rung": 0, "step": 1, "competing": 2, "better": 1})
        trial(log, 2, {"lr": 1e-2}, 4.2, "tpe", steps=9, status="complete",
              rungs=[[1, 4.9], [3, 4.5]])
        trial(log, 3, {"lr": 8e-3}, 4.7, "tpe", steps=3, status="pruned",
              rungs=[[1, 4.8], [3, 4.7]])
    return store


def test_a_pruned_sweep_shows_each_trials_rung_losses_and_what_pruning_saved(tmp_path, capsys):
    store = pruned_store(tmp_path)
    capsys.readouterr()
    assert cli(["sweep", RUN, "--durable", store]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["trial", "source", "lr", "status", "loss", "steps", "rungs"]
    rows = [line.split() for line in lines[2:6]]
    assert rows[0] == ["0", "prior", "0.005", "complete", "4.4000", "9", "5.0000@1,4.6000@3"]
    # a pruned trial: no final loss (it never wins, even below the winner), the steps it
    # trained, and the rung it stopped at last
    assert rows[1] == ["1", "tpe", "0.02", "pruned", "-", "1", "5.3000@1"]
    assert rows[2] == ["*", "2", "tpe", "0.01", "complete", "4.2000", "9", "4.9000@1,4.5000@3"]
    assert rows[3] == ["3", "tpe", "0.008", "pruned", "-", "3", "4.8000@1,4.7000@3"]
    assert lines[6] == "winner: trial 2 (lr 0.01)"
    # 22 of 36 planned trial steps trained
    assert lines[7] == "pruning: 2 of 4 trials pruned, 39% of the trials' steps saved (22 of 36)"
    assert cli(["sweep", RUN, "--durable", store, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["winner"] == 2 and doc["trials"][3]["rungs"] == [[1, 4.8], [3, 4.7]]
    assert doc["pruning"] == {"trials_pruned": 2, "pruning_saving": 1 - 22 / 36,
                              "trained_steps": 22, "planned_steps": 36}


def test_a_pruned_trials_row_has_no_loss_and_carries_its_rung_losses():
    events = [{"kind": "sweep_trial", "event_id": "sweep_trial/0", "payload": {
        "params": {"lr": 1e-2}, "result": 5.3, "trial_run_id": f"{RUN}-trial-0",
        "source": "prior", "steps": 1, "status": "pruned", "rungs": [[1, 5.3]]}}]
    (row,) = sweep_rows(events)
    assert (row.status, row.val_loss, row.steps, row.rungs, row.winner) == (
        "pruned", None, 1, [[1, 5.3]], False)


def test_the_report_never_stars_a_pruned_trial_whose_rung_loss_is_lowest(tmp_path):
    store = pruned_store(tmp_path)  # trial 1 stopped at step 1 with 3.1, below the winner
    trials = trials_of(read_events(store, RUN), {})
    assert [t.index for t in trials if t.best] == [2]
    assert trials[1].val_loss is None
