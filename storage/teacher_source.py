"""A student run's teacher (`distill.teacher`): where its promoted checkpoint is, and whether
it reads this run's tokens — decided from the durable store alone, on the data worker once
the dataset is ready, before any accelerator is used (activities/data.py); the trainer that
loads the teacher reads the same source (trainer/teacher.py). The checks are
`train.init_from`'s (storage/init_source.py), named for this field; the teacher's model
shape is its own (it need not be the student's).
"""

from __future__ import annotations

from common.errors import BadConfig
from spec import RunSpec
from storage.dataset import DatasetManifest
from storage.init_source import InitSource, check_tokenizer, promoted_source
from storage.runs import stored_spec

FIELD = "distill.teacher"


def teacher_source(spec: RunSpec) -> InitSource:
    """The promoted checkpoint `distill.teacher` names; BadConfig naming the field when the
    run has none, or not that step, or no stored spec to read its model from."""
    try:
        source = promoted_source(spec.storage.durable, spec.distill.teacher)
    except BadConfig as exc:  # promoted_source speaks of train.init_from
        raise BadConfig(FIELD, exc.problem, "name a run of this store that finished and "
                        "promoted a checkpoint: RUN_ID or RUN_ID@STEP") from None
    if stored_spec(spec.storage.durable, source.run_id) is None:
        raise BadConfig(FIELD, f"run {source.run_id} has no stored spec (RUN.json) to read "
                        "its model from", "name a run this store ran through mainspring")
    return source


def check_teacher(spec: RunSpec, manifest_uri: str, manifest: DatasetManifest) -> InitSource:
    """The teacher against this run's dataset: BadConfig naming both vocabularies when its
    tokenizer is not this dataset's (the same size is not enough: the same ids must mean
    the same text for its distribution to teach anything)."""
    source = teacher_source(spec)
    check_tokenizer(spec.storage.durable, source.run_id, manifest_uri, manifest, FIELD,
                    "the teacher")
    return source
