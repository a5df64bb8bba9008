"""``python -m peft_ext.multimodal build [--out PATH]``: rebuild the committed emoji pairs file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .emoji import DEFAULT_FONT, DEFAULT_PATH, DEFAULT_TEST_FILE, build_emoji_pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m peft_ext.multimodal", description=__doc__)
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--emoji-test", type=Path, default=DEFAULT_TEST_FILE, help="Unicode's emoji-test.txt")
    parser.add_argument("--font", type=Path, default=DEFAULT_FONT, help="NotoColorEmoji.ttf")
    parser.add_argument("--out", type=Path, default=DEFAULT_PATH, help="output .npz")
    args = parser.parse_args(argv)
    pairs = build_emoji_pairs(args.emoji_test, args.font, args.out)
    groups, subgroups = len(pairs.group_names), len(pairs.subgroup_names)
    print(f"wrote {len(pairs)} pairs, {groups} groups, {subgroups} subgroups to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
