"""cim_sim: arrives with its own issue."""
