"""Game day (`make gameday`, `python -m bench.gameday`): the stack as `make run` starts it
(stack.py), open-loop traffic through the project's client (traffic.py), faults on a schedule
(faults.py, play.py), and what they cost users: availability, latency, recovery, lost and
twice-run jobs, 5xx (ledger.py), in a table and a picture (report.py). bench/README.md says
how to run it and what each figure means."""
