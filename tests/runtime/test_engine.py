"""The ONNX Runtime engine's session options: what EngineOptions asks for is what the session
gets."""

from __future__ import annotations

from runtime.bundle import load_bundle_spec
from runtime.engine import Engine, EngineOptions


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
