"""Predicting: the hardware catalogue, the cost model and the advisor (`dpkit plan`, `dpkit doctor`)."""
