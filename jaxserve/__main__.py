"""`python -m jaxserve`: the `jaxserve` command. It belongs to the composition root (cli/) and sits here only
because Python looks for a package's __main__ in the package's own folder; it imports nothing else
(tests/test_layers.py)."""

import sys

from jaxserve.cli import main

if __name__ == "__main__":
    sys.exit(main())
