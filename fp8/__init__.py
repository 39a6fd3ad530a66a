"""fp8: arrives with its own issue."""
