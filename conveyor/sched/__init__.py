"""Scheduling policy: which requests, and how many of their tokens, go into the next pass (`scheduler`),
and what it decides (`output`: the step's chunks, read by the engine and the model runner). It runs
no model: speculative proposals reach it through its `Proposer` interface."""
