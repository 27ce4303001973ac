"""Runs a docs page's example as its reader would: every ``python`` block whose first line is
``# NAME.py`` is written to a fresh folder under that name, then the page's block marked
``# run`` is run there with this Python; the run must exit 0 and print ``--expect``.

Used by the ``estimate-alone`` nox session, in an environment holding only the
``pallas-flash-estimate`` wheel and what it depends on::

    python scripts/run_docs_example.py docs/api/estimate.md --expect "static estimate"
"""

from __future__ import annotations

import argparse
import pathlib
import re
import subprocess
import sys
import tempfile

BLOCK_RE = re.compile(r"^```python\n(?P<code>.*?)^```$", re.MULTILINE | re.DOTALL)
FILE_RE = re.compile(r"^# (?P<name>\w+\.py)\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page", type=pathlib.Path, help="the docs page (Markdown)")
    parser.add_argument("--expect", required=True, help="text the run must print")
    args = parser.parse_args(argv)
    blocks = [m["code"] for m in BLOCK_RE.finditer(args.page.read_text())]
    files = {m["name"]: code for code in blocks if (m := FILE_RE.match(code))}
    runs = [code for code in blocks if code.startswith("# run\n")]
    if len(runs) != 1:
        raise SystemExit(f"{args.page}: expected one python block marked '# run', got {len(runs)}")
    with tempfile.TemporaryDirectory() as folder:
        for name, code in files.items():
            (pathlib.Path(folder) / name).write_text(code)
        (pathlib.Path(folder) / "example.py").write_text(runs[0])
        done = subprocess.run([sys.executable, "example.py"], cwd=folder, capture_output=True,
                              text=True, check=False)  # fmt: skip
    print(done.stdout, end="")
    if done.returncode != 0:
        print(done.stderr, end="", file=sys.stderr)
        raise SystemExit(f"{args.page}: the example exited with {done.returncode}")
    if args.expect not in done.stdout:
        raise SystemExit(f"{args.page}: the example did not print {args.expect!r}")
    print(f"{args.page}: the example ran ({', '.join(files)} beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
