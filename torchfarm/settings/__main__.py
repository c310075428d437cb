"""`python -m torchfarm.settings --markdown`: the README's configuration table, from the
table of variables (settings/env.py); `--readme README.md` writes it there in place."""

import argparse
import pathlib

from torchfarm.settings import env


def with_table(readme: str) -> str:
    """`readme` with its configuration table (the lines from its header row to the first
    blank line) replaced by the generated one."""
    lines = readme.split("\n")
    start = lines.index(env.markdown().split("\n")[0])
    end = lines.index("", start)
    return "\n".join([*lines[:start], env.markdown(), *lines[end:]])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m torchfarm.settings")
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    parser.add_argument("--readme", type=pathlib.Path, help="write the table into this file")
    args = parser.parse_args()
    if args.readme:
        args.readme.write_text(with_table(args.readme.read_text()))
    if args.markdown or not args.readme:
        print(env.markdown())


if __name__ == "__main__":
    main()
