"""Integrations with serving frameworks (each behind its own optional extra).

- :mod:`asyncllm.integrations.ray_serve`: replicas on Ray Serve with prefix-cache-aware
  routing (``pip install 'asyncllm[ray]'``; docs/scaling.md); the router itself is in
  :mod:`asyncllm.integrations.ray_router`.
"""
