"""One task vocabulary: the capability table (runtime/capabilities.py) is the list that the
endpoints, the export's head wiring, the evaluators and the training commands derive from. Each
test fails if one of them names a capability the table lacks, or the reverse."""

from __future__ import annotations

import argparse

import pytest

from bertserve.runtime.capabilities import CAPABILITIES, evaluations, trained_by
from bertserve.runtime.tasks import READS, TASKS
from bertserve.runtime.tasks.common import RequestLimits
from bertserve.service.settings import Settings


def test_every_capability_is_served_and_every_endpoint_serves_a_capability():
    assert set(READS) == set(CAPABILITIES)
    for task in TASKS.values():
        assert set(task.reads) <= set(CAPABILITIES[task.capability].outputs), task.path


def test_the_export_wires_a_head_for_each_capability_and_no_other():
    graph = pytest.importorskip("bertserve.export.graph")
    assert set(graph.HEAD_KEYS) == set(CAPABILITIES) == set(graph.TASKS)
    heads = pytest.importorskip("bertserve.model.heads")
    for capability in CAPABILITIES.values():
        assert capability.architecture in heads.HEADS, capability.name


def test_the_evaluators_are_the_tables_evaluations():
    evaluate = pytest.importorskip("bertserve.model.training.evaluate")
    assert set(evaluate.EVALUATORS) == set(evaluations())


def subparser_choices(name: str) -> list[str]:
    training = pytest.importorskip("bertserve.model.training.__main__")
    parser = training.build_parser("bertserve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    task = next(a for a in sub.choices[name]._actions if a.dest == "task")
    return list(task.choices)


@pytest.mark.parametrize("command", ["finetune", "distil"])
def test_the_training_commands_offer_the_capabilities_they_train(command):
    assert subparser_choices(command) == trained_by("finetune") == ["classify", "ner", "qa"]


def test_evaluate_offers_every_evaluation():
    assert subparser_choices("evaluate") == list(evaluations())


def test_every_request_limit_is_a_setting_and_names_a_tasks_limit():
    limits = set(RequestLimits.__dataclass_fields__)
    assert limits <= set(Settings.model_fields)
    named = {t.batch_limit for t in TASKS.values()} | {t.rows_limit for t in TASKS.values()}
    assert named == limits
    defaults = RequestLimits()
    for name in limits:
        assert getattr(defaults, name) == Settings.model_fields[name].default, name
