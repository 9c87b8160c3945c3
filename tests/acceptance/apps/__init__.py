"""Small programs the acceptance tests start as real processes."""
