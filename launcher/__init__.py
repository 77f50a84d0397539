"""The `tinkerd` command: starts the services (together or one at a time) and makes local models."""
