"""Each store and the SQL layer against real servers (no celery worker)."""
