"""``python -m cubinstore``: the same as the ``cubinstore`` console script."""

from cubinstore.cli import main

raise SystemExit(main())
