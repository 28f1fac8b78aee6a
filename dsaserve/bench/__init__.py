"""`dsaserve bench serve`: a serving benchmark in the manner of vLLM's `benchmark_serving` (measurement only,
never part of the request path).

Owns: nothing itself; the parts are `datasets` (what is sent), `client` (sending it, recording when each
token arrived), `metrics` (numbers from those records, pure functions), `report` (the summary table and the
JSON) and `serve` (the command: arguments, load run, first-request mode). `dsaserve.cli.bench` registers it.
"""
