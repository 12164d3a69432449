"""The local launcher: the processes of a swarm on one machine (processes.py) and its view of the
run from the DHT (monitor.py), shared by `peer swarm`, the tests and the benchmarks."""
