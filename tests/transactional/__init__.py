"""Transactional tasks and enqueue: the refund example under real workers."""
