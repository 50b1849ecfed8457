"""`python -m mplan` runs the command line."""
from mplan.cli import main

raise SystemExit(main())
