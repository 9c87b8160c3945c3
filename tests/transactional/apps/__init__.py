"""Programs the transactional tests run as real processes."""
