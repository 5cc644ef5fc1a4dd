"""Capacity lab: real model configs, the KV memory calculator and the continuous-batching simulator (pure logic)."""
