"""`python -m services.cli ...` is `sked ...` (how `sked dev` starts its services)."""

from __future__ import annotations

import sys

from services.cli import main

if __name__ == "__main__":
    sys.exit(main())
