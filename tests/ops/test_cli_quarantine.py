"""`mainspring data quarantine RUN`: each quarantined document with its source, record,
hash, z and step, and the start of its text read back from the source record — scrubbed
of secrets, control and format characters escaped, cut at 80 characters."""

from __future__ import annotations

import hashlib
import json

from dataprep.clean import clean_text
from ops.cli import main as cli
from ops.cli_quarantine import NOT_READABLE, SNIPPET_CHARS, snippet
from storage.events import EventLog
from storage.runs import claim_run

RUN = "spiky"
SECRET_TEXT = ("leaked password=hunter2-very-secret-value\tthen\nAKIAIOSFODNN7EXAMPLE "
               "\u202eevil " + "long tail of ordinary words " * 8)
PLAIN_TEXT = "an ordinary document that was only unlucky " * 3


def sha(text: str) -> str:
    return hashlib.sha256(clean_text(text, "NFC")[0].encode()).hexdigest()[:32]


def make_run(tmp_path, sources: list[dict], verdict: str = "data") -> str:
    """A run whose stored spec reads tmp_path/corpus: sources there may be opened."""
    store = str(tmp_path / "store")
    claim_run(store, RUN, "h", {"run_id": RUN, "data": {"corpus": str(tmp_path / "corpus")}})
    with EventLog(store, RUN, "trainer") as log:
        log.emit("run_started", event_id="run_started", spec_hash="x")
        log.emit("spike_diagnosed", step=78, event_id="spike_diagnosed/78/76/70/a1r1",
                 verdict=verdict, documents=[s["document"] for s in sources],
                 outliers=[{"document": s["document"], "loss": 9.0, "z": 11.5 + s["document"]}
                           for s in sources], sources=sources)
    return store


def corpus(tmp_path) -> tuple[str, str]:
    c = tmp_path / "corpus"
    c.mkdir()
    lines = [json.dumps({"text": PLAIN_TEXT + "(first)"}), json.dumps({"text": SECRET_TEXT})]
    (c / "a.jsonl").write_text("\n".join(lines) + "\n")
    (c / "b.txt").write_text(PLAIN_TEXT)
    return f"file://{c}/a.jsonl", f"file://{c}/b.txt"


def test_each_document_is_listed_with_a_redacted_escaped_truncated_snippet(tmp_path, capsys):
    jsonl, txt = corpus(tmp_path)
    store = make_run(tmp_path, [
        {"document": 4, "source": jsonl, "record": 2, "sha256": sha(SECRET_TEXT), "chars": 300},
        {"document": 5, "source": txt, "record": -1, "sha256": sha(PLAIN_TEXT), "chars": 129},
        {"document": 6, "source": str(tmp_path / "corpus" / "gone.jsonl"), "record": 1,
         "sha256": "ab" * 16, "chars": 99}])
    capsys.readouterr()  # the event log's own log lines
    assert cli(["data", "quarantine", RUN, "--durable", store]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"run {RUN}: 3 quarantined documents (data.quarantine: ")
    assert f"runs/{RUN}/quarantine.jsonl" in out
    assert f"step 78  z 15.5  sha256 {sha(SECRET_TEXT)}  {jsonl}:2" in out
    assert f"z 16.5  sha256 {sha(PLAIN_TEXT)}  {txt}\n" in out
    assert "hunter2" not in out and "AKIAIOSFODNN7EXAMPLE" not in out and "***" in out
    assert "\u202e" not in out and "\\u202e" in out and "\\t" in out and "\\n" in out
    quoted = [line.strip() for line in out.splitlines() if line.startswith('    "')]
    assert len(quoted) == 2 and all(len(q) <= SNIPPET_CHARS + 2 for q in quoted)
    assert quoted[0].endswith('…"') and quoted[0].startswith('"leaked password=***')
    assert out.rstrip().endswith(NOT_READABLE)


def test_json_gives_one_object_per_document_with_its_figures(tmp_path, capsys):
    jsonl, _ = corpus(tmp_path)
    store = make_run(tmp_path, [
        {"document": 4, "source": jsonl, "record": 2, "sha256": sha(SECRET_TEXT), "chars": 300}])
    capsys.readouterr()  # the event log's own log lines
    assert cli(["data", "quarantine", RUN, "--durable", store, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert (row["source"], row["record"], row["sha256"], row["z"], row["step"]) == \
        (jsonl, 2, sha(SECRET_TEXT), 15.5, 78)
    assert row["text_from"] == "source" and len(row["snippet"]) == SNIPPET_CHARS
    assert "hunter2" not in row["snippet"] and row["snippet"].endswith("…")


def test_a_source_that_no_longer_holds_the_text_says_so(tmp_path, capsys):
    jsonl, _ = corpus(tmp_path)
    store = make_run(tmp_path, [
        {"document": 4, "source": jsonl, "record": 1, "sha256": sha(SECRET_TEXT), "chars": 300}])
    capsys.readouterr()  # the event log's own log lines
    assert cli(["data", "quarantine", RUN, "--durable", store]) == 0
    out = capsys.readouterr().out
    assert "(source no longer holds this text)" in out and "unlucky" not in out


def test_a_run_without_quarantined_documents_says_so_and_exits_0(tmp_path, capsys):
    jsonl, _ = corpus(tmp_path)
    store = make_run(tmp_path, [{"document": 4, "source": jsonl, "record": 2,
                                 "sha256": sha(SECRET_TEXT), "chars": 300}],
                     verdict="optimisation")
    capsys.readouterr()  # the event log's own log lines
    assert cli(["data", "quarantine", RUN, "--durable", store]) == 0
    assert capsys.readouterr().out.startswith(f"run {RUN}: no quarantined documents")
    capsys.readouterr()  # the event log's own log lines
    assert cli(["data", "quarantine", RUN, "--durable", store, "--json"]) == 0
    got = capsys.readouterr()
    assert got.out == "" and "no quarantined documents" in got.err


def test_an_unknown_run_is_one_line_naming_the_store_exit_1(tmp_path, capsys):
    assert cli(["data", "quarantine", "nope", "--durable", str(tmp_path / "store")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mainspring data quarantine: ") and "nope" in err
    assert len(err.strip().splitlines()) == 1


def test_a_snippet_escapes_terminal_controls_and_cuts_at_the_width():
    assert snippet("a\x1b[31mred\x00\u200bz") == "a\\x1b[31mred\\x00\\u200bz"
    assert snippet("x" * 200, 10) == "x" * 9 + "…" and snippet("short") == "short"


def test_the_text_is_decoded_from_the_run_s_dataset_when_its_source_is_gone(tmp_path, capsys):
    from dataprep.pipeline import prepare_dataset
    from storage.provenance import load_provenance
    from tests.dataprep.test_pipeline import TEXTS, config

    c = tmp_path / "corpus"
    c.mkdir()
    planted = [f"planted {i}: secret_token=abcdefgh12345678 "
               + " ".join(f"odd{i}w{j}" for j in range(30)) for i in range(3)]
    (c / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                       for t in TEXTS[:12] + planted))
    store = str(tmp_path / "store")
    url, man, _ = prepare_dataset(config(c), store, seed=1)
    index = load_provenance(url, "train").index
    doc = next(d for d in range(len(index)) if index.entry(d).record > 12)  # a planted one
    entry = index.entry(doc)
    (c / "a.jsonl").unlink()  # the corpus is gone; the dataset still holds the text
    with EventLog(store, RUN, "data") as log:
        log.emit("dataset_ready", event_id=f"dataset_ready/{man.content_hash}", uri=url,
                 content_hash=man.content_hash)
        log.emit("spike_diagnosed", step=12, event_id="spike_diagnosed/12/10/5/a1r1",
                 verdict="data", documents=[doc],
                 outliers=[{"document": doc, "loss": 9.0, "z": 8.0}],
                 sources=[{"document": doc, "source": entry.source, "record": entry.record,
                           "sha256": entry.sha256, "chars": entry.chars}])
    capsys.readouterr()
    assert cli(["data", "quarantine", RUN, "--durable", store, "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["text_from"] == "dataset" and row["record"] == entry.record
    assert row["snippet"].startswith(f"planted {entry.record - 13}: secret_token=***")
    assert "abcdefgh12345678" not in row["snippet"] and len(row["snippet"]) == SNIPPET_CHARS
