"""The OpenAI server on Ray Serve: protocol, serving, routes, the app and its config, metrics."""
