"""One broker node as a process: config, leadership, HTTP API and command line."""
