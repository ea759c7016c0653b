"""Device and interconnect profiles that ship with smp: one JSON per device type, each figure with its source."""
