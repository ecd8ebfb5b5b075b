"""The Ray layer: actors, the Serve reward application, the controller, the CLI and job entrypoint."""
