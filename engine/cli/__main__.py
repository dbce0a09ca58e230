"""``python -m engine.cli``: the same as the ``tidelog`` command."""

from engine.cli.commands import main

raise SystemExit(main())
