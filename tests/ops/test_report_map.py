"""The training map of `mainspring report` (ops/report_map.py, ops/report_map_render.py), on
a real run's durable record: tests/fixtures/report_run/store, recorded by its record.py
through real Temporal, workers and DeepSpeed (two ranks; a trainer worker SIGKILLed at step
50, corrupted batches at 110 rolled back past, a four-trial sweep). Every expected figure
is read from that record - the event log, the spans, the dataset manifest, the stored
spec - never written down here."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from common.errors import BadConfig
from ops.goodput import BADPUT_CAUSES, from_record
from ops.report import build_report, loss_series, training_map_of
from ops.report_map import COST_GROUPS, OTHER, hour_price, layout_of
from spec import RunSpec
from storage.dataset import load_manifest, manifest_url
from storage.events import read_events
from storage.runs import stored_spec
from storage.spans import read_spans
from tests.spec.helpers import pinned

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STORE = os.path.join(ROOT, "tests", "fixtures", "report_run", "store")
RUN = "map-run"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def record() -> dict:
    events, spans = read_events(STORE, RUN), read_spans(STORE, RUN)
    # the fixture is what the claims below are about: a fault, a spike rollback, a sweep
    kinds = [e["kind"] for e in events]
    assert kinds.count("rollback") >= 1 and kinds.count("sweep_trial") >= 2
    assert any(e["kind"] == "fault" and not e["payload"].get("injected") for e in events)
    return {"events": events, "spans": spans, "rec": from_record(events, spans),
            "spec": stored_spec(STORE, RUN)}


def tmap_of(record: dict, store: str = STORE, price: float = 0.0):
    return training_map_of(store, RUN, record["events"], record["spans"],
                           stored_spec(store, RUN), price)


def box(tmap, stage: str):
    return next(b for b in tmap.boxes if b.stage == stage)


def kind(events: list[dict], k: str) -> list[dict]:
    return [e for e in events if e["kind"] == k]


def copy_store(tmp_path, **spec_changes) -> str:
    """The fixture store copied, its stored spec changed by dotted name."""
    store = str(tmp_path / "store")
    shutil.copytree(STORE, store)
    path = os.path.join(store, "runs", RUN, "RUN.json")
    with open(path) as f:
        claim = json.load(f)
    for dotted, value in spec_changes.items():
        section, name = dotted.split(".")
        claim["spec"][section][name] = value
    with open(path, "w") as f:
        json.dump(claim, f)
    return store


def test_data_prep_box_counts_are_the_dataset_manifests_stats(record):
    ready = kind(record["events"], "dataset_ready")[-1]["payload"]
    stats = load_manifest(manifest_url(STORE, ready["content_hash"])).stats
    prep = box(tmap_of(record), "prepare_data")
    fig = prep.figures
    assert fig["removed_by_filter"] == {k.removeprefix("dropped_"): v for k, v in stats.items()
                                        if k.startswith("dropped_")}
    assert fig["removed_total"] == sum(v for k, v in stats.items() if k.startswith("dropped_"))
    assert fig["removed_total"] > 0  # the stdlib corpus does trip the quality filters
    for key in ("docs_in", "exact_dups", "near_dups", "docs_out", "docs_train", "docs_val",
                "tokens_train", "tokens_val", "shards_train", "shards_val", "files"):
        assert fig[key] == stats[key], key
    assert f"documents read: {stats['docs_in']:,}" in prep.lines
    assert f"tokens: {stats['tokens_train']:,} train / {stats['tokens_val']:,} val" in prep.lines
    for name, n in fig["removed_by_filter"].items():
        assert (f"   {name}: {n:,}" in prep.lines) == (n > 0)  # each filter that removed any


def test_the_manifest_is_found_in_the_store_given_when_the_recorded_uri_is_elsewhere(record):
    ready = kind(record["events"], "dataset_ready")[-1]["payload"]
    assert STORE not in ready["uri"]  # recorded in the recorder's temporary directory
    source = box(tmap_of(record), "prepare_data").figures["source"]
    assert source == manifest_url(STORE, ready["content_hash"])


def test_training_box_fault_rollback_and_skip_counts_equal_the_event_log(record):
    events = record["events"]
    fig = box(tmap_of(record), "train").figures
    faults, rollbacks = kind(events, "fault"), kind(events, "rollback")
    assert fig["faults"] == len(faults)
    assert fig["faults_injected"] == sum(bool(e["payload"].get("injected")) for e in faults)
    assert fig["faults_detected"] == len(faults) - fig["faults_injected"] >= 1
    assert fig["recoveries"] == len(kind(events, "recovered")) >= 1
    assert fig["rollbacks"] == len(rollbacks) >= 1
    assert fig["rollback_lost_steps"] == sum(r["payload"]["lost_steps"] for r in rollbacks)
    assert fig["skip_windows"] == [r["payload"]["skip"] for r in rollbacks]
    assert fig["skipped_data_batches"] == sum(b - a for a, b in fig["skip_windows"]) > 0
    assert fig["batches_skipped"] == len(kind(events, "batch_skipped"))
    assert fig["loss_spikes"] == len(kind(events, "loss_spike"))
    assert fig["launches"] == len(kind(events, "segment_started"))
    finished = [e for e in kind(events, "stage_finished") if e["payload"]["stage"] == "train"]
    assert fig["segments"] == finished[-1]["payload"]["segments"]
    assert fig["final_step"] == finished[-1]["payload"]["final_step"]
    assert fig["steps_replayed"] == record["rec"]["steps"]["replayed"]
    lines = box(tmap_of(record), "train").lines
    assert f"rollbacks: {len(rollbacks)} ({fig['rollback_lost_steps']} steps lost)" in lines
    for e in faults:
        assert f"   {e['payload']['kind']} @ step {e['step']}" in lines


def test_the_training_box_shows_the_runs_layout_from_its_stored_spec(record):
    # the recorded run: two data-parallel ranks, ZeRO 0
    train = box(tmap_of(record), "train")
    assert train.figures["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero": 0, "ranks": 2,
                                       "why": '2 replicas, ZeRO 0 (train.layout "dp")'}
    assert "layout: TP 1 × PP 1 × DP 2 on 2 ranks" in train.lines


def test_a_layout_says_how_the_ranks_split_and_why():
    tp_dp = layout_of({"train": {"nodes": 2, "procs_per_node": 2, "zero_stage": 2,
                                 "layout": {"tp": 2, "pp": 1, "zero": 2}}})
    assert (tp_dp["tp"], tp_dp["pp"], tp_dp["dp"], tp_dp["ranks"]) == (2, 1, 2, 4)
    assert tp_dp["why"] == "TP shards inside a node · 2 replicas, ZeRO 2 (train.layout)"
    pp = layout_of({"train": {"procs_per_node": 2, "layout": {"tp": 1, "pp": 2, "zero": 0}}})
    assert pp["why"] == "PP stages, 1F1B · 1 replica, ZeRO 0 (train.layout)"
    assert layout_of(None) is None and layout_of({"run_id": "x"}) is None
    auto = layout_of(pinned(**{"train.layout": "auto"}).to_dict())
    assert auto["why"].startswith('1 replica, ZeRO 0 (train.layout "auto": planned for 1 x 1 '
                                  "CPU host (")
    assert "TP 1: the bf16 weights" in auto["why"]


def test_sweep_box_and_plot_carry_every_trial_the_lowest_loss_best(record):
    events = record["events"]
    tmap = tmap_of(record)
    logged = kind(events, "sweep_trial")
    assert [(t.run_id, t.params, t.val_loss) for t in tmap.trials] == [
        (e["payload"]["trial_run_id"], e["payload"]["params"], e["payload"]["result"])
        for e in logged]
    best = min(logged, key=lambda e: e["payload"]["result"])
    [chosen] = [t for t in tmap.trials if t.best]
    assert chosen.run_id == best["payload"]["trial_run_id"]
    finished = [e for e in kind(events, "stage_finished") if e["payload"]["stage"] == "warmup_sweep"]
    assert chosen.params == finished[-1]["payload"]["best_params"]
    assert box(tmap, "warmup_sweep").figures["trials"] == len(logged)
    for t in tmap.trials:  # each trial's curve: the training loss of its own event log
        windows = loss_series(read_events(STORE, t.run_id)).current
        assert t.curve == [(w.last, w.mean) for w in windows] and len(t.curve) >= 2


def test_each_stage_box_has_its_stage_window_and_accelerator_hours_at_the_world_size(record):
    events, spec = record["events"], record["spec"]
    tmap = tmap_of(record)
    world = RunSpec.from_dict(spec).train.world_size
    assert world == 2 and tmap.accelerators == world  # two ranks recorded the run
    for b in tmap.boxes:
        started = [e["ts"] for e in kind(events, "stage_started") if e["payload"]["stage"] == b.stage]
        done = [e["ts"] for e in kind(events, "stage_finished") if e["payload"]["stage"] == b.stage]
        assert b.wall_s == pytest.approx(done[-1] - started[0], abs=1e-9)
        assert b.accel_h == pytest.approx(b.wall_s * world / 3600, rel=1e-12)


def test_the_specs_world_size_scales_every_accelerator_hour(record, tmp_path):
    store = copy_store(tmp_path, **{"train.procs_per_node": 8})  # 8 accelerators, not 2
    wide, narrow = tmap_of(record, store), tmap_of(record)
    assert wide.accelerators == 8
    assert [b.accel_h for b in wide.boxes] == pytest.approx([4 * b.accel_h for b in narrow.boxes])
    assert [r.accel_h for r in wide.cost] == pytest.approx([4 * r.accel_h for r in narrow.cost])


def test_cost_rows_add_up_to_the_wall_time_times_accelerators(record):
    rec = record["rec"]
    tmap = tmap_of(record)
    assert math.fsum(r.seconds for r in tmap.cost) == pytest.approx(rec["wall_s"], abs=1e-9)
    assert math.fsum(r.accel_h for r in tmap.cost) == pytest.approx(
        rec["wall_s"] * tmap.accelerators / 3600, abs=1e-12)
    assert tmap.accel_h == pytest.approx(rec["wall_s"] * tmap.accelerators / 3600)
    parts = {"productive": rec["productive_s"], **rec["badput_s"]}
    rows = {r.row: r for r in tmap.cost}
    for name, causes in COST_GROUPS:  # each row is from_record's seconds, regrouped
        assert rows[name].seconds == pytest.approx(sum(parts[c] for c in causes), abs=1e-9)
    # the recorded run's faults, spikes and sweep cost something; nothing unexplained is
    # negative: from_record's own `other` is what is left
    for name in ("productive training", "lost to faults and spikes", "warm-up sweep",
                 "evaluation", "checkpoint stalls"):
        assert rows[name].seconds > 0, name
    assert rows[OTHER].seconds == pytest.approx(rec["badput_s"]["other"], abs=1e-6)


def test_cost_groups_give_every_badput_cause_exactly_one_row():
    grouped = [c for _, causes in COST_GROUPS for c in causes]
    assert sorted(grouped + ["other"]) == sorted(["productive", *BADPUT_CAUSES])


def test_the_specs_price_multiplies_through_every_row_and_the_page(record, tmp_path):
    store = copy_store(tmp_path, **{"ops.accelerator_hour_price": 3.0})
    tmap = tmap_of(record, store, hour_price(stored_spec(store, RUN)))
    assert tmap.price == 3.0
    assert [r.cost for r in tmap.cost] == pytest.approx([3.0 * r.accel_h for r in tmap.cost])
    with open(build_report(store, RUN, str(tmp_path / "out"))["html"], encoding="utf-8") as f:
        page = f.read()
    total = f"{tmap.accel_h * 3.0:.4g}"
    assert (f"<td>total (wall time × accelerators)</td><td>–</td><td>{tmap.wall_s:.4g}</td>"
            f"<td>100</td><td>{tmap.accel_h:.4g}</td><td>{total}</td>") in page
    assert "price per accelerator-hour: 3" in page
    # --price wins over the spec's
    flag = tmap_of(record, store, hour_price(stored_spec(store, RUN), 0.5))
    assert [r.cost for r in flag.cost] == pytest.approx([0.5 * r.accel_h for r in tmap.cost])


@pytest.mark.parametrize("price", [-1.0, float("nan"), float("inf"), "cheap"])
def test_a_negative_or_non_finite_price_is_refused_naming_the_field_and_the_fix(price, tmp_path):
    with pytest.raises(BadConfig) as err:
        hour_price({"ops": {"accelerator_hour_price": price}})
    assert err.value.field == "ops.accelerator_hour_price"
    assert "ops.accelerator_hour_price" in err.value.fix and "e.g. 2.5" in err.value.fix
    with pytest.raises(BadConfig) as err:
        hour_price(None, price)
    assert err.value.field == "--price"
    if isinstance(price, float):  # the spec itself refuses it, in its own words
        with pytest.raises(BadConfig) as err:
            RunSpec.from_dict({**stored_spec(STORE, RUN),
                               "ops": {"accelerator_hour_price": price}})
        assert err.value.field == "ops.accelerator_hour_price"


@pytest.mark.process
def test_report_cli_refuses_a_negative_price_before_writing_anything(tmp_path):
    cli = ("import argparse, sys\nfrom ops.report import register\np = argparse.ArgumentParser()"
           "\nregister(p.add_subparsers())\na = p.parse_args(sys.argv[1:])\nsys.exit(a.fn(a))")
    done = subprocess.run([sys.executable, "-c", cli, "report", RUN, "--durable", STORE,
                           "--out", str(tmp_path / "out"), "--price", "-2"], check=False,
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert "mainspring report: --price: must be a finite price >= 0, got -2.0" in done.stderr
    assert not (tmp_path / "out").exists()


def test_report_writes_a_legible_training_map_png_and_its_html_section(record, tmp_path):
    from ops.report import ordered, val_series
    from ops.report_map_render import plot_map

    events = record["events"]
    tmap = tmap_of(record)
    path = str(tmp_path / "map.png")
    # no two labels overlap, and every box's text fits its box
    assert plot_map(path, RUN, tmap, loss_series(events), val_series(events),
                    ordered(events)) == []
    paths = build_report(STORE, RUN, str(tmp_path / "out"), price=2.5)
    with open(paths["map"], "rb") as f:
        assert f.read().startswith(PNG_MAGIC)
    with open(paths["html"], encoding="utf-8") as f:
        page = f.read()
    section = page.split("<h2>Training map</h2>", 1)[1].split("<h2>Loss</h2>", 1)[0]
    for b in tmap.boxes:
        assert f'id="stage-{b.stage}"' in section
    for t in tmap.trials:
        assert f"<td>{t.run_id}</td>" in section
    assert f"<td>{OTHER}</td>" in section and "<td>warm-up sweep</td>" in section
    faults = len(kind(events, "fault"))
    assert f"<li>faults: {faults} (" in section


def test_a_run_without_a_stored_spec_counts_the_ranks_in_its_spans_and_is_unpriced(
        record, tmp_path):
    store = copy_store(tmp_path)
    os.remove(os.path.join(store, "runs", RUN, "RUN.json"))
    tmap = tmap_of(record, store, hour_price(stored_spec(store, RUN)))
    ranks = {s["attributes"]["rank"] for s in record["spans"] if "rank" in s["attributes"]}
    assert tmap.accelerators == len(ranks) == 2 and tmap.price == 0.0
    assert "spans" in tmap.accelerators_from
    with open(build_report(store, RUN, str(tmp_path / "out"))["html"], encoding="utf-8") as f:
        assert "unpriced (ops.accelerator_hour_price 0)" in f.read()


def test_a_fault_is_counted_in_the_box_of_the_stage_it_happened_in():
    from ops.report_map import training_map

    def ev(k: str, t: float, step: int | None = None, **payload) -> dict:
        return {"event_id": f"{k}/{t}", "run_id": "r", "kind": k, "ts": 1e9 + t, "step": step,
                "attempt": 1, "payload": payload}
    events = [ev("run_started", 0), ev("stage_started", 0, stage="prepare_data"),
              ev("fault", 2, **{"kind": "storage_outage"}),
              ev("stage_finished", 5, stage="prepare_data"),
              ev("stage_started", 5, stage="train"), ev("fault", 7, 3, **{"kind": "hang"}),
              ev("fault", 8, 4, **{"kind": "worker_lost"}),
              ev("stage_finished", 10, stage="train"), ev("run_finished", 10)]
    tmap = training_map(events, from_record(events, []), stats={}, stats_source="none",
                        trials=[], accelerators=4, accelerators_from="test", price=0.0)
    assert box(tmap, "prepare_data").figures["faults"] == 1
    assert "   storage_outage" in box(tmap, "prepare_data").lines
    assert box(tmap, "train").figures["faults"] == 2
    assert math.fsum(r.accel_h for r in tmap.cost) == pytest.approx(10 * 4 / 3600)
