"""Choosing the peer of the next stage (one routing policy) and handing a micro-batch to it."""
