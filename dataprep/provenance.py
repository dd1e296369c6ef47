"""A split's document index (storage.provenance) from its kept documents, in stream order."""

from __future__ import annotations

from typing import Collection, Sequence

import numpy as np

from common.redact import redact
from dataprep.clean import Document
from dataprep.filters import FIGURE_NAMES
from storage.provenance import CONTROL_STRIPPED, NORMALIZED, WHOLE_FILE, DocIndex


def source_record(source: str, file_urls: Collection[str]) -> tuple[str, int]:
    """(file URL, record) of a document's `source`: the file URL itself for a text file
    (record WHOLE_FILE), `<url>:<line>` for jsonl, `<url>:<row>` for parquet."""
    if source in file_urls:
        return source, WHOLE_FILE
    url, _, record = source.rpartition(":")
    if url not in file_urls or not record.isdigit():
        raise ValueError(f"document source {source!r} names no input file")
    return url, int(record)


def document_index(docs: Sequence[Document], file_urls: Collection[str]) -> DocIndex:
    """One index row per document of `docs`, in their order (the split's token stream).

    File URLs pass through `redact`, as anything else the dataset records: userinfo in an
    input URL must not land on the durable tier.
    """
    table: dict[str, int] = {}
    file, record = [], []
    for doc in docs:
        url, rec = source_record(doc.source, file_urls)
        file.append(table.setdefault(url, len(table)))
        record.append(rec)
    figures = np.full((len(docs), len(FIGURE_NAMES)), np.nan, dtype=np.float32)
    for row, doc in enumerate(docs):
        for col, name in enumerate(FIGURE_NAMES):
            if name in doc.figures:
                figures[row, col] = doc.figures[name]
    return DocIndex.build(files=[redact(u) for u in table], file=file, record=record,
                          sha256_hex=[d.sha256 for d in docs],
                          chars=[len(d.text) for d in docs],
                          flags=[NORMALIZED * d.normalized + CONTROL_STRIPPED * d.stripped
                                 for d in docs],
                          figure_names=FIGURE_NAMES, figures=figures)
