"""Data preparation, a pipeline of its own (DESIGN §1, stage 1): corpus → cleaned,
deduplicated, tokenized shards and a DatasetManifest (storage/dataset.py, the contract with
the trainer). Entry point: `dataprep.pipeline.prepare_dataset`."""
