"""The ONNX Runtime engine's session options: what EngineOptions asks for is what the session
gets, the lone session's included."""

from __future__ import annotations

import numpy as np

from bertserve.runtime.bundle import load_bundle_spec
from bertserve.runtime.engine import Engine, EngineOptions


def test_spinning_can_stop_with_each_call(bundle_dir):
    """BERTSERVE_INTRA_OP_SPIN_STOP reaches the session as ONNX Runtime's force_spinning_stop,
    and only with spinning on."""
    directory = bundle_dir / "sentiment"
    spec = load_bundle_spec(directory)
    for spinning, stop, expected in ((True, True, "1"), (True, False, ""), (False, True, "")):
        engine = Engine(directory, spec, EngineOptions("CPUExecutionProvider", 2, spinning, stop))
        entry = engine.session.get_session_options().get_session_config_entry
        assert entry("session.intra_op.allow_spinning") == ("1" if spinning else "0")
        try:
            stop = entry("session.force_spinning_stop")
        except Exception:  # ORT raises for an entry never set
            stop = ""
        assert stop == expected


def tiny_feeds(length: int = 7) -> dict[str, np.ndarray]:
    return {
        "input_ids": (5 + np.arange(length, dtype=np.int64) % 90)[None, :],
        "attention_mask": np.ones((1, length), np.int64),
        "token_type_ids": np.zeros((1, length), np.int64),
    }


def test_a_lone_session_has_every_thread_asked_and_the_same_answers(bundle_dir):
    """lone_threads above the threads builds a second CPU session whose threads spin only
    within a call; a call `alone` runs there and answers as the first session does."""
    directory = bundle_dir / "sentiment"
    spec = load_bundle_spec(directory)
    engine = Engine(directory, spec, EngineOptions("CPUExecutionProvider", 1, lone_threads=2))
    assert engine.runs_alone
    lone = engine.lone_session.get_session_options()
    assert lone.intra_op_num_threads == 2
    assert lone.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert lone.get_session_config_entry("session.force_spinning_stop") == "1"
    shared = engine.session.get_session_options()
    assert shared.intra_op_num_threads == 1
    assert shared.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    for length in (3, 7, spec.max_seq_len):
        feeds = tiny_feeds(length)
        np.testing.assert_allclose(
            engine.run(feeds, alone=True)["logits"], engine.run(feeds)["logits"], atol=1e-5
        )
    for threads, lone_threads in ((2, 2), (1, 0), (1, 1)):
        options = EngineOptions("CPUExecutionProvider", threads, lone_threads=lone_threads)
        engine = Engine(directory, spec, options)
        assert not engine.runs_alone and engine.lone_session is None
        np.testing.assert_allclose(  # `alone` without a lone session: the one session
            engine.run(tiny_feeds(), alone=True)["logits"],
            engine.run(tiny_feeds())["logits"],
        )
