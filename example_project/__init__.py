"""The payment-API security suite story, runnable with nothing installed.

``celery -A example_project worker`` runs an agent; ``python -m example_project``
runs the whole demo timeline with two real worker processes.
"""

from example_project.tasks import app

__all__ = ["app"]
