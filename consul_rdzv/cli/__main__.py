"""``python -m consul_rdzv.cli``: the same as ``consul-rdzv``."""

from .app import main

raise SystemExit(main())
