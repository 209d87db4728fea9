"""Experiments over the tensor transports: the ``bench`` command, results store and plots."""
