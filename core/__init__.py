"""hivepipe's shared floor: what servers, volunteers and every command agree on.

- core/model/: the transformer, its configurations, the optimizer and the update rule, the task
  arithmetic every server and `peer reference` compute the same way, mixed precision, the corpus.
- core/protocol/: the wire (tensors, codecs, payload checks), the one method table, sessions and
  their handler name, typed refusals, lease tickets, signed records, the retry policy.
- core/layout.py: the run's layout (stages, servers, roles, rows) and the shard assignment every
  client and server compute alike.

It imports nothing from peer/ or parameter_server/ (import-linter checks it): the servers below the
node's commands, and both above this floor.
"""
