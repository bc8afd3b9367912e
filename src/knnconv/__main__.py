"""``python -m knnconv``: the command line of :mod:`knnconv.cli`."""

from .cli import main

raise SystemExit(main())
