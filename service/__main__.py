"""`bertserve serve --bundles DIR [--host H] [--port P]`: serve the bundles in DIR.

Every setting is also an environment variable with the `BERTSERVE_` prefix (flags win). On
SIGTERM (or Ctrl-C) the service stops admitting work (503, readiness false), finishes every
admitted request within BERTSERVE_DRAIN_TIMEOUT_S, then exits; a second signal exits at once.
"""

from __future__ import annotations

import argparse
import sys

from pydantic import ValidationError

EXAMPLES = """examples:
  {prog} --bundles bundles                      # http://127.0.0.1:8000/docs
  {prog} --bundles bundles --host 0.0.0.0 --port 8080 --workers 4
  BERTSERVE_API_KEYS=a-key-of-16-or-more-chars {prog} --bundles bundles
"""


def main(argv: list[str] | None = None, prog: str = "python -m bertserve.service") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [--bundles DIR] [--host H] [--port P] [--workers N] [setting ...]",
        description=__doc__,
        epilog=EXAMPLES.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from bertserve.service.settings import add_arguments

    add_arguments(parser)
    args = parser.parse_args(argv)

    from bertserve.service.settings import Settings

    try:
        settings = Settings(**vars(args))
    except ValidationError as exc:
        for error in exc.errors():
            name = "BERTSERVE_" + "_".join(str(p) for p in error["loc"]).upper()
            print(f"error: {name}: {error['msg']}", file=sys.stderr)  # noqa: T201
        return 2
    from bertserve.runtime.bundle import (
        BUNDLE_FILE,
        BundleError,
        bundle_dirs,
        check_model_file,
        load_bundle_spec,
        load_quantization_ranges,
    )

    # Fail fast, in one line, on a bad bundle, before any worker starts: inside one, the
    # lifespan would say it in a traceback, seconds later, once per worker.
    try:
        found = bundle_dirs(settings.bundles)
        if not found:
            raise BundleError(f"{settings.bundles}: no bundles (no */{BUNDLE_FILE})")
        for directory in found:
            spec = load_bundle_spec(directory)
            check_model_file(directory, spec)
            load_quantization_ranges(directory, spec)
    except (BundleError, OSError) as exc:  # OSError: a file it cannot read
        print(f"error: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    if settings.require_gpu:  # the common failure, said before any model is loaded
        import onnxruntime

        if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
            print(  # noqa: T201
                "error: BERTSERVE_REQUIRE_GPU is set but this ONNX Runtime build has no CUDA "
                f"provider ({onnxruntime.get_available_providers()}): install the gpu extra "
                "(pip install '.[gpu]' in a CUDA 12 image, '.[gpu-wheels]' elsewhere)",
                file=sys.stderr,
            )
            return 2
    if (
        settings.worker_count == 1
        and not settings.engine_process
        and not settings.max_worker_rss_mb
    ):
        from bertserve.service.process.server import run_worker

        return run_worker(settings)
    from bertserve.service.process.supervisor import Supervisor

    return Supervisor(settings).run()


if __name__ == "__main__":
    sys.exit(main())
