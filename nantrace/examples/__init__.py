"""Small, real example workloads used by ``nantrace demo`` and the documentation."""
