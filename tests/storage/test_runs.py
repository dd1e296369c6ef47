"""The run-id claim runs/<id>/RUN.json (storage/runs.py)."""

import json
import os
import uuid

import pytest

from common.errors import BadConfig, BadData
from ops.cli import main
from spec import preset
from storage.events import EventLog
from storage.runs import RESUME_FIX, check_claim, claim_run


@pytest.fixture(params=["file", "memory"])
def durable(request, tmp_path):
    return str(tmp_path / "store") if request.param == "file" \
        else f"memory://claims-{uuid.uuid4().hex}"


def test_first_claim_creates_run_json_and_the_same_spec_resumes(durable):
    assert check_claim(durable, "r1", "aaaa") == "free"
    assert claim_run(durable, "r1", "aaaa", {"run_id": "r1"}) == "created"
    assert claim_run(durable, "r1", "aaaa", {"run_id": "r1"}) == "resumed"
    assert check_claim(durable, "r1", "aaaa") == "claimed"
    assert check_claim(durable, "r2", "bbbb") == "free"  # other ids are not affected


def test_another_spec_with_a_claimed_id_is_refused_saying_how_to_resume(durable):
    claim_run(durable, "r1", "aaaa", {"run_id": "r1"})
    for call in (claim_run, check_claim):
        with pytest.raises(BadConfig) as info:
            call(durable, "r1", "bbbb", *([{}] if call is claim_run else []))
        err = info.value
        assert err.field == "run_id" and not err.retryable and err.fix == RESUME_FIX
        assert f"already exists in {durable} with spec aaaa; this spec is bbbb" in err.problem


def test_run_json_is_written_once_with_the_spec(tmp_path):
    store = str(tmp_path / "store")
    claim_run(store, "r1", "aaaa", {"run_id": "r1", "seed": 7})
    path = tmp_path / "store" / "runs" / "r1" / "RUN.json"
    first = path.read_bytes()
    doc = json.loads(first)
    assert doc["spec_hash"] == "aaaa" and doc["spec"]["seed"] == 7 and doc["created"] > 0
    claim_run(store, "r1", "aaaa", {"run_id": "r1", "seed": 8})
    assert path.read_bytes() == first  # a resume never rewrites the claim


def test_a_run_directory_from_before_claims_belongs_to_its_run_started_hash(tmp_path):
    store = str(tmp_path / "store")
    with EventLog(store, "old", "workflow") as log:
        log.emit("run_started", step=0, event_id="run_started", spec_hash="aaaa")
    with pytest.raises(BadConfig):
        claim_run(store, "old", "bbbb", {})
    assert not (tmp_path / "store" / "runs" / "old" / "RUN.json").exists()
    assert claim_run(store, "old", "aaaa", {}) == "resumed"  # same spec: adopted, now claimed
    assert check_claim(store, "old", "aaaa") == "claimed"


def test_a_run_directory_with_data_but_no_spec_is_refused(tmp_path):
    ckpt = tmp_path / "store" / "runs" / "r-trial-0" / "checkpoints" / "step-000000010"
    ckpt.mkdir(parents=True)
    (ckpt / "MANIFEST.json").write_text("{}")
    with pytest.raises(BadConfig) as info:
        claim_run(str(tmp_path / "store"), "r-trial-0", "aaaa", {})
    assert "unknown" in info.value.problem


def test_an_unreadable_claim_is_bad_data_naming_the_file(tmp_path):
    path = tmp_path / "store" / "runs" / "r1" / "RUN.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(BadData) as info:
        claim_run(str(tmp_path / "store"), "r1", "aaaa", {})
    assert info.value.path.endswith("RUN.json") and not info.value.retryable


def test_cli_refuses_to_start_a_run_id_another_spec_owns_before_connecting(tmp_path, capsys):
    store = str(tmp_path / "store")
    claim_run(store, "taken", "0123456789abcdef", {})
    # the address is unreachable on purpose: the refusal comes before any connection
    code = main(["run", "start", "--preset", "demo", "--set", "run_id=taken",
                 "--set", f"storage.durable={store}", "--set", f"storage.fast={tmp_path}/fast",
                 "--address", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2 and "run taken already exists" in err and "0123456789abcdef" in err
    assert "pick a new run_id" in err
    assert os.listdir(tmp_path / "store" / "runs" / "taken") == ["RUN.json"]
    assert preset("demo").spec_hash() != "0123456789abcdef"
