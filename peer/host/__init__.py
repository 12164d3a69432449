"""A peer's life as objects, under thin commands (`peer serve`, `peer join`, `peer swarm` parse their
arguments and run these): `ServerHost` (a reliable server: start, find the run, wait for its stage's
servers, serve, finish, stop) with its parts, each a loop with its own tests, `Announcer` (its records
in the DHT), `FailureDetector` (lost servers and their failover) and `Maintenance` (the stage server's
periodic work); `VolunteerSession` (a volunteer: find the run, pick a stage, compute, leave); and the
states both go through, each said once (`PeerState`, `StateLine`)."""
