"""The ``blockdiag`` console script's entry point: an interrupt while torch imports is one line.

The script's wrapper imports its entry module before any of our code runs, and importing
anything in the ``blockdiag`` package imports torch, which takes a while: a Ctrl-C then
printed a traceback from inside torch, where every later interrupt is one line and status
130. This module lies outside the package, so the import happens inside :func:`main`,
under that rule. ``blockdiag.cli.main`` is unchanged and may still be called directly.
"""

import sys


def main() -> int:
    """Import the command line (and torch), then run it; an interrupt before it runs is status 130."""
    try:
        from blockdiag.cli import main as cli_main
    except KeyboardInterrupt:
        # The command is not known yet: the parser is built by the modules being imported.
        if sys.stderr is not None:
            try:
                print("blockdiag: interrupted", file=sys.stderr)
            except OSError:  # a stderr that cannot be written (2>/dev/full): the status says it
                pass
        return 130
    return cli_main()
