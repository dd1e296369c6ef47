"""A student run's teacher (`distill.teacher`): where its promoted checkpoint is, and whether
it reads this run's tokens — decided from the durable store alone, on the data worker once
the dataset is ready, before any accelerator is used (activities/data.py); the trainer that
loads the teacher reads the same source (trainer/teacher.py). The checks are
`train.init_from`'s (storage/init_source.py), named for this field; the teacher's model
shape is its own (it need not be the student's), read from the teacher run's stored spec
(RUN.json) — the bucket's word, so its size is bounded (`distill.max_teacher_params`) here,
on the data worker, before any rank builds it; every rank checks it again before it does.
"""

from __future__ import annotations

from common.errors import BadConfig
from spec import ModelConfig, RunSpec
from spec.codec import build
from spec.model import param_count
from storage.dataset import DatasetManifest
from storage.init_source import InitSource, check_tokenizer, promoted_source
from storage.runs import stored_spec

FIELD = "distill.teacher"
LIMIT = "distill.max_teacher_params"


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


def teacher_model(spec: RunSpec, source: InitSource, vocab_size: int) -> ModelConfig:
    """The teacher's model config, from its run's stored spec, within the spec's bound:
    BadConfig naming distill.teacher when the stored section is missing or not a model
    section this version reads, naming distill.max_teacher_params when the model it
    describes (with this vocabulary) has more parameters than allowed. Pure arithmetic on
    the stored shape: nothing is allocated."""
    raw = (stored_spec(spec.storage.durable, source.run_id) or {}).get("model")
    if not isinstance(raw, dict):
        raise BadConfig(FIELD, f"run {source.run_id}'s stored spec (RUN.json) has no model "
                        "section", "name a run this store ran through mainspring")
    try:
        cfg = build(ModelConfig, raw, "model")
    except BadConfig as exc:
        raise BadConfig(FIELD, f"run {source.run_id}'s stored model section does not read: "
                        f"{exc.field}: {exc.problem[:200]}", "name another teacher") from None
    params, limit = param_count(cfg, vocab_size), spec.distill.max_teacher_params
    if params > limit:
        raise BadConfig(LIMIT, f"the teacher, run {source.run_id}, has {params:,} parameters "
                        f"(its stored model with a vocabulary of {vocab_size}), over the limit "
                        f"of {limit:,}", f"name a smaller teacher, or raise {LIMIT} to at "
                        f"least {params} if every rank's host and device hold 4 bytes a "
                        "parameter")
    return cfg


def check_teacher(spec: RunSpec, manifest_uri: str, manifest: DatasetManifest) -> InitSource:
    """The teacher against this run's dataset: BadConfig naming both vocabularies when its
    tokenizer is not this dataset's (the same size is not enough: the same ids must mean
    the same text for its distribution to teach anything), and naming
    distill.max_teacher_params when it is larger than allowed (`teacher_model`)."""
    source = teacher_source(spec)
    teacher_model(spec, source, manifest.vocab_size)
    check_tokenizer(spec.storage.durable, source.run_id, manifest_uri, manifest, FIELD,
                    "the teacher")
    return source
