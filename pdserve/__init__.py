"""The `pdserve` command: `pdserve serve [MODEL] [flags]` starts the router and the node pools
(`pdserve.cli` parses and validates, `pdserve.launcher` runs the processes)."""
