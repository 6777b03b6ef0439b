"""Scoring: rewards (in worker processes), reward shaping, advantages and the trainer's batch."""
