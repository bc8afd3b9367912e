"""``python -m knnconv``: the command line of :mod:`knnconv.tools.cli`."""

from .tools.cli import main

raise SystemExit(main())
