"""Static versus continuous batching, step by step, and a plan of N replicas x T tensor-parallel ranks
with a stated cost model: `python -m tools.simulate --help`.

Modules: `batching` (the simulation and the replay through Conveyor's scheduler), `scaling` (the cost
model of replicas and tensor parallelism), `allreduce` (a two-rank gloo all-reduce timed on this
machine), `timeline_plot` (slot-occupancy PNGs), `cli` (the command line).
"""
