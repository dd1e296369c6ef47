"""Parallel, resumable, cached data prep: a crash redoes only unfinished work units."""

from __future__ import annotations

import time

import pytest

from dataprep.pipeline import PROVENANCE_STATS, prepare_dataset
from spec import DataConfig, TokenizerConfig
from storage.dataset import DatasetManifest, dataset_dir, tokenizer_path
from storage.fs import resolve
from tests.dataprep.test_pipeline import TEXTS, all_texts, config, write_txt

TEXTS_48 = TEXTS + [t.replace("document", "record") + " tail" for t in TEXTS]


class Crash(Exception):
    """Stands in for the process dying after `after` reports of `phase`."""


def crash_after(phase: str, after: int):
    seen = []

    def progress(name: str, counts: dict) -> None:
        if name == phase:
            seen.append(counts)
            if len(seen) == after:
                raise Crash(phase)
    return progress


def comparable(man: DatasetManifest) -> dict:
    """Everything but how the dataset was made (timings, what was reused)."""
    raw = {**man.__dict__, "stats": {k: v for k, v in man.stats.items()
                                     if k not in PROVENANCE_STATS}}
    return raw


def read_text(url: str) -> str:
    fs, path = resolve(url)
    return fs.cat_file(path).decode()


def small_units(tmp_path, **kw) -> DataConfig:
    corpus = write_txt(tmp_path / "c", TEXTS_48)
    return config(corpus, unit_bytes=400, **kw)  # ~4 files per unit: 12 units


@pytest.mark.process
def test_crash_while_cleaning_in_worker_processes_redoes_only_the_unfinished_units(tmp_path):
    data = small_units(tmp_path, workers=2)
    store = str(tmp_path / "store")
    with pytest.raises(Crash):
        prepare_dataset(data, store, seed=1, progress=crash_after("unit_cleaned", 5))
    url, resumed, hit = prepare_dataset(data, store, seed=1)
    units = resumed.stats["resume"]["units"]
    assert not hit and units >= 10
    assert resumed.stats["resume"] == {"units": units, "clean_reused": 5, "tokenize_reused": 0}
    _, clean, _ = prepare_dataset(data, str(tmp_path / "fresh"), seed=1)
    assert clean.stats["resume"] == {"units": units, "clean_reused": 0, "tokenize_reused": 0}
    assert comparable(resumed) == comparable(clean)
    assert sorted(all_texts(url)) == sorted(TEXTS_48)


def test_crash_while_tokenizing_reuses_every_cleaned_unit_and_the_tokenizer(tmp_path):
    data = small_units(tmp_path)
    store = str(tmp_path / "store")
    with pytest.raises(Crash):
        prepare_dataset(data, store, seed=1, progress=crash_after("unit_tokenized", 3))
    _, resumed, _ = prepare_dataset(data, store, seed=1)
    units = resumed.stats["resume"]["units"]
    assert resumed.stats["resume"] == {"units": units, "clean_reused": units,
                                       "tokenize_reused": 3}
    _, clean, _ = prepare_dataset(data, str(tmp_path / "fresh"), seed=1)
    assert comparable(resumed) == comparable(clean)


def test_a_corrupted_work_unit_is_redone_not_trusted(tmp_path):
    data = small_units(tmp_path)
    store = tmp_path / "store"
    with pytest.raises(Crash):
        prepare_dataset(data, str(store), seed=1, progress=crash_after("unit_tokenized", 1))
    (work,) = store.glob("datasets/*/work")
    (work / "clean-00001.json").write_text('{"records": [], "counts": {}, "cpu_s": {}}')
    _, resumed, _ = prepare_dataset(data, str(store), seed=1)
    units = resumed.stats["resume"]["units"]
    assert resumed.stats["resume"]["clean_reused"] == units - 1  # unit 1 failed its checksum
    assert sorted(all_texts(str(dataset_dir(str(store), resumed.content_hash))
                            + "/MANIFEST.json")) == sorted(TEXTS_48)
    assert not work.exists()  # the work dir goes once the manifest is committed


@pytest.mark.process
def test_worker_processes_give_the_same_dataset_as_one_process(tmp_path):
    one = small_units(tmp_path, workers=1)
    two = small_units(tmp_path, workers=2)
    url1, man1, _ = prepare_dataset(one, str(tmp_path / "a"), seed=1)
    url2, man2, _ = prepare_dataset(two, str(tmp_path / "b"), seed=1)
    assert (man1.stats["workers"], man2.stats["workers"]) == (1, 2)
    assert man1.content_hash == man2.content_hash  # worker count is not part of the key
    # One thread (workers=1) or a thread per core trains the same tokenizer.
    assert read_text(tokenizer_path(url1)) == read_text(tokenizer_path(url2))
    assert ({**comparable(man1), "stats": {**comparable(man1)["stats"], "workers": 0}}
            == {**comparable(man2), "stats": {**comparable(man2)["stats"], "workers": 0}})


def test_second_run_on_the_stdlib_corpus_is_a_cache_hit_in_well_under_a_second(tmp_path):
    data = DataConfig(max_documents=40, tokenizer=TokenizerConfig(vocab_size=512))
    store = str(tmp_path / "store")
    _, first, hit = prepare_dataset(data, store, seed=1)
    assert not hit
    start = time.perf_counter()
    _, second, hit = prepare_dataset(data, store, seed=7)
    elapsed = time.perf_counter() - start
    assert hit and second == first
    assert elapsed < 0.5 and elapsed < first.stats["seconds"]["total"] / 2
