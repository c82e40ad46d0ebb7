"""Local test bed for the demo, the tests and the benchmarks: tiny models built on this machine
and inference servers started as child processes. Not part of the installed package."""
