"""Actors: one per file, each owning one resource and speaking typed messages."""
