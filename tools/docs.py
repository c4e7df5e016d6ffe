"""The parts of the docs that are generated, written in place between their markers:
`python tools/docs.py` rewrites them, `python tools/docs.py --check` fails if one is stale
(tests/test_docs_house.py runs the check).

- docs/api.md#settings: the table of every setting, from bertserve.service.settings' fields.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def settings_table() -> str:
    from bertserve.service.settings import settings_table

    return settings_table()


# file -> (block name, its generator)
GENERATED: dict[str, list[tuple[str, Callable[[], str]]]] = {
    "docs/api.md": [("settings", settings_table)],
}


def block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated:{name} .*?-->\n)(.*?)(<!-- end:{name} -->)", re.DOTALL)


def render(text: str, name: str, make: Callable[[], str]) -> str:
    pattern = block(name)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- generated:{name} ... --> ... <!-- end:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + make() + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a block is stale")
    args = parser.parse_args(argv)
    stale = []
    for relative, blocks in GENERATED.items():
        path = ROOT / relative
        text = path.read_text(encoding="utf-8")
        new = text
        for name, make in blocks:
            new = render(new, name, make)
        if new != text:
            stale.append(relative)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print(f"stale generated docs: {stale}; run `python tools/docs.py`", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
