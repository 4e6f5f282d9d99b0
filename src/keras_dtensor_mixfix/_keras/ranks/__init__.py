"""Rank agreement, below the backend and the files that both need it.

- :mod:`.agreement`: rank 0's value on every rank, the barrier of the group the package created, ``RankZeroStopped``.
"""
