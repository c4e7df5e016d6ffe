"""The runtime's errors are HTTP-free, and the service's table answers every one of them."""

from __future__ import annotations

import inspect
import re

from bertserve.runtime import errors
from bertserve.service.http.errors import RUNTIME_ERRORS, answer_of

RUNTIME = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.RequestError)
]


def test_the_runtime_errors_carry_no_http():
    for cls in RUNTIME:
        error = cls("x", retry_after_s=2)
        assert not hasattr(error, "status") and not hasattr(error, "headers"), cls
    assert not re.search(r"\b[45]\d\d\b", inspect.getsource(errors))  # no status codes


def test_each_runtime_error_has_its_own_row_in_the_service_table():
    assert set(RUNTIME) == set(RUNTIME_ERRORS)
    answers = {cls: answer_of(cls("x")) for cls in RUNTIME}
    assert answers[errors.InvalidInput][:2] == (422, "invalid_input")
    assert answers[errors.Overloaded][:2] == (429, "overloaded")
    assert answers[errors.ClientGone][:2] == (499, "client_closed")
    assert len({a.status for a in answers.values()}) == len(answers) - 1  # 500: internal, backend


def test_retry_after_becomes_the_header():
    assert answer_of(errors.Overloaded("busy", retry_after_s=1)).headers == {"Retry-After": "1"}
    assert answer_of(errors.NotReady("starting")).headers == {}
