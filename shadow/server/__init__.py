"""`shadow serve`: settings, the build from settings to a running service, the service (turns and sessions), and its parts."""
