"""Programs the ordering tests start as real processes, and what they share."""
