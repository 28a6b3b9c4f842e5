"""swectl: train and evaluate software-engineering agents with reinforcement learning."""

__version__ = "0.1.0"
