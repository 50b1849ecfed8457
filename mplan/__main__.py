"""`python -m mplan` runs the command line. A refused command (`mplan.cli.main` prints its one
line and returns `EXIT_STATUS`, or a refusal escapes it) ends without the interpreter's teardown,
which would destroy a live process group and, under torchrun on GPUs, add warnings of its own
on every rank (`mplan.refusal`)."""
from mplan.cli import main
from mplan.refusal import EXIT_STATUS, exit_now, run

status = run(main)
if status == EXIT_STATUS:
    exit_now(status)
raise SystemExit(status)
