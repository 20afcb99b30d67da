"""The service's HTTP side: the app, the error shape, the guard, proxy mode, embedded completions, the shadow's own endpoints, status lines and their channels."""
