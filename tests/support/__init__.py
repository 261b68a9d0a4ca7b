"""Shared test helpers: real servers (Redis) and cached demo checkpoints."""
