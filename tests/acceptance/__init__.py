"""Real celery worker processes, the CLI, Flower, the example project, the docs and packaging."""
