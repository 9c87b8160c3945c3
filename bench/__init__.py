"""On-demand benchmark of kombu-sqlinbox against kombu ``sqla``, raw drivers, Redis, RabbitMQ.

Run ``python bench/run.py --help``. Not part of the test suite: figures depend on
the machine and whatever else runs on it.
"""
