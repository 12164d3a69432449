"""The volunteer: the worker loop that pulls tasks from a stage's servers and pushes results
(worker.py), its gradient-flush policy as a pure function (flush.py), and the choice of a stage for
`--stage auto` (stage_choice.py). The `peer join` command (peer/join.py) runs it; a server's own
worker is the same code."""
