"""The ``hf-apex`` console script."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"doctor": "Which apex kernels are really available here, with a runtime proof."}
    if argv and argv[0] not in commands and argv[0] not in ("-h", "--help"):
        print(f"hf-apex: error: unknown command {argv[0]!r} (choose from: {', '.join(commands)})", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: hf-apex COMMAND [options]\n\ncommands:")
        for name, help_text in commands.items():
            print(f"  {name:<10}{help_text}")
        return 0
    from .doctor import main as doctor_main

    return doctor_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
