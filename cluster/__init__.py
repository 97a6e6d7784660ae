"""One broker node as a process: config, leadership, HTTP API, command line and client."""
