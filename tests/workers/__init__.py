"""Programs the tests launch as separate processes (torchrun ranks, a job killed mid-run), not test modules."""
