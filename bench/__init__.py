"""On-demand benchmark of kombu-sqlinbox: the transport against kombu ``sqla``, raw drivers,
Redis and RabbitMQ, plus ordering, transactional tasks and the outbox.

Run ``python bench/run.py --help``. Not part of the test suite: figures depend on
the machine and whatever else runs on it.
"""
